"""The Hopper (sm_90a) family: our FA4-style warp-specialised TMA + wgmma forward kernel.

Family API (see fa4.kernels): can_implement, resources, resource_reasons, default_config,
problem_key, compile_attention, compile_report, SOURCE_FILES. Importing this module does not import
the DSL; compiling does (kernel.py, build.py).

The resource model mirrors the kernel's SharedStorage (kernel.py `shared_storage`) byte for byte:
three mbarrier arrays (Q full/empty per Q stage, K and V full/empty per K/V stage), then 1024-byte
aligned buffers sQ (q_stages x tile_m x D), sK and sV (kv_stages x tile_n x D each) and sP
(tile_m x tile_n, only when P goes through shared memory). O is staged in the current Q buffer.
"""

from __future__ import annotations

from ..knobs import Config
from ..problem import AttentionProblem

ARCH = "sm90"
SOURCE_FILES = ("__init__.py", "kernel.py", "layouts.py", "scheduler.py", "build.py")

SMEM_LIMIT_BYTES = 232_448  # per block on sm_90 (227 KiB)
SUPPORTED_HEAD_DIMS = (64, 128)
ELEM_BYTES = 2
BUFFER_ALIGN = 1024
# setmaxnreg consumer budget minus a reserve for addresses, indices and softmax state; the same
# split as kernel.REGISTER_SPLIT ({1: 256, 2: 240, 3: 160} consumer registers).
CONSUMER_REGISTERS = {1: 256, 2: 240, 3: 160}
RESERVED_REGISTERS = {1: 40, 2: 24, 3: 32}


def can_implement(problem: AttentionProblem) -> list[str]:
    reasons = []
    if problem.head_dim not in SUPPORTED_HEAD_DIMS:
        reasons.append(f"head dim {problem.head_dim} is not supported (sm90 kernel: "
                       f"{', '.join(map(str, SUPPORTED_HEAD_DIMS))})")
    if problem.dtype not in ("fp16", "bf16"):
        reasons.append(f"dtype {problem.dtype} is not supported (fp16, bf16)")
    if problem.batch < 1 or problem.seqlen_q < 1 or problem.seqlen_k < 1 or problem.heads_q < 1:
        reasons.append("empty problem: batch, sequence lengths and heads must be >= 1")
    return reasons


def _num_consumer_warpgroups(config: Config) -> int:
    return config.tile_m // 64


