"""Compiling a family's kernel: what every family shares, in one place.

- the DSL target architecture (`target_arch`, from `family.DSL_TARGET`; the DSL's private target
  cache is switched in `dsl_internals.py`),
- the fake arguments a kernel is traced with (symbolic batch, lengths, heads and strides, so one
  compile serves every such problem), and the runtime mask arguments of a kernel with a sliding window
  or a softcap (`mask_values`: the window's bounded sides and the cap, one compile for every value),
- the compile options, the launchable wrapper, and one compile-report schema (`REPORT_KEYS`).

A family contributes only what is its own (`family.KernelFamily`): the kernel object
(`make_kernel(config, problem, device)`), the shared memory it traced, its PTX markers and its resource
model. Nothing here caches: the one cache of compiled kernels, in-process over disk, is the runtime's
`fa4.compile_cache`. Nothing here imports the DSL at module import time.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
import time
from typing import Optional

from .device import DeviceDescription, from_torch
from .dsl_internals import dsl_target
from .family import DSL_TARGET, KernelFamily, family
from .knobs import Config
from .problem import AttentionProblem

# Every compile report has exactly these keys, whatever the family.
REPORT_KEYS = (
    "ok", "arch", "config", "problem", "registers", "spill_stores", "spill_loads", "stack_frame",
    "wgmma_serialized", "ptxas_warnings", "remarks_excerpt", "smem_bytes", "smem_model_bytes",
    "threads", "compile_seconds", "ptx_markers",
)


def target_arch(arch: str):
    """Trace and compile for the DSL target of family `arch` ("sm90" -> sm_90a, "sm100" -> sm_100a)
    on any machine, then restore the previous target (a context manager). The DSL caches its target
    in a private attribute; `dsl_internals.dsl_target` is the one place that switches it."""
    return dsl_target(DSL_TARGET[arch])


def fake_arguments(problem: AttentionProblem, tvm_ffi: bool = False):
    """Fake Q, K, V, O, LSE and stream with symbolic batch, sequence lengths, head counts and strides;
    V and O have the problem's value head dim.

    Strides are symbolic multiples of 8 elements (16-byte TMA alignment) with a contiguous head dim,
    so one compile serves any (B, S, H, D) view the runtime passes. `tvm_ffi`: the stream is the
    TVM-FFI environment's (torch's current stream), for a launchable compile.
    """
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    dtype = {"fp16": cutlass.Float16, "bf16": cutlass.BFloat16}[problem.dtype]
    d, dv = problem.head_dim, problem.value_head_dim
    batch, seq_q, seq_k = cute.sym_int(), cute.sym_int(), cute.sym_int()
    heads_q, heads_kv = cute.sym_int(), cute.sym_int()

    def bshd(seq, heads, dim=d):
        stride = (cute.sym_int64(divisibility=8), cute.sym_int64(divisibility=8),
                  cute.sym_int64(divisibility=8), 1)
        return make_fake_tensor(dtype, (batch, seq, heads, dim), stride=stride, assumed_align=16)

    q, o = bshd(seq_q, heads_q), bshd(seq_q, heads_q, dv)
    k, v = bshd(seq_k, heads_kv), bshd(seq_k, heads_kv, dv)
    lse = None
    if problem.return_lse:
        lse = make_fake_tensor(cutlass.Float32, (batch, heads_q, seq_q),
                               stride=(cute.sym_int64(), cute.sym_int64(), 1), assumed_align=4)
    return q, k, v, o, lse, make_fake_stream(use_tvm_ffi_env_stream=tvm_ffi)


def mask_values(problem: AttentionProblem) -> Optional[tuple]:
    """What a kernel of `problem` takes after the softmax scale: (window left side, window right side,
    softcap), each None where the problem has none (causal's right side is compiled in), or None for a
    problem with neither window nor softcap, whose kernel's call ends at the scale (`__call__`; the
    others' is `call_masked`; a varlen kernel's is `call_varlen`, which always takes the three)."""
    if problem.window is None and problem.softcap is None and not problem.varlen:
        return None
    return (problem.window_left, None if problem.causal else problem.window_right, problem.softcap)


def varlen_fake_arguments() -> tuple:
    """What a varlen kernel takes after the mask values: cu_seqlens_q and cu_seqlens_k (int32, a
    symbolic count of sequences + 1) and max_seqlen_q."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    count = cute.sym_int()
    cu_q, cu_k = (make_fake_tensor(cutlass.Int32, (count,), stride=(1,), assumed_align=4) for _ in range(2))
    return cu_q, cu_k, cutlass.Int32(0)


