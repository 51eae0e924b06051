"""The one reference and comparison rule (`fa4.reference`): what every check of an output uses."""

from __future__ import annotations

import math

import pytest
import torch

from fa4 import fallback
from fa4.kernels import AttentionProblem
from fa4.reference import (Expected, attention_fp32, attention_grads, check, compare, lse_fp32, random_inputs,
                           rows_without_keys, sdpa_same_precision, softmax_scale)


def naive(q, k, v, causal, scale):
    """Attention written the textbook way, in fp64, for these tests only."""
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    qd, kd, vd = (t.double().transpose(1, 2) for t in (q, k, v))
    kd, vd = kd.repeat_interleave(hq // hkv, 1), vd.repeat_interleave(hq // hkv, 1)
    s = qd @ kd.transpose(-1, -2) * scale
    if causal:
        i = torch.arange(sq).view(-1, 1)
        j = torch.arange(sk).view(1, -1)
        s = s.masked_fill(j > i + (sk - sq), -math.inf)
    return (torch.softmax(s, -1).nan_to_num(0.0) @ vd).transpose(1, 2), torch.logsumexp(s, -1)


@pytest.mark.parametrize("sq,sk", [(64, 64), (40, 100), (100, 40), (1, 33), (17, 0)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2)])
def test_fp32_reference_against_the_textbook(sq, sk, causal, hq, hkv):
    p = AttentionProblem(2, sq, max(sk, 1), hq, hkv, 32, "fp16", causal)
    q, k, v = random_inputs(p, device="cpu", seed=3)
    k, v = k[:, :sk], v[:, :sk]
    out, lse = attention_fp32(q, k, v, causal, 0.2)
    want_out, want_lse = naive(q, k, v, causal, 0.2)
    torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)
    dead = rows_without_keys(sq, sk, causal)
    assert torch.all(out[:, :dead] == 0) and torch.all(torch.isneginf(lse[:, :, :dead]))
    assert torch.isfinite(lse[:, :, dead:]).all()


def test_chunks_do_not_change_the_answer():
    p = AttentionProblem(1, 70, 90, 4, 2, 16, "bf16", causal=True)
    q, k, v = random_inputs(p, device="cpu")
    whole = attention_fp32(q, k, v, True)
    by_rows = attention_fp32(q, k, v, True, chunk_bytes=1)  # one query row at a time
    for a, b in zip(whole, by_rows):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse_fp32(q, k, True, chunk_bytes=1), whole[1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("sq,sk,causal,window,softcap", [
    (70, 90, True, None, None), (90, 40, True, None, None), (64, 64, False, (20, 5), None),
    (50, 50, True, None, 5.0), (33, 65, False, None, None)])
def test_gradient_chunks_do_not_change_the_answer(sq, sk, causal, window, softcap):
    """The gradient references a few query rows at a time (dK, dV the chunks' sums, masks of the whole
    problem, a gradient through the LSE) equal the whole problem's; in bf16 the chunks' sums round
    differently, not worse."""
    p = AttentionProblem(2, sq, sk, 4, 2, 16, "bf16", causal=causal)
    q, k, v = random_inputs(p, device="cpu", seed=5)
    generator = torch.Generator().manual_seed(6)
    dout = torch.randn(q.shape, generator=generator).to(q.dtype)
    dlse = torch.randn((2, 4, sq), generator=generator)
    mask = {"window": window, "softcap": softcap}
    seven_rows = 4 * 2 * 4 * sk * 7
    whole = attention_grads(q, k, v, dout, causal, 0.25, torch.float64, dlse, **mask)
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.float64, 1e-12)):
        chunked = attention_grads(q, k, v, dout, causal, 0.25, dtype, dlse, chunk_bytes=seven_rows, **mask)
        for got, want in zip(chunked, whole):
            torch.testing.assert_close(got, want.float(), rtol=tolerance, atol=tolerance)
    low_whole = attention_grads(q, k, v, dout, causal, 0.25, torch.bfloat16, dlse, **mask)
    low_chunked = attention_grads(q, k, v, dout, causal, 0.25, torch.bfloat16, dlse, chunk_bytes=seven_rows, **mask)
    for chunk_grad, whole_grad, want in zip(low_chunked, low_whole, whole):
        assert (chunk_grad - want.float()).abs().max() <= 1.5 * (whole_grad - want.float()).abs().max() + 1e-3


def test_rows_without_keys_is_the_leading_block():
    assert rows_without_keys(100, 40, causal=True) == 60
    assert rows_without_keys(100, 40, causal=False) == 0
    assert rows_without_keys(40, 100, causal=True) == 0
    assert rows_without_keys(5, 0, causal=False) == 5


