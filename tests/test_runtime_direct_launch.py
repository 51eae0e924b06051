"""The fast path's direct TVM-FFI launcher (fa4.kernels.dsl_internals.direct_launcher), on CPU.

The stand-in compiled function is the DSL's own `TVMFFIJitCompiledFunctionWithKwargs` (the class DSL
4.8 returns for our kernels), built around a TVM-FFI function whose body is Python: it computes SDPA
into the output it receives, so a launch that dropped, reordered or mis-converted an argument gives a
wrong result here. The real sm90 kernel, compiled for sm_90a on CPU, must be accepted too.
"""

from __future__ import annotations

import json
import types

import pytest
import torch

import fa4
from fa4 import checks, database, fallback, kernels, state
from fa4.kernels import dsl_internals
from fa4.kernels import AttentionProblem, Config
from fa4.kernels.device import H200

tvm_ffi = pytest.importorskip("tvm_ffi")
kwargs_wrapper = pytest.importorskip("tvm_ffi.utils.kwargs_wrapper")
provider = pytest.importorskip("cutlass.cutlass_dsl.tvm_ffi_provider")

NAMES = ["mQ", "mK", "mV", "mO", "mLSE", "softmax_scale"]


def ffi_kernel(causal, calls, dtype=torch.float16):
    """A TVM-FFI function that writes SDPA into O (and LSE) and counts its calls. Like the compiled
    kernels' TVM-FFI functions, it refuses what the kernel path's short key leaves to it: a dtype
    other than the compiled one, tensors on several devices, V's extents unlike K's, a batch unlike
    Q's, data not 16-byte aligned."""
    def body(q, k, v, out, lse, scale):
        q, k, v, out = (torch.from_dlpack(t) for t in (q, k, v, out))
        for name, t in (("mQ", q), ("mK", k), ("mV", v), ("mO", out)):
            if t.dtype != dtype:
                raise ValueError(f"Mismatched Tensor on argument #{name}, expected dtype={dtype}")
            if t.data_ptr() % 16:
                raise ValueError(f"Misaligned Tensor data on argument #{name}")
            if t.device != q.device:
                raise ValueError(f"Mismatched {name}.device.index")
        if v.shape != k.shape or k.shape[0] != q.shape[0] or out.shape != q.shape:
            raise ValueError("Mismatched Shape")
        o, l = fallback.sdpa_attention(q, k, v, causal, scale, lse is not None)
        out.copy_(o)
        if lse is not None:
            torch.from_dlpack(lse).copy_(l)
        calls.append(scale)
    return tvm_ffi.convert(body)


def dsl_function(target, wrapper=None, pointer_args=False):
    fn = dsl_internals.stand_in_compiled_function(target, NAMES, wrapper, pointer_args)
    assert type(fn) is provider.TVMFFIJitCompiledFunctionWithKwargs   # the DSL's own class
    return fn


class CountingCompiled:
    """CompiledAttention's shape: `compiled` plus a checked `run` (counted here)."""

    def __init__(self, fn, problem):
        self.compiled, self.problem, self.checked_runs = fn, problem, 0

    def run(self, q, k, v, out, lse=None, softmax_scale=None):
        self.checked_runs += 1
        if (lse is None) == self.problem.return_lse:
            raise ValueError("lse must be given exactly when the problem returns LSE")
        self.compiled(q, k, v, out, lse, float(softmax_scale))


class Family(types.SimpleNamespace):
    def can_implement(self, problem):
        return []

    def resource_reasons(self, config, problem, device=None):
        return []

    def launch_reasons(self, config, problem, device=None):
        return []

    def default_config(self, problem, device=None):
        return Config.make(self.arch)

    def problem_key(self, config, problem):
        return (problem.dtype, problem.head_dim, problem.gqa_ratio, problem.causal, problem.return_lse)

    def device_key(self, device):
        return (("num_sms", device.sm_count),)

    def compile_attention(self, config, problem, device=None):
        compiled = CountingCompiled(dsl_function(ffi_kernel(problem.causal, self.calls)), problem)
        self.compiled.append(compiled)
        return compiled


@pytest.fixture
def family(monkeypatch, tmp_path):
    fam = Family(arch="sm90", calls=[], compiled=[], REFERENCE_DEVICE=H200)
    monkeypatch.setattr(kernels, "family", lambda arch: fam)
    monkeypatch.setattr(kernels, "kernel_fingerprint", lambda arch: "fp")
    monkeypatch.setattr(state, "device_description", lambda device: H200)
    monkeypatch.setattr(checks, "device_reasons", lambda spec: [])
    db_path = tmp_path / "best.json"
    db_path.write_text(json.dumps({"schema": database.SCHEMA_VERSION, "entries": []}))
    fa4.use_config_db(db_path)
    fa4.reset_caches(compiled=True)
    yield fam
    fa4.use_config_db(None)
    fa4.reset_caches(compiled=True)


