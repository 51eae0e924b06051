"""Autotune on first use (`fa4.autotune`, `fa4tune.autotune`) on CPU: the mode, the guards (capture,
torch.compile, no GPU, off), the per-shape lock, the recording path with a fake tuner, and the
harness's tuner with the fake evaluator (candidates, the wall-clock budget). The tune itself on a GPU:
tests/gpu/test_autotune_gpu.py."""

from __future__ import annotations

import ast
import hashlib
import threading
import time
import tomllib
from pathlib import Path

import pytest
import torch

import fa4
from fa4 import autotuning as autotune, database, kernels, planning, state
from fa4.kernels import AttentionProblem, reference_device

ROOT = Path(__file__).resolve().parent.parent
DEVICE = "NVIDIA H200"
SHAPE = (1, 384, 8, 64)   # B, S, H, D: no packaged entry within reach


def qkv():
    b, s, h, d = SHAPE
    return tuple(torch.zeros(b, s, h, d, dtype=torch.float16) for _ in range(3))


def a_plan():
    """The plan fa4.attention makes for SHAPE on an H200 (no exact entry: the default or a neighbour's)."""
    q, k, v = qkv()
    return planning.plan(q, k, v, False, False, None, "error", False, arch="sm90", device_name=DEVICE)


@pytest.fixture(autouse=True)
def fresh(monkeypatch, tmp_path):
    monkeypatch.setenv("FA4TUNE_HOME", str(tmp_path))
    monkeypatch.delenv(autotune.ENV_VAR, raising=False)
    monkeypatch.delenv(autotune.BUDGET_ENV_VAR, raising=False)
    fa4.use_config_db(None)
    fa4.reset_caches()
    yield
    fa4.autotune(None)
    autotune._api_settings = None
    autotune.register_tuner(None)
    fa4.reset_caches()


PROBLEM = AttentionProblem(batch=1, seqlen_q=384, seqlen_k=384, heads_q=8, heads_kv=8, head_dim=64,
                           dtype="fp16", causal=False)
DEFAULT = kernels.default_config("sm90", PROBLEM, reference_device("sm90"))
FASTER = DEFAULT.replace(tile_n=80)


class FakeTuner:
    """Returns the default at 30 us and one other configuration at 24 us; counts its calls."""

    def __init__(self, measured=None):
        self.calls, self.measured = [], measured

    def __call__(self, request):
        self.calls.append(request)
        default = DEFAULT.to_dict()
        other = FASTER.to_dict()
        measured = self.measured if self.measured is not None else [
            autotune.Measured(default, 30.0, 0.001, True), autotune.Measured(other, 24.0, 0.002)]
        return autotune.TuneResult(measured=measured, tried=2, versions={"torch": torch.__version__})


# ---- the mode ----

def test_off_unless_asked(monkeypatch):
    assert autotune.settings() is None
    monkeypatch.setenv(autotune.ENV_VAR, "quick")
    assert autotune.settings() == autotune.Settings("quick", autotune.BUDGET_S["quick"])
    monkeypatch.setenv(autotune.BUDGET_ENV_VAR, "12")
    assert autotune.settings().budget_s == 12.0
    fa4.autotune(None)   # the API wins over the environment
    assert autotune.settings() is None
    fa4.autotune("full", budget_s=5)
    assert autotune.settings() == autotune.Settings("full", 5.0)


@pytest.mark.parametrize("effort, budget", [("fast", None), ("quick", 0), ("quick", "nan"), ("quick", -3)])
def test_bad_settings_are_refused(effort, budget):
    with pytest.raises(fa4.InvalidInputError, match="fa4.autotune"):
        fa4.autotune(effort, budget_s=budget)


def test_a_malformed_variable_warns_and_leaves_it_off(monkeypatch):
    monkeypatch.setenv(autotune.ENV_VAR, "fastest")
    with pytest.warns(fa4.Fa4Warning, match="FA4_AUTOTUNE: effort must be one of quick, default, full"):
        assert autotune.settings() is None