def _case(causal=True):
    p = AttentionProblem(1, 48, 32, 4, 2, 64, "fp16", causal)  # 16 rows see no key when causal
    q, k, v = random_inputs(p, device="cpu", seed=1)
    return p, q, k, v, Expected.of(q, k, v, causal, softmax_scale(64))


def test_the_same_precision_answer_passes():
    _, q, k, v, expected = _case()
    out = sdpa_same_precision(q, k, v, True, softmax_scale(64))
    result = compare(out, lse_fp32(q, k, True), expected)
    assert result["passed"] and result["failures"] == [] and result["max_err"] < 1e-2
    assert result["max_err_lse"] == 0.0


@pytest.mark.parametrize("softcap", [5.0, 50.0])
def test_the_same_precision_answer_under_a_softcap_passes(softcap):
    """With a softcap the second reference is written out at a flash kernel's precision (fp32 scores
    and softmax, P and V in bf16); it must itself pass the rule against fp32. Its first version rounded
    the scores to bf16 before the cap and failed correct kernels (ours and flash-attn-4) on the H200."""
    problem = AttentionProblem(1, 700, 700, 8, 2, 128, "bf16", causal=True, window=(200, 0), softcap=softcap)
    q, k, v = random_inputs(problem, device="cpu")
    out = sdpa_same_precision(q, k, v, True, window=(200, 0), softcap=softcap)
    assert out.dtype == torch.bfloat16
    result = compare(out, lse_fp32(q, k, True, window=(200, 0), softcap=softcap),
                     Expected.of(q, k, v, True, window=(200, 0), softcap=softcap))
    assert result["passed"], result["failures"]


@pytest.mark.parametrize("damage, words", [
    (lambda o, lse: (o + 0.05, lse), "fp32 reference"),
    (lambda o, lse: (torch.full_like(o, float("nan")), lse), "NaN"),
    (lambda o, lse: (o.index_fill(1, torch.tensor([0]), 1e-3), lse), "no key are not 0"),
    (lambda o, lse: (o, lse.index_fill(2, torch.tensor([0]), 0.0)), "LSE of rows that see no key"),
    (lambda o, lse: (o, lse + 0.1), "LSE differs"),
])
def test_wrong_outputs_fail(damage, words):
    _, q, k, v, expected = _case()
    out, lse = damage(sdpa_same_precision(q, k, v, True, softmax_scale(64)), lse_fp32(q, k, True))
    result = compare(out, lse, expected)
    assert not result["passed"] and words in result["error"], result


def test_sdpa_is_held_only_on_rows_that_see_a_key():
    # SDPA has no defined answer for a row without keys (NaN on GPU backends, 0 on some CPU paths):
    # whatever it says there, the comparison ignores it
    _, q, k, v, expected = _case()
    assert bool(expected.seen[16:].all()) and not bool(expected.seen[:16].any())
    expected.out_sdpa[:, :16] = float("nan")
    out = sdpa_same_precision(q, k, v, True, softmax_scale(64))
    assert compare(out, None, expected)["passed"]


def test_check_is_compare_against_fresh_references():
    p, q, k, v, _ = _case(causal=False)
    good = sdpa_same_precision(q, k, v, False)
    assert check(good, None, q, k, v, False) == []
    assert check(good * 1.5, None, q, k, v, False)


@pytest.mark.parametrize("sq,sk,causal", [(64, 64, True), (100, 40, True), (40, 100, False)])
def test_the_sdpa_fallback_follows_the_rule(sq, sk, causal):
    p = AttentionProblem(1, sq, sk, 8, 2, 64, "fp16", causal)
    q, k, v = random_inputs(p, device="cpu")
    out, lse = fallback.sdpa_attention(q, k, v, causal, None, True)
    assert check(out, lse, q, k, v, causal) == []


def test_random_inputs_are_the_same_on_every_device_and_scale_logits():
    p = AttentionProblem(1, 8, 8, 2, 2, 16, "bf16")
    q, k, v = random_inputs(p, device="cpu", seed=7)
    q30, k30, v30 = random_inputs(p, device="cpu", seed=7, logit_scale=30.0)
    assert q.dtype == torch.bfloat16 and q.shape == (1, 8, 2, 16)
    torch.testing.assert_close(q30.float(), (q.float() * 30).to(torch.bfloat16).float(), rtol=1e-2, atol=0.5)
    assert torch.equal(v, v30)
