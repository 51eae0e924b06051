"""The backward's tile algorithm (`fa4.kernels.backward_emulation`) against autograd: dQ, dK, dV of the
block-by-block recompute from the saved LSE match an fp32 autograd reference within flash-attn's rule
for gradients (error <= 2x a PyTorch low-precision implementation's error + a small atol), over odd
lengths, Sq != Sk both ways, GQA and MQA, both masks, both dtypes, several tile shapes."""

from __future__ import annotations

import pytest
import torch

from fa4.kernels.backward_emulation import backward, query_block_order
from fa4.reference import attention_fp32, check_grads, softmax_scale

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


CASES = [  # (B, Sq, Sk, Hq, Hkv, D, causal, tile_m, tile_n)
    (1, 77, 77, 4, 1, 64, True, 64, 128),       # MQA, odd length
    (2, 130, 200, 4, 2, 64, True, 64, 64),      # Sq < Sk, GQA 2
    (1, 200, 130, 5, 1, 64, True, 64, 96),      # Sq > Sk: rows that see no key; GQA 5
    (1, 96, 160, 8, 1, 128, False, 80, 128),    # full mask, GQA 8, a tile that does not divide
    (1, 129, 129, 4, 4, 128, False, 128, 128),  # MHA, a one-row tail block
    (2, 170, 300, 8, 2, 128, True, 80, 128),    # causal on 80-row blocks (the kernel's tile_m 80), Sq < Sk
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
    assert all(g.dtype == low for g in got)
    failures = check_grads(got, q, k, v, dout, causal, scale)
    assert not failures, failures


SPLIT_CASES = [  # (B, Sq, Sk, Hq, Hkv, D, causal, tile_m, tile_n, group_split)
    (1, 77, 77, 4, 1, 64, True, 64, 128, 4),      # MQA, one query head a CTA
    (2, 130, 200, 4, 2, 64, True, 64, 64, 2),     # Sq < Sk, two heads a part
    (1, 200, 130, 5, 1, 64, True, 64, 96, 2),     # GQA 5: parts of 3 and 2 heads; rows without keys
    (1, 96, 160, 8, 1, 128, False, 64, 128, 8),   # GQA 8, full
]


@pytest.mark.parametrize("case", SPLIT_CASES, ids=lambda c: "b{}-sq{}-sk{}-hq{}-hkv{}-d{}-{}-{}x{}-split{}".format(
    *c[:6], "causal" if c[6] else "full", *c[7:]))
def test_a_split_group_sums_its_parts_to_the_same_gradients(case):
    """group_split > 1: each part's dK and dV partial sums meet in fp32 accumulators. The gradients
    pass flash-attn's rule, and dQ (its order unchanged) is the unsplit run's bit for bit."""
    batch, sq, sk, hq, hkv, d, causal, tile_m, tile_n, split = case
    gen = torch.Generator().manual_seed(sq * 7 + sk)
    q, k, v = (torch.randn(batch, s, h, d, generator=gen).bfloat16() for s, h in ((sq, hq), (sk, hkv), (sk, hkv)))
    dout = torch.randn(batch, sq, hq, d, generator=gen).bfloat16()
    scale = softmax_scale(d)
    out, lse = attention_fp32(q, k, v, causal, scale)
    got = backward(q, k, v, out.bfloat16(), lse, dout, causal, scale, tile_m, tile_n, group_split=split)
    assert not check_grads(got, q, k, v, dout, causal, scale)
    unsplit = backward(q, k, v, out.bfloat16(), lse, dout, causal, scale, tile_m, tile_n)
    assert torch.equal(got[0], unsplit[0])
    for split_grad, whole in zip(got[1:], unsplit[1:]):   # only the fp32 order of the sums moved
        torch.testing.assert_close(split_grad.float(), whole.float(), rtol=2e-2, atol=2e-2)


def test_a_split_that_leaves_a_part_empty_is_refused():
    q = torch.randn(1, 16, 5, 64).half()
    k = v = torch.randn(1, 16, 1, 64).half()
    out, lse = attention_fp32(q, k, v, False)
    with pytest.raises(ValueError, match="empty"):
        backward(q, k, v, out.half(), lse, q, False, softmax_scale(64), 64, 64, group_split=4)


def test_rows_that_see_no_key_get_no_gradient():
    q = torch.randn(1, 40, 2, 64).half()
    k, v = torch.randn(1, 24, 1, 64).half(), torch.randn(1, 24, 1, 64).half()
    dout = torch.randn(1, 40, 2, 64).half()
    out, lse = attention_fp32(q, k, v, True)
    dq, dk, dv = backward(q, k, v, out.half(), lse, dout, True, softmax_scale(64), 64, 64)
    assert torch.isneginf(lse[:, :, :16]).all()
    assert (dq[:, :16] == 0).all() and torch.isfinite(dq).all()
    assert torch.isfinite(dk).all() and torch.isfinite(dv).all()


@pytest.mark.parametrize("case", CASES, ids=lambda c: "sq{}-sk{}-{}-{}x{}".format(
    c[1], c[2], "causal" if c[6] else "full", *c[7:]))
def test_each_key_block_walks_its_unmasked_query_blocks_first(case):
    """The kernel's order (its two block loops): every query block that sees a key of the key block
    once, those without a masked (query, key) pair first."""
    _, sq, sk, _, _, _, causal, tile_m, tile_n = case
    for j0 in range(0, sk, tile_n):
        order = query_block_order(j0, sq, sk, tile_m, tile_n, causal)
        rows = torch.arange(sq)[:, None]
        keys = torch.arange(j0, j0 + tile_n)[None, :]
        visible = (keys < sk) & ((keys <= rows + sk - sq) if causal else (rows >= 0))
        seen = [i0 for i0 in range(0, sq, tile_m) if visible[i0:i0 + tile_m].any()]
        whole = [bool(visible[i0:i0 + tile_m].all()) for i0 in order]
        assert sorted(order) == [i0 for i0 in range(seen[0], sq, tile_m)] if seen else order == []
        assert set(seen) <= set(order)
        assert whole == sorted(whole, reverse=True), (j0, order, whole)
