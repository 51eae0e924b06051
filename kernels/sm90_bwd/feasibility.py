"""What the sm90 backward can run: the problems it implements, the resources a configuration uses and
every reason a configuration cannot run a problem in one block (shared memory, registers). The one
check: `compile_backward`, the tests, the benchmarks and the runtime all ask `reasons`.

Shared memory mirrors the main kernel's SharedStorage (kernel.py `shared_storage`) byte for byte: the
mbarrier arrays (Q/dO full and empty per stage, K/V full and empty), then 1024-byte aligned buffers
sQ and sdO (q_stages x tile_m x D each), sK and sV (tile_n x D each), sP (unless sdp_swap) and sdS
(pds_stages x tile_m x tile_n each), sdQ (tile_m x D fp32, dq_accum "bulk" or "fragment") and the rows' LSE2 and D
(q_stages x tile_m fp32 each, sdp_swap). The test holds it to the traced struct
(tests/test_sm90_bwd_compile.py).

Registers: the fp32 accumulators one MMA thread holds (`accumulator_registers`), against limits
calibrated on ptxas (the tests compile what the limits admit clean and what they refuse with spills).

`group_split` needs no shared memory of its own (its fp32 dK/dV tiles reuse the K/V and Q/dO
buffers at the end); it must leave every part of a GQA group at least one query head (`split_reasons`).
"""

from __future__ import annotations

from typing import Optional

from ..device import DeviceDescription, reference_device
from ..knobs import Config
from ..problem import AttentionProblem
from .plan import DTYPES, MMA_WARPGROUPS, SUPPORTED_HEAD_DIMS, THREADS, WGMMA_M, row_stage_floats

KNOB_SET = "sm90_bwd"
REFERENCE_DEVICE = reference_device("sm90")
ELEM_BYTES = 2
FP32_BYTES = 4
BUFFER_ALIGN = 1024
# fp32 accumulator registers per MMA thread under setmaxnreg's 240, calibrated on ptxas over the
# whole space (tests/test_sm90_bwd_compile.py): S and dP together, by whether P and dS go through
# shared memory (sdp_swap off: 128 x 128 tiles, 128 of them, spill 16-360 bytes at head dim 64) or
# feed dV and dK from registers (on: 128 x 128 compiles clean at head dim 64); and all four (S, dP,
# dK, dV: 208 at 80 x 128 and head dim 128, sdp_swap, compile clean; 256 at 128 x 128 and head dim
# 128 spill kilobytes either way)
SCORE_REGISTER_LIMIT = {False: 64, True: 128}
ACCUMULATOR_REGISTER_LIMIT = 208
# with S and dP through shared memory (sdp_swap off), a split group's CTA under a causal mask with two
# P/dS buffers spills from this many on (8 bytes at 64 x 128, head dim 128, group_split 2, either
# Q/dO stage count; with sdp_swap, one P/dS buffer, no mask or one CTA a group the same accumulators
# compile clean, as do sectioned grids since the unmasked blocks' loop comes first: 2026-12-06)
DIRECT_SPLIT_REGISTER_LIMIT = 192


def can_implement(problem: AttentionProblem) -> list[str]:
    """Reasons no configuration of the backward can run the problem."""
    reasons = []
    if problem.head_dim not in SUPPORTED_HEAD_DIMS:
        reasons.append(f"head_dim={problem.head_dim} is not one of {SUPPORTED_HEAD_DIMS} (sm90 backward)")
    if problem.head_dim_v is not None:
        reasons.append(f"value head dim {problem.head_dim_v} != head dim {problem.head_dim}: the sm90 backward "
                       f"has one head dim for Q, K, V, O and their gradients (Dv = D only)")
    if problem.dtype not in DTYPES:
        reasons.append(f"dtype {problem.dtype} is not one of {DTYPES}")
    return reasons


def score_registers(config: Config) -> int:
    """fp32 registers per MMA thread for S and dP (tile_m x tile_n each, split over the warpgroups)."""
    return 2 * config.tile_m * config.tile_n // (128 * MMA_WARPGROUPS)


