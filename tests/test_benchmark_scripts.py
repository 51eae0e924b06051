"""The benchmark scripts import what they use: a renamed or moved harness module breaks them here, on
CPU, rather than on the H200 where a broken script costs device time."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).resolve().parents[1] / "benchmarks").glob("*.py"))


def test_there_are_scripts():
    assert SCRIPTS


@pytest.mark.parametrize("path", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_script_imports(path):
    spec = importlib.util.spec_from_file_location(f"benchmark_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # module level only: `main()` runs under __main__
    assert callable(getattr(module, "main", None))


def test_the_cpu_fast_path_bench_runs_every_row(tmp_path):
    """bench_fastpath_cpu.py patches the runtime's own modules (the kernel family, device facts): it
    runs whole here, in a subprocess, so a runtime change that breaks one of its rows shows on CPU."""
    import json
    import os
    import subprocess
    import sys

    out = tmp_path / "rows.json"
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_fastpath_cpu.py"
    # the script keeps its stand-in database in a temporary folder of its own: this test's, not the machine's
    done = subprocess.run([sys.executable, str(script), "--number", "20", "--repeat", "2", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["name"] for r in rows if "error" in r] == []
    assert rows[0]["note"] == "as shipped"  # the call took the kernel path
