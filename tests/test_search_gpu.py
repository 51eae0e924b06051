"""GPU tests of the search machinery: timing, validation, real process isolation, a real search.

All carry `@pytest.mark.gpu` (skipped without a Hopper GPU). Only the last one needs our kernel; the
others put SDPA in its place (tests/test_search_fakes.py: SdpaGpuEvaluator) so a fault, a hang and a
wrong result are the worker machinery's to handle, not the kernel's.
"""

from __future__ import annotations

import math

import pytest

from fa4.kernels import AttentionProblem, Config
from fa4tune.workers.timing import TimingSettings

pytestmark = pytest.mark.gpu

MISSION = AttentionProblem(1, 1024, 1024, 32, 8, 128, "fp16", causal=True)
SDPA_EVALUATOR = "test_search_fakes:SdpaGpuEvaluator"


def test_graph_replay_timing_of_sdpa():
    import torch

    from fa4.reference import random_inputs, softmax_scale
    from fa4tune.workers.peers import peer_call
    from fa4tune.workers.timing import time_cuda

    q, k, v = random_inputs(MISSION)
    call, _ = peer_call("sdpa_flash", q, k, v, True, softmax_scale(128))
    warm = time_cuda(call, TimingSettings())
    assert len(warm.replay_us) == 7 and all(math.isfinite(t) and t > 0 for t in warm.replay_us)
    assert warm.us == sorted(warm.replay_us)[3]
    flushed = time_cuda(call, TimingSettings(l2="flushed"))
    assert flushed.us > 0
    torch.cuda.synchronize()


def test_fault_hang_and_mismatch_in_real_gpu_workers(monkeypatch):
    from fa4tune.workers.pool import WorkerPool
    from fa4tune.workers.worker import INJECT_ENV

    monkeypatch.setenv(INJECT_ENV, "fault@tile_n=80;timeout@tile_n=96;mismatch@tile_n=144")
    timing = TimingSettings().to_dict()

    def payload(tile_n):
        return {"arch": "sm90", "config": Config.make("sm90", tile_n=tile_n).to_dict(),
                "problem": MISSION.to_dict(), "timing": timing, "validate": True}

    with WorkerPool(2, [0], evaluator=SDPA_EVALUATOR, trial_timeout_s=20) as pool:
        assert pool.device["cc"] == "9.0" and pool.device["sm_count"] > 0
        ids = {pool.submit("trial", payload(n)): n for n in (80, 96, 144, 128)}
        ids[pool.submit("peers", {"problem": MISSION.to_dict(), "timing": timing,
                                  "names": ["sdpa_flash", "sdpa_cudnn", "flash_attn_4"]})] = "peers"
        results = {}
        while len(results) < len(ids):
            for task_id, result in pool.poll(5.0):
                results[ids[task_id]] = result
        assert results[80]["outcome"] == "fault"          # a real device-side assert, context poisoned
        assert results[96]["outcome"] == "timeout"
        assert results[144]["outcome"] == "mismatch" and results[144]["max_err"] > 0.5
        assert results[128]["outcome"] == "ok" and results[128]["us"] > 0 and results[128]["max_err"] < 1e-2
        assert results["peers"]["peers"]["sdpa_flash"]["us"] > 0
        # the pool replaced the dead workers and still runs trials
        again = pool.submit("trial", payload(112))
        done = []
        while not done:
            done = pool.poll(5.0)
        assert done[0][0] == again and done[0][1]["outcome"] == "ok"
        assert pool.events["replaced"] >= 2


def test_real_search_at_the_mission_shape(tmp_path):
    """Our kernel through the whole search: the seeded default validates and the best is no worse."""
    from fa4tune.searches.runner import Progress, SearchSettings, run_search

    settings = SearchSettings(trials=8, processes=4, storage=str(tmp_path / "studies.journal"),
                              db_path=str(tmp_path / "db.json"))
    [summary] = run_search("sm90", [MISSION], settings, Progress())
    assert summary["evaluated"] == 8
    assert summary["default_us"] is not None, "the default configuration did not validate"
    assert summary["best"]["us"] <= summary["default_us"]
    assert summary["best"]["max_err"] < 1e-2