def accumulator_registers(config: Config, head_dim: int) -> int:
    """fp32 registers per MMA thread for S, dP (tile_m x tile_n) and dK, dV (tile_n x D)."""
    return score_registers(config) + 2 * config.tile_n * head_dim // (128 * MMA_WARPGROUPS)


def smem_bytes(config: Config, problem: AttentionProblem) -> int:
    """Dynamic shared memory per CTA: the arithmetic of the kernel's SharedStorage (a buffer a
    configuration does not use has no bytes, but keeps its 1024-byte alignment)."""
    d = problem.head_dim
    q, tm, tn, pds = config.q_stages, config.tile_m, config.tile_n, config.pds_stages
    offset = 8 * (2 * q + 2)  # mbarriers: Q/dO full + empty per stage, K/V full + empty
    buffers = [
        q * tm * d * ELEM_BYTES, q * tm * d * ELEM_BYTES,             # sQ, sdO
        tn * d * ELEM_BYTES, tn * d * ELEM_BYTES,                     # sK, sV
        0 if config.sdp_swap else pds * tm * tn * ELEM_BYTES,         # sP (none: P^T stays in registers)
        pds * tm * tn * ELEM_BYTES,                                   # sdS
        tm * d * FP32_BYTES if config.dq_accum in ("bulk", "fragment") else 0,   # sdQ, the bulk reduce's tile
        q * row_stage_floats(tm) * FP32_BYTES if config.sdp_swap else 0,   # sLSE2
        q * row_stage_floats(tm) * FP32_BYTES if config.sdp_swap else 0,   # sDelta
    ]
    for size in buffers:
        offset = -(-offset // BUFFER_ALIGN) * BUFFER_ALIGN + size
    return -(-offset // BUFFER_ALIGN) * BUFFER_ALIGN  # the struct is as aligned as its buffers


def resources(config: Config, problem: AttentionProblem, device: Optional[DeviceDescription] = None) -> dict:
    device = device or REFERENCE_DEVICE
    return {
        "smem_bytes": smem_bytes(config, problem),
        "smem_limit_bytes": device.smem_per_block_bytes,
        "score_registers": score_registers(config),
        "accumulator_registers": accumulator_registers(config, problem.head_dim),
        "threads": THREADS,
    }


def heads_per_part(config: Config, problem: AttentionProblem) -> int:
    """Query heads per CTA: ceil(ratio / group_split), the kernel's `query_heads` (the last part of a
    group may hold fewer)."""
    return -(-problem.gqa_ratio // config.group_split)


def split_reasons(config: Config, problem: AttentionProblem) -> list[str]:
    """Why `group_split` cannot divide this problem's GQA groups: a part would hold no query head."""
    ratio = problem.gqa_ratio
    split = config.group_split
    if split == 1:
        return []
    if split > ratio:
        return [f"group_split={split} > the GQA ratio {ratio} (query heads per KV head): a part of a "
                f"group would hold no query head"]
    per_part = heads_per_part(config, problem)
    if (split - 1) * per_part >= ratio:
        return [f"group_split={split} leaves a part of the {ratio} query heads of a group empty "
                f"(ceil({ratio} / {split}) = {per_part} a part)"]
    return []


def resource_reasons(config: Config, problem: AttentionProblem,
                     device: Optional[DeviceDescription] = None) -> list[str]:
    """Every reason `config` cannot run `problem` in one block of `device` (default: the H200)."""
    if config.arch != KNOB_SET:
        return [f"configuration is for {config.arch}, not {KNOB_SET}"]
    if problem.head_dim not in SUPPORTED_HEAD_DIMS:
        return []  # can_implement says why
    res = resources(config, problem, device)
    reasons = []
    if config.sdp_swap and config.tile_n != 64 * MMA_WARPGROUPS:
        reasons.append(f"sdp_swap needs tile_n={64 * MMA_WARPGROUPS} (each MMA warpgroup owns 64 key "
                       f"rows of S^T); tile_n={config.tile_n}")
    if config.tile_m % WGMMA_M:
        if not config.sdp_swap:
            reasons.append(f"tile_m={config.tile_m} (not a multiple of {WGMMA_M}) needs sdp_swap: query "
                           f"rows can only be a wgmma's N (S^T = K Q^T)")
        if config.dq_accum == "atomic":
            reasons.append(f"tile_m={config.tile_m} computes dQ^T = K^T dS^T, which reaches the "
                           f"accumulator in fragment order or by a bulk path only (dq_accum 'bulk', "
                           f"'fragment' or 'fragment_atomic'); dq_accum={config.dq_accum!r}")
    score_limit = SCORE_REGISTER_LIMIT[config.sdp_swap]
    if res["score_registers"] > score_limit:
        reasons.append(f"registers: S and dP hold {res['score_registers']} fp32 registers per MMA "
                       f"thread > {score_limit} (sdp_swap={'on' if config.sdp_swap else 'off'})")
    if res["accumulator_registers"] > ACCUMULATOR_REGISTER_LIMIT:
        reasons.append(f"registers: S, dP, dK and dV hold {res['accumulator_registers']} fp32 registers "
                       f"per MMA thread > {ACCUMULATOR_REGISTER_LIMIT}")
    elif (not config.sdp_swap and res["accumulator_registers"] >= DIRECT_SPLIT_REGISTER_LIMIT
          and problem.causal and config.pds_stages > 1 and config.group_split > 1):
        # S and dP through shared memory leave no register for a split group's CTA with a causal
        # mask's block loop and two P/dS buffers besides (DIRECT_SPLIT_REGISTER_LIMIT)
        reasons.append(f"registers: S, dP, dK and dV hold {res['accumulator_registers']} fp32 registers per "
                       f"MMA thread, and a split group (group_split={config.group_split}) under a causal "
                       f"mask with two P/dS buffers needs more with sdp_swap off (at most "
                       f"{DIRECT_SPLIT_REGISTER_LIMIT - 1})")
    if res["smem_bytes"] > res["smem_limit_bytes"]:
        reasons.append(f"shared memory {res['smem_bytes']} B > {res['smem_limit_bytes']} B per block "
                       f"({(device or REFERENCE_DEVICE).name})")
    return reasons + split_reasons(config, problem)


def launch_grid(config: Config, problem: AttentionProblem) -> tuple[int, int, int]:
    """The main kernel's grid (kernel.py `__call__`): one CTA per (key block, part of a KV head's
    group, batch), key blocks fastest ("single"), outermost ("single_lpt"), or outermost within
    sections of groups, on one axis ("sectioned_lpt")."""
    n_blocks = -(-max(problem.seqlen_k, 1) // config.tile_n)
    head_slots = problem.heads_kv * config.group_split
    if config.scheduler == "single_lpt":
        return (head_slots, max(problem.batch, 1), n_blocks)
    if config.scheduler == "sectioned_lpt":
        return (n_blocks * head_slots * max(problem.batch, 1), 1, 1)
    return (n_blocks, head_slots, max(problem.batch, 1))


def launch_reasons(config: Config, problem: AttentionProblem,
                   device: Optional[DeviceDescription] = None) -> list[str]:
    """Why the main kernel's grid exceeds CUDA's limits on `device` (empty: it does not)."""
    limits = (device or REFERENCE_DEVICE).max_grid
    grid = launch_grid(config, problem)
    return [f"grid {axis} = {size} > {limit} ({config.scheduler})"
            for axis, size, limit in zip("xyz", grid, limits) if size > limit]


def reasons(config: Config, problem: AttentionProblem, device: Optional[DeviceDescription] = None) -> list[str]:
    """Every reason the backward cannot run `config` on `problem` (empty: it can): the problem, one
    block's resources, the grid."""
    why = can_implement(problem) + resource_reasons(config, problem, device)
    if config.arch == KNOB_SET and not why:
        why += launch_reasons(config, problem, device)
    return why


def validate(config: Config, problem: AttentionProblem, device: Optional[DeviceDescription] = None) -> None:
    why = reasons(config, problem, device)
    if why:
        raise ValueError(f"the sm90 backward cannot run {config.label()} on {problem.label()}: "
                         + "; ".join(why))
