"""Input checks of fa4.attention, on CPU tensors: each bad input gets an error that names the problem."""

from __future__ import annotations

import warnings

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
    invalid(r"head dims differ: q 64, k 32", q, k[..., :32], v)
    # v may differ only where a kernel runs the pair (q/k/v 192/192/128)
    invalid(r"v's head dim 32 differs from q's and k's 64 .* 192/192/128", q, k, v[..., :32])


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


# --- the remaining bad inputs ----------------------------------------------------------------------

def test_head_dim_zero_is_an_invalid_call_even_with_the_fallback():
    q, k, v = qkv(d=0)
    invalid("head dim is 0", q, k, v)
    invalid("head dim is 0", q, k, v, fallback="sdpa")  # SDPA's scale 1/sqrt(0) divided by zero


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_nested_and_sparse_tensors_are_named(which):
    q, k, v = qkv()
    nested = torch.nested.nested_tensor([torch.randn(4, 2, 64, dtype=F16), torch.randn(5, 2, 64, dtype=F16)],
                                        layout=torch.jagged)
    for bad, match in ((nested, f"{which} is a nested tensor"),
                       (dict(q=q, k=k, v=v)[which].to_sparse(), f"{which} has layout torch.sparse_coo")):
        t = {**dict(q=q, k=k, v=v), which: bad}
        invalid(match, t["q"], t["k"], t["v"], fallback="sdpa")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", fa4.Fa4Warning)
            fa4.attention(q, k, v, fallback="sdpa")  # a signature of dense tensors is cached ...
        invalid(match, t["q"], t["k"], t["v"], fallback="sdpa")  # ... and the bad one still named
        with pytest.raises(InvalidInputError, match=match):
            fa4.explain(t["q"], t["k"], t["v"], arch="sm90")


BAD_SCALES = [
    (float("nan"), "finite, got nan"), (float("inf"), "finite, got inf"), (-float("inf"), "finite, got -inf"),
    ("x", "a number, got str 'x'"), ("0.5", "a number, got str '0.5'"), (object(), "a number, got object"),
    (True, "a number, got bool True"),  # return_lse passed one place too far
    (1 + 2j, r"a real number, got complex \(1\+2j\)"),
    (torch.tensor([0.5, 0.25]), r"a real number, got a torch.float32 tensor of shape \(2,\)"),
    (torch.tensor(0.5 + 0j), "a real number, got a torch.complex64 tensor"),
    # finite in Python, but not in fp32 (inf; the kernels also fold log2(e) into the scale) or 0 in fp32
    (1e40, r"positive, between 2\*\*-126 and 2\*\*127, got 1e\+40"), (1e-40, "positive, .*got 1e-40"),
    (-0.125, "positive, .*got -0.125"), (0.0, "positive, .*got 0.0"),
]


@pytest.mark.parametrize("scale,match", BAD_SCALES)
def test_a_bad_softmax_scale_is_refused_by_attention_and_explain(scale, match):
    q, k, v = qkv()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fa4.Fa4Warning)
        fa4.attention(q, k, v, fallback="sdpa")  # the signature is cached
    invalid(f"softmax_scale must be {match}", q, k, v, softmax_scale=scale, fallback="sdpa")
    with pytest.raises(InvalidInputError, match=f"softmax_scale must be {match}"):
        fa4.explain(q, k, v, softmax_scale=scale, fallback="sdpa")
    with pytest.raises(InvalidInputError, match=f"softmax_scale must be {match}"):
        fa4.explain(*qkv(device="meta"), arch="sm90", softmax_scale=scale)


def test_softmax_scale_values_that_work():
    import numpy as np

    assert checks.softmax_scale_value(None) is None
    assert checks.softmax_scale_value(0.125) == 0.125 and checks.softmax_scale_value(2) == 2.0
    for scale in (torch.tensor(0.5), torch.tensor([0.5]), np.float32(0.5), np.float64(0.5)):
        assert type(checks.softmax_scale_value(scale)) is float and checks.softmax_scale_value(scale) == 0.5
    assert checks.softmax_scale_value(2.0**-126) == 2.0**-126 and checks.softmax_scale_value(2.0**127) == 2.0**127
    assert torch.tensor(2.0**127 * 1.4426950408889634, dtype=torch.float32).isfinite()  # scale * log2(e)
    assert isinstance(fa4.explain(*qkv(), softmax_scale=torch.tensor(0.5)), fa4.Explanation)