def qkv(sq=64, sk=64, hq=4, hkv=2, d=64):
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, s, h, d, dtype=torch.float16, generator=g)
                 for s, h in ((sq, hq), (sk, hkv), (sk, hkv)))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("return_lse", [False, True])
def test_first_call_checked_then_direct_and_correct(family, causal, return_lse):
    q, k, v = qkv()
    want_o, want_lse = fallback.sdpa_attention(q, k, v, causal, None, True)
    for call in range(3):
        scale = None if call < 2 else 2  # an int scale reaches the kernel as a float
        got = fa4.attention(q, k, v, causal=causal, return_lse=return_lse, softmax_scale=scale)
        o, lse = got if return_lse else (got, None)
        ref_o, ref_lse = ((want_o, want_lse) if scale is None
                          else fallback.sdpa_attention(q, k, v, causal, 2.0, True))
        torch.testing.assert_close(o, ref_o, atol=2e-3, rtol=2e-3)
        if return_lse:
            torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)
    (compiled,) = family.compiled
    assert compiled.checked_runs == 1  # only the first call of the signature
    assert len(family.calls) == 3 and all(type(s) is float for s in family.calls)
    launch = state.STATE.last[1]
    assert type(launch.fast_run) is tvm_ffi.Function and launch.fast_run is not launch.run


def test_failed_first_run_keeps_the_checked_run(family, monkeypatch):
    def failing(self, *args, **kwargs):
        raise ValueError("rejected by run")
    monkeypatch.setattr(CountingCompiled, "run", failing)
    q, k, v = qkv()
    for _ in range(2):  # the second call hits the cached signature and must still be checked
        with pytest.raises(ValueError, match="rejected by run"):
            fa4.attention(q, k, v)


def test_kernel_path_skips_the_checked_path(family):
    q, k, v = qkv()
    fa4.attention(q, k, v)
    launch = state.STATE.last[1]
    assert state.STATE.last_kernel[1] is launch
    for _ in range(3):
        fa4.attention(q, k, v)
    assert fa4.cache_info()["slow_calls"] == 1 and len(family.calls) == 4


def test_misaligned_pointer_still_caught_on_the_direct_path(family):
    q, k, v = qkv()
    fa4.attention(q, k, v)
    fa4.attention(q, k, v)
    storage = torch.empty(q.numel() + 1, dtype=q.dtype)
    shifted = storage[1:].view(q.shape)
    shifted.copy_(q)
    with pytest.raises(checks.UnsupportedInputError, match="16"):
        fa4.attention(shifted, k, v)
    with pytest.warns(fa4.Fa4Warning, match="SDPA"):
        out = fa4.attention(shifted, k, v, fallback="sdpa")
    torch.testing.assert_close(out, fallback.sdpa_attention(q, k, v, False, None, False)[0])


@pytest.mark.parametrize("change", ["v_seqlen", "v_heads", "k_dtype", "v_dtype"])
def test_what_the_short_key_leaves_out_gets_the_checked_path_error(family, change):
    """Inputs that share the short key of a cached kernel signature but differ in what only the
    compiled function checks: the compiled function refuses them and the checked path names the problem."""
    q, k, v = qkv()
    fa4.attention(q, k, v)
    fa4.attention(q, k, v)
    strides = (k.stride(), v.stride())
    if change == "v_seqlen":
        v = v[:, :32]
    elif change == "v_heads":
        v = v[:, :, :1]
    elif change == "k_dtype":
        k = k.to(torch.bfloat16)
    else:
        v = v.float()
    assert (k.stride(), v.stride()) == strides  # the short key of the cached signature
    with pytest.raises((checks.InvalidInputError, checks.UnsupportedInputError)):
        fa4.attention(q, k, v)
    assert family.calls and len(family.calls) == 2  # nothing ran with the bad inputs


def _wrapper(source, target):
    namespace = {"__i_target_func": target}
    exec(source, namespace)
    return namespace["wrapper"]


