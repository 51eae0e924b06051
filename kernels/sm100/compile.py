"""Compile the sm100 kernel: for sm_100a on any machine (fake tensors, no GPU), or for launch.

NOT RUN ON HARDWARE: no Blackwell GPU exists here, so `compile_attention` refuses to build a launchable
kernel unless the GPU in this process is a Blackwell (compute capability 10.x); `compile_report` only
compiles for sm_100a with fake tensors and reads registers, spills, shared memory and PTX markers.
"""

from __future__ import annotations

import os
import re
import tempfile
import threading
import time
from typing import Any

from ..knobs import Config
from ..problem import AttentionProblem
from .plan import B200_NUM_SMS, make_plan

PTX_MARKERS = {
    "tcgen05.mma": re.compile(r"\btcgen05\.mma\b"),
    "tcgen05.ld": re.compile(r"\btcgen05\.ld\b"),
    "tcgen05.st": re.compile(r"\btcgen05\.st\b"),
    "cp.async.bulk.tensor": re.compile(r"\bcp\.async\.bulk\.tensor\b"),
}


def _dsl_dtype(name: str):
    import cutlass
    return {"fp16": cutlass.Float16, "bf16": cutlass.BFloat16}[name]


def _fake_arguments(problem: AttentionProblem, tvm_ffi_stream: bool = False):
    """Fake Q, K, V, O, LSE with symbolic batch, sequence lengths, head counts and strides.

    Strides are symbolic (multiples of 8 elements: 16-byte TMA alignment) so one compile serves any
    (B, S, H, D) view whose last dimension is contiguous, as the runtime passes them.
    """
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    dt = _dsl_dtype(problem.dtype)
    d = problem.head_dim
    batch, seq_q, seq_k = cute.sym_int(), cute.sym_int(), cute.sym_int()
    heads_q, heads_kv = cute.sym_int(), cute.sym_int()

    def bshd(seq, heads):
        stride = (cute.sym_int64(divisibility=8), cute.sym_int64(divisibility=8),
                  cute.sym_int64(divisibility=8), 1)
        return make_fake_tensor(dt, (batch, seq, heads, d), stride=stride, assumed_align=16)

    q, o = bshd(seq_q, heads_q), bshd(seq_q, heads_q)
    k, v = bshd(seq_k, heads_kv), bshd(seq_k, heads_kv)
    lse = None
    if problem.return_lse:
        lse = make_fake_tensor(cutlass.Float32, (batch, heads_q, seq_q),
                               stride=(cute.sym_int64(), cute.sym_int64(), 1), assumed_align=4)
    return q, k, v, o, lse, make_fake_stream(use_tvm_ffi_env_stream=tvm_ffi_stream)


def _parse_remarks(path: str) -> dict:
    """Registers and spills of the kernel from ptxas's remark file (YAML-ish text)."""
    text = open(path).read() if os.path.exists(path) else ""
    out: dict[str, Any] = {}
    for key, pattern in (("registers", r"(\d+)\s+registers"),
                         ("spill_stores", r"(\d+)\s+bytes spill stores"),
                         ("spill_loads", r"(\d+)\s+bytes spill loads"),
                         ("stack_frame", r"(\d+)\s+bytes stack frame")):
        values = [int(m) for m in re.findall(pattern, text)]
        out[key] = max(values) if values else None
    out["warnings"] = sorted(set(re.findall(r"Performance.*|[Ww]arning[^\n]*", text)))[:10]
    out["remarks_text"] = text
    return out


class _TargetArch:
    """Trace for sm_100a (the DSL checks tcgen05 atoms against its target at trace time), then
    restore the previous target so another family compiling in the same process keeps its own.

    The DSL reads CUTE_DSL_ARCH once and caches it in its singleton's environment manager, so both
    the variable and the cached value are set (a process that compiled sm_90a first would otherwise
    keep tracing for sm_90a).
    """

    def __enter__(self):
        from cutlass.cutlass_dsl import BaseDSL
        self.envar = BaseDSL._get_dsl().envar
        self.previous_env = os.environ.get("CUTE_DSL_ARCH")
        self.previous_cached = self.envar._arch
        os.environ["CUTE_DSL_ARCH"] = "sm_100a"
        self.envar.arch = "sm_100a"

    def __exit__(self, *exc):
        self.envar.arch = self.previous_cached
        if self.previous_env is None:
            os.environ.pop("CUTE_DSL_ARCH", None)
        else:
            os.environ["CUTE_DSL_ARCH"] = self.previous_env
        return False


def compile_report(config: Config, problem: AttentionProblem, num_sms: int = B200_NUM_SMS) -> dict:
    """Compile for sm_100a with fake tensors; registers, spills, shared memory, PTX markers, seconds.

    Runs on a CPU. Raises whatever the DSL raises when tracing or compiling fails (the caller turns that
    into a result with a reason).
    """
    with _TargetArch():
        return _compile_report(config, problem, num_sms)


