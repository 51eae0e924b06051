"""Our sm90 attention backward (`fa4.kernels.sm90_bwd`) compiles for sm_90a on a CPU: preprocess, main
kernel and postprocess, for both head dims, both 16-bit dtypes, causal and full, with no register
spills; and it rejects, loudly, parameters it cannot run. (Whether its gradients are right is
tests/gpu/test_sm90_bwd_gpu.py's question, on an H200.)"""

from __future__ import annotations

import itertools

import pytest

from fa4.kernels import sm90_bwd
from fa4.kernels.problem import AttentionProblem

# GQA ratio 4, odd lengths, Sq != Sk: what is compiled in is only dtype, head dim and causal (the
# rest is symbolic), but the problem a test names is one the kernel must run
CASES = [AttentionProblem(2, 177, 301, 8, 2, d, dtype, causal)
         for d, dtype, causal in itertools.product((64, 128), ("fp16", "bf16"), (True, False))]


def _case_id(problem: AttentionProblem) -> str:
    return f"d{problem.head_dim}-{problem.dtype}-{'causal' if problem.causal else 'full'}"


@pytest.mark.parametrize("problem", CASES, ids=_case_id)
def test_the_backward_compiles_clean(problem):
    params = sm90_bwd.default_params(problem.head_dim)
    reports = sm90_bwd.compile_report(params, problem)
    assert tuple(reports) == sm90_bwd.KERNELS
    for name, report in reports.items():
        assert report["spill_stores"] == 0 and report["spill_loads"] == 0, (name, report)
        assert not report["wgmma_serialized"], (name, report)
        assert report["registers"] is not None, (name, report)
    main = reports["main"]
    assert all(main["ptx_markers"].values()), main["ptx_markers"]
    # the traced shared memory is what the model that validates parameters expects, at most
    assert 0 < main["smem_bytes"] <= sm90_bwd.smem_bytes(params, problem.head_dim) <= sm90_bwd.SMEM_LIMIT_BYTES
    # the elementwise kernels use no tensor cores and no shared memory
    assert reports["preprocess"]["smem_bytes"] == reports["postprocess"]["smem_bytes"] == 0
    assert not any(reports["preprocess"]["ptx_markers"].values())


@pytest.mark.parametrize("params, head_dim, why", [
    (sm90_bwd.BackwardParams(tile_m=96), 128, "tile_m=96"),
    (sm90_bwd.BackwardParams(tile_n=256), 128, "tile_n=256"),
    (sm90_bwd.BackwardParams(q_stages=3), 128, "q_stages=3"),
    (sm90_bwd.BackwardParams(tile_m=128, tile_n=128), 64, "S and dP hold 128"),
    (sm90_bwd.BackwardParams(), 96, "head_dim=96"),
])
def test_parameters_it_cannot_run_are_rejected(params, head_dim, why):
    problem = AttentionProblem(1, 128, 128, 4, 2, head_dim, "bf16", True)
    assert any(why in reason for reason in sm90_bwd.reasons(params, problem))
    with pytest.raises(ValueError, match=why):
        sm90_bwd.compile_report(params, problem)


def test_the_defaults_are_runnable_at_every_supported_head_dim():
    for head_dim in sm90_bwd.SUPPORTED_HEAD_DIMS:
        problem = AttentionProblem(1, 128, 128, 4, 2, head_dim, "bf16", False)
        assert sm90_bwd.reasons(sm90_bwd.default_params(head_dim), problem) == []