def smem_bytes(config: Config, problem: AttentionProblem) -> int:
    """Dynamic shared memory per CTA, the same arithmetic as the kernel's SharedStorage."""
    d = problem.head_dim
    barriers = 8 * (2 * config.q_stages + 4 * config.kv_stages)
    offset = barriers
    buffers = [
        config.q_stages * config.tile_m * d * ELEM_BYTES,
        config.kv_stages * config.tile_n * d * ELEM_BYTES,
        config.kv_stages * config.tile_n * d * ELEM_BYTES,
        config.tile_m * config.tile_n * ELEM_BYTES if config.pv_operand == "ss" else 0,
    ]
    for size in buffers:
        offset = -(-offset // BUFFER_ALIGN) * BUFFER_ALIGN + size
    return -(-offset // BUFFER_ALIGN) * BUFFER_ALIGN if offset % BUFFER_ALIGN else offset


def estimated_registers(config: Config, problem: AttentionProblem) -> int:
    """Accumulator registers per consumer thread: O (64 x D fp32 over 128 threads), S (64 x tile_n
    fp32) and P (S in 16 bits), which is live next to S in every mode: with overlap the previous
    block's P feeds the in-flight value MMA while the next S arrives; without it (and with P going
    through shared memory) P is built in registers while S is still live. Calibrated against ptxas
    on sm_90a (compile_sweep): the accepted edge cases compile without spills, e.g. 192x80 at D=128
    (124 of 128), 128x192 at D=128 (208 of 216), 64x192 at D=128 (208 of 216); rejected ones such as
    192x112 or 192x128-ss at D=128 spill. Overlap with P in registers costs a few more (measured:
    192x128 at D=64 spills 16 B with it, none without), hence the small extra term."""
    regs_o = 64 * problem.head_dim // 128
    regs_s = 64 * config.tile_n // 128
    regs_p = regs_s // 2
    regs_overlap = 4 if (config.softmax_overlap and config.pv_operand == "rs") else 0
    return regs_o + regs_s + regs_p + regs_overlap


def register_budget(config: Config) -> int:
    wg = _num_consumer_warpgroups(config)
    return CONSUMER_REGISTERS[wg] - RESERVED_REGISTERS[wg]


def resources(config: Config, problem: AttentionProblem) -> dict:
    return {
        "smem_bytes": smem_bytes(config, problem),
        "smem_limit_bytes": SMEM_LIMIT_BYTES,
        "registers_per_consumer_thread": estimated_registers(config, problem),
        "register_budget": register_budget(config),
        "consumer_warpgroups": _num_consumer_warpgroups(config),
        "threads": 128 * (_num_consumer_warpgroups(config) + 1),
    }


def resource_reasons(config: Config, problem: AttentionProblem) -> list[str]:
    if config.arch != ARCH:
        return [f"configuration is for {config.arch}, not {ARCH}"]
    reasons = []
    if problem.head_dim not in SUPPORTED_HEAD_DIMS:
        return reasons  # can_implement says why
    res = resources(config, problem)
    if res["smem_bytes"] > SMEM_LIMIT_BYTES:
        reasons.append(f"shared memory {res['smem_bytes']} B > {SMEM_LIMIT_BYTES} B per block")
    if res["registers_per_consumer_thread"] > res["register_budget"]:
        reasons.append(
            f"registers: about {res['registers_per_consumer_thread']} accumulator registers per "
            f"consumer thread > budget {res['register_budget']} with "
            f"{res['consumer_warpgroups']} consumer warpgroup(s)")
    if config.tile_n % 16:
        reasons.append(f"tile_n={config.tile_n}: the value MMA's K must be a multiple of 16")
    if config.q_stages == 2 and config.scheduler == "single":
        reasons.append("q_stages=2 needs a persistent scheduler (static/lpt): with one tile per "
                       "CTA the second Q buffer is never used")
    ratio = problem.gqa_ratio
    if config.pack_gqa:
        if ratio == 1:
            reasons.append("pack_gqa needs a GQA ratio > 1 (Hq == Hkv: nothing to pack)")
        elif config.tile_m % ratio:
            reasons.append(f"pack_gqa: GQA ratio {ratio} does not divide tile_m={config.tile_m} "
                           f"(a packed tile must hold whole groups of query heads)")
    return reasons


def default_config(problem: AttentionProblem) -> Config:
    """Heuristic default: 128 x 128 tiles (two consumer warpgroups), P from registers with
    intra-warpgroup overlap, 2 K/V stages, rescale threshold 8, GQA packing when the ratio divides
    the tile, and LPT persistent scheduling for causal (long tiles first; measured on the H200 at
    B1 S1024 H32/8 D128 fp16: 28.7 us vs 32.2 us with one CTA per tile; non-causal: single 35.1 us,
    static 34.7 us, lpt 35.8 us, so the plain grid stays)."""
    ratio = problem.gqa_ratio
    pack = ratio > 1 and 128 % ratio == 0
    return Config.make(
        ARCH, tile_m=128, tile_n=128, kv_stages=2, q_stages=1, rescale_threshold=8.0,
        softmax_overlap=True, pv_operand="rs", scheduler="lpt" if problem.causal else "single",
        pack_gqa=pack)


def problem_key(config: Config, problem: AttentionProblem) -> tuple:
    """What of the problem the generated code depends on (never sequence lengths, batch or heads;
    the GQA ratio only when rows are packed, where it shapes the tile)."""
    key = (("dtype", problem.dtype), ("head_dim", problem.head_dim), ("causal", problem.causal),
           ("return_lse", problem.return_lse))
    if config.pack_gqa:
        key += (("gqa_ratio", problem.gqa_ratio),)
    return key


def compile_attention(config: Config, problem: AttentionProblem):
    """A launchable kernel: `.run(q, k, v, out, lse, softmax_scale)` on torch's current stream.
    Cached in-process by fa4.kernels.compile_key."""
    from .. import compile_key
    from . import build
    reasons = can_implement(problem) + resource_reasons(config, problem)
    if reasons:
        raise ValueError(f"infeasible configuration {config.label()}: {'; '.join(reasons)}")
    return build.compile_attention(config, problem, compile_key(config, problem))


def compile_report(config: Config, problem: AttentionProblem) -> dict:
    """Compile for sm_90a without a GPU: registers, spills, smem (SharedStorage), seconds, PTX markers."""
    from . import build
    return build.compile_report(config, problem)