def compile_kernel(fam: KernelFamily, config: Config, problem: AttentionProblem, device: DeviceDescription,
                   options: str = "", tvm_ffi: bool = False):
    """Trace and compile the family's kernel for its target and `device`: (compiled function, kernel
    object, traced shared-memory bytes, seconds). `options` are the DSL's compile options
    (`--enable-tvm-ffi` is added for a launchable compile). A problem the family cannot implement is
    refused here, before the kernel is built (a window or softcap the family has no code for must not
    compile into a dense kernel)."""
    import cutlass
    import cutlass.cute as cute
    reasons = fam.can_implement(problem)
    if reasons:
        raise ValueError(f"the {fam.ARCH} kernel cannot run {problem.label()}: {'; '.join(reasons)}")
    if tvm_ffi:
        options = f"--enable-tvm-ffi {options}"
    with target_arch(fam.ARCH):
        kernel = fam.make_kernel(config, problem, device)
        q, k, v, o, lse, stream = fake_arguments(problem, tvm_ffi=tvm_ffi)
        values = mask_values(problem)
        entry, masks = kernel, ()
        if values is not None:   # one compile for every window width and cap: runtime arguments
            entry = kernel.call_masked
            masks = tuple(None if value is None else
                          (cutlass.Float32(1.0) if isinstance(value, float) else cutlass.Int32(0))
                          for value in values)
        if problem.varlen:   # one compile for every batch of sequences: offsets and max length at run time
            entry = kernel.call_varlen
            masks += varlen_fake_arguments()
        start = time.perf_counter()
        compiled = cute.compile[cute.GPUArch(DSL_TARGET[fam.ARCH])](
            entry, q, k, v, o, lse, cutlass.Float32(1.0), *masks, stream, options=options.strip())
        seconds = time.perf_counter() - start
    return compiled, kernel, int(fam.traced_smem_bytes(kernel)), seconds


# ------------------------------------------------------------------------------------------------
# launchable kernels

