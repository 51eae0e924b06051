"""Notes (a failed outcome's reason, a report's missing input) never carry an absolute path: a bench
file, a journal and a report are committed and shared, and an error's message names the files of the
machine it ran on (`fa4tune.workers.outcomes.portable_note`)."""

from __future__ import annotations

import re

import pytest

from fa4tune.workers.outcomes import portable_note, portable_error

# a "/" that starts a word and is followed by a path segment: an absolute path left in a note
ABSOLUTE_PATH = re.compile(r"(?<![\w.~…<>/:-])/[\w.-]+")

NOTES = {
    "ImportError: /root/.venv/lib/python3.12/site-packages/flash_attn/cute/interface.py: undefined symbol":
        "ImportError: <site-packages>/flash_attn/cute/interface.py: undefined symbol",
    "File \"/usr/lib/python3/site-packages/cutlass/base_dsl/jit.py\", line 3: ptxas failed":
        "File \"<site-packages>/cutlass/base_dsl/jit.py\", line 3: ptxas failed",
    "cannot load /home/x/runs/kernels/ab12.so (see /home/x/notes.txt)":
        "cannot load <home>/runs/kernels/ab12.so (see <home>/notes.txt)",
    "[Errno 28] No space left on device: '/tmp/pytest-7/test_bench0/bench.json'.":
        "[Errno 28] No space left on device: 'bench.json'.",
    "compiled in /root": "compiled in <home>",
    "opened sqlite:////srv/optuna/studies.db": "opened sqlite:///studies.db",
}


@pytest.mark.parametrize("note", sorted(NOTES))
def test_absolute_paths_become_placeholders_or_file_names(note):
    out = portable_note(note)
    assert out == NOTES[note]
    assert not ABSOLUTE_PATH.search(out), out
    assert portable_note(out) == out   # applied twice (worker, then bench or report): the same


def test_the_results_directory_and_the_users_home(tmp_path, monkeypatch):
    assert portable_note(f"could not read {tmp_path}/r/bench.json", results_dir=tmp_path / "r") == \
        "could not read <results>/bench.json"
    monkeypatch.setenv("FA4TUNE_HOME", str(tmp_path / "home"))   # the default results directory
    assert portable_note(f"{tmp_path}/home/studies.journal is torn") == "<results>/studies.journal is torn"
    monkeypatch.setenv("HOME", "/opt/someone")
    assert portable_note("/opt/someone/.cache/x.json") == "<home>/.cache/x.json"


def test_what_is_not_a_path_is_left_alone():
    text = ("12.5 us/call, 3/4 of H32/8 at 600 TFLOP/s; see https://example.org/a/b; "
            "…/results/bench.json; results/studies.json; a / b; <site-packages>/x.py")
    assert portable_note(text) == text


def test_portable_error_makes_portable_reasons():
    exc = FileNotFoundError(2, "No such file or directory", "/home/x/.cache/fa4tune/kernels/k.so")
    assert portable_error(exc) == "FileNotFoundError: [Errno 2] No such file or directory: '<home>/.cache/fa4tune/kernels/k.so'"
    long = RuntimeError("/root/venv/lib/python3.12/site-packages/cutlass/" + "x" * 500 + ".py\nlast line")
    assert portable_error(long).startswith("RuntimeError: <site-packages>/cutlass/x") and len(portable_error(long)) <= 400
