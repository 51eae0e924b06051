"""Our attention backward for Hopper (sm_90a) in CuTe DSL: preprocess, main kernel, postprocess.

The tile algorithm (the math and its accumulation order) is `fa4.kernels.backward_emulation`'s;
`kernel.py` runs it (design in its docstring), `prepost.py` holds the two small kernels around it.
Importing this module does not import the DSL; compiling does.

    kernels = compile_backward(BackwardParams(), problem)     # on a machine with the GPU
    kernels.run(q, k, v, out, dout, lse, dq, dk, dv, softmax_scale)

Workspaces (`.run` allocates them, on torch's caching allocator, so a caller needs to know nothing
of the kernel's padding): LSE2 and D, (B, Hq, Sq rounded up to tile_m) fp32, written by the
preprocess; dQ_accum, (B, Sq, Hq, D) fp32, zeroed by `torch.zeros` (a memset is as fast as any
kernel of ours would be, and keeps the preprocess a pure row reduction), accumulated by the main
kernel's atomics, converted by the postprocess.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Optional

from .. import compiling
from ..device import DeviceDescription
from ..problem import AttentionProblem

ARCH = "sm90"
SUPPORTED_HEAD_DIMS = (64, 128)
# setmaxnreg split (producer warpgroup, each of the two MMA warpgroups): 128 * (24 + 2 * 240) <= 64K
REGISTER_SPLIT = (24, 240)
MMA_WARPGROUPS = 2
# fp32 accumulator registers per MMA thread, under the 240 a thread gets: S and dP together (live
# through the elementwise part beside dK, dV and the wgmma descriptors: 128 x 128 tiles, 128 of
# them, spill 16-34 registers at head dim 64, measured), and all four (S, dP, dK, dV) together
SCORE_REGISTER_LIMIT = 64
ACCUMULATOR_REGISTER_LIMIT = 192
SMEM_LIMIT_BYTES = 227 * 1024
KERNELS = ("preprocess", "main", "postprocess")  # in launch order
# what the main kernel's sm_90a PTX holds when it is built as designed
PTX_MARKERS = {
    "wgmma": re.compile(r"wgmma\.mma_async"),
    "tma_load": re.compile(r"cp\.async\.bulk\.tensor"),
    "dq_atomics": re.compile(r"red\.[a-z.]*global\.add\.f32"),
    "setmaxnreg": re.compile(r"setmaxnreg"),
    "stmatrix": re.compile(r"stmatrix"),
}


@dataclass(frozen=True)
class BackwardParams:
    """The main kernel's parameters (compiled in).

    tile_m:    query rows per block of the inner loop (64 or 128)
    tile_n:    key rows per CTA (64 or 128)
    q_stages:  Q / dO buffers in the TMA pipeline (1 or 2)
    """

    tile_m: int = 64
    tile_n: int = 128
    q_stages: int = 2

    def to_dict(self) -> dict:
        return asdict(self)

    def label(self) -> str:
        return f"{self.tile_m}x{self.tile_n} q_stages={self.q_stages}"


def default_params(head_dim: int) -> BackwardParams:
    """64 x 128 at both head dims (flash-attn takes 128 x 128 at head dim 64; this kernel's S and
    dP at 128 x 128 exceed `SCORE_REGISTER_LIMIT`)."""
    return BackwardParams(tile_m=64, tile_n=128, q_stages=2)


def score_registers(params: BackwardParams) -> int:
    """fp32 registers per MMA thread for S and dP (tile_m x tile_n each)."""
    return 2 * params.tile_m * params.tile_n // (128 * MMA_WARPGROUPS)


def accumulator_registers(params: BackwardParams, head_dim: int) -> int:
    """fp32 registers per MMA thread for S, dP (tile_m x tile_n) and dK, dV (tile_n x D)."""
    return score_registers(params) + 2 * params.tile_n * head_dim // (128 * MMA_WARPGROUPS)


def smem_bytes(params: BackwardParams, head_dim: int) -> int:
    """Q and dO stages, K, V, P and dS (16-bit), plus barriers and 1 KiB alignment per buffer."""
    elems = (2 * params.q_stages * params.tile_m * head_dim + 2 * params.tile_n * head_dim
             + 2 * params.tile_m * params.tile_n)
    return elems * 2 + 6 * 1024


def reasons(params: BackwardParams, problem: AttentionProblem) -> list[str]:
    """Why the kernel cannot run `params` on `problem` (empty: it can)."""
    out = []
    if params.tile_m not in (64, 128):
        out.append(f"tile_m={params.tile_m} is not 64 or 128")
    if params.tile_n not in (64, 128):
        out.append(f"tile_n={params.tile_n} is not 64 or 128")
    if params.q_stages not in (1, 2):
        out.append(f"q_stages={params.q_stages} is not 1 or 2")
    if problem.head_dim not in SUPPORTED_HEAD_DIMS:
        out.append(f"head_dim={problem.head_dim} is not one of {SUPPORTED_HEAD_DIMS}")
    if out:
        return out
    if score_registers(params) > SCORE_REGISTER_LIMIT:
        out.append(f"{params.label()}: S and dP hold {score_registers(params)} fp32 registers per "
                   f"thread > {SCORE_REGISTER_LIMIT}")
    regs = accumulator_registers(params, problem.head_dim)
    if regs > ACCUMULATOR_REGISTER_LIMIT:
        out.append(f"{params.label()} at head dim {problem.head_dim} holds {regs} fp32 accumulator "
                   f"registers per thread > {ACCUMULATOR_REGISTER_LIMIT}")
    smem = smem_bytes(params, problem.head_dim)
    if smem > SMEM_LIMIT_BYTES:
        out.append(f"{params.label()} at head dim {problem.head_dim} needs {smem} bytes of shared "
                   f"memory > {SMEM_LIMIT_BYTES}")
    return out


def validate(params: BackwardParams, problem: AttentionProblem) -> None:
    why = reasons(params, problem)
    if why:
        raise ValueError(f"the sm90 backward cannot run {params.label()} on {problem.label()}: "
                         + "; ".join(why))


# ------------------------------------------------------------------------------------------------
# fake arguments and compiling

def _fake_arguments(problem: AttentionProblem, tvm_ffi: bool):
    """Fake tensors with symbolic batch, lengths, heads and strides for the three kernels: one compile
    serves every such problem (as `compiling.fake_arguments` does for the forward)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    dtype = {"fp16": cutlass.Float16, "bf16": cutlass.BFloat16}[problem.dtype]
    d = problem.head_dim
    batch, seq_q, seq_k, seq_q_padded = cute.sym_int(), cute.sym_int(), cute.sym_int(), cute.sym_int()
    heads_q, heads_kv = cute.sym_int(), cute.sym_int()

    def bshd(seq, heads, element=dtype, divisibility=8):
        stride = tuple(cute.sym_int64(divisibility=divisibility) for _ in range(3)) + (1,)
        return make_fake_tensor(element, (batch, seq, heads, d), stride=stride, assumed_align=16)

    def rows(seq):  # (B, Hq, S) fp32, rows contiguous
        return make_fake_tensor(cutlass.Float32, (batch, heads_q, seq),
                                stride=(cute.sym_int64(), cute.sym_int64(), 1), assumed_align=4)

    return dict(
        q=bshd(seq_q, heads_q), k=bshd(seq_k, heads_kv), v=bshd(seq_k, heads_kv),
        out=bshd(seq_q, heads_q), dout=bshd(seq_q, heads_q), lse=rows(seq_q),
        lse2=rows(seq_q_padded), delta=rows(seq_q_padded),
        dq_accum=bshd(seq_q, heads_q, cutlass.Float32, divisibility=4), dq=bshd(seq_q, heads_q),
        dk=bshd(seq_k, heads_kv), dv=bshd(seq_k, heads_kv),
        stream=make_fake_stream(use_tvm_ffi_env_stream=tvm_ffi))