def test_the_effort_counts_are_the_search_presets():
    from fa4tune.searches.runner import EFFORTS

    assert EFFORTS is autotune.EFFORTS and set(autotune.BUDGET_S) == set(EFFORTS)


# ---- the guards ----

@pytest.fixture
def tuner(monkeypatch):
    fake = FakeTuner()
    autotune.register_tuner(fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)   # past the no-GPU guard
    monkeypatch.setattr(autotune, "_capturing", lambda: False)
    fa4.autotune("quick", budget_s=5)
    return fake


def test_tunes_an_unseen_shape_once(tuner):
    plan = a_plan()
    assert plan.explanation.source in ("default", "nearest")
    assert autotune.tune_first(plan, in_graph=False) is True
    assert len(tuner.calls) == 1
    request = tuner.calls[0]
    assert request.max_configs == autotune.EFFORTS["quick"] and request.problem == plan.problem
    assert 0 < request.deadline - time.monotonic() <= 5
    assert autotune.tune_first(a_plan(), in_graph=False) is False   # now an exact entry
    fa4.reset_caches()   # a new process, as it were: it finds the entry (and plans again), no tune
    assert autotune.tune_first(plan, in_graph=False) is True
    assert len(tuner.calls) == 1


def test_off_means_no_tune(tuner):
    fa4.autotune(None)
    assert autotune.tune_first(a_plan(), in_graph=False) is False and tuner.calls == []


def test_no_gpu_means_no_tune(tuner, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert autotune.tune_first(a_plan(), in_graph=False) is False and tuner.calls == []


@pytest.mark.parametrize("where", ["capture", "compiling", "custom op"])
def test_never_inside_a_capture_or_a_compile(tuner, monkeypatch, where):
    if where == "capture":
        monkeypatch.setattr(autotune, "_capturing", lambda: True)
    if where == "compiling":
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with pytest.warns(fa4.Fa4Warning, match="once eagerly with these shapes .*before capturing or compiling"):
        assert autotune.tune_first(a_plan(), in_graph=where == "custom op") is False
    assert tuner.calls == []


def test_a_forced_configuration_or_a_pinned_database_is_not_tuned(tuner, tmp_path):
    q, k, v = qkv()
    forced = planning.plan(q, k, v, False, False, {"tile_n": 80}, "error", False, arch="sm90", device_name=DEVICE)
    assert autotune.tune_first(forced, in_graph=False) is False
    fa4.use_config_db(tmp_path / "pinned.json")
    assert autotune.tune_first(a_plan(), in_graph=False) is False
    assert tuner.calls == []


def test_the_runtime_asks_on_every_first_call():
    """The slow path of fa4.attention plans, asks `tune_first`, and plans again when it recorded."""
    source = (ROOT / "fa4" / "runtime.py").read_text()
    assert "if autotuning.tune_first(plan, in_graph):" in source


# ---- the recording path ----

def test_records_the_fastest_in_the_user_database(tuner):
    plan = a_plan()
    assert autotune.tune_and_record(plan, autotune.settings()) == "recorded"
    [entry] = database.BestConfigDB.load(database.user_path()).entries
    assert entry.config == FASTER.to_dict()
    assert (entry.us, entry.default_us, entry.study) == (24.0, 30.0, "autotune-quick")
    assert entry.device == DEVICE and entry.kernel_fingerprint == state.fingerprint("sm90")
    assert entry.backend_us == {}   # ours alone: dispatch predicts from the neighbours, as before
    q, k, v = qkv()
    explained = fa4.explain(q, k, v, arch="sm90", device_name=DEVICE)
    assert explained.source == "exact" and explained.config == FASTER


def test_nothing_measured_records_nothing_and_says_why(tuner):
    tuner.measured = []
    with pytest.warns(fa4.Fa4Warning, match="measured no configuration in 5 s"):
        assert autotune.tune_and_record(a_plan(), autotune.settings()) == "nothing measured"
    assert not database.user_path().exists()


def test_a_failing_tuner_runs_untuned(tuner):
    def broken(request):
        raise RuntimeError("no worker starts")

    with pytest.warns(fa4.Fa4Warning, match="failed .RuntimeError: no worker starts.; running untuned"):
        assert autotune.tune_and_record(a_plan(), autotune.settings(), broken) == "failed"


def test_a_second_process_waits_for_the_first_and_finds_its_entry(tuner):
    """The per-shape lock: while another holder tunes, this one waits (within its budget); once that
    one recorded, this one finds the entry and does not tune."""
    from filelock import FileLock

    plan = a_plan()
    digest = hashlib.sha256(autotune._shape_key(plan).encode()).hexdigest()[:16]
    lock_path = database.user_path().parent / "autotune" / f"{digest}.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    held, release = threading.Event(), threading.Event()

    def hold():   # another holder: its own descriptor, so its flock excludes this process's too
        with FileLock(str(lock_path)):
            held.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait(5)
    t0 = time.monotonic()
    with pytest.warns(fa4.Fa4Warning, match="another process was still tuning"):
        assert autotune.tune_and_record(plan, autotune.Settings("quick", 0.5)) == "busy"
    assert 0.4 < time.monotonic() - t0 < 3
    release.set()
    holder.join()
    assert autotune.tune_and_record(plan, autotune.settings()) == "recorded"
    assert autotune.tune_and_record(plan, autotune.settings()) == "found"
    assert len(tuner.calls) == 1


# ---- layering ----

def test_fa4_reaches_the_harness_only_through_the_entry_point():
    for path in (ROOT / "fa4").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n == "fa4tune" or n.startswith("fa4tune.") for n in names), path
    points = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    assert points[autotune.TUNER_GROUP] == {"fa4tune": "fa4tune.autotune:tune"}
    from fa4tune.autotune import tune

    assert callable(tune)


