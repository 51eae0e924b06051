"""fa4.attention on a Hopper GPU: correctness against SDPA and fp32, config forcing, compile-cache reuse
across sequence lengths, torch.compile(fullgraph=True), CUDA-graph capture, zero lengths, errors.

    python -m pytest -m gpu -q tests/gpu/test_runtime_gpu.py

Every test uses its own empty best-config database (so the heuristic default runs unless a test forces
a configuration), except `test_packaged_database_is_usable`.
"""

from __future__ import annotations

import math

import pytest
import torch

import fa4
from fa4 import kernels, state
from fa4.reference import attention_fp32 as reference_fp32, check

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("empty_database")]

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def make_qkv(b, sq, sk, hq, hkv, d, dtype="fp16", seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return tuple(torch.randn(b, s, h, d, device="cuda", dtype=DTYPES[dtype], generator=gen)
                 for s, h in ((sq, hq), (sk, hkv), (sk, hkv)))


def check_against_references(out, q, k, v, causal, scale=None, lse=None):
    """The one rule (`fa4.reference`): fp32 and SDPA at rtol = atol = 1e-2, rows without keys 0."""
    failures = check(out, lse, q, k, v, causal, scale)
    assert not failures, failures


SHAPES = [  # b, sq, sk, hq, hkv, d, dtype
    (1, 1024, 1024, 32, 8, 128, "fp16"),  # the shape
    (2, 333, 333, 16, 16, 128, "bf16"),   # tails, no GQA
    (1, 200, 517, 8, 2, 64, "fp16"),      # Sq != Sk, head dim 64
    (1, 517, 200, 8, 1, 128, "bf16"),     # Sq > Sk: causal rows with no key
    (3, 1, 77, 4, 4, 128, "fp16"),        # one query row (decode-like)
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}_Sq{}_Sk{}_H{}-{}_D{}_{}".format(*s))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_matches_sdpa_and_fp32(shape, causal):
    b, sq, sk, hq, hkv, d, dtype = shape
    q, k, v = make_qkv(b, sq, sk, hq, hkv, d, dtype)
    plan = fa4.explain(q, k, v, causal=causal)
    assert plan.path == "kernel" and plan.arch == "sm90", str(plan)
    with torch.no_grad():
        out, lse = fa4.attention(q, k, v, causal=causal, return_lse=True)
        again = fa4.attention(q, k, v, causal=causal)  # the cached fast path, no LSE
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (b, hq, sq)
    check_against_references(out, q, k, v, causal)
    check_against_references(again, q, k, v, causal)
    _, ref_lse = reference_fp32(q, k, v, causal)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-3, atol=1e-3)


def test_softmax_scale_and_extreme_logits():
    q, k, v = make_qkv(1, 256, 256, 8, 2, 128)
    q = q * 8  # scores in the hundreds: the online softmax must rescale correctly
    for scale in (0.05, 0.5):
        out = fa4.attention(q, k, v, causal=True, softmax_scale=scale)
        check_against_references(out, q, k, v, True, scale)


def test_non_contiguous_inputs_from_a_packed_projection():
    packed = torch.randn(2, 300, 3, 8, 128, device="cuda", dtype=torch.float16)
    q, k, v = packed[:, :, 0], packed[:, :, 1, :4], packed[:, :, 2, :4]
    out = fa4.attention(q, k, v, causal=True)
    assert out.is_contiguous()
    check_against_references(out, q, k, v, True)


def test_forced_config_runs_that_config():
    q, k, v = make_qkv(1, 1024, 1024, 32, 8, 128)
    problem = kernels.AttentionProblem(1, 1024, 1024, 32, 8, 128, "fp16", False)
    default = kernels.default_config("sm90", problem)
    forced = next(default.replace(tile_n=n) for n in (64, 96, 112, 176)
                  if n != default.tile_n and not kernels.feasible(default.replace(tile_n=n), problem))
    plan = fa4.explain(q, k, v, config=forced)
    assert (plan.source, plan.config) == ("forced", forced)
    out = fa4.attention(q, k, v, config=forced)
    launchers = [l for l in state.STATE.compiled.values() if getattr(l, "config", None) == forced]
    assert launchers, "the forced configuration was not the one compiled"
    check_against_references(out, q, k, v, False)