def _make_kernel(name: str, params: BackwardParams, problem: AttentionProblem):
    d, dtype = problem.head_dim, problem.dtype
    if name == "main":
        from .kernel import FlashAttentionBackwardSm90
        return FlashAttentionBackwardSm90(dtype=dtype, head_dim=d, causal=problem.causal,
                                          tile_m=params.tile_m, tile_n=params.tile_n,
                                          q_stages=params.q_stages)
    from . import prepost
    return {"preprocess": prepost.Preprocess, "postprocess": prepost.Postprocess}[name](
        dtype=dtype, head_dim=d)


def _compile_all(params: BackwardParams, problem: AttentionProblem, options: str, tvm_ffi: bool,
                 only: Optional[tuple] = None) -> dict:
    """{name: (compiled function, kernel object, seconds)} for the three kernels (or `only` those)."""
    import cutlass
    import cutlass.cute as cute
    from ..family import DSL_TARGET

    validate(params, problem)
    if tvm_ffi:
        options = f"--enable-tvm-ffi {options}"
    out = {}
    with compiling.target_arch(ARCH):
        a = _fake_arguments(problem, tvm_ffi)
        arguments = dict(
            preprocess=(a["out"], a["dout"], a["lse"], a["lse2"], a["delta"], a["stream"]),
            main=(a["q"], a["k"], a["v"], a["dout"], a["lse2"], a["delta"], a["dq_accum"], a["dk"],
                  a["dv"], cutlass.Float32(1.0), a["stream"]),
            postprocess=(a["dq_accum"], a["dq"], cutlass.Float32(1.0), a["stream"]))
        for name in only or KERNELS:
            kernel = _make_kernel(name, params, problem)
            start = time.perf_counter()
            compiled = cute.compile[cute.GPUArch(DSL_TARGET[ARCH])](
                kernel, *arguments[name], options=options.strip())
            out[name] = (compiled, kernel, time.perf_counter() - start)
    return out


