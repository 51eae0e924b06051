"""A value head dim of its own (v's last dim Dv != q's and k's D, DeepSeek's 192/128) through the
runtime, on the CPU: the input checks accept exactly the pairs a kernel of ours runs, the problem,
explanation and database key carry Dv only where it differs, the reference and the SDPA fallback give
(B, Sq, Hq, Dv), and the blockwise backward matches fp32 autograd."""

from __future__ import annotations

import warnings

import pytest
import torch

import fa4
from fa4 import backward, checks
from fa4.database import entry_key, mask_key
from fa4.kernels import AttentionProblem
from fa4.reference import attention_fp32, attention_grads, plain_attention, random_inputs, sdpa_same_precision


def _qkv(sq=33, sk=40, hq=4, hkv=2, d=192, dv=128, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(1, sq, hq, d, generator=gen).to(dtype), torch.randn(1, sk, hkv, d, generator=gen).to(dtype),
            torch.randn(1, sk, hkv, dv, generator=gen).to(dtype))


def test_checks_accept_the_kernel_pair_only():
    q, k, v = _qkv(dtype=torch.float16)
    spec = checks.inspect_inputs(q, k, v)
    assert spec.head_dim == 192 and spec.head_dim_v == 128 and spec.value_head_dim == 128
    problem = spec.problem(True, False)
    assert problem.head_dim_v == 128 and problem.label().endswith("D192 Dv128 fp16 causal")
    same = checks.inspect_inputs(*_qkv(dv=192, dtype=torch.float16))
    assert same.head_dim_v is None and "head_dim_v" not in same.problem(False, False).to_dict()
    for d, dv in ((128, 64), (192, 64), (64, 128)):
        with pytest.raises(checks.InvalidInputError, match=f"v's head dim {dv} differs .* 192/192/128"):
            checks.inspect_inputs(*_qkv(d=d, dv=dv, dtype=torch.float16))
    q, k, v = _qkv(dtype=torch.float16)
    with pytest.raises(checks.InvalidInputError, match="q 192, k 128"):
        checks.inspect_inputs(q, k[..., :128], v)


def test_kernel_reasons_and_explanation():
    q, k, v = _qkv(dtype=torch.bfloat16)
    spec = checks.inspect_inputs(q, k, v)
    assert checks.kernel_reasons("sm90", spec, True, True) == []
    assert any("192" in r for r in checks.kernel_reasons("sm100", spec, True, True))
    text = str(fa4.explain(q, k, v, causal=True, arch="sm90", device_name="NVIDIA H200"))
    assert "D192 Dv128 bf16 causal" in text and "runs: our sm90 kernel" in text
    assert "backward (inputs that require grad): blockwise" in text


@pytest.mark.parametrize("causal", [False, True])
def test_reference_and_fallback_have_the_value_head_dim(causal):
    q, k, v = _qkv()
    out, lse = attention_fp32(q, k, v, causal)
    expected, expected_lse = plain_attention(q.double(), k.double(), v.double(), causal, 192 ** -0.5,
                                             torch.float64, return_lse=True)
    assert out.shape == (1, 33, 4, 128)
    torch.testing.assert_close(out, expected.float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, expected_lse.float(), atol=1e-5, rtol=1e-5)
    assert sdpa_same_precision(q, k, v, causal, 192 ** -0.5).shape == (1, 33, 4, 128)
    with warnings.catch_warnings():   # "running PyTorch SDPA" (once per process)
        warnings.simplefilter("ignore")
        got, got_lse = fa4.attention(q.half(), k.half(), v.half(), causal=causal, return_lse=True, fallback="sdpa")
    assert got.shape == (1, 33, 4, 128) and got.dtype == torch.float16
    torch.testing.assert_close(got.float(), out, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(got_lse, lse, atol=2e-3, rtol=2e-3)


def test_random_inputs_draw_v_at_the_value_head_dim():
    problem = AttentionProblem(1, 8, 9, 2, 1, 192, "bf16", head_dim_v=128)
    q, k, v = random_inputs(problem, device="cpu")
    assert (q.shape[-1], k.shape[-1], v.shape[-1]) == (192, 192, 128)
    plain = random_inputs(AttentionProblem(1, 8, 9, 2, 1, 192, "bf16"), device="cpu")
    assert torch.equal(plain[1], k)   # the same draws as before for q and k


@pytest.mark.parametrize("causal,window,sq,sk,hq,hkv", [
    (False, None, 33, 40, 4, 2), (True, None, 40, 33, 4, 4), (True, None, 17, 17, 6, 2),
    (False, (5, 3), 29, 31, 4, 1)])
def test_blockwise_backward_matches_autograd(causal, window, sq, sk, hq, hkv):
    q, k, v = _qkv(sq, sk, hq, hkv, seed=1)
    scale = 192 ** -0.5
    out, lse = attention_fp32(q, k, v, causal, scale, window=window)
    dout = torch.randn_like(out)
    grads = backward.blockwise_backward(dout, q, k, v, out, lse, causal, scale, block_bytes=4096, window=window)
    expected = attention_grads(q.double(), k.double(), v.double(), dout.double(), causal, scale, torch.float64,
                               window=window)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want.float(), atol=1e-4, rtol=1e-4)


def test_gradients_through_attention_on_the_cpu():
    q, k, v = (t.half().requires_grad_() for t in _qkv(seed=2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = fa4.attention(q, k, v, causal=True, fallback="sdpa")
    assert out.shape == (1, 33, 4, 128)
    dout = torch.randn_like(out)
    out.backward(dout)
    expected = attention_grads(q.detach().double(), k.detach().double(), v.detach().double(), dout.double(),
                               True, 192 ** -0.5, torch.float64)
    for t, want in zip((q, k, v), expected):
        assert t.grad.shape == t.shape
        torch.testing.assert_close(t.grad.float(), want.float(), atol=2e-2, rtol=2e-2)
    assert backward.choose(q, k=k, causal=True, v=v)[0] == backward.BLOCKWISE


def test_database_key_carries_dv_only_where_it_differs():
    plain = AttentionProblem(1, 4096, 4096, 16, 16, 192, "bf16", causal=True)
    dv = AttentionProblem(1, 4096, 4096, 16, 16, 192, "bf16", causal=True, head_dim_v=128)
    assert mask_key(plain.to_dict()) == "causal" and mask_key(dv.to_dict()) == "causal-dv128"
    assert entry_key("sm90", "NVIDIA H200", plain) == "sm90|NVIDIA H200|bf16|d192|gqa1|causal|sq4096|sk4096|w16"
    assert entry_key("sm90", "NVIDIA H200", dv) == "sm90|NVIDIA H200|bf16|d192|gqa1|causal-dv128|sq4096|sk4096|w16"


def test_shapes_file_field():
    from fa4tune.inputs.shape_sets import parse_shapes

    problems = parse_shapes("[[problem]]\nbatch = 1\nseqlen = 1024\nheads_q = 16\ngqa = 1\nhead_dim = 192\n"
                            "head_dim_v = 128\ndtype = 'bf16'\n")
    assert [p.head_dim_v for p in problems] == [128, 128] and [p.causal for p in problems] == [False, True]


def test_sdpa_peers_refuse_and_flash_attn_4_takes_the_pair():
    from fa4 import backends

    problem = AttentionProblem(1, 1024, 1024, 16, 16, 192, "bf16", head_dim_v=128)
    for peer in backends.peers():
        why = peer.supports(problem)
        if peer.name == "flash_attn_4":
            assert why is None
        elif peer.name.startswith("sdpa"):
            assert why and "192/128" in why, peer.name