def test_other_seqlens_do_not_recompile(monkeypatch):
    # one configuration (the default's rules may pick another at some lengths, e.g. 128-row tiles
    # where 192 rows would be over 5 % padding) serves every length from one compile
    fa4.reset_caches(compiled=True)
    calls = []
    real = kernels.compile_attention
    monkeypatch.setattr(kernels, "compile_attention", lambda c, p, d=None: calls.append(p) or real(c, p, d))
    config = kernels.default_config("sm90", kernels.AttentionProblem(1, 1024, 1024, 32, 8, 128, "fp16", True))
    for seqlen in (512, 777, 1024, 2048, 4000):
        q, k, v = make_qkv(1, seqlen, seqlen, 32, 8, 128, seed=seqlen)
        out = fa4.attention(q, k, v, causal=True, config=config)
        check_against_references(out, q, k, v, True)
    assert len(calls) == 1, f"compiled {len(calls)} times for one configuration: {calls}"
    assert fa4.cache_info()["compiles"] == 1


def test_torch_compile_fullgraph():
    q, k, v = make_qkv(2, 384, 384, 16, 4, 128)
    w = torch.randn(128, 128, device="cuda", dtype=torch.float16) / 12

    def block(q, k, v):
        out, lse = fa4.attention(q @ w, k, v, causal=True, return_lse=True)
        return out * 2 + 1, lse

    compiled = torch.compile(block, fullgraph=True)
    out, lse = compiled(q, k, v)
    ref_out, ref_lse = reference_fp32(q @ w, k, v, True)
    torch.testing.assert_close(out.float(), ref_out * 2 + 1, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-3, atol=1e-3)
    q2, k2, v2 = make_qkv(2, 384, 384, 16, 4, 128, seed=1)  # same shapes, new data: no recompile
    out2, _ = compiled(q2, k2, v2)
    torch.testing.assert_close(out2.float(), reference_fp32(q2 @ w, k2, v2, True)[0] * 2 + 1,
                               rtol=2e-2, atol=2e-2)


def test_torch_compile_reduce_overhead_cuda_graphs():
    q, k, v = make_qkv(1, 512, 512, 16, 4, 128)
    compiled = torch.compile(lambda q, k, v: fa4.attention(q, k, v, causal=False) + 0, fullgraph=True,
                             mode="reduce-overhead")
    for _ in range(3):  # cudagraph trees record on a later call
        out = compiled(q, k, v)
    check_against_references(out.clone(), q, k, v, False)


def test_custom_op_called_eagerly_matches_the_direct_path():
    q, k, v = make_qkv(1, 640, 640, 16, 4, 128)
    direct, direct_lse = fa4.attention(q, k, v, causal=True, return_lse=True)
    out, lse = torch.ops.fa4.attention(q, k, v, True, None, True, None, "error", False)
    torch.testing.assert_close(out, direct, rtol=0, atol=0)
    torch.testing.assert_close(lse, direct_lse, rtol=0, atol=0)
    out, no_lse = torch.ops.fa4.attention(q, k, v, True, None, False, None, "error", False)
    assert no_lse.shape == (0,)


def test_sdpa_fallback_for_a_head_dim_without_kernel():
    q, k, v = make_qkv(1, 300, 300, 8, 2, 80)
    with pytest.raises(fa4.UnsupportedInputError, match="head dim 80"):
        fa4.attention(q, k, v)
    with pytest.warns(fa4.Fa4Warning, match="SDPA"):
        out, lse = fa4.attention(q, k, v, causal=True, return_lse=True, fallback="sdpa")
    check_against_references(out, q, k, v, True)
    torch.testing.assert_close(lse, reference_fp32(q, k, v, True)[1], rtol=1e-3, atol=1e-3)


