"""`fa4tune search --backward` on the H200, tiny: the real evaluator compiles our backward in worker
processes, validates dQ, dK, dV by flash-attn's rule and times the backward alone; the peers' backward
timed in the same run; the entry recorded under its own key; `fa4.attention`'s backward then runs the
tuned configuration and its gradients pass.

    python -m pytest -m gpu -q tests/gpu/test_backward_search_gpu.py
"""

from __future__ import annotations

import pytest
import torch

import fa4
from fa4 import backward, kernels
from fa4.database import BestConfigDB
from fa4.kernels import AttentionProblem, Config, sm90_bwd
from fa4.reference import check_grads
from fa4tune.progress import Progress
from fa4tune.searches.runner import SearchSettings, run_search
from fa4tune.workers.backward import BackwardInputs, compile_backward, run_backward_trial
from fa4tune.workers.timing import TimingSettings

pytestmark = pytest.mark.gpu

PROBLEM = AttentionProblem(2, 1024, 1024, 16, 4, 128, "bf16", causal=True)


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bwd-search")
    settings = SearchSettings(trials=4, processes=4, storage=str(folder / "studies.journal"),
                              db_path=str(folder / "db.json"), retime_rounds=1, trial_timeout_s=60,
                              peers=("flash_attn_4", "sdpa_cudnn", "sdpa_flash"))
    [summary] = run_search("sm90_bwd", [PROBLEM], settings, Progress(quiet=True))
    return folder, summary


def test_a_backward_search_validates_times_and_records(searched):
    folder, summary = searched
    assert summary["arch"] == "sm90_bwd" and summary["outcomes"]["ok"] >= 1, summary["outcomes"]
    assert summary["default_us"] is not None   # the default passed flash-attn's rule
    assert summary["best"]["us"] <= summary["default_us"] * 1.05
    timed = {name: d["us"] for name, d in summary["peers"].items() if "us" in d}
    assert timed, summary["peers"]   # at least SDPA's backward ran beside ours
    [entry] = BestConfigDB.load(folder / "db.json").entries
    assert entry.key.startswith("sm90_bwd|") and entry.arch == "sm90_bwd"
    assert entry.kernel_fingerprint == kernels.kernel_fingerprint("sm90_bwd")
    assert set(timed) <= set(entry.backend_us) and "ours" in entry.backend_us


def test_the_runtime_runs_the_tuned_backward(searched, monkeypatch):
    folder, summary = searched
    fa4.use_config_db(folder / "db.json")
    fa4.reset_caches()
    try:
        monkeypatch.setenv(backward.ENV_VAR, "ours")
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, dout = (torch.randn(2, 1024, 16, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
        k, v = (torch.randn(2, 1024, 4, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
        config, source, _ = backward.tuned(q, k, True)
        assert source == "exact" and config == Config.from_dict("sm90_bwd", summary["best"]["config"])
        line = str(fa4.explain(q, k, v, causal=True))
        assert f"configuration {config.label()}: tuned, exact entry" in line
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        fa4.attention(*leaves, causal=True).backward(dout)
        assert not check_grads([t.grad for t in leaves], q, k, v, dout, True)
    finally:
        fa4.use_config_db(None)
        fa4.reset_caches()


def test_a_backward_trial_waits_for_work_queued_before_it():
    """A trial's NaN-filled gradients are made on the current stream and the backward runs on the
    forward's: with the current stream still busy (as behind a large problem's references), the
    backward must wait for the fill, or the fill lands on its results (the search once recorded every
    worker's first trial of B1 S4096 H32/8 as a NaN mismatch)."""
    problem = AttentionProblem(1, 512, 512, 8, 2, 128, "bf16", causal=False)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 512, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(1, 512, 2, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    inputs = BackwardInputs(problem, q, k, v, 128 ** -0.5)
    kernel = compile_backward(sm90_bwd.default_config(problem), problem)
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)   # ~0.1 s of one busy kernel on the current stream
    result = run_backward_trial(kernel, inputs, problem, TimingSettings(), validate=True, perturb=False)
    assert result["outcome"] == "ok", result