@pytest.mark.parametrize("scale", [-0.125, 0.0])
def test_the_kernels_softmax_needs_a_positive_scale(scale):
    """Why softmax_scale must be positive: the kernels' tile algorithm (replayed on the CPU by the sm100
    emulation, whose softmax is the sm90 kernel's: basis = the row's largest raw score) misses the fp32
    reference for a scale <= 0, which SDPA and the reference compute without trouble."""
    from fa4.kernels import Config
    from fa4.kernels.sm100.emulation import emulate_fa4_forward
    from fa4.reference import attention_fp32

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 256, 2, 64, dtype=F16, generator=g) for _ in range(3))
    want, _ = attention_fp32(q, k, v, True, scale)
    assert torch.isfinite(want).all()
    got = emulate_fa4_forward(q, k, v, Config.make("sm100"), causal=True, softmax_scale=scale).float()
    assert not torch.allclose(got, want, rtol=1e-2, atol=1e-2)
    positive = emulate_fa4_forward(q, k, v, Config.make("sm100"), causal=True, softmax_scale=0.125).float()
    torch.testing.assert_close(positive, attention_fp32(q, k, v, True, 0.125)[0], rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("config,match", [
    ("fast", "config='fast' is not a configuration label: want name=value pairs"),
    ("", "config='' names no knob"),
    ("tile_n=", "cannot read 'tile_n=' of configuration"),
    ("tile_n=80 tile_n=96", "names tile_n twice"),
    ("tile_n=abc", "tile_n='abc' is not one of"),
    # the custom op's old string forms are no labels (the op carries labels now)
    ("sm90;tile_n=(", r"cannot read 'sm90;tile_n=\(' of configuration"),
    ("*;tile_n=[", r"cannot read '\*;tile_n=\[' of configuration"),
])
def test_malformed_config_strings_are_named(config, match):
    meta = qkv(device="meta")
    with pytest.raises(InvalidInputError, match=match):
        fa4.explain(*meta, arch="sm90", config=config)


def test_a_malformed_config_is_an_error_even_where_nothing_launches():
    with pytest.raises(InvalidInputError, match="is not one of"):
        fa4.explain(*qkv(b=0, device="meta"), arch="sm90", config="tile_n=7")


def test_a_config_while_sdpa_runs_is_not_ignored_silently():
    q, k, v = qkv()
    with pytest.warns(fa4.Fa4Warning, match=r"config= is ignored: PyTorch SDPA runs \(fallback='sdpa'\) because "
                                            "the tensors are on cpu"):
        fa4.attention(q, k, v, config={"tile_n": 80}, fallback="sdpa")


@pytest.mark.parametrize("config,match", [
    ("fast please", "config='fast please' is not a configuration label"),
    ("tile_n=abc", "sm90 knob tile_n='abc' is not one of"),
    ("nosuchknob=3", "unknown knob.* nosuchknob"),
    ({"tile_n": 81}, "sm90 knob tile_n=81 is not one of"),
    ({"tile_n": 192, "kv_stages": 4}, r"sm90: config= .* cannot run .*D128.*: shared memory 427008 B"),
])
@pytest.mark.parametrize("fallback", ["sdpa", "error"])
def test_a_wrong_config_is_refused_where_sdpa_would_run(config, match, fallback):
    """CPU tensors name no GPU architecture: config= must fit one of the kernels (each is asked), and
    an invalid call is named before the tensors' device, whatever the fallback."""
    q, k, v = qkv(d=128)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and no "config= is ignored" warning
        invalid(match, q, k, v, config=config, fallback=fallback)


def test_a_config_is_checked_where_sdpa_runs_for_another_reason():
    q, k, v = qkv(d=80)  # no kernel has head dim 80: no configuration runs it, so one is only read
    invalid("sm90 knob tile_n=81 is not one of", q, k, v, config={"tile_n": 81}, fallback="sdpa")
    with pytest.warns(fa4.Fa4Warning, match="config= is ignored"):
        fa4.attention(q, k, v, config={"tile_n": 192, "kv_stages": 4}, fallback="sdpa")
    q, k, v = (t.float() for t in qkv(d=128))  # fp32: judged in fp16, which takes the same resources
    invalid("shared memory", q, k, v, config="tile_n=192 kv_stages=4", fallback="sdpa")
    q, k, v = qkv(b=0, d=128)  # nothing launches
    invalid("shared memory", q, k, v, config="tile_n=192 kv_stages=4", fallback="sdpa")


def _long(seqlen, heads=1, d=64, device="cpu"):
    """A (1, seqlen, heads, d) fp16 tensor of one row repeated: no memory for the rows."""
    return torch.zeros(1, 1, heads, d, dtype=F16, device=device).expand(1, seqlen, heads, d)


@pytest.mark.parametrize("which", ["seqlen_q", "seqlen_k"])
def test_a_sequence_past_32_bits_is_an_invalid_call_whatever_the_fallback(which):
    long, short = _long(2**31), _long(16)
    q, k = (long, short) if which == "seqlen_q" else (short, long)
    match = f"{which} is 2147483648, more than fa4 takes \\(2147483647 = 2\\*\\*31 - 1"
    invalid(match, q, k, k, fallback="sdpa")
    invalid(match, q, k, k)
    with pytest.raises(InvalidInputError, match=match):
        fa4.explain(q.to("meta"), k.to("meta"), k.to("meta"), arch="sm90")
    spec = checks.inspect_inputs(_long(2**31 - 1), _long(2**31 - 1), _long(2**31 - 1))  # the longest
    assert spec.seqlen_q == spec.seqlen_k == 2**31 - 1
