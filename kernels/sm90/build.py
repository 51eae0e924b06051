"""Compiling the sm90 kernel: for the GPU in this process, or for sm_90a on a CPU-only machine.

One compile serves every batch size and sequence length (and head count) of a compile key: the
kernel is traced with fake tensors whose batch, sequence and head extents are symbolic, and called
through the DSL's TVM-FFI entry point with torch tensors directly (no per-call DLPack conversion).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import tempfile
import threading
import time
from typing import Optional

from ..knobs import Config
from ..problem import AttentionProblem

SM_COUNT_H200 = 132
TARGET_ARCH = "sm_90a"

_cache: dict = {}
_cache_lock = threading.Lock()


def _kernel_for(config: Config, problem: AttentionProblem, num_sms: int):
    from .kernel import FlashAttentionSm90
    return FlashAttentionSm90(
        dtype=problem.dtype, head_dim=problem.head_dim, causal=problem.causal,
        return_lse=problem.return_lse,
        gqa_pack_ratio=problem.gqa_ratio if config.pack_gqa else None,
        tile_m=config.tile_m, tile_n=config.tile_n, kv_stages=config.kv_stages,
        q_stages=config.q_stages, rescale_threshold=config.rescale_threshold,
        scheduler=config.scheduler, pv_operand=config.pv_operand,
        softmax_overlap=config.softmax_overlap,
        exp2_poly_columns=config.exp2_poly_columns, num_sms=num_sms)


def _fake_args(problem: AttentionProblem):
    """Fake Q, K, V, O, LSE with symbolic batch / sequence / head extents and 16-byte strides."""
    import cutlass
    import cutlass.cute as cute
    dtype = {"fp16": cutlass.Float16, "bf16": cutlass.BFloat16}[problem.dtype]
    d = problem.head_dim
    batch, seq_q, seq_k = cute.sym_int(), cute.sym_int(), cute.sym_int()
    heads_q, heads_kv = cute.sym_int(), cute.sym_int()

    def bshd(seq, heads):
        stride = (cute.sym_int64(divisibility=8), cute.sym_int64(divisibility=8),
                  cute.sym_int64(divisibility=8), 1)
        return cute.runtime.make_fake_tensor(dtype, (batch, seq, heads, d), stride=stride,
                                             assumed_align=16)

    q, o = bshd(seq_q, heads_q), bshd(seq_q, heads_q)
    k, v = bshd(seq_k, heads_kv), bshd(seq_k, heads_kv)
    lse = None
    if problem.return_lse:
        lse = cute.runtime.make_fake_tensor(
            cutlass.Float32, (batch, heads_q, seq_q),
            stride=(cute.sym_int64(), cute.sym_int64(), 1), assumed_align=4)
    return q, k, v, o, lse


def _compile(config: Config, problem: AttentionProblem, num_sms: int, extra_options: str = ""):
    """(compiled function, kernel object, SharedStorage bytes, seconds)."""
    import cutlass
    import cutlass.cute as cute
    kern = _kernel_for(config, problem, num_sms)
    q, k, v, o, lse = _fake_args(problem)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    t0 = time.perf_counter()
    compiled = cute.compile[cute.GPUArch(TARGET_ARCH)](
        kern, q, k, v, o, lse, cutlass.Float32(1.0), stream,
        options=("--enable-tvm-ffi " + extra_options).strip())
    seconds = time.perf_counter() - t0
    smem = kern.smem_bytes
    return compiled, kern, smem, seconds


class CompiledAttention:
    """A compiled kernel; `.run(q, k, v, out, lse, softmax_scale)` launches on torch's current stream."""

    def __init__(self, compiled, config: Config, problem: AttentionProblem, smem_bytes: int,
                 compile_seconds: float):
        self._fn = compiled
        self.config = config
        self.problem = problem
        self.smem_bytes = smem_bytes
        self.compile_seconds = compile_seconds
        self._default_scale = 1.0 / math.sqrt(problem.head_dim)

    def run(self, q, k, v, out, lse=None, softmax_scale: Optional[float] = None) -> None:
        """Q, out (B, Sq, Hq, D); K, V (B, Sk, Hkv, D); lse (B, Hq, Sq) fp32 exactly when the problem
        returns LSE. Batch, lengths and heads may differ from the compiled problem; what the code
        was specialised on (head dim, and the GQA ratio of a packed kernel) may not."""
        if (lse is None) == self.problem.return_lse:
            raise ValueError("lse must be given exactly when the problem returns LSE")
        if q.shape[-1] != self.problem.head_dim:
            raise ValueError(f"head dim {q.shape[-1]} != compiled {self.problem.head_dim}")
        if self.config.pack_gqa and q.shape[2] != k.shape[2] * self.problem.gqa_ratio:
            raise ValueError(f"this kernel packs GQA ratio {self.problem.gqa_ratio}; got "
                             f"Hq={q.shape[2]}, Hkv={k.shape[2]}")
        scale = self._default_scale if softmax_scale is None else float(softmax_scale)
        self._fn(q, k, v, out, lse, scale)