@pytest.mark.parametrize("source", [
    "def wrapper(mQ, mK, mV, mO, mLSE, softmax_scale):\n"
    "    return __i_target_func(mK, mQ, mV, mO, mLSE, softmax_scale)\n",            # reordered
    "def wrapper(mQ, mK, mV, mO, mLSE, softmax_scale=1.0):\n"
    "    return __i_target_func(mQ, mK, mV, mO, mLSE, softmax_scale)\n",            # a default
    "def wrapper(mQ, mK, mV, mO, mLSE, softmax_scale):\n"
    "    return __i_target_func(mQ, mK, mV, mO, mLSE, softmax_scale, 0)\n",         # an extra argument
    "def wrapper(mQ, mK, mV, mO, mLSE, softmax_scale, *rest):\n"
    "    return __i_target_func(mQ, mK, mV, mO, mLSE, softmax_scale)\n",            # varargs
    "def wrapper(mQ, mK, mV, mO, mLSE, softmax_scale):\n"
    "    return __i_target_func(mQ, mK, mV, mO, mLSE, softmax_scale=softmax_scale)\n",  # keyword
])
def test_wrappers_that_do_more_than_forward_are_refused(source):
    target = ffi_kernel(False, [])
    compiled = types.SimpleNamespace(compiled=dsl_function(target, _wrapper(source, target)))
    assert dsl_internals.direct_launcher(compiled) is None


def test_forwarding_wrapper_pointer_args_and_foreign_objects():
    target = ffi_kernel(False, [])
    forward = ("def wrapper(mQ, mK, mV, mO, mLSE, softmax_scale):\n"
               "    return __i_target_func(mQ, mK, mV, mO, mLSE, softmax_scale)\n")
    ok = types.SimpleNamespace(compiled=dsl_function(target, _wrapper(forward, target)))
    assert dsl_internals.direct_launcher(ok) is target
    pointers = types.SimpleNamespace(compiled=dsl_function(target, pointer_args=True))
    assert dsl_internals.direct_launcher(pointers) is None
    assert dsl_internals.direct_launcher(types.SimpleNamespace(compiled=lambda *a: None)) is None
    assert dsl_internals.direct_launcher(object()) is None


def test_real_sm90_compile_is_accepted():
    """The DSL's actual object for our kernel (compiled for sm_90a without a GPU) gets the direct path."""
    from fa4.kernels import compiling

    problem = AttentionProblem(1, 256, 256, 4, 2, 64)
    config = kernels.default_config("sm90", problem)
    sm90 = kernels.family("sm90")
    compiled, _, smem, seconds = compiling.compile_kernel(sm90, config, problem, sm90.REFERENCE_DEVICE,
                                                          tvm_ffi=True)
    launcher = dsl_internals.direct_launcher(compiling.CompiledAttention(compiled, config, problem, smem, seconds))
    assert type(launcher) is tvm_ffi.Function


@pytest.mark.parametrize("scale,match", [
    (float("nan"), "finite"), (float("inf"), "finite"), (-float("inf"), "finite"),
    (-0.125, "positive"), (0.0, "positive"), (1e40, "positive"), (1e-40, "positive"),  # fp32: inf, 0
    ("0.5", "a number, got str"), (True, "a number, got bool")])
def test_a_scale_the_checked_path_refuses_is_refused_on_the_kernel_path(family, scale, match):
    q, k, v = qkv()
    fa4.attention(q, k, v)
    fa4.attention(q, k, v, softmax_scale=0.5)  # the kernel path is taken from now on
    launches = len(family.calls)
    with pytest.raises(fa4.InvalidInputError, match=f"softmax_scale must be {match}"):
        fa4.attention(q, k, v, softmax_scale=scale)
    assert len(family.calls) == launches  # nothing was launched with it


def test_the_dsl_internals_are_read_in_one_module():
    """Only kernels/dsl_internals.py (`fa4.kernels.dsl_internals`) reads or replaces the DSL's private
    objects, in every package and script of the repository, so a DSL upgrade has one place to check
    (and test_real_sm90_compile_is_accepted fails when it stops recognising them). Tests may: they
    are what fails loudly on an upgrade."""
    import re
    from pathlib import Path

    private = re.compile(r"_kwargs_wrapper|_tvm_ffi_function|execution_args|\bimport dis\b|\benvar\b|_get_dsl"
                         r"|HardwareInfo\s*=|_set_enable_frame_filtering|\._fn\b")
    repo = Path(__file__).resolve().parents[1]
    home = Path(dsl_internals.__file__).resolve()
    assert home == repo / "kernels" / "dsl_internals.py"
    offenders = [str(p.relative_to(repo)) for folder in ("kernels", "fa4", "fa4tune", "benchmarks")
                 for p in sorted((repo / folder).rglob("*.py"))
                 if p.resolve() != home and private.search(p.read_text())]
    assert offenders == []