class CompiledBackward:
    """The three compiled kernels; `.run` launches them on torch's current stream (TVM-FFI)."""

    def __init__(self, compiled: dict, params: BackwardParams, problem: AttentionProblem):
        self.compiled = compiled
        self.params = params
        self.problem = problem

    def run(self, q, k, v, out, dout, lse, dq, dk, dv, softmax_scale: Optional[float] = None) -> None:
        """Q, out, dout, dq (B, Sq, Hq, D); K, V, dk, dv (B, Sk, Hkv, D); lse (B, Hq, Sq) fp32 (the
        forward's, natural log). dq, dk, dv are written."""
        import torch

        if q.shape[-1] != self.problem.head_dim:
            raise ValueError(f"head dim {q.shape[-1]} != compiled {self.problem.head_dim}")
        batch, seqlen_q, heads_q, head_dim = q.shape
        scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
        padded = -(-max(seqlen_q, 1) // self.params.tile_m) * self.params.tile_m
        lse2 = torch.empty((batch, heads_q, padded), dtype=torch.float32, device=q.device)
        delta = torch.empty_like(lse2)
        dq_accum = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        self.compiled["preprocess"](out, dout, lse, lse2, delta)
        self.compiled["main"](q, k, v, dout, lse2, delta, dq_accum, dk, dv, scale)
        self.compiled["postprocess"](dq_accum, dq, scale)


def compile_backward(params: BackwardParams, problem: AttentionProblem,
                     device: Optional[DeviceDescription] = None) -> CompiledBackward:
    """The launchable backward of `params` for `problem`'s dtype, head dim and causal flag (one compile
    serves every batch, length and head count). `device` is accepted for symmetry with the forward;
    nothing of it is compiled in (the grid is one CTA per key block, not persistent)."""
    compiled = _compile_all(params, problem, options="", tvm_ffi=True)
    return CompiledBackward({name: c for name, (c, _, _) in compiled.items()}, params, problem)


def compile_report(params: BackwardParams, problem: AttentionProblem,
                   device: Optional[DeviceDescription] = None, only: Optional[tuple] = None) -> dict:
    """Compile the three kernels for sm_90a with fake tensors (a CPU is enough): {kernel name:
    {registers, spill_stores, spill_loads, stack_frame, wgmma_serialized, ptxas_warnings, smem_bytes,
    compile_seconds, ptx_markers}}. `registers` is ptxas's count for the whole kernel (168: 64K over
    384 threads); the MMA warpgroups run under setmaxnreg's 240 (`REGISTER_SPLIT`). `only`: a subset of ("preprocess", "main", "postprocess")."""
    reports = {}
    for name in only or KERNELS:
        with tempfile.TemporaryDirectory(prefix="fa4-sm90-bwd-") as tmp:
            remarks_path = os.path.join(tmp, "remarks.yaml")
            (compiled, kernel, seconds), = _compile_all(
                params, problem, tvm_ffi=False, only=(name,),
                options=f"--keep-ptx --dump-dir {tmp} remarks{{ptx}} --remark-output {remarks_path}",
            ).values()
            remarks = open(remarks_path).read() if os.path.exists(remarks_path) else ""
            ptx = getattr(compiled, "__ptx__", "") or ""
        parsed = compiling.parse_remarks(remarks)
        parsed.pop("remarks_excerpt")
        reports[name] = {**parsed, "smem_bytes": int(getattr(kernel, "smem_bytes", 0)),
                         "compile_seconds": round(seconds, 2),
                         "ptx_markers": {marker: bool(rx.search(ptx)) for marker, rx in PTX_MARKERS.items()}}
    return reports