def device_sm_count() -> int:
    """SMs of torch's current CUDA device: the persistent schedulers' grid is compiled in, and an
    H100 PCIe (114 SMs) or an H20 (78) must not get the H200's 132."""
    import torch
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


def compile_attention(config: Config, problem: AttentionProblem, key, num_sms: Optional[int] = None):
    if num_sms is None:
        num_sms = device_sm_count()
    key = (*key, ("num_sms", num_sms))
    with _cache_lock:
        hit = _cache.get(key)
    if hit is not None:
        return hit
    with target_arch(TARGET_ARCH):
        compiled, _, smem, seconds = _compile(config, problem, num_sms)
    result = CompiledAttention(compiled, config, problem, smem, seconds)
    with _cache_lock:
        _cache.setdefault(key, result)
    return _cache[key]


_REG_RE = re.compile(r"Used (\d+) registers")


def compile_report(config: Config, problem: AttentionProblem, num_sms: int = SM_COUNT_H200) -> dict:
    """Compile for sm_90a without a GPU and report what the compiler says."""
    with target_arch(TARGET_ARCH):
        return _report(config, problem, num_sms)


@contextlib.contextmanager
def target_arch(arch: str):
    """Trace and compile for `arch` (e.g. sm_90a) on any machine, then restore the previous target.

    The DSL checks arch-specific atoms (wgmma, TMA) against its target at trace time. It reads
    CUTE_DSL_ARCH once and caches it in the DSL singleton's environment manager, so setting the
    environment variable alone works only for the first compile of a process: a process that first
    compiled for sm_100a would keep tracing for sm_100a. Both are set here and both restored.
    """
    from cutlass.cutlass_dsl import BaseDSL
    envar = BaseDSL._get_dsl().envar
    previous_env = os.environ.get("CUTE_DSL_ARCH")
    previous_cached = envar._arch
    os.environ["CUTE_DSL_ARCH"] = arch
    envar.arch = arch
    try:
        yield
    finally:
        envar.arch = previous_cached
        if previous_env is None:
            os.environ.pop("CUTE_DSL_ARCH", None)
        else:
            os.environ["CUTE_DSL_ARCH"] = previous_env


def _report(config: Config, problem: AttentionProblem, num_sms: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="fa4-sm90-") as tmp:
        remarks = os.path.join(tmp, "remarks.yaml")
        import cutlass.cute as cute
        try:
            compiled, kern, smem, seconds = _compile_keep(config, problem, num_sms, remarks)
        except Exception as exc:  # a failing configuration is a result with a reason
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
        text = open(remarks).read() if os.path.exists(remarks) else ""
        ptx = getattr(compiled, "__ptx__", "") or ""
        if not ptx:
            for name in os.listdir(tmp):
                if name.endswith(".ptx"):
                    ptx = open(os.path.join(tmp, name)).read()
    report = _parse_remarks(text)
    report.update({
        "ok": True,
        "smem_bytes": smem,
        "compile_seconds": round(seconds, 2),
        "ptx_markers": {
            "wgmma": "wgmma.mma_async" in ptx,
            "tma_load": "cp.async.bulk.tensor" in ptx,
            "setmaxnreg": "setmaxnreg" in ptx,
            "stmatrix": "stmatrix" in ptx,
        },
        "threads": kern.num_threads,
    })
    return report


def _compile_keep(config, problem, num_sms, remarks_path):
    import cutlass.cute as cute
    import cutlass
    kern = _kernel_for(config, problem, num_sms)
    q, k, v, o, lse = _fake_args(problem)
    # The device code does not depend on the host calling convention, so the report compiles
    # without TVM-FFI (which a CPU-only CI machine need not have).
    stream = cute.runtime.make_fake_stream()
    t0 = time.perf_counter()
    dump_dir = os.path.dirname(remarks_path)
    compiled = cute.compile[cute.GPUArch(TARGET_ARCH)](
        kern, q, k, v, o, lse, cutlass.Float32(1.0), stream,
        options=f"--keep-ptx --dump-dir {dump_dir} remarks{{ptx}} --remark-output {remarks_path}")
    seconds = time.perf_counter() - t0
    smem = kern.smem_bytes
    return compiled, kern, smem, seconds


def _parse_remarks(text: str) -> dict:
    regs = [int(m) for m in _REG_RE.findall(text)]
    spill_st = [int(m) for m in re.findall(r"(\d+) bytes spill stores", text)]
    spill_ld = [int(m) for m in re.findall(r"(\d+) bytes spill loads", text)]
    return {
        "registers": max(regs) if regs else None,
        "spill_stores": sum(spill_st),
        "spill_loads": sum(spill_ld),
        "wgmma_serialized": "serialized" in text,
        "remarks_excerpt": text[:1500],
    }