class CompiledAttention:
    """A compiled kernel; `.run(q, k, v, out, lse, softmax_scale)` launches on torch's current stream
    through the DSL's TVM-FFI entry point (torch tensors directly, no per-call DLPack conversion). A
    kernel with a window or softcap also takes the call's `mask_values` (`mask_values(problem)`)."""

    def __init__(self, compiled, config: Config, problem: AttentionProblem, smem_bytes: int,
                 compile_seconds: float):
        self.compiled = compiled  # the DSL's compiled function (the disk cache exports it)
        self.config = config
        self.problem = problem
        self.smem_bytes = smem_bytes
        self.compile_seconds = compile_seconds
        self._default_scale = 1.0 / math.sqrt(problem.head_dim)
        self._mask_kinds = _kinds(mask_values(problem))
        # the compiled function's positional arguments: Q, K, V, O, LSE, scale (and the mask values;
        # varlen: and cu_seqlens_q, cu_seqlens_k, max_seqlen_q)
        self.positionals = 6 if self._mask_kinds is None else 12 if problem.varlen else 9

    def run(self, q, k, v, out, lse=None, softmax_scale: Optional[float] = None,
            masks: Optional[tuple] = None) -> None:
        """Q (B, Sq, Hq, D), out (B, Sq, Hq, Dv); K (B, Sk, Hkv, D), V (B, Sk, Hkv, Dv); lse (B, Hq, Sq)
        fp32 exactly when the problem returns LSE. Batch, lengths and heads may differ from the compiled problem; what the code
        was specialised on (head dim, and the GQA ratio of a packed kernel) may not; nor which sides
        of a window are bounded and whether there is a softcap (`masks`: `mask_values` of the call's
        problem; the widths and the cap are the call's)."""
        if self.problem.varlen:
            raise ValueError("a varlen kernel is launched with run_varlen")
        scale = self._checked_scale(q, v, out, lse, softmax_scale, masks)
        if self.config.pack_gqa and q.shape[2] != k.shape[2] * self.problem.gqa_ratio:
            raise ValueError(f"this kernel packs GQA ratio {self.problem.gqa_ratio}; got "
                             f"Hq={q.shape[2]}, Hkv={k.shape[2]}")
        if masks is None:
            self.compiled(q, k, v, out, lse, scale)
        else:
            self.compiled(q, k, v, out, lse, scale, *kernel_mask_values(masks, q.shape[1], k.shape[1]))

    def _checked_scale(self, q, v, out, lse, softmax_scale: Optional[float], masks: Optional[tuple]) -> float:
        """The checks `run` and `run_varlen` share (mask kinds, LSE presence, head dims); the call's
        softmax scale."""
        if _kinds(masks) != self._mask_kinds:
            raise ValueError(f"mask values {masks} do not fit this kernel (compiled for "
                             f"{self.problem.mask_label()})")
        if (lse is None) == self.problem.return_lse:
            raise ValueError("lse must be given exactly when the problem returns LSE")
        self._check_head_dims(q, v, out)
        return self._default_scale if softmax_scale is None else float(softmax_scale)

    def _check_head_dims(self, q, v, out) -> None:
        if q.shape[-1] != self.problem.head_dim:
            raise ValueError(f"head dim {q.shape[-1]} != compiled {self.problem.head_dim}")
        if v.shape[-1] != self.problem.value_head_dim or out.shape[-1] != self.problem.value_head_dim:
            raise ValueError(f"value head dim of v {v.shape[-1]} / out {out.shape[-1]} != compiled "
                             f"{self.problem.value_head_dim}")

    def run_varlen(self, q, k, v, out, lse, softmax_scale: Optional[float], masks: tuple, cu_seqlens_q,
                   cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int) -> None:
        """A varlen kernel on flash-attn's packed tensors: q, out (total_q, Hq, D); k, v (total_k, Hkv,
        D); lse (Hq, total_q) fp32 exactly when the problem returns LSE; int32 offsets on the GPU;
        `masks` as `run`'s (`mask_values`: three values, None where there is none). Rows no sequence
        covers are left as they are."""
        if not self.problem.varlen:
            raise ValueError("run_varlen needs a kernel compiled for a varlen problem")
        scale = self._checked_scale(q, v, out, lse, softmax_scale, masks)
        self.compiled(q[None], k[None], v[None], out[None], None if lse is None else lse[None], scale,
                      *kernel_mask_values(masks, max_seqlen_q, max_seqlen_k), cu_seqlens_q, cu_seqlens_k,
                      int(max_seqlen_q))


def _kinds(masks: Optional[tuple]) -> Optional[tuple]:
    """Which of a call's mask values are given (what the kernel was compiled for)."""
    return None if masks is None else tuple(m is not None for m in masks)


def kernel_mask_values(values: tuple, seqlen_q: int, seqlen_k: int) -> tuple:
    """`mask_values` as the kernel takes them: a window side wider than the sequences hides nothing
    more, and is clamped to Sq + Sk so that the kernel's 32-bit key arithmetic cannot overflow."""
    left, right, softcap = values
    widest = seqlen_q + seqlen_k
    return (None if left is None else min(int(left), widest), None if right is None else min(int(right), widest),
            None if softcap is None else float(softcap))


def current_device() -> DeviceDescription:
    """The description of torch's current CUDA device: what a launchable compile is for when no
    device is given (a persistent grid is compiled for its SM count: an H100 PCIe (114 SMs) or an H20
    (78) must not get the H200's 132)."""
    import torch
    return from_torch(torch.cuda.current_device())


