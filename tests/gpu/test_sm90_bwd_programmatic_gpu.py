"""The main backward kernel as a programmatic dependent launch of the preprocess
(`FA4_BWD_PROGRAMMATIC_LAUNCH=1`, `fa4.kernels.sm90_bwd.plan.PROGRAMMATIC_LAUNCH`): its CTAs start in
the preprocess's tail and load K and V before they wait for LSE2, D and the zeroed dQ accumulator; each
postprocess (dQ's, a split group's dK and dV converters) starts in the last wave of the kernel before it
and waits for its end before it reads an accumulator. The gradients pass flash-attn's rule for each dQ path, a split group, sdp_swap, a gradient through the LSE
(a torch op between the two kernels) and the deterministic order, on reused (NaN-filled) workspace
memory, so a read before the wait would show.

    python -m pytest -m gpu -q tests/gpu/test_sm90_bwd_programmatic_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from fa4.kernels import Config, sm90_bwd
from fa4.kernels.problem import AttentionProblem
from fa4.reference import attention_fp32, check_grads, softmax_scale

pytestmark = pytest.mark.gpu

KNOBS = [dict(), dict(dq_accum="bulk"), dict(dq_accum="fragment", group_split=2),
         dict(sdp_swap=True, dq_accum="bulk", tile_m=80), dict(group_split=4, scheduler="single_lpt")]
CASES = [(2, 777, 777, 16, 4, 128, True), (1, 1000, 300, 8, 1, 128, True), (3, 65, 131, 8, 2, 128, False)]


@pytest.mark.parametrize("with_dlse, deterministic", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}-sq{}-sk{}-hq{}-hkv{}-d{}-{}".format(
    *c[:6], "causal" if c[6] else "full"))
@pytest.mark.parametrize("knobs", KNOBS, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()) or "default")
def test_programmatic_launch_follows_flash_attns_rule(knobs, case, with_dlse, deterministic, monkeypatch):
    monkeypatch.setenv("FA4_BWD_PROGRAMMATIC_LAUNCH", "1")
    batch, sq, sk, hq, hkv, d, causal = case
    config = Config.make("sm90_bwd", **knobs)
    problem = AttentionProblem(batch, sq, sk, hq, hkv, d, "bf16", causal)
    if sm90_bwd.reasons(config, problem):
        pytest.skip(f"the model refuses {config.label()} here")
    kernels = sm90_bwd.compile_backward(config, problem, deterministic=deterministic)
    gen = torch.Generator(device="cuda").manual_seed(sum(case[:6]))
    shapes = ((batch, sq, hq, d), (batch, sk, hkv, d), (batch, sk, hkv, d), (batch, sq, hq, d))
    q, k, v, dout = [torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=gen) for s in shapes]
    dlse = torch.randn(batch, hq, sq, device="cuda", generator=gen) if with_dlse else None
    scale = softmax_scale(d)
    out, lse = attention_fp32(q, k, v, causal, scale)
    grads = [torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)]
    for _ in range(2):
        # the workspaces come back from the caching allocator full of NaN: a read of LSE2, D or the
        # dQ accumulator before the preprocess has written them would poison the gradients
        poison = torch.full((batch, max(sq, sk) + 128, hq, d), float("nan"), device="cuda")
        del poison
        kernels.run(q, k, v, out.to(q.dtype), dout, lse, *grads, scale, dlse)
        torch.cuda.synchronize()
        assert all(torch.isfinite(g).all() for g in grads)
    failures = check_grads(grads, q, k, v, dout, causal, dlse=dlse)
    assert not failures, failures
