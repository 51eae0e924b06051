"""The per-user folders come from one place (`fa4.places`, platformdirs), and `import fa4` stays cheap:
it imports none of the harness's heavy dependencies."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import platformdirs

from fa4 import compile_cache, database, places


def test_results_dir_is_fa4tune_home_else_the_platform_user_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("FA4TUNE_HOME", str(tmp_path / "home"))
    assert places.results_dir() == tmp_path / "home"
    assert database.user_path() == tmp_path / "home" / "best_configs.json"
    monkeypatch.delenv("FA4TUNE_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert places.results_dir() == Path(platformdirs.user_cache_dir("fa4tune", appauthor=False))
    if sys.platform.startswith("linux"):
        assert places.results_dir() == tmp_path / "xdg" / "fa4tune"


def test_kernel_cache_dir_is_its_variable_else_kernels_in_the_user_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("FA4TUNE_CACHE_DIR", str(tmp_path / "k"))
    assert compile_cache.cache_dir() == tmp_path / "k"
    monkeypatch.delenv("FA4TUNE_CACHE_DIR")
    assert compile_cache.cache_dir() == places.user_cache_dir() / "kernels"


def test_no_other_module_reads_the_cache_folder_variables():
    root = Path(__file__).resolve().parent.parent
    readers = [p.relative_to(root).as_posix() for d in ("fa4", "fa4tune", "kernels") for p in (root / d).rglob("*.py")
               if p.name != "places.py" and ("XDG_CACHE_HOME" in p.read_text() or '".cache"' in p.read_text())]
    assert readers == []


def test_import_fa4_imports_no_harness_dependency():
    heavy = ("optuna", "pandas", "plotly", "fa4tune", "sqlalchemy", "platformdirs", "filelock")
    code = ("import sys, time; import torch; t = time.perf_counter(); import fa4; "
            "print(round(time.perf_counter() - t, 3)); "
            f"print(','.join(m for m in {heavy!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    seconds, loaded = out.splitlines()[0], out.splitlines()[1:]
    assert loaded in ([], [""]), f"import fa4 imported {loaded}"
    assert float(seconds) < 5.0   # about 0.06 s after torch on a development machine