def compile_attention(config: Config, problem: AttentionProblem,
                      device: Optional[DeviceDescription] = None) -> CompiledAttention:
    """A launchable kernel of `config`'s family for `device` (default: torch's current GPU), compiled
    now: one compile serves every batch, length and head count (`fa4.kernels.compile_key`). Not
    cached here: `fa4.compile_cache` is the one cache."""
    device = device or current_device()
    compiled, _, smem, seconds = compile_kernel(family(config.arch), config, problem, device, tvm_ffi=True)
    return CompiledAttention(compiled, config, problem, smem, seconds)


# ------------------------------------------------------------------------------------------------
# compiling without a GPU: reports and cubins

def compile_report(config: Config, problem: AttentionProblem, device: Optional[DeviceDescription] = None) -> dict:
    """Compile for the family's target and `device` (default: the family's reference device) with fake
    tensors (a CPU is enough) and report what the compiler says: registers, spills and warnings
    (ptxas remarks), the traced shared memory beside the model's, the PTX markers, seconds. The keys
    are `REPORT_KEYS` for every family. Raises whatever the DSL raises when tracing or compiling fails
    (the caller makes that a result)."""
    fam = family(config.arch)
    device = device or fam.REFERENCE_DEVICE
    with tempfile.TemporaryDirectory(prefix=f"fa4-{fam.ARCH}-") as tmp:
        remarks_path = os.path.join(tmp, "remarks.yaml")
        # the device code does not depend on the host calling convention: no TVM-FFI here (a
        # CPU-only CI machine need not have it)
        compiled, kernel, smem, seconds = compile_kernel(
            fam, config, problem, device,
            options=f"--keep-ptx --dump-dir {tmp} remarks{{ptx}} --remark-output {remarks_path}")
        remarks = open(remarks_path).read() if os.path.exists(remarks_path) else ""
        ptx = getattr(compiled, "__ptx__", "") or ""
    resources = fam.resources(config, problem, device)
    report = {
        "ok": True,
        "arch": DSL_TARGET[fam.ARCH],
        "config": config.to_dict(),
        "problem": problem.to_dict(),
        **parse_remarks(remarks),
        "smem_bytes": smem,
        "smem_model_bytes": resources["smem_bytes"],
        "threads": resources["threads"],
        "compile_seconds": round(seconds, 2),
        "ptx_markers": {name: bool(rx.search(ptx)) for name, rx in fam.PTX_MARKERS.items()},
    }
    assert tuple(report) == REPORT_KEYS, "the compile-report schema is REPORT_KEYS"
    return report


def parse_remarks(text: str) -> dict:
    """Registers, spills, stack and warnings of the kernel from ptxas's remark file."""
    def numbers(pattern):
        return [int(m) for m in re.findall(pattern, text)]
    registers = numbers(r"Used (\d+) registers")
    stack = numbers(r"(\d+) bytes stack frame")
    return {
        "registers": max(registers) if registers else None,
        "spill_stores": sum(numbers(r"(\d+) bytes spill stores")),
        "spill_loads": sum(numbers(r"(\d+) bytes spill loads")),
        "stack_frame": max(stack) if stack else None,
        # ptxas's "wgmma.mma_async instructions are serialized due to insufficient register resources"
        "wgmma_serialized": "serialized" in text,
        "ptxas_warnings": sorted(set(re.findall(r"Performance.*|[Ww]arning[^\n]*", text)))[:10],
        "remarks_excerpt": text[:1500],
    }


def compile_cubin(config: Config, problem: AttentionProblem, device: Optional[DeviceDescription] = None) -> bytes:
    """The cubin of one configuration for `device` (default: the family's reference device), compiled
    on this machine (a CPU is enough), for disassembly (`fa4tune sass`)."""
    fam = family(config.arch)
    device = device or fam.REFERENCE_DEVICE
    with tempfile.TemporaryDirectory(prefix=f"fa4-{fam.ARCH}-") as tmp:
        compiled, _, _, _ = compile_kernel(fam, config, problem, device,
                                           options=f"--keep-cubin --dump-dir {tmp}")
        return bytes(compiled.__cubin__)
