"""Where things are read and written: the packaged database is package data on its own and read-only;
what a run produces goes to the results directory (FA4TUNE_HOME or ~/.cache/fa4tune), never into the
package; result files are 0644; the harness uses no private attribute of optuna."""

from __future__ import annotations

import gzip
import json
import os
import re
import tomllib
from pathlib import Path

import pytest

from fa4 import database
from fa4.database import BestConfigDB, Entry
from fa4.files import atomic_write
from fa4.kernels import AttentionProblem, Config
from fa4tune import paths
from fa4tune.searches.record import database_for_writing

REPO = Path(__file__).resolve().parent.parent


def test_the_packaged_database_is_the_only_copy():
    # The database that ships is the reviewed one (docs/search-at-scale.md: "Refresh the packaged
    # database"); a second copy would drift from it. Any other file of the checkout named like it, or
    # holding the same bytes, fails here.
    packaged = database.packaged_path()
    assert packaged == REPO / "fa4" / "data" / "best_configs.json"
    assert len(BestConfigDB.load(packaged)) > 0
    content = packaged.read_bytes()
    skipped = {".git", ".venv", "node_modules", "__pycache__"}
    copies = []
    for folder, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if d not in skipped and not d.endswith(".egg-info")]
        for name in files:
            path = Path(folder) / name
            if path == packaged:
                continue
            if name == packaged.name or (path.stat().st_size == len(content) and path.read_bytes() == content):
                copies.append(str(path.relative_to(REPO)))
    assert copies == []


def test_results_is_not_a_package_and_only_the_database_ships():
    assert not (REPO / "results" / "__init__.py").exists()
    setup = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "fa4.results" not in setup["packages"] and "fa4.data" in setup["packages"]
    # the database and the host-time table, nothing else
    assert setup["package-data"]["fa4.data"] == ["best_configs.json", "host_overhead.json"]


def test_the_packaged_host_overhead_is_derived_from_the_committed_runs():
    # results/h200/overhead_*.json are the measurements; fa4/data/host_overhead.json what ships
    # (fa4tune.benchmark.host_overhead says how to refresh it)
    from fa4 import backends, dispatch
    from fa4tune.benchmark import host_overhead

    runs = sorted(str(p.relative_to(REPO)) for p in (REPO / "results").glob("*/overhead_*.json"))
    cwd = os.getcwd()
    try:
        os.chdir(REPO)
        derived = host_overhead.to_json(host_overhead.derive(runs))
    finally:
        os.chdir(cwd)
    assert dispatch.host_overhead_path().read_text() == derived
    h200 = dispatch.host_us("NVIDIA H200")
    assert set(h200) == set(backends.implementations())
    assert h200["ours"] < h200["sdpa_cudnn"] and h200["ours"] < h200["flash_attn_4"]