# ---- the harness's tuner, with the fake evaluator in real worker processes ----

def test_candidates_are_the_default_then_neighbours_then_single_knob_moves():
    from fa4tune.autotune import candidates

    device = reference_device("sm90")
    chosen = candidates("sm90", PROBLEM, device, 10)
    default = kernels.default_config("sm90", PROBLEM, device)
    assert len(chosen) == 10 and chosen[0] == (default, "default")
    assert len({c for c, _ in chosen}) == 10
    assert all(not kernels.feasible(c, PROBLEM, device) for c, _ in chosen)
    sources = [s for _, s in chosen]
    neighbours = [i for i, s in enumerate(sources) if s.startswith("neighbour")]
    moves_at = [i for i, s in enumerate(sources) if s.startswith("default with")]
    assert neighbours and moves_at and max(neighbours) < min(moves_at)
    moves = [c for c, s in chosen if s.startswith("default with")]
    changed = [[n for n, v in c.items if getattr(default, n) != v] for c in moves]
    assert all(len(names) == 1 for names in changed)
    assert len({names[0] for names in changed}) == len(changed)   # round-robin: one move per knob first


def _request(seconds: float, max_configs: int = 10):
    return autotune.TuneRequest("sm90", PROBLEM, reference_device("sm90"), 0, max_configs,
                                time.monotonic() + seconds)


def test_the_tuner_measures_in_worker_processes():
    from fa4tune.autotune import tune

    result = tune(_request(60, max_configs=4), evaluator="test_search_fakes:FakeEvaluator")
    assert result.tried == 4 and len(result.measured) == 4
    assert sum(m.is_default for m in result.measured) == 1
    assert set(result.versions) >= {"torch", "optuna"}


def test_the_tuner_stops_at_the_deadline(monkeypatch):
    from fa4tune.autotune import tune

    monkeypatch.setenv("FA4TUNE_FAKE_COMPILE_S", "60")   # every compile outlasts the budget
    t0 = time.monotonic()
    result = tune(_request(3), evaluator="test_search_fakes:FakeEvaluator")
    took = time.monotonic() - t0
    assert result.measured == [] and 2.9 < took < 4.0, took
    assert "the budget ended" in result.notes[-1]
