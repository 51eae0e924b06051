"""Deterministic gradients of our sm90 backward on the GPU (`compile_backward(..., deterministic=True)`):
the same inputs give dQ, dK and dV equal bit for bit on every run, for each dQ path (atomic, bulk,
fragment), split groups (dK and dV added in part order) and every scheduler, in either order of the dQ
adds (`plan.DESCENDING_TURNS`), and they pass flash-attn's gradient rule; a problem whose dQ sums have
many writers (long keys, many key blocks a query block) runs to the end (no deadlock: a hang would time
the test out). The non-deterministic default's sums differ between runs there, which shows the test can
tell.

    python -m pytest -m gpu -q tests/gpu/test_sm90_bwd_deterministic_gpu.py
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

from fa4.kernels import Config, sm90_bwd
from fa4.kernels.problem import AttentionProblem
from fa4.reference import attention_fp32, check_grads, softmax_scale

pytestmark = pytest.mark.gpu

KNOBS = [dict(), dict(dq_accum="bulk"), dict(dq_accum="fragment"), dict(group_split=2),
         dict(dq_accum="bulk", group_split=4, scheduler="single_lpt"),
         dict(tile_m=80, sdp_swap=True, dq_accum="fragment", group_split=2, scheduler="sectioned_lpt"),
         dict(sdp_swap=True, dq_accum="bulk", tile_m=64),
         dict(tile_m=80, sdp_swap=True, dq_accum="fragment_atomic")]
CASES = [(2, 777, 777, 16, 4, 128, True), (1, 300, 1000, 8, 1, 128, False), (1, 1000, 300, 8, 2, 128, True)]


@functools.lru_cache(maxsize=None)
def _compiled(config: Config, causal: bool, deterministic: bool, order: str):
    # the order of the dQ adds is read at compile time (`sm90_bwd.descending_turns`)
    saved = os.environ.get("FA4_BWD_DETERMINISTIC_ORDER")
    os.environ["FA4_BWD_DETERMINISTIC_ORDER"] = order
    try:
        return sm90_bwd.compile_backward(config, AttentionProblem(1, 128, 128, 8, 1, 128, "bf16", causal),
                                         deterministic=deterministic)
    finally:
        if saved is None:
            del os.environ["FA4_BWD_DETERMINISTIC_ORDER"]
        else:
            os.environ["FA4_BWD_DETERMINISTIC_ORDER"] = saved


def _backward(case, config, deterministic, runs, order="ascending"):
    batch, sq, sk, hq, hkv, d, causal = case
    gen = torch.Generator(device="cuda").manual_seed(sum(case[:6]))
    shapes = ((batch, sq, hq, d), (batch, sk, hkv, d), (batch, sk, hkv, d), (batch, sq, hq, d))
    q, k, v, dout = [torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=gen) for s in shapes]
    scale = softmax_scale(d)
    out, lse = attention_fp32(q, k, v, causal, scale)
    results = []
    for _ in range(runs):
        grads = [torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)]
        _compiled(config, causal, deterministic, order).run(q, k, v, out.to(q.dtype), dout, lse, *grads, scale)
        torch.cuda.synchronize()
        results.append(grads)
    return (q, k, v, dout, causal), results


@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}-sq{}-sk{}-hq{}-hkv{}-d{}-{}".format(
    *c[:6], "causal" if c[6] else "full"))
@pytest.mark.parametrize("knobs", KNOBS, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()) or "default")
@pytest.mark.parametrize("order", ["ascending", "descending"])   # plan.DESCENDING_TURNS
def test_deterministic_gradients_are_equal_bit_for_bit_and_follow_the_rule(order, knobs, case):
    config = Config.make("sm90_bwd", **knobs)
    problem = AttentionProblem(*case[:6], "bf16", case[6])
    if sm90_bwd.reasons(config, problem):
        pytest.skip(f"the model refuses {config.label()} here")
    (q, k, v, dout, causal), runs = _backward(case, config, True, 4, order)
    for grads in runs[1:]:
        for name, first, again in zip(("dq", "dk", "dv"), runs[0], grads):
            assert torch.equal(first, again), f"{name} differs between runs ({config.label()})"
    failures = check_grads(runs[0], q, k, v, dout, causal)
    assert not failures, failures


def test_many_writers_a_sum_finish_and_the_plain_order_varies():
    """B1 S8192 H8/1 D128 full, 64 key blocks adding to every query block's dQ: the deterministic run
    ends and repeats itself in either order; the atomic default's does not repeat itself (what the
    mode is for)."""
    case = (1, 8192, 8192, 8, 1, 128, False)
    config = Config.make("sm90_bwd", tile_n=128)
    for order in ("ascending", "descending"):
        _, ordered = _backward(case, config, True, 3, order)
        assert all(torch.equal(ordered[0][0], run[0]) for run in ordered[1:]), order
    _, plain = _backward(case, config, False, 3)
    assert any(not torch.equal(plain[0][0], run[0]) for run in plain[1:]), \
        "three atomic runs gave the same dQ: this shape cannot show the difference"
