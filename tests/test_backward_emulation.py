"""The backward's tile algorithm (`fa4.kernels.backward_emulation`) against autograd: dQ, dK, dV of the
block-by-block recompute from the saved LSE match an fp32 autograd reference within flash-attn's rule
for gradients (error <= 2x a PyTorch low-precision implementation's error + a small atol), over odd
lengths, Sq != Sk both ways, GQA and MQA, both masks, both dtypes, several tile shapes."""

from __future__ import annotations

import pytest
import torch

from fa4.kernels.backward_emulation import backward
from fa4.reference import attention_fp32, softmax_scale, visible_keys

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
ATOL = 1e-3


def _attention(q, k, v, causal: bool, scale: float, dtype):
    """Plain attention in `dtype` (autograd-able); rows that see no key give 0."""
    q, k, v = (t.to(dtype).transpose(1, 2) for t in (q, k, v))        # (B, H, S, D)
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = (q @ k.transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(~visible_keys(q.shape[2], k.shape[2]), float("-inf"))
    has_key = torch.isfinite(scores).any(-1, keepdim=True)
    p = torch.softmax(scores.masked_fill(~has_key, 0.0), dim=-1).masked_fill(~has_key, 0.0)
    return (p @ v).transpose(1, 2)


def _grads(q, k, v, dout, causal, scale, dtype):
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    _attention(*leaves, causal, scale, dtype).backward(dout.to(dtype))
    return [t.grad.float() for t in leaves]


CASES = [  # (B, Sq, Sk, Hq, Hkv, D, causal, tile_m, tile_n)
    (1, 77, 77, 4, 1, 64, True, 64, 128),       # MQA, odd length
    (2, 130, 200, 4, 2, 64, True, 64, 64),      # Sq < Sk, GQA 2
    (1, 200, 130, 5, 1, 64, True, 64, 96),      # Sq > Sk: rows that see no key; GQA 5
    (1, 96, 160, 8, 1, 128, False, 80, 128),    # full mask, GQA 8, a tile that does not divide
    (1, 129, 129, 4, 4, 128, False, 128, 128),  # MHA, a one-row tail block
]


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}-sq{}-sk{}-hq{}-hkv{}-d{}-{}-{}x{}".format(
    *c[:6], "causal" if c[6] else "full", *c[7:]))
def test_tile_algorithm_gradients_match_autograd(case, dtype):
    batch, sq, sk, hq, hkv, d, causal, tile_m, tile_n = case
    low = DTYPES[dtype]
    gen = torch.Generator().manual_seed(sq * 7 + sk)
    q = torch.randn(batch, sq, hq, d, generator=gen).to(low)
    k = torch.randn(batch, sk, hkv, d, generator=gen).to(low)
    v = torch.randn(batch, sk, hkv, d, generator=gen).to(low)
    dout = torch.randn(batch, sq, hq, d, generator=gen).to(low)
    scale = softmax_scale(d)
    out, lse = attention_fp32(q, k, v, causal, scale)
    got = backward(q, k, v, out.to(low), lse, dout, causal, scale, tile_m, tile_n)
    reference = _grads(q, k, v, dout, causal, scale, torch.float32)
    low_precision = _grads(q, k, v, dout, causal, scale, low)
    for name, g, ref, pt in zip(("dQ", "dK", "dV"), got, reference, low_precision):
        assert g.dtype == low and g.shape == ref.shape
        err, pt_err = (g.float() - ref).abs().max().item(), (pt - ref).abs().max().item()
        assert err <= 2 * pt_err + ATOL, f"{name}: error {err:.3g} > 2 x {pt_err:.3g} + {ATOL}"


def test_rows_that_see_no_key_get_no_gradient():
    q = torch.randn(1, 40, 2, 64).half()
    k, v = torch.randn(1, 24, 1, 64).half(), torch.randn(1, 24, 1, 64).half()
    dout = torch.randn(1, 40, 2, 64).half()
    out, lse = attention_fp32(q, k, v, True)
    dq, dk, dv = backward(q, k, v, out.half(), lse, dout, True, softmax_scale(64), 64, 64)
    assert torch.isneginf(lse[:, :, :16]).all()
    assert (dq[:, :16] == 0).all() and torch.isfinite(dq).all()
    assert torch.isfinite(dk).all() and torch.isfinite(dv).all()
