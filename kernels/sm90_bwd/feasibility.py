"""What the sm90 backward can run: the problems it implements, the resources a configuration uses and
every reason a configuration cannot run a problem in one block (shared memory, registers). The one
check: `compile_backward`, the tests, the benchmarks and the runtime all ask `reasons`.

Shared memory mirrors the main kernel's SharedStorage (kernel.py `shared_storage`) byte for byte: the
mbarrier arrays (Q/dO full and empty per stage, K/V full and empty), then 1024-byte aligned buffers
sQ and sdO (q_stages x tile_m x D each), sK and sV (tile_n x D each), sP and sdS (tile_m x tile_n
each). The test holds it to the traced struct (tests/test_sm90_bwd_compile.py).

Registers: the fp32 accumulators one MMA thread holds (`accumulator_registers`), against limits
calibrated on ptxas (the tests compile what the limits admit clean and what they refuse with spills).
"""

from __future__ import annotations

from typing import Optional

from ..device import DeviceDescription, reference_device
from ..knobs import Config
from ..problem import AttentionProblem
from .plan import DTYPES, MMA_WARPGROUPS, SUPPORTED_HEAD_DIMS, THREADS

KNOB_SET = "sm90_bwd"
REFERENCE_DEVICE = reference_device("sm90")
ELEM_BYTES = 2
BUFFER_ALIGN = 1024
# fp32 accumulator registers per MMA thread under setmaxnreg's 240: S and dP together stay live
# through the elementwise part beside dK, dV and the wgmma descriptors (128 x 128 tiles, 128 of
# them, spill at head dim 64), and all four together (S, dP, dK, dV)
SCORE_REGISTER_LIMIT = 64
ACCUMULATOR_REGISTER_LIMIT = 192


def can_implement(problem: AttentionProblem) -> list[str]:
    """Reasons no configuration of the backward can run the problem."""
    reasons = []
    if problem.head_dim not in SUPPORTED_HEAD_DIMS:
        reasons.append(f"head_dim={problem.head_dim} is not one of {SUPPORTED_HEAD_DIMS} (sm90 backward)")
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
    """Dynamic shared memory per CTA: the arithmetic of the kernel's SharedStorage."""
    d = problem.head_dim
    offset = 8 * (2 * config.q_stages + 2)  # mbarriers: Q/dO full + empty per stage, K/V full + empty
    buffers = [config.q_stages * config.tile_m * d] * 2 + [config.tile_n * d] * 2 \
        + [config.tile_m * config.tile_n] * 2
    for elems in buffers:
        offset = -(-offset // BUFFER_ALIGN) * BUFFER_ALIGN + elems * ELEM_BYTES
    return offset


def resources(config: Config, problem: AttentionProblem, device: Optional[DeviceDescription] = None) -> dict:
    device = device or REFERENCE_DEVICE
    return {
        "smem_bytes": smem_bytes(config, problem),
        "smem_limit_bytes": device.smem_per_block_bytes,
        "score_registers": score_registers(config),
        "accumulator_registers": accumulator_registers(config, problem.head_dim),
        "threads": THREADS,
    }


def resource_reasons(config: Config, problem: AttentionProblem,
                     device: Optional[DeviceDescription] = None) -> list[str]:
    """Every reason `config` cannot run `problem` in one block of `device` (default: the H200)."""
    if config.arch != KNOB_SET:
        return [f"configuration is for {config.arch}, not {KNOB_SET}"]
    if problem.head_dim not in SUPPORTED_HEAD_DIMS:
        return []  # can_implement says why
    res = resources(config, problem, device)
    reasons = []
    if res["score_registers"] > SCORE_REGISTER_LIMIT:
        reasons.append(f"registers: S and dP hold {res['score_registers']} fp32 registers per MMA "
                       f"thread > {SCORE_REGISTER_LIMIT}")
    if res["accumulator_registers"] > ACCUMULATOR_REGISTER_LIMIT:
        reasons.append(f"registers: S, dP, dK and dV hold {res['accumulator_registers']} fp32 registers "
                       f"per MMA thread > {ACCUMULATOR_REGISTER_LIMIT}")
    if res["smem_bytes"] > res["smem_limit_bytes"]:
        reasons.append(f"shared memory {res['smem_bytes']} B > {res['smem_limit_bytes']} B per block "
                       f"({(device or REFERENCE_DEVICE).name})")
    return reasons


def reasons(config: Config, problem: AttentionProblem, device: Optional[DeviceDescription] = None) -> list[str]:
    """Every reason the backward cannot run `config` on `problem` (empty: it can)."""
    return can_implement(problem) + resource_reasons(config, problem, device)


def validate(config: Config, problem: AttentionProblem, device: Optional[DeviceDescription] = None) -> None:
    why = reasons(config, problem, device)
    if why:
        raise ValueError(f"the sm90 backward cannot run {config.label()} on {problem.label()}: "
                         + "; ".join(why))
