"""The search orchestration on CPU: a fake kernel API and a fake evaluator (tests/test_search_fakes.py)
run through the real worker pool, optuna storage, resume and database code."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import optuna
import pytest
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState

import test_search_fakes as fakes
from fa4.database import BestConfigDB
from fa4.kernels import AttentionProblem, Config, knobs_for
from fa4tune.searches import liveness
from fa4tune.searches.liveness import sweep_interrupted
from fa4tune.workers.outcomes import OUTCOMES
from fa4tune.progress import Progress
from fa4tune.searches.runner import SearchSettings, run_search
from fa4tune.inputs.shapes import parse_shape, shape_key
from fa4tune.searches.storage import open_storage
from fa4tune.workers.pool import WorkerPool
from fa4tune.workers.worker import INJECT_ENV

TESTS = Path(__file__).resolve().parent
MISSION = AttentionProblem(1, 1024, 1024, 32, 8, 128, "fp16", causal=True)
EVALUATOR = "test_search_fakes:FakeEvaluator"
QUIET = Progress(quiet=True)


def settings(tmp_path, **kw) -> SearchSettings:
    base = dict(trials=12, processes=2, storage=str(tmp_path / "studies.journal"), db_path=str(tmp_path / "db.json"),
                evaluator=EVALUATOR, kernel_api="test_search_fakes", trial_timeout_s=20, seed=1)
    base.update(kw)
    return SearchSettings(**base)


def load(tmp_path, name):
    return optuna.load_study(study_name=name, storage=open_storage(tmp_path / "studies.journal"))


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(2, [0], evaluator=EVALUATOR, trial_timeout_s=20) as p:
        yield p


def test_shape_key_and_parse_shape():
    assert shape_key("sm90", MISSION) == "sm90-fp16-b1-hq32-hkv8-d128-sq1024-sk1024-causal"
    defaults = {**MISSION.to_dict(), "causal": False}
    arch, p = parse_shape("sm100-bf16-s4096-gqa8-causal-lse", defaults)
    assert arch == "sm100" and (p.seqlen_q, p.seqlen_k, p.heads_kv, p.dtype, p.causal, p.return_lse) == (
        4096, 4096, 4, "bf16", True, True)
    assert shape_key("sm100", p).endswith("-causal-lse")
    _, q = parse_shape("b2-hq16-hkv16-d64-sq128-sk512", defaults)
    assert (q.batch, q.heads_q, q.heads_kv, q.head_dim, q.seqlen_q, q.seqlen_k, q.causal) == (2, 16, 16, 64, 128, 512, False)
    with pytest.raises(ValueError, match="cannot read"):
        parse_shape("sq1024-x7", defaults)
    with pytest.raises(ValueError, match="not divisible"):
        parse_shape("gqa5", defaults)


def test_the_gpu_tests_sdpa_stand_in_kernel_computes_attention():
    """The stand-in of tests/test_search_gpu.py runs only there; on CPU its call path (SDPA through
    fa4.backends, GQA expanded) is checked against the fp32 reference, so a rename breaks it here."""
    import torch

    from fa4.reference import Expected

    problem = AttentionProblem(1, 64, 64, 4, 2, 64, "fp16", causal=True)
    q, k, v = (torch.randn(1, 64, heads, 64) for heads in (4, 2, 2))
    out = torch.full_like(q, float("nan"))
    fakes.SdpaKernel(Config.make("sm90"), problem).run(q, k, v, out, None, 0.125)
    assert (out - Expected.of(q, k, v, True, 0.125).out_fp32).abs().max() < 1e-4


def test_identical_compile_keys_compile_once(pool):
    from fa4tune.workers.timing import TimingSettings

    config = Config.make("sm90", tile_n=160)
    payload = {"arch": "sm90", "config": config.to_dict(), "problem": MISSION.to_dict(),
               "timing": TimingSettings().to_dict(), "validate": True}
    key = fakes.compile_key(config, MISSION)
    first = pool.submit("trial", payload, compile_key=key)
    second = pool.submit("trial", payload, compile_key=key)   # routed to the worker holding the key
    results = {}
    while len(results) < 2:
        results.update(pool.poll(5.0))
    assert results[first]["compile_cached"] is False and results[second]["compile_cached"] is True
    assert results[first]["us"] == results[second]["us"]


def test_workers_spread_over_gpus_one_lock_each(tmp_path):
    from fa4tune.workers.timing import TimingSettings

    with WorkerPool(4, [0, 1], evaluator=EVALUATOR, lock_dir=str(tmp_path)) as pool:
        deadline = time.time() + 120
        while sum(w.ready for w in pool._workers) < 4 and time.time() < deadline:
            pool.poll(0.5)
        ids = [pool.submit("trial", {"arch": "sm90", "config": Config.make("sm90", tile_n=n).to_dict(),
                                     "problem": MISSION.to_dict(), "timing": TimingSettings().to_dict()})
               for n in (64, 80, 96, 112)]
        results = {}
        while len(results) < 4:
            results.update(pool.poll(5.0))
    assert sorted(results) == sorted(ids)  # every task came back once
    assert {r["visible_gpu"] for r in results.values()} == {"0", "1"}
    assert len({r["worker_pid"] for r in results.values()}) == 4
    assert sorted(p.name for p in tmp_path.glob("*.lock")) == ["fa4tune-gpu0.lock", "fa4tune-gpu1.lock"]


def test_search_records_the_documented_schema(tmp_path, pool):
    s = settings(tmp_path, trials=16)
    [summary] = run_search("sm90", [MISSION], s, QUIET, pool=pool)
    study = load(tmp_path, shape_key("sm90", MISSION))
    attrs = study.user_attrs
    assert attrs["arch"] == "sm90" and attrs["problem"] == MISSION.to_dict()
    assert attrs["device"] == {"name": "Fake H200", "sm_count": 132, "cc": "9.0", "driver": "fake"}
    assert set(attrs["versions"]) == {"torch", "cutlass_dsl", "optuna", "cuda", "flash_attn_4"}
    assert attrs["kernel_fingerprint"] == "fake-fingerprint-1"
    assert attrs["timing"] == {"method": "cuda_graph", "launches_per_graph": 20, "replays": 7, "l2": "warm",
                               "warmup_ms": 100.0}
    # GPU time only: a search does not time the peers' eager calls (the bench does)
    assert attrs["peers"]["sdpa_cudnn"] == {"us": 31.6, "tflops": pytest.approx(271.8, abs=0.1)}
    assert "error" in attrs["peers"]["flash_attn_4"]
    assert attrs["default_us"] == fakes.fake_us(Config.make("sm90").to_dict())

    trials = study.get_trials(deepcopy=False)
    first = trials[0]
    assert first.user_attrs["is_default"] and first.params == Config.make("sm90").to_dict()
    assert sum(1 for t in trials if t.user_attrs.get("is_default")) == 1
    names = [k.name for k in knobs_for("sm90")]
    for t in trials:
        assert list(t.params) == names
        assert all(isinstance(d, CategoricalDistribution) for d in t.distributions.values())
        out = t.user_attrs["outcome"]
        assert out in OUTCOMES
        for key in ("us", "tflops", "compile_s", "max_err", "max_err_sdpa", "error", "is_default"):
            assert key in t.user_attrs, (key, t.number)
        if out == "ok":
            assert t.state == TrialState.COMPLETE and t.value == t.user_attrs["us"]
            assert t.constraints == {"works": 0.0, "0": 0.0}   # optuna's format and the dashboard's
        else:
            assert t.state == TrialState.PRUNED and t.value is None and t.user_attrs["error"]
            assert t.constraints == {"works": 1.0, "0": 1.0}
        if out == "infeasible":
            assert t.user_attrs["reasons"] and "shared memory" in t.user_attrs["reasons"][0]
    assert summary["evaluated"] == 16 == summary["configurations"] - summary["outcomes"]["infeasible"]
    assert sum(summary["outcomes"].values()) == summary["configurations"]
    best = summary["best"]
    assert best["us"] <= attrs["default_us"]          # seeded with the default: never worse
    assert best["us"] == min(t.value for t in trials if t.state == TrialState.COMPLETE)
    assert summary["speedup"]["sdpa_flash"] == round(53.0 / best["us"], 3)

    # the best configuration went to the database with the study's facts
    [entry] = BestConfigDB.load(tmp_path / "db.json").entries
    assert entry.config == best["config"] and entry.us == best["us"] and entry.study == study.study_name
    assert entry.trial == best["trial"] and entry.kernel_fingerprint == "fake-fingerprint-1"
    assert entry.speedup["sdpa_cudnn"] == round(31.6 / best["us"], 4) and entry.device == "Fake H200"
    assert summary["db"]["written"] is True


def test_rerun_resumes_up_to_the_trial_count(tmp_path, pool):
    run_search("sm90", [MISSION], settings(tmp_path, trials=8), QUIET, pool=pool)
    study = load(tmp_path, shape_key("sm90", MISSION))
    before = {t.number: (t.params, t.user_attrs["outcome"]) for t in study.get_trials()}
    [again] = run_search("sm90", [MISSION], settings(tmp_path, trials=8), QUIET, pool=pool)
    assert again["evaluated"] == 8 and len(load(tmp_path, study.study_name).trials) == len(before)
    [more] = run_search("sm90", [MISSION], settings(tmp_path, trials=14), QUIET, pool=pool)
    study = load(tmp_path, study.study_name)
    assert more["evaluated"] == 14
    assert {t.number: (t.params, t.user_attrs["outcome"]) for t in study.get_trials()
            if t.number in before} == before      # nothing finished was lost or changed
    assert sum(1 for t in study.trials if t.user_attrs.get("is_default")) == 1  # seeded once
    distinct = {json.dumps(t.params, sort_keys=True) for t in study.trials if "repeat_of" not in t.user_attrs}
    assert len(distinct) == more["configurations"]


@pytest.mark.parametrize("sampler", ["grid", "random"])
def test_other_samplers(tmp_path, pool, sampler):
    [summary] = run_search("sm90", [MISSION], settings(tmp_path, trials=6, sampler=sampler), QUIET, pool=pool)
    assert summary["evaluated"] == 6 and summary["best"] is not None


def test_changed_kernel_fingerprint_continues_in_a_new_study(tmp_path, pool, monkeypatch):
    run_search("sm90", [MISSION], settings(tmp_path, trials=4), QUIET, pool=pool)
    monkeypatch.setenv(fakes.FAKE_FINGERPRINT_ENV, "fake-fingerprint-2")
    [summary] = run_search("sm90", [MISSION], settings(tmp_path, trials=4), QUIET, pool=pool)
    name = shape_key("sm90", MISSION)
    assert summary["study"] == f"{name}~2"
    new = load(tmp_path, f"{name}~2")
    assert new.user_attrs["previous_study"] == name and new.user_attrs["kernel_fingerprint"] == "fake-fingerprint-2"
    assert load(tmp_path, name).user_attrs["kernel_fingerprint"] == "fake-fingerprint-1"
    # the database entry of the old fingerprint was replaced (stale), not kept because it was faster
    [entry] = BestConfigDB.load(tmp_path / "db.json").entries
    assert entry.kernel_fingerprint == "fake-fingerprint-2"


def test_two_problems_two_studies(tmp_path, pool):
    full = replace(MISSION, causal=False)
    summaries = run_search("sm90", [full, MISSION], settings(tmp_path, trials=5), QUIET, pool=pool)
    assert [s["study"] for s in summaries] == [shape_key("sm90", full), shape_key("sm90", MISSION)]
    assert len(BestConfigDB.load(tmp_path / "db.json")) == 2


def test_injected_failures_are_classified_and_the_search_continues(tmp_path, monkeypatch):
    monkeypatch.setenv(INJECT_ENV, "fault@tile_n=80;timeout@tile_n=96;launch_error@tile_n=112;"
                                   "mismatch@tile_n=144;compile_error@tile_n=64")
    s = settings(tmp_path, sampler="grid", trials=40, trial_timeout_s=3, processes=2,
                 space_path=str(_write_space(tmp_path)))
    [summary] = run_search("sm90", [MISSION], s, QUIET)
    study = load(tmp_path, summary["study"])
    by_tile = {}
    # the grid sampler does not know the enqueued default holds its grid point: one repeat at most
    assert sum("repeat_of" in t.user_attrs for t in study.trials) <= 1
    for t in study.trials:
        if "repeat_of" not in t.user_attrs:
            by_tile.setdefault(t.params["tile_n"], set()).add(t.user_attrs["outcome"])
    assert by_tile[80] == {"fault"}
    assert by_tile[96] == {"timeout"}
    assert by_tile[112] == {"launch_error"}
    assert by_tile[144] == {"mismatch"}
    assert by_tile[64] == {"compile_error"}
    assert by_tile[128] == {"ok"}
    assert by_tile[160] == {"ok"} and by_tile[176] == {"infeasible"}   # the fake's own budget
    assert summary["configurations"] == 24   # the whole grid ran despite faults and hangs
    fault = next(t for t in study.trials if t.params["tile_n"] == 80)
    assert "SIGSEGV" in fault.user_attrs["error"]
    hung = next(t for t in study.trials if t.params["tile_n"] == 96)
    assert "exceeded 3 s" in hung.user_attrs["error"]
    assert summary["pool_events"]["killed_hung"] >= 1 and summary["pool_events"]["died"] >= 1
    assert summary["best"]["config"]["tile_n"] == 128
    _assert_dashboard_shows_feasibility(tmp_path / "studies.journal", study)


def _assert_dashboard_shows_feasibility(journal: Path, study) -> None:
    """Each measured trial is feasible in optuna-dashboard exactly when its outcome is "ok": the
    dashboard reads the trial system attribute "constraints" (a list; feasible when every value is <= 0;
    its server `_serializer.serialize_frozen_trial`, its browser journal reader `log.system_attr`),
    and so do optuna's own samplers and plots (`FrozenTrial.constraints`)."""
    measured = [t for t in study.trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    outcomes = {t.user_attrs["outcome"] for t in measured}
    assert {"ok", "infeasible", "compile_error", "mismatch"} <= outcomes
    for t in measured:
        values = t.system_attrs.get("constraints", [])
        ok = t.user_attrs["outcome"] == "ok"
        assert values and all(v <= 0 for v in values) == ok, (t.number, t.user_attrs["outcome"], values)
        assert all(v <= 0 for v in t.constraints.values()) == ok
    for t in study.trials:  # a repeat, or a trial over the budget: no result, so no feasibility either
        if t.state == TrialState.FAIL:
            assert "constraints" not in t.system_attrs and not t.constraints
    # as the journal holds it (what the dashboard's browser-only reader parses): a plain JSON list
    logged = [json.loads(line)["system_attr"]["constraints"] for line in journal.read_text().splitlines()
              if '"constraints"' in line and json.loads(line).get("op_code") == 9]
    assert len(logged) == len(measured) and all(v in ([0.0], [1.0]) for v in logged)


def test_the_dashboards_constraints_attribute_is_optunas():
    # the dashboard's format is optuna's private _CONSTRAINTS_KEY (the list samplers' constraints_func
    # writes); an optuna that renames it fails here, not silently in the dashboard
    from optuna.study._constrained_optimization import _CONSTRAINTS_KEY
    from optuna.study._constrained_optimization import _get_constraints_from_system_attrs

    from fa4tune.searches.study import CONSTRAINT_NAME, DASHBOARD_CONSTRAINTS_ATTR

    assert DASHBOARD_CONSTRAINTS_ATTR == _CONSTRAINTS_KEY
    both = {DASHBOARD_CONSTRAINTS_ATTR: [1.0], f"{_CONSTRAINTS_KEY}:{CONSTRAINT_NAME}": 1.0}
    assert _get_constraints_from_system_attrs(both) == {"0": 1.0, CONSTRAINT_NAME: 1.0}


def _write_space(tmp_path) -> Path:
    path = tmp_path / "narrow.toml"
    # 8 tile_n values x 3 kv_stages, the default among them: each failure class appears; every other
    # knob held at its declared default
    varied = {"tile_n": [64, 80, 96, 112, 128, 144, 160, 176], "kv_stages": [2, 3, 4]}
    lines = ["[knobs]"] + [f"{k.name} = {json.dumps(varied.get(k.name, [k.default]))}"
                           for k in knobs_for("sm90")]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_sweep_marks_trials_of_dead_owners_failed(tmp_path):
    storage = open_storage(tmp_path / "studies.journal")
    study = optuna.create_study(study_name="s", storage=storage)
    dist = {"x": CategoricalDistribution([1, 2])}
    dead = study.ask(dist)
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    liveness.claim_trial(storage, study, dead.number, {"host": os.uname().nodename, "pid": proc.pid, "start": "1"})
    mine = study.ask(dist)
    liveness.claim_trial(storage, study, mine.number, liveness.this_process())
    remote_fresh = study.ask(dist)
    liveness.claim_trial(storage, study, remote_fresh.number, {"host": "elsewhere"})
    remote_old = study.ask(dist)
    old_id = liveness.claim_trial(storage, study, remote_old.number, {"host": "elsewhere"})
    storage.set_trial_system_attr(old_id, liveness.HEARTBEAT_ATTR, time.time() - 3600)
    ownerless = study.ask(dist)   # killed between ask and writing its owner
    other_run = {"host": "elsewhere", "pid": 1, "start": "1"}
    study_id = storage.get_study_id_from_name("s")
    storage.set_study_system_attr(study_id, liveness.run_attr(other_run), {"owner": other_run, "beat": time.time()})
    swept = sweep_interrupted(storage, study)
    assert sorted(swept) == sorted([dead.number, remote_old.number])   # another run may own it
    storage.set_study_system_attr(study_id, liveness.run_attr(other_run),
                                  {"owner": other_run, "beat": time.time() - 3600})
    assert sweep_interrupted(storage, study) == [ownerless.number]     # no live run is left
    states = {t.number: (t.state, t.user_attrs.get("outcome")) for t in study.get_trials()}
    assert states[dead.number] == (TrialState.FAIL, "interrupted")
    assert states[mine.number][0] == TrialState.RUNNING and states[remote_fresh.number][0] == TrialState.RUNNING


_KILL_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
from fa4.kernels import AttentionProblem
from fa4tune.progress import Progress
from fa4tune.searches.runner import SearchSettings, run_search
if __name__ == "__main__":
    s = SearchSettings(trials={trials}, processes=2, storage={storage!r}, db_path={db!r},
                       evaluator="test_search_fakes:FakeEvaluator", kernel_api="test_search_fakes")
    run_search("sm90", [AttentionProblem(1, 1024, 1024, 32, 8, 128, "fp16", True)], s, Progress(quiet=True))
"""


def test_kill_9_loses_only_the_trials_in_flight(tmp_path):
    storage = str(tmp_path / "studies.journal")
    script = tmp_path / "run.py"
    script.write_text(_KILL_SCRIPT.format(tests=str(TESTS), trials=30, storage=storage, db=str(tmp_path / "db.json")))
    env = {**os.environ, fakes.FAKE_COMPILE_S_ENV: "0.4"}
    proc = subprocess.Popen([sys.executable, str(script)], env=env, start_new_session=True)
    name = shape_key("sm90", MISSION)
    deadline = time.time() + 120
    finished_before: dict = {}
    try:
        while time.time() < deadline:
            time.sleep(0.5)
            try:
                study = optuna.load_study(study_name=name, storage=open_storage(storage))
            except KeyError:
                continue
            trials = study.get_trials(deepcopy=False)
            done = [t for t in trials if t.state.is_finished()]
            running = [t for t in trials if t.state == TrialState.RUNNING]
            if len(done) >= 6 and running:
                os.killpg(proc.pid, signal.SIGKILL)   # the search and its workers, mid-trial
                proc.wait(30)
                break
        else:
            pytest.fail("the search did not get going")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    study = optuna.load_study(study_name=name, storage=open_storage(storage))
    finished_before = {t.number: (t.state, t.value, t.params) for t in study.get_trials() if t.state.is_finished()}
    running_before = [t.number for t in study.get_trials() if t.state == TrialState.RUNNING]
    assert running_before

    [summary] = run_search("sm90", [MISSION], SearchSettings(
        trials=30, processes=2, storage=storage, db_path=str(tmp_path / "db.json"), evaluator=EVALUATOR,
        kernel_api="test_search_fakes"), QUIET)
    study = optuna.load_study(study_name=name, storage=open_storage(storage))
    after = {t.number: t for t in study.get_trials()}
    for number, (state, value, params) in finished_before.items():   # no finished trial lost
        assert (after[number].state, after[number].value, after[number].params) == (state, value, params)
    for number in running_before:                                    # in flight: marked failed
        assert after[number].state == TrialState.FAIL and after[number].user_attrs["outcome"] == "interrupted"
    assert not [t for t in after.values() if t.state == TrialState.RUNNING]
    assert summary["evaluated"] == 30 and summary["interrupted"] == len(running_before)


@pytest.mark.parametrize("sampler", ["tpe", "random"])
def test_a_study_holds_one_trial_per_configuration(tmp_path, pool, sampler):
    """The whole 24-point space asked for: drawn with replacement, TPE and random would propose many
    configurations twice; each becomes no trial of its own (no duplicate points, no inflated count)."""
    s = settings(tmp_path, sampler=sampler, trials=40, space_path=str(_write_space(tmp_path)), peers=())
    [summary] = run_search("sm90", [MISSION], s, QUIET, pool=pool)
    study = load(tmp_path, summary["study"])
    keys = [json.dumps(t.params, sort_keys=True) for t in study.trials]
    assert len(keys) == len(set(keys)) == 24 == summary["configurations"]
    assert summary["repeats"] == 0 and summary["interrupted"] == 0


def test_a_repeat_is_a_fail_trial_without_a_value_and_is_not_counted(tmp_path, pool):
    """A race between processes can still hand a study a configuration it holds: recorded as FAIL with
    repeat_of, not measured, not counted, not interrupted."""
    s = settings(tmp_path, sampler="random", trials=4, peers=())
    run_search("sm90", [MISSION], s, QUIET, pool=pool)
    study = load(tmp_path, shape_key("sm90", MISSION))
    held = next(t for t in study.trials if t.user_attrs.get("outcome") == "ok" and not t.user_attrs["is_default"])
    study.enqueue_trial(held.params)           # what a concurrent process's identical ask looks like
    [summary] = run_search("sm90", [MISSION], replace(s, trials=6), QUIET, pool=pool)
    study = load(tmp_path, summary["study"])
    [repeat] = [t for t in study.trials if "repeat_of" in t.user_attrs]
    assert repeat.state == TrialState.FAIL and repeat.value is None and repeat.params == held.params
    assert repeat.user_attrs == {"repeat_of": held.number}
    assert summary["repeats"] == 1 and summary["interrupted"] == 0 and summary["evaluated"] == 6


def _search_with_a_lucky_trial(tmp_path, monkeypatch, retime_rounds: int) -> dict:
    """The whole 24-point test space, where tile_n=128 kv_stages=3 times 3 us lucky the first time."""
    from test_search_fakes import FAKE_LUCKY_ENV

    lucky = tmp_path / "lucky"
    lucky.mkdir()
    monkeypatch.setenv(FAKE_LUCKY_ENV, f"{lucky}:tile_n=128 kv_stages=3")
    s = settings(tmp_path, sampler="grid", trials=24, space_path=str(_write_space(tmp_path)), peers=(),
                 retime_rounds=retime_rounds)
    [summary] = run_search("sm90", [MISSION], s, QUIET)   # its own pool: the workers see the variable
    return summary


def test_the_retime_step_records_the_lowest_median_not_the_luckiest_trial(tmp_path, monkeypatch):
    """tile_n=128 kv_stages=3 (33.0 us in the fake) reads 30.0 the first time it is timed: the search's
    best trial.
    Re-timed three times with the other finalists, its median is 33.0, and the database gets tile_n=112
    (32.0), timed by its median; without the re-time it would get the lucky one."""
    summary = _search_with_a_lucky_trial(tmp_path, monkeypatch, retime_rounds=3)
    study = load(tmp_path, summary["study"])
    assert study.best_trial.params["tile_n"] == 128 and study.best_value == pytest.approx(30.0)
    retimed = summary["retime"]
    by_trial = {r["trial"]: r for r in retimed["finalists"]}
    assert by_trial[study.best_trial.number]["median_us"] == pytest.approx(33.0)
    assert all(len(r["us"]) == 3 for r in retimed["finalists"])
    assert any(r["is_default"] for r in retimed["finalists"])
    [entry] = BestConfigDB.load(tmp_path / "db.json").entries
    assert entry.config["tile_n"] == 112 and entry.us == pytest.approx(32.0)
    assert study.user_attrs["retime"]["winner_trial"] == entry.trial
    # the re-times are not trials
    assert summary["configurations"] == 24 and len(study.trials) == 24 + summary["repeats"]


def test_without_the_retime_the_search_records_its_best_trial(tmp_path, monkeypatch):
    summary = _search_with_a_lucky_trial(tmp_path, monkeypatch, retime_rounds=0)
    [entry] = BestConfigDB.load(tmp_path / "db.json").entries
    assert "retime" not in summary and entry.config["tile_n"] == 128 and entry.us == pytest.approx(30.0)