def _compile_report(config: Config, problem: AttentionProblem, num_sms: int) -> dict:
    import cutlass
    import cutlass.cute as cute

    from .kernel import FlashAttentionForwardSm100

    plan = make_plan(config, problem, num_sms=num_sms)
    kernel = FlashAttentionForwardSm100(plan)
    q, k, v, o, lse, stream = _fake_arguments(problem)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fa4_sm100_") as tmp:
        remarks = os.path.join(tmp, "remarks.yaml")
        options = (f"--gpu-arch sm_100a --keep-ptx --dump-dir {tmp} "
                   f"remarks{{ptx}} --remark-output {remarks}")
        compiled = cute.compile(
            kernel, q, k, v, o, lse, cutlass.Float32(1.0), stream, options=options)
        seconds = time.perf_counter() - start
        ptx = compiled.__ptx__ or ""
        parsed = _parse_remarks(remarks)
    smem = kernel.shared_storage.size_in_bytes()
    return {
        "arch": "sm_100a",
        "config": config.to_dict(),
        "problem": problem.to_dict(),
        "registers": parsed["registers"],
        "spill_stores": parsed["spill_stores"],
        "spill_loads": parsed["spill_loads"],
        "stack_frame": parsed["stack_frame"],
        "smem_bytes": int(smem),
        "smem_model_bytes": plan.smem_bytes,
        "tmem_columns": plan.tmem_columns,
        "compile_seconds": round(seconds, 2),
        "ptx_markers": {name: bool(rx.search(ptx)) for name, rx in PTX_MARKERS.items()},
        "ptxas_warnings": parsed["warnings"],
    }


_cache: dict = {}
_cache_lock = threading.Lock()


def compile_attention(config: Config, problem: AttentionProblem, num_sms: int | None = None):
    """A launchable kernel for the Blackwell GPU in this process: `.run(q, k, v, out, lse, scale)`.

    Refuses on anything but compute capability 10.x: this kernel has never run on hardware, and the
    caller (`fa4.attention`) must have asked for it explicitly. Cached per compile key.
    """
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("the sm100 kernel needs a Blackwell GPU (sm_100); no CUDA GPU is available")
    major, minor = torch.cuda.get_device_capability()
    if major != 10:
        raise RuntimeError(
            f"the sm100 kernel needs a Blackwell GPU (compute capability 10.x); this GPU is "
            f"sm_{major}{minor}. Use the sm90 kernel on Hopper, or PyTorch SDPA elsewhere.")
    if num_sms is None:
        num_sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    from .. import compile_key
    key = (compile_key(config, problem), num_sms)
    with _cache_lock:
        hit = _cache.get(key)
    if hit is not None:
        return hit
    launchable = CompiledAttentionSm100(config, problem, num_sms)
    with _cache_lock:
        _cache.setdefault(key, launchable)
        return _cache[key]


class CompiledAttentionSm100:
    """One compile per compile key (symbolic batch, sequence, heads, strides), called through the
    DSL's TVM-FFI entry point with torch tensors on torch's current stream. Never run on hardware."""

    def __init__(self, config: Config, problem: AttentionProblem, num_sms: int):
        import cutlass
        import cutlass.cute as cute

        from .kernel import FlashAttentionForwardSm100

        self.config = config
        self.problem = problem
        self.plan = make_plan(config, problem, num_sms=num_sms)
        kernel = FlashAttentionForwardSm100(self.plan)
        q, k, v, o, lse, stream = _fake_arguments(problem, tvm_ffi_stream=True)
        start = time.perf_counter()
        with _TargetArch():
            self._fn = cute.compile(kernel, q, k, v, o, lse, cutlass.Float32(1.0), stream,
                                    options="--gpu-arch sm_100a --enable-tvm-ffi")
        self.compile_seconds = time.perf_counter() - start
        self.smem_bytes = kernel.shared_storage.size_in_bytes()
        self._default_scale = problem.head_dim ** -0.5

    def run(self, q, k, v, out, lse=None, softmax_scale: float | None = None) -> None:
        if (lse is None) == self.problem.return_lse:
            raise ValueError("lse must be given exactly when the problem returns LSE")
        scale = self._default_scale if softmax_scale is None else float(softmax_scale)
        self._fn(q, k, v, out, lse, scale)


def compile_cubin(config: Config, problem: AttentionProblem, num_sms: int = B200_NUM_SMS) -> bytes:
    """The sm_100a cubin of one configuration, compiled on this machine (CPU is fine), for
    disassembly (`fa4tune sass`). Never run: no Blackwell GPU exists here."""
    import cutlass
    import cutlass.cute as cute

    from .kernel import FlashAttentionForwardSm100

    with _TargetArch():
        kernel = FlashAttentionForwardSm100(make_plan(config, problem, num_sms=num_sms))
        q, k, v, o, lse, stream = _fake_arguments(problem)
        with tempfile.TemporaryDirectory(prefix="fa4_sm100_") as tmp:
            compiled = cute.compile(kernel, q, k, v, o, lse, cutlass.Float32(1.0), stream,
                                    options=f"--gpu-arch sm_100a --keep-cubin --dump-dir {tmp}")
            return bytes(compiled.__cubin__)