def test_cuda_graph_capture_and_replay():
    q, k, v = make_qkv(1, 1024, 1024, 32, 8, 128)
    # the same signature first, outside the capture: compiling (and loading the module) is not a
    # stream operation and must not happen while capturing
    fa4.attention(q, k, v, causal=True, return_lse=True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = fa4.attention(q, k, v, causal=True, return_lse=True)
    for seed in (1, 2):
        q2, k2, v2 = make_qkv(1, 1024, 1024, 32, 8, 128, seed=seed)
        q.copy_(q2), k.copy_(k2), v.copy_(v2)
        graph.replay()
        torch.cuda.synchronize()
        check_against_references(out, q2, k2, v2, True)
        torch.testing.assert_close(lse, reference_fp32(q2, k2, v2, True)[1], rtol=1e-3, atol=1e-3)


def test_zero_lengths_on_gpu():
    q, k, v = make_qkv(1, 0, 64, 8, 2, 128)
    out, lse = fa4.attention(q, k, v, return_lse=True)
    assert out.shape == (1, 0, 8, 128) and lse.shape == (1, 8, 0) and out.is_cuda
    q, k, v = make_qkv(1, 32, 0, 8, 2, 128)
    out, lse = fa4.attention(q, k, v, return_lse=True)
    assert torch.all(out == 0) and torch.all(lse == -math.inf)


def test_errors_on_gpu():
    q, k, v = make_qkv(1, 128, 128, 8, 2, 128)
    flat = torch.empty(q.numel() + 8, device="cuda", dtype=q.dtype)
    shifted = flat[1:1 + q.numel()].view(q.shape).copy_(q)
    fa4.attention(q, k, v)
    with pytest.raises(fa4.UnsupportedInputError, match="16-byte aligned"):
        fa4.attention(shifted, k, v)
    with pytest.raises(fa4.InvalidInputError, match="one device"):
        fa4.attention(q, k.cpu(), v)
    with pytest.raises(fa4.UnsupportedInputError, match="float32 has no kernel"):
        fa4.attention(q.float(), k.float(), v.float())


@pytest.mark.parametrize("change", ["v_seqlen", "v_heads", "k_dtype", "v_dtype", "k_cpu", "v_misaligned"])
def test_kernel_path_refusals_reach_the_checked_errors(change):
    """The kernel path's short key leaves V's shape, K's and V's dtypes and devices and the data
    alignment to the compiled kernel's TVM-FFI checks: inputs sharing a cached short key but wrong in
    one of those must get the checked path's error, and a good call afterwards the right result."""
    q, k, v = make_qkv(1, 256, 256, 8, 2, 128)
    want = fa4.attention(q, k, v)
    fa4.attention(q, k, v)
    assert state.STATE.last_kernel[1] is not None
    strides = (k.stride(), v.stride())
    bad_k, bad_v = k, v
    if change == "v_seqlen":
        bad_v = v[:, :128]
    elif change == "v_heads":
        bad_v = v[:, :, :1]
    elif change == "k_dtype":
        bad_k = k.to(torch.bfloat16)
    elif change == "v_dtype":
        bad_v = v.float()
    elif change == "k_cpu":
        bad_k = k.cpu()
    else:
        flat = torch.empty(v.numel() + 8, device="cuda", dtype=v.dtype)
        bad_v = flat[1:1 + v.numel()].view(v.shape).copy_(v)
    assert (bad_k.stride(), bad_v.stride()) == strides  # the short key of the cached signature
    with pytest.raises((fa4.InvalidInputError, fa4.UnsupportedInputError)):
        fa4.attention(q, bad_k, bad_v)
    torch.cuda.synchronize()
    assert torch.equal(fa4.attention(q, k, v), want)


def test_sm100_is_opt_in_and_labelled_untested():
    q, k, v = make_qkv(1, 128, 128, 8, 2, 128)
    with pytest.raises(fa4.UnsupportedInputError, match="not yet run on hardware"):
        fa4.explain(q, k, v, arch="sm100")
    assert "not yet run on hardware" in str(fa4.explain(q, k, v, arch="sm100", allow_untested_sm100=True))


def test_packaged_database_is_usable():
    fa4.use_config_db(None)
    fa4.reset_caches()
    q, k, v = make_qkv(1, 1024, 1024, 32, 8, 128)
    plan = fa4.explain(q, k, v, causal=True)
    print(plan)
    assert plan.path == "kernel" and "unusable" not in (plan.database or "")
    check_against_references(fa4.attention(q, k, v, causal=True), q, k, v, True)