def test_the_results_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("FA4TUNE_HOME", str(tmp_path / "home"))
    assert paths.results_dir() == tmp_path / "home"
    assert paths.storage_path() == tmp_path / "home" / "studies.journal"
    assert paths.bench_path() == tmp_path / "home" / "bench.json"
    monkeypatch.delenv("FA4TUNE_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert paths.results_dir() == tmp_path / "cache" / "fa4tune"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert paths.results_dir() == Path.home() / ".cache" / "fa4tune"
    import fa4

    package = Path(fa4.__file__).resolve().parent
    assert package not in paths.results_dir().resolve().parents


def test_a_search_records_into_the_users_layer_never_the_package(monkeypatch, tmp_path):
    monkeypatch.setenv("FA4TUNE_HOME", str(tmp_path))
    monkeypatch.delenv(database.ENV_VAR, raising=False)
    target = database_for_writing(None)
    assert target == tmp_path / "best_configs.json" == database.default_path()
    assert not target.exists()                                   # no copy of the packaged entries
    assert database.default_layers() == [("packaged", database.packaged_path()), ("user", target)]
    assert database_for_writing(str(tmp_path / "mine.json")) == tmp_path / "mine.json"
    monkeypatch.setenv(database.ENV_VAR, str(tmp_path / "env.json"))
    assert database_for_writing(None) == tmp_path / "env.json" and not (tmp_path / "env.json").exists()


def test_files_written_by_rename_are_readable_by_others(tmp_path):
    path = atomic_write(tmp_path / "sub" / "x.json", "{}\n")
    assert path.read_text() == "{}\n" and path.stat().st_mode & 0o777 == 0o644
    entry = Entry.from_result(arch="sm90", device="Fake H200", problem=AttentionProblem(1, 128, 128, 4, 4, 64),
                              config=Config.make("sm90").to_dict(), us=10.0, tflops=1.0, default_us=None,
                              peers_us={}, max_err=None, kernel_fingerprint="f", versions={}, study="s", trial=0)
    db = tmp_path / "db.json"
    database.record(entry, db)
    assert db.stat().st_mode & 0o777 == 0o644 and json.loads(db.read_text())["entries"]


def test_the_harness_uses_no_private_optuna_attribute():
    # the storage is addressed through its public API (fa4tune.searches.storage); a private attribute would
    # break silently on an optuna upgrade
    private = re.compile(r"\.(_storage|_study_id|_trial_id)\b")
    offenders = [f"{p.relative_to(REPO)}:{i}" for p in sorted((REPO / "fa4tune").rglob("*.py"))
                 for i, line in enumerate(p.read_text().splitlines(), 1) if private.search(line)]
    assert offenders == []


def test_the_public_storage_api_the_harness_relies_on(tmp_path):
    import optuna

    from fa4tune.searches import liveness
    from fa4tune.searches.storage import open_storage, trial_id

    storage = open_storage(tmp_path / "s.journal")
    study = optuna.create_study(study_name="s", storage=storage)
    trial = study.ask({"x": optuna.distributions.CategoricalDistribution([1, 2])})
    tid = liveness.claim_trial(storage, study, trial.number, liveness.this_process())
    assert tid == trial_id(storage, study, trial.number)
    assert storage.get_trial(tid).system_attrs[liveness.OWNER_ATTR]["pid"] == liveness.this_process()["pid"]


def test_no_closures_share_state():
    offenders = [str(p.relative_to(REPO)) for p in sorted((REPO / "fa4tune").rglob("*.py")) if "nonlocal" in p.read_text()]
    assert offenders == []


def test_bench_does_not_import_private_names():
    text = (REPO / "fa4tune" / "benchmark" / "runner.py").read_text()
    private_import = re.compile(r"from fa4tune[\w.]* import [^\n]*\b_\w+")
    assert private_import.search("from fa4tune.workers.pool import WorkerPool, _spawn")  # modules in rooms too
    assert not private_import.search(text)


@pytest.mark.parametrize("module", ["searches/runner", "searches/trial_loop", "searches/study", "searches/storage",
                                    "searches/liveness", "progress", "inputs/shapes", "searches/record",
                                    "searches/compile_space", "environment", "paths", "workers/outcomes",
                                    "workers/worker", "workers/pool", "workers/evaluator", "api", "searches/journal",
                                    "searches/sampler", "inputs/shape_sets", "searches/warm_start"])
def test_search_modules_stay_focused(module):
    # search.py (now searches/runner.py) once held all of these in 823 lines; a module that grows back past this holds two jobs
    lines = (REPO / "fa4tune" / f"{module}.py").read_text().count("\n")
    assert lines < 350, f"fa4tune/{module}.py has {lines} lines: two responsibilities?"


def test_committed_results_name_no_machine_paths():
    """Results carry the commands that made them, with $OUT or relative paths, never a machine's
    folders (the device's /root/out, a checkout under /work or /home)."""
    machine = re.compile(r"(?<![\w.$])/(root|work|home)/")
    text_suffixes = {".json", ".txt", ".log", ".md", ".csv", ".html", ".journal", ".toml"}

    def text_of(path: Path) -> str | None:
        if path.suffix == ".gz" and Path(path.stem).suffix in text_suffixes:   # compressed evidence
            return gzip.decompress(path.read_bytes()).decode(errors="replace")
        return path.read_text(errors="replace") if path.suffix in text_suffixes else None

    offenders = [str(p.relative_to(REPO)) for p in sorted((REPO / "results").rglob("*"))
                 if p.is_file() and machine.search(text_of(p) or "")]
    assert not offenders, offenders
