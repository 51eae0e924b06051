"""Our attention backward for Hopper (sm_90a) in CuTe DSL: preprocess, main kernel, postprocess.

The tile algorithm (the math and its accumulation order) is `fa4.kernels.backward_emulation`'s;
`kernel.py` runs it (design in its docstring), `prepost.py` holds the two small kernels around it.
Its knobs are declared in `fa4.kernels.knobs` (knob set "sm90_bwd"); a configuration is a `Config`
of that set, judged by `feasibility.reasons`. Importing this module does not import the DSL;
compiling does.

    kernels = compile_backward(default_config(problem), problem)     # on a machine with the GPU
    kernels.run(q, k, v, out, dout, lse, dq, dk, dv, softmax_scale)

Workspaces (`.run` allocates them, on torch's caching allocator, so a caller needs to know nothing
of the kernel's padding): LSE2 and D, (B, Hq, Sq rounded up to tile_m) fp32, written by the
preprocess; dQ_accum, (B, Sq, Hq, D) fp32 (dq_accum "fragment": (B, Hq, Sq padded, D), each query
block's elements in the main kernel's fragment order), zeroed by the preprocess (as flash-attn-4's
does: the bytes of a memset without a kernel of its own), accumulated by the main kernel, converted by
the postprocess; with `group_split` > 1 also dK_accum and dV_accum, (B, Sk, Hkv, D) fp32, zeroed,
reduced into by the main kernel's CTAs and converted by the row postprocess ("kv_postprocess" where
the dQ postprocess is the fragment one).

Deterministic gradients (`deterministic=True` at compile time, the caller's requirement, not a knob:
every configuration has both): the main kernel adds each sum in global memory in a fixed order, dQ's
by key block and a split group's dK and dV by part, each writer waiting for its turn on a counter
(`kernel.FlashAttentionBackwardSm90.wait_turn`); `.run` allocates the zeroed counters, dQ's (B, Hq,
query blocks) and dK/dV's (B, Hkv, key blocks) int32. Which key block adds first is a compile-time choice
(`plan.DESCENDING_TURNS`, `FA4_BWD_DETERMINISTIC_ORDER`), in `compile_key`.

The main kernel as a programmatic dependent launch of the preprocess, and each postprocess of the
kernel before it (`plan.PROGRAMMATIC_LAUNCH`, or `FA4_BWD_PROGRAMMATIC_LAUNCH=0|1` when compiling): a
compile-time choice of the launch, not a knob (it is to be on everywhere once timed); `compile_key`
carries it.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
import time
from typing import Optional

from .. import compiling
from ..device import DeviceDescription
from ..knobs import Config
from ..problem import AttentionProblem
from .defaults import default_config, group_split_for  # noqa: F401  (the rules: not in the fingerprint)
# the resource model and the one check of a configuration
from .feasibility import (KNOB_SET, REFERENCE_DEVICE, can_implement, reasons, resource_reasons,  # noqa: F401
                          resources, smem_bytes, validate)
from .plan import (DESCENDING_TURNS, MMA_WARPGROUPS, PROGRAMMATIC_LAUNCH, REGISTER_SPLIT,  # noqa: F401
                   SUPPORTED_HEAD_DIMS)

ARCH = "sm90"
KERNELS = ("preprocess", "main", "postprocess")  # in launch order
# what the main kernel's sm_90a PTX holds when it is built as designed
PTX_MARKERS = {
    "wgmma": re.compile(r"wgmma\.mma_async"),
    "tma_load": re.compile(r"cp\.async\.bulk\.tensor"),
    "dq_atomics": re.compile(r"red\.[a-z.]*global\.add\.f32"),               # dq_accum "atomic"
    "dq_vector_atomics": re.compile(r"red\.[a-z.]*global\.add\.v4\.f32"),    # dq_accum "fragment_atomic"
    "tma_reduce": re.compile(r"cp\.reduce\.async\.bulk\.tensor.*\.add"),   # dq_accum "bulk", group_split > 1
    "setmaxnreg": re.compile(r"setmaxnreg"),
    "stmatrix": re.compile(r"stmatrix"),
    "turns": re.compile(r"ld\.[a-z.]*acquire\.gpu"),                      # deterministic: waits for a turn
    "griddepcontrol": re.compile(r"griddepcontrol\.(wait|launch_dependents)"),  # programmatic launch
}


def kernel_names(config: Config) -> tuple:
    """The kernels a configuration compiles: `KERNELS`, and a split group's dK/dV converter where the
    dQ postprocess reads a fragment-ordered accumulator (`FragmentPostprocess`) and cannot serve."""
    separate_kv = fragment_ordered(config) and config.group_split > 1
    return KERNELS + (("kv_postprocess",) if separate_kv else ())


def fragment_ordered(config: Config) -> bool:
    """Whether the dQ accumulator holds each query block's values in the MMA fragment's order (dq_accum
    "fragment" or "fragment_atomic"): (B, Hq, Sq padded, D), converted by `FragmentPostprocess`."""
    return config.dq_accum in ("fragment", "fragment_atomic")


def _compile_switch(variable: str, default: bool, off: str, on: str) -> bool:
    """A compile-time choice `plan` sets (`default`), unless the environment's `variable` names one
    side (`off` or `on`): an A/B on the GPU without an edit."""
    value = os.environ.get(variable, "").strip()
    if value not in ("", off, on):
        raise ValueError(f"{variable}={value!r}: {off} or {on}")
    return default if not value else value == on


def programmatic_launch() -> bool:
    """Whether the main kernel is compiled as the preprocess's programmatic dependent: `plan.
    PROGRAMMATIC_LAUNCH`, unless `FA4_BWD_PROGRAMMATIC_LAUNCH` is 0 or 1 (an A/B on the GPU)."""
    return _compile_switch("FA4_BWD_PROGRAMMATIC_LAUNCH", PROGRAMMATIC_LAUNCH, "0", "1")


def descending_turns() -> bool:
    """Deterministic gradients: whether a query block's dQ adds come last key block first (`plan.
    DESCENDING_TURNS`), unless `FA4_BWD_DETERMINISTIC_ORDER` is "ascending" or "descending" (an A/B)."""
    return _compile_switch("FA4_BWD_DETERMINISTIC_ORDER", DESCENDING_TURNS, "ascending", "descending")


def compile_key(config: Config, problem: AttentionProblem, deterministic: bool = False) -> tuple:
    """What the generated code depends on: the codegen knobs, dtype, head dim, causal, whether the
    sums are ordered (and in which order) and how the main kernel is launched (never lengths, batch or
    heads: they are symbolic in the compile)."""
    return (KNOB_SET, config.codegen_items(),
            (("dtype", problem.dtype), ("head_dim", problem.head_dim), ("causal", problem.causal))
            + ((("deterministic", True),) if deterministic else ())
            + ((("descending_turns", True),) if deterministic and descending_turns() else ())
            + ((("programmatic_launch", True),) if programmatic_launch() else ()))


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

    def rows(seq, divisibility=1, heads=heads_q, element=cutlass.Float32):  # (B, H, S), rows contiguous
        stride = (cute.sym_int64(divisibility=divisibility), cute.sym_int64(divisibility=divisibility), 1)
        return make_fake_tensor(element, (batch, heads, seq), stride=stride, assumed_align=4 * divisibility)

    return dict(
        q=bshd(seq_q, heads_q), k=bshd(seq_k, heads_kv), v=bshd(seq_k, heads_kv),
        out=bshd(seq_q, heads_q), dout=bshd(seq_q, heads_q), lse=rows(seq_q),
        # the padded workspaces hold whole query blocks: 16-byte rows, which their TMA loads need
        lse2=rows(seq_q_padded, 4), delta=rows(seq_q_padded, 4),
        dq_accum=bshd(seq_q, heads_q, cutlass.Float32, divisibility=4), dq=bshd(seq_q, heads_q),
        # dq_accum "fragment": the (B, Sq padded, Hq, D) view of a (B, Hq, Sq padded, D) tensor
        dq_accum_padded=bshd(seq_q_padded, heads_q, cutlass.Float32, divisibility=4),
        dk=bshd(seq_k, heads_kv), dv=bshd(seq_k, heads_kv),
        dk_accum=bshd(seq_k, heads_kv, cutlass.Float32, divisibility=4),
        dv_accum=bshd(seq_k, heads_kv, cutlass.Float32, divisibility=4),
        # deterministic: the turn counters of dQ's query blocks and of dK/dV's key blocks
        dq_turn=rows(cute.sym_int(), element=cutlass.Int32),
        dkv_turn=rows(cute.sym_int(), heads=heads_kv, element=cutlass.Int32),
        stream=make_fake_stream(use_tvm_ffi_env_stream=tvm_ffi))


def _make_kernel(name: str, config: Config, problem: AttentionProblem, deterministic: bool = False):
    d, dtype = problem.head_dim, problem.dtype
    if name == "main":
        from .kernel import FlashAttentionBackwardSm90
        # every knob reaches the kernel under its own name: a new knob needs no line here
        return FlashAttentionBackwardSm90(dtype=dtype, head_dim=d, causal=problem.causal,
                                          deterministic=deterministic,
                                          descending_turns=deterministic and descending_turns(),
                                          programmatic_launch=programmatic_launch(), **config.to_dict())
    from . import prepost
    if name == "postprocess" and fragment_ordered(config):
        return prepost.FragmentPostprocess(_make_kernel("main", config, problem))
    if name == "preprocess":
        return prepost.Preprocess(dtype=dtype, head_dim=d, programmatic_launch=programmatic_launch())
    # postprocess, kv_postprocess
    return prepost.Postprocess(dtype=dtype, head_dim=d, programmatic_launch=programmatic_launch())


def _compile_all(config: Config, problem: AttentionProblem, options: str, tvm_ffi: bool,
                 only: Optional[tuple] = None, deterministic: bool = False) -> dict:
    """{name: (compiled function, kernel object, seconds)} for the three kernels (or `only` those)."""
    import cutlass
    import cutlass.cute as cute
    from ..family import DSL_TARGET

    if tvm_ffi:
        options = f"--enable-tvm-ffi {options}"
    out = {}
    with compiling.target_arch(ARCH):
        a = _fake_arguments(problem, tvm_ffi)
        # a split group's CTAs add dK and dV into fp32 accumulators; one CTA a group stores them
        dk, dv = (a["dk"], a["dv"]) if config.group_split == 1 else (a["dk_accum"], a["dv_accum"])
        dq_accum = a["dq_accum_padded" if fragment_ordered(config) else "dq_accum"]
        arguments = dict(
            preprocess=(a["out"], a["dout"], a["lse"], a["lse2"], a["delta"], dq_accum, a["stream"]),
            main=(a["q"], a["k"], a["v"], a["dout"], a["lse2"], a["delta"], dq_accum, dk, dv,
                  cutlass.Float32(1.0), a["stream"])
            + ((a["dq_turn"],) + ((a["dkv_turn"],) if config.group_split > 1 else ()) if deterministic else ()),
            postprocess=(dq_accum, a["dq"], cutlass.Float32(1.0), a["stream"]),
            kv_postprocess=(a["dk_accum"], a["dk"], cutlass.Float32(1.0), a["stream"]))
        for name in only or kernel_names(config):
            kernel = _make_kernel(name, config, problem, deterministic)
            start = time.perf_counter()
            compiled = cute.compile[cute.GPUArch(DSL_TARGET[ARCH])](
                kernel, *arguments[name], options=options.strip())
            out[name] = (compiled, kernel, time.perf_counter() - start)
    return out


class CompiledBackward:
    """The three compiled kernels; `.run` launches them on torch's current stream (TVM-FFI)."""

    def __init__(self, compiled: dict, config: Config, problem: AttentionProblem, deterministic: bool = False):
        self.compiled = compiled
        self.config = config
        self.problem = problem
        self.deterministic = deterministic

    def run(self, q, k, v, out, dout, lse, dq, dk, dv, softmax_scale: Optional[float] = None,
            dlse=None) -> None:
        """Q, out, dout, dq (B, Sq, Hq, D); K, V, dk, dv (B, Sk, Hkv, D); lse (B, Hq, Sq) fp32 (the
        forward's, natural log); dlse (B, Hq, Sq), the gradient of a returned LSE, or None. dq, dk, dv
        are written."""
        import torch

        if q.shape[-1] != self.problem.head_dim:
            raise ValueError(f"head dim {q.shape[-1]} != compiled {self.problem.head_dim}")
        batch, seqlen_q, heads_q, head_dim = q.shape
        scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
        padded = -(-max(seqlen_q, 1) // self.config.tile_m) * self.config.tile_m
        lse2 = torch.empty((batch, heads_q, padded), dtype=torch.float32, device=q.device)
        delta = torch.empty_like(lse2)
        # the fp32 dQ accumulator, zeroed by the preprocess; in fragment order (B, Hq, Sq padded, D),
        # passed as its (B, Sq padded, Hq, D) view
        if fragment_ordered(self.config):
            dq_accum = torch.empty((batch, heads_q, padded, head_dim), dtype=torch.float32,
                                   device=q.device).transpose(1, 2)
        else:
            dq_accum = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        # every zeroed workspace before the preprocess: the main kernel follows it directly (its
        # programmatic dependent, `plan.PROGRAMMATIC_LAUNCH`)
        turns = ()
        if self.deterministic:   # zeroed counters: each sum's writers take their turns from 0
            turns = (torch.zeros((batch, heads_q, padded // self.config.tile_m), dtype=torch.int32,
                                 device=q.device),)
            if self.config.group_split > 1:
                key_blocks = -(-k.shape[1] // self.config.tile_n)
                turns += (torch.zeros((batch, k.shape[2], max(key_blocks, 1)), dtype=torch.int32,
                                      device=q.device),)
        if self.config.group_split > 1:
            dk_accum = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
            dv_accum = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
        self.compiled["preprocess"](out, dout, lse, lse2, delta, dq_accum)
        if dlse is not None:
            # D = rowsum(dO * O) - dLSE: since dS = P * (dP - D), the LSE's gradient enters the
            # backward only through D; one elementwise op on (B, Hq, Sq) beside the main kernel's
            # O(Sq * Sk) work. Rows that see no key have P = 0, so their D does not matter.
            delta[:, :, :seqlen_q].sub_(dlse.float())
        if self.config.group_split == 1:
            self.compiled["main"](q, k, v, dout, lse2, delta, dq_accum, dk, dv, scale, *turns)
        else:
            self.compiled["main"](q, k, v, dout, lse2, delta, dq_accum, dk_accum, dv_accum, scale, *turns)
            # the row postprocess converts any (B, S, H, D) fp32 accumulator: dK is scaled, dV is not
            convert = self.compiled.get("kv_postprocess", self.compiled["postprocess"])
            convert(dk_accum, dk, scale)
            convert(dv_accum, dv, 1.0)
        self.compiled["postprocess"](dq_accum, dq, scale)


def compile_backward(config: Config, problem: AttentionProblem,
                     device: Optional[DeviceDescription] = None, deterministic: bool = False) -> CompiledBackward:
    """The launchable backward of `config` for `problem`'s dtype, head dim and causal flag (one compile
    serves every batch, length and head count); refuses a configuration it cannot run (`reasons`).
    Nothing of `device` is compiled in (the grid is one CTA per key block, not persistent); its
    shared memory per block judges the configuration (default: the H200). `deterministic`: gradients
    bit for bit the same on every run (the module docstring)."""
    validate(config, problem, device)
    compiled = _compile_all(config, problem, options="", tvm_ffi=True, deterministic=deterministic)
    return CompiledBackward({name: c for name, (c, _, _) in compiled.items()}, config, problem, deterministic)


def compile_report(config: Config, problem: AttentionProblem,
                   device: Optional[DeviceDescription] = None, only: Optional[tuple] = None,
                   check: bool = True, deterministic: bool = False) -> dict:
    """Compile the three kernels for sm_90a with fake tensors (a CPU is enough): {kernel name:
    {registers, spill_stores, spill_loads, stack_frame, wgmma_serialized, ptxas_warnings, smem_bytes,
    compile_seconds, ptx_markers}}. `registers` is ptxas's count for the whole kernel (168: 64K over
    384 threads); the MMA warpgroups run under setmaxnreg's 240 (`REGISTER_SPLIT`). `only`: a subset
    of ("preprocess", "main", "postprocess"). `check=False` compiles a configuration the model refuses
    (to hold the model to the compiler); otherwise it is refused like `compile_backward` refuses it."""
    if check:
        validate(config, problem, device)
    reports = {}
    for name in only or kernel_names(config):
        with tempfile.TemporaryDirectory(prefix="fa4-sm90-bwd-") as tmp:
            remarks_path = os.path.join(tmp, "remarks.yaml")
            (compiled, kernel, seconds), = _compile_all(
                config, problem, tvm_ffi=False, only=(name,), deterministic=deterministic,
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
