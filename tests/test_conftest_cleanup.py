"""tests/conftest.py, run as a pytest session of its own (a subprocess in a folder of its own, its
temporary files in a TMPDIR of their own): the temporary FA4TUNE_HOME it makes is gone when the session
ends, and tests marked slow run only when asked (--run-slow, or an -m expression that names slow)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CONFTEST = Path(__file__).resolve().parent / "conftest.py"

PROBE = '''
import os
from pathlib import Path

import pytest


def test_home_is_a_fresh_folder_under_tmpdir():
    home = Path(os.environ["FA4TUNE_HOME"])
    assert home.is_dir() and home.parent == Path(os.environ["TMPDIR"]).resolve()
    (home / "kernels").mkdir()
    (home / "kernels" / "a.so").write_bytes(b"x")   # a test leaves something in it
    Path(os.environ["PROBE_SEEN_HOME"]).write_text(str(home))


@pytest.mark.slow
def test_slow():
    pass
'''


def _session(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, Path, Path]:
    suite = tmp_path / "suite"
    tmpdir = tmp_path / "tmpdir"
    suite.mkdir()
    tmpdir.mkdir()
    shutil.copy(CONFTEST, suite / "conftest.py")
    (suite / "test_probe.py").write_text(PROBE)
    (suite / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: long\n    gpu: gpu\n    sm100: sm100\n")
    seen = tmp_path / "seen_home.txt"
    env = {**os.environ, "TMPDIR": str(tmpdir.resolve()), "PROBE_SEEN_HOME": str(seen)}
    env.pop("FA4TUNE_HOME", None)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *args],
                          cwd=suite, env=env, capture_output=True, text=True, timeout=300)
    return proc, tmpdir, seen


def test_the_session_removes_its_home(tmp_path):
    proc, tmpdir, seen = _session(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    home = Path(seen.read_text())
    assert home.name.startswith("fa4tune-test-home-")
    assert not home.exists(), f"{home} left behind"
    assert not list(tmpdir.glob("fa4tune-test-home-*"))


@pytest.mark.parametrize("args,slow_runs", [((), False), (("--run-slow",), True), (("-m", "slow"), True),
                                            (("-m", "not gpu"), False)])
def test_slow_runs_only_when_asked(tmp_path, args, slow_runs):
    proc, _, _ = _session(tmp_path, *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = proc.stdout.strip().splitlines()[-1]
    if slow_runs:
        assert "skipped" not in summary, proc.stdout
        assert ("1 passed" if args == ("-m", "slow") else "2 passed") in summary, proc.stdout
    else:
        assert "1 passed, 1 skipped" in summary, proc.stdout
        assert "--run-slow" in proc.stdout   # the skip says how to run it
