"""Input checks of fa4.attention, on CPU tensors: each bad input gets an error that names the problem."""

from __future__ import annotations

import pytest
import torch

import fa4
from fa4 import checks
from fa4.checks import InvalidInputError, UnsupportedInputError

F16 = torch.float16


@pytest.fixture(autouse=True)
def fresh_runtime():
    fa4.reset_caches()  # one-time warnings and cached decisions start over in every test
    yield
    fa4.reset_caches()


def qkv(b=1, sq=64, sk=64, hq=4, hkv=2, d=64, dtype=F16, device="cpu"):
    q = torch.randn(b, sq, hq, d, dtype=dtype, device=device)
    k = torch.randn(b, sk, hkv, d, dtype=dtype, device=device)
    v = torch.randn(b, sk, hkv, d, dtype=dtype, device=device)
    return q, k, v


def invalid(match, *args, **kwargs):
    with pytest.raises(InvalidInputError, match=match):
        fa4.attention(*args, **kwargs)


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_wrong_rank_names_the_tensor(which):
    q, k, v = qkv()
    t = {"q": q, "k": k, "v": v}
    t[which] = t[which].flatten(2)
    invalid(rf"{which} must be 4-D, got 3-D", t["q"], t["k"], t["v"])


def test_not_a_tensor():
    q, k, v = qkv()
    invalid("k must be a torch.Tensor, got list", q, [1, 2], v)


def test_tensors_on_different_devices():
    q, k, v = qkv()
    invalid("one device.*q on cpu, k on meta", q, k.to("meta"), v)


def test_mixed_dtypes():
    q, k, v = qkv()
    invalid("one dtype.*torch.float16.*torch.bfloat16", q, k.bfloat16(), v)


def test_integer_dtype_is_invalid():
    q, k, v = (t.to(torch.int32) for t in qkv())
    invalid("dtype torch.int32 is not supported", q, k, v)


def test_fp32_is_unsupported_but_runs_with_the_fallback():
    q, k, v = (t.float() for t in qkv())
    spec = checks.inspect_inputs(q, k, v)
    assert any("float32 has no kernel" in r for r in spec.unsupported)
    with pytest.raises(UnsupportedInputError, match="float32 has no kernel"):
        fa4.attention(q, k, v)
    with pytest.warns(fa4.Fa4Warning, match="SDPA"):
        out = fa4.attention(q, k, v, fallback="sdpa")
    assert out.dtype == torch.float32 and out.shape == q.shape


def test_head_dims_differ():
    q, k, v = qkv()
    invalid(r"head dims differ: q 64, k 64, v 32", q, k, v[..., :32])


def test_batch_mismatch_between_q_and_k():
    q, k, v = qkv(b=2)
    invalid(r"batch sizes differ: q 2, k 1, v 1", q, k[:1], v[:1])


def test_batch_mismatch_between_k_and_v():
    q, k, v = qkv(b=2)
    invalid(r"batch sizes differ: q 2, k 2, v 1", q, k, v[:1])


def test_head_mismatch_between_k_and_v():
    q, k, v = qkv(hq=4, hkv=2)
    invalid(r"k and v must have the same number of heads, got k 2, v 1", q, k, v[:, :, :1])


def test_seqlen_mismatch_between_k_and_v():
    q, k, v = qkv()
    invalid(r"same sequence length, got k 64, v 32", q, k, v[:, :32])


def test_heads_q_not_a_multiple_of_heads_kv():
    q, k, v = qkv(hq=6, hkv=4)
    invalid(r"heads_q \(6\) must be a multiple of heads_kv \(4\)", q, k, v)


def test_zero_heads_is_invalid():
    q, k, v = qkv(hq=0, hkv=2)
    invalid("at least one head", q, k, v)


def test_non_contiguous_head_dim():
    q, k, v = qkv()
    k_strided = torch.randn(1, 64, 2, 128, dtype=F16)[..., ::2]
    spec = checks.inspect_inputs(q, k_strided, v)
    assert any("k has stride 2 in its last (head) dimension" in r for r in spec.unsupported)
    with pytest.raises(UnsupportedInputError, match=r"k has stride 2 in its last \(head\) dimension"):
        fa4.attention(q, k_strided, v)


def test_stride_not_16_byte_aligned():
    q, k, v = qkv()
    padded = torch.randn(1, 64, 4, 68, dtype=F16)[..., :64]  # head stride 68 * 2 = 136 bytes
    spec = checks.inspect_inputs(padded, k, v)
    assert any("q stride 68 of its head dimension is 136 bytes, not a multiple of 16" in r
               for r in spec.unsupported)
    with pytest.raises(UnsupportedInputError, match="not a multiple of 16"):
        fa4.attention(padded, k, v)


def test_aligned_padding_is_accepted():
    q, k, v = qkv()
    padded = torch.randn(1, 64, 4, 72, dtype=F16)[..., :64]  # 144 bytes: fine for TMA
    assert checks.inspect_inputs(padded, k, v).unsupported == ()


def test_size_one_dimension_with_odd_stride_is_restrided_not_refused():
    q, k, v = qkv(b=1)
    odd = q.as_strided(q.shape, (3, *q.stride()[1:]))  # batch stride 3: never stepped over
    spec = checks.inspect_inputs(odd, k, v)
    assert spec.unsupported == () and spec.needs_restride
    strides = checks.aligned_strides(odd)
    assert strides[1:] == odd.stride()[1:] and (strides[0] * 2) % 16 == 0
    assert torch.equal(odd.as_strided(odd.shape, strides), odd)


def test_misaligned_data_pointer():
    q, k, v = qkv()
    flat = torch.randn(q.numel() + 1, dtype=F16)
    shifted = flat[1:].view(q.shape)  # starts 2 bytes into the allocation
    reason = checks.pointers_misaligned(shifted, k, v)
    assert reason is not None and "q at 0x" in reason and "storage offset 1" in reason
    assert checks.pointers_misaligned(q, k, v) is None


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_requires_grad_is_refused_forward_only(which):
    q, k, v = qkv()
    t = {"q": q, "k": k, "v": v}
    t[which].requires_grad_(True)
    invalid(rf"forward only.*{which} requires grad", t["q"], t["k"], t["v"], fallback="sdpa")
    with torch.no_grad():  # no graph is built: fine
        fa4.attention(t["q"], t["k"], t["v"], fallback="sdpa")


def test_cpu_tensors_are_unsupported_by_default():
    with pytest.raises(UnsupportedInputError, match="on cpu; the kernels run on CUDA GPUs only.*fallback='sdpa'"):
        fa4.attention(*qkv())


def test_bad_fallback_and_flags():
    q, k, v = qkv()
    invalid("fallback must be one of", q, k, v, fallback="triton")
    invalid("causal and return_lse must be bools", q, k, v, causal=1)


def test_spec_is_a_function_of_the_signature():
    q, k, v = qkv(b=2, sq=33, sk=70, hq=8, hkv=2, d=128, dtype=torch.bfloat16)
    spec = checks.inspect_inputs(q, k, v)
    assert (spec.batch, spec.seqlen_q, spec.seqlen_k, spec.heads_q, spec.heads_kv, spec.head_dim) == (
        2, 33, 70, 8, 2, 128)
    assert spec.dtype == "bf16" and spec.unsupported == ()
    p = spec.problem(causal=True, return_lse=True)
    assert p.gqa_ratio == 4 and p.causal and p.return_lse
