"""`fa4tune report` as a command: writes one self-contained file, and reports what is missing."""

from __future__ import annotations

import json
import os
import re

import pytest
from click.testing import CliRunner

from fa4tune.report.command import report_command
from test_report_data import write_synthetic_results


def test_report_command_writes_a_self_contained_file(tmp_path):
    write_synthetic_results(tmp_path / "results", n_trials=12)
    out = tmp_path / "out" / "report.html"
    result = CliRunner().invoke(report_command, ["--results", str(tmp_path / "results"), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == str(out)  # data on stdout, progress on stderr
    assert "3 studies" in result.stderr
    text = out.read_text(encoding="utf-8")
    # offline: no script or stylesheet is fetched from anywhere
    assert not re.search(r"<script[^>]+src=", text)
    assert not re.search(r"<link[^>]+href=\"?https?:", text)
    assert "Plotly" in text and len(text) > 3_000_000  # plotly.js itself is inlined
    assert text.count('class="plotly-graph-div') == 4 + 2 * 3
    assert not list(out.parent.glob("*.tmp"))  # the atomic write left nothing behind


def test_report_command_data_json(tmp_path):
    write_synthetic_results(tmp_path / "results", n_trials=12)
    data_json = tmp_path / "report.json"
    result = CliRunner().invoke(report_command, ["--results", str(tmp_path / "results"), "--out",
                                                 str(tmp_path / "r.html"), "--data-json", str(data_json)])
    assert result.exit_code == 0, result.output
    data = json.loads(data_json.read_text())
    assert len(data["studies"]) == 3 and "ok_study" not in data["studies"][0]
    assert data["studies"][0]["outcomes"]["ok"] > 0
    assert data["speedup_summary"]["flash_attn_4"]["geomean"] == pytest.approx(1.1)
    assert len(data["shape_rows"]) == 3 and data["heatmaps"][0]["baseline"] == "default"


def test_report_command_explicit_inputs_and_missing_ones(tmp_path):
    write_synthetic_results(tmp_path / "results", n_trials=12)
    out = tmp_path / "report.html"
    (tmp_path / "elsewhere").mkdir()   # a results folder without the inputs named below
    result = CliRunner().invoke(report_command, [
        "--results", str(tmp_path / "elsewhere"), "--storage", str(tmp_path / "results" / "studies.journal"),
        "--bench", str(tmp_path / "results" / "bench.json"), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "missing: best-config database" in result.stderr
    text = out.read_text(encoding="utf-8")
    assert "missing: best-config database" in text and "3 studies" in text


def test_report_is_registered_in_the_cli():
    cli = pytest.importorskip("fa4tune.cli", reason="fa4tune.cli is not written yet")
    assert cli.main.get_command(None, "report") is report_command


def _damage(results):
    """Inputs the report must survive: a study attribute of the wrong type, a database entry whose
    config is a number, a bench row whose problem is text."""
    import optuna

    from fa4tune.searches.storage import open_storage

    storage = open_storage(results / "studies.journal")
    study = optuna.create_study(study_name="odd", storage=storage)
    study.set_user_attr("problem", "B1 S1024")
    study.set_user_attr("device", 7)
    db = json.loads((results / "best_configs.json").read_text())
    db["entries"][0]["config"] = 5
    db["entries"].append("not an entry")
    (results / "best_configs.json").write_text(json.dumps(db))
    bench = json.loads((results / "bench.json").read_text())
    bench["rows"][0]["problem"] = {**bench["rows"][0]["problem"], "head_dim": "128"}
    (results / "bench.json").write_text(json.dumps(bench))


def test_malformed_inputs_are_skipped_with_a_note(tmp_path):
    results = tmp_path / "results"
    write_synthetic_results(results, n_trials=12)
    _damage(results)
    out = tmp_path / "report.html"
    result = CliRunner().invoke(report_command, ["--results", str(results), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "study odd: skipped" in result.stderr
    assert "best-config entry" in result.stderr and "config is a int" in result.stderr
    assert "bench row" in result.stderr and "head_dim" in result.stderr
    assert "3 studies" in result.stderr and out.is_file()


def test_the_report_writes_nothing_into_what_it_reads(tmp_path):
    import sqlite3

    results = tmp_path / "results"
    write_synthetic_results(results, n_trials=12)
    unrelated = results / "notes.db"   # an SQLite file that is not an optuna storage
    with sqlite3.connect(unrelated) as conn:
        conn.execute("CREATE TABLE notes (text TEXT)")
    before = {p.name: p.read_bytes() for p in results.iterdir()}
    result = CliRunner().invoke(report_command, ["--results", str(results), "--out", str(tmp_path / "r.html")])
    assert result.exit_code == 0, result.output
    assert {p.name: p.read_bytes() for p in results.iterdir()} == before   # nothing changed, nothing added
    explicit = CliRunner().invoke(report_command, ["--results", str(results), "--storage", str(unrelated),
                                                   "--out", str(tmp_path / "r2.html")])
    assert explicit.exit_code == 0 and "without optuna's tables" in explicit.stderr
    assert unrelated.read_bytes() == before["notes.db"]


def test_written_files_are_readable_by_others(tmp_path):
    write_synthetic_results(tmp_path / "results", n_trials=12)
    out, data_json = tmp_path / "r.html", tmp_path / "r.json"
    CliRunner().invoke(report_command, ["--results", str(tmp_path / "results"), "--out", str(out),
                                        "--data-json", str(data_json)])
    assert out.stat().st_mode & 0o777 == 0o644 and data_json.stat().st_mode & 0o777 == 0o644


def test_bar_labels_stand_above_their_own_bar(tmp_path):
    from fa4tune.report.data import collect
    from fa4tune.report.draw import comparison_figure

    write_synthetic_results(tmp_path / "results", n_trials=12)
    fig = comparison_figure(collect(tmp_path / "results").shape_rows)
    bars = [t for t in fig.data if t.type == "bar"]
    assert bars and all(t.textangle == -90 and t.textposition == "outside" for t in bars)


def test_the_report_carries_no_absolute_paths(tmp_path):
    results = tmp_path / "results"
    write_synthetic_results(results, n_trials=12)
    out, data_json = tmp_path / "r.html", tmp_path / "r.json"
    result = CliRunner().invoke(report_command, ["--results", str(results), "--out", str(out),
                                                 "--data-json", str(data_json), "--bench", str(tmp_path / "none.json")])
    assert result.exit_code == 0, result.output
    for text in (out.read_text(encoding="utf-8"), data_json.read_text()):
        assert str(tmp_path) not in text
        assert "results/studies.journal" in text   # still says which input it read


# notes as a real toolchain writes them: under a home, site-packages, /tmp
PATHY_NOTES = ("ImportError: /root/.venv/lib/python3.12/site-packages/flash_attn/cute/interface.py: bad ELF",
               "RuntimeError: ptxas died, see /home/x/runs/ptxas.log",
               "OSError: /usr/lib/python3/site-packages/cutlass/_mlir/libmlir.so: cannot open",
               "[Errno 28] No space left on device: '/tmp/fa4tune-run/peer.bin'")
PLANTED = ("/root/", "/home/x", "/usr/lib", "/tmp/fa4tune-run")


def _plant_path_notes(results):
    """A bench row and a study's peers that failed with reasons naming absolute paths."""
    import optuna

    bench = json.loads((results / "bench.json").read_text())
    for row, note in zip([r for r in bench["rows"] if r["variant"] == "sdpa_flash"], PATHY_NOTES):
        row.update(outcome="launch_error", us=None, tflops=None, error=note)
    (results / "bench.json").write_text(json.dumps(bench))
    storage = optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(results / "studies.journal")))
    for summary in optuna.get_all_study_summaries(storage):
        study = optuna.load_study(study_name=summary.study_name, storage=storage)
        study.set_user_attr("peers", {**study.user_attrs["peers"], "flash_attn_4": {"error": PATHY_NOTES[0]},
                                      "sdpa_flash": {"error": PATHY_NOTES[3]}})


def test_report_notes_carry_no_absolute_path(tmp_path):
    """An error note read from a bench file or a study (a peer that did not import, a launch that
    failed) is shown in the report, its absolute paths rewritten (`fa4tune.workers.outcomes.portable_note`)."""
    from test_portable_notes import ABSOLUTE_PATH

    results = tmp_path / "results"
    write_synthetic_results(results, n_trials=12)
    _plant_path_notes(results)
    out, data_json = tmp_path / "r.html", tmp_path / "r.json"
    result = CliRunner().invoke(report_command, ["--results", str(results), "--out", str(out),
                                                 "--data-json", str(data_json)])
    assert result.exit_code == 0, result.output
    html, data = out.read_text(encoding="utf-8"), json.loads(data_json.read_text())
    for planted in PLANTED:
        assert planted not in html and planted not in data_json.read_text(), planted
    notes = data["missing"] + data["warnings"] + [s["importance_note"] for s in data["studies"]]
    notes += [e["error"] for r in data["shape_rows"] for e in r["impls"].values() if "error" in e]
    notes += [p["error"] for s in data["studies"] for p in s["peers"].values() if "error" in p]
    assert "<site-packages>/flash_attn/cute/interface.py: bad ELF" in "\n".join(notes)
    assert "peer.bin" in "\n".join(notes) and "ptxas.log" in "\n".join(notes)
    assert not [n for n in notes if ABSOLUTE_PATH.search(n)]
    # a storage that cannot be read: its error names it, without the folder it lies in
    notes_file = tmp_path / "notes.txt"
    notes_file.write_text("not a storage\n")
    result = CliRunner().invoke(report_command, ["--results", str(results), "--storage", str(notes_file),
                                                 "--out", str(out)])
    [missing] = [line for line in result.stderr.splitlines() if line.startswith("missing: optuna storage")]
    assert result.exit_code == 0 and "notes.txt" in missing and str(tmp_path) not in missing
    assert str(tmp_path) not in out.read_text(encoding="utf-8")


def _one_line_error(result, *words):
    """A ClickException: exit 1, its one line last on stderr naming the problem, no traceback."""
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), repr(result.exception)
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("Error: ") and "Traceback" not in result.output, result.output
    assert all(word in error for word in words), error


def test_a_results_folder_or_storage_that_does_not_exist_is_an_error(tmp_path):
    """Not an empty 4.8 MB report of nothing, and no file created where a name was mistyped."""
    out = tmp_path / "r.html"
    _one_line_error(CliRunner().invoke(report_command, ["--results", str(tmp_path / "typo"), "--out", str(out)]),
                    "--results", "typo", "no such folder")
    _one_line_error(CliRunner().invoke(report_command, ["--out", str(out)],
                                       env={"FA4TUNE_HOME": str(tmp_path / "never-run")}),
                    "no results folder", "never-run")
    results = tmp_path / "results"
    write_synthetic_results(results, n_trials=12)
    _one_line_error(CliRunner().invoke(report_command, ["--results", str(results), "--out", str(out),
                                                        "--storage", str(tmp_path / "typo.journal")]),
                    "--storage", "typo.journal")
    url = f"sqlite:///{tmp_path / 'new.db'}"
    _one_line_error(CliRunner().invoke(report_command, ["--results", str(results), "--out", str(out),
                                                        "--storage", url]), "--storage", "new.db")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results"]   # no report, no new.db
    # collect() alone does not create the file an sqlite URL names either
    from fa4tune.report.data import collect

    data = collect(results, storage=url)
    assert any("new.db does not exist" in line for line in data.missing) and not (tmp_path / "new.db").exists()


@pytest.mark.parametrize("option", ["--out", "--data-json", "--screenshot"])
def test_an_output_that_cannot_be_written_is_refused_before_anything_is_written(tmp_path, option):
    results = tmp_path / "results"
    results.mkdir()
    (tmp_path / "a-file").write_text("mine\n")
    outputs = {"--out": tmp_path / "r.html", "--data-json": tmp_path / "r.json", "--screenshot": None}
    outputs[option] = tmp_path / "a-file" / "r.out"   # its folder is a file
    args = ["--results", str(results)] + [a for o, p in outputs.items() if p for a in (o, str(p))]
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    result = CliRunner().invoke(report_command, args)
    _one_line_error(result, option, "a-file", "not a directory")
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before   # nothing half-written


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write in any folder")
def test_an_output_folder_without_write_permission_is_refused(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    result = CliRunner().invoke(report_command, ["--results", str(results), "--out", str(locked / "r.html")])
    _one_line_error(result, "--out", "cannot write in")


def test_a_write_that_fails_anyway_is_one_line(tmp_path, monkeypatch):
    """A disk that fills during the write: the error, not a traceback; no temporary file left."""
    import errno

    from fa4 import files

    results = tmp_path / "results"
    results.mkdir()
    real = os.fdopen

    def full_disk(fd, *args, **kwargs):
        handle = real(fd, *args, **kwargs)
        def fail(text):
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "r.html"))
        handle.write = fail
        return handle

    monkeypatch.setattr(files.os, "fdopen", full_disk)
    result = CliRunner().invoke(report_command, ["--results", str(results), "--out", str(tmp_path / "r.html")])
    _one_line_error(result, "No space left on device", "r.html")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results"]
