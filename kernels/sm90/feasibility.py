"""What the sm90 kernel can run: the problems it implements, the resources a configuration uses and
every reason a configuration cannot run a problem within one block (shared memory, registers, layout).

The resource model mirrors the kernel's SharedStorage (kernel.py `shared_storage`) byte for byte:
three mbarrier arrays (Q full/empty per Q stage, K and V full/empty per K/V stage), then 1024-byte
aligned buffers sQ (q_stages x tile_m x D), sK (kv_stages x tile_n x D), sV (kv_stages x tile_n x Dv)
and sP (tile_m x tile_n, only when P goes through shared memory). O (tile_m x Dv, Dv <= D) is staged in
the current Q buffer.

Kept out of the source fingerprint (`SOURCE_FILES`): the model judges configurations, it does not
change what any of them compiles to, so tuned entries stay current when the model is recalibrated.
"""

from __future__ import annotations

from typing import Optional

from ..device import DeviceDescription, reference_device
from ..knobs import Config
from ..family import unsupported_by_family
from ..problem import AttentionProblem
from ..scheduling import PERSISTENT_SCHEDULERS
from .plan import REGISTER_SPLIT, SUPPORTED_HEAD_DIM_PAIRS, SUPPORTED_HEAD_DIMS

ARCH = "sm90"
REFERENCE_DEVICE = reference_device(ARCH)  # what a compile without a GPU is for
ELEM_BYTES = 2
BUFFER_ALIGN = 1024
# the register model's budget: the consumer's setmaxnreg minus a reserve for addresses, indices and
# softmax state
RESERVED_REGISTERS = {1: 40, 2: 24, 3: 32}
# P through shared memory without the overlap keeps more of the softmax live at once: in the sweep
# (results/sm90_register_table.json) it spills under the causal mask at 127 estimated registers with
# three consumer warpgroups (192 x 112 and 192 x 128 at D=128, 192 x 192 at D=64), where the others
# stay clean up to 128
SS_WITHOUT_OVERLAP_RESERVE = 2
# every head dim: the varlen O store spreads a row over `plan.varlen_threads_per_row` threads
VARLEN_HEAD_DIMS = SUPPORTED_HEAD_DIMS


def can_implement(problem: AttentionProblem) -> list[str]:
    unknown_dims = unsupported_by_family(problem, ARCH, SUPPORTED_HEAD_DIMS, SUPPORTED_HEAD_DIM_PAIRS)
    reasons = list(unknown_dims)
    if problem.batch < 1 or problem.seqlen_q < 1 or problem.seqlen_k < 1 or problem.heads_q < 1:
        reasons.append("empty problem: batch, sequence lengths and heads must be >= 1")
    return reasons


def _num_consumer_warpgroups(config: Config) -> int:
    return config.tile_m // 64


def smem_bytes(config: Config, problem: AttentionProblem) -> int:
    """Dynamic shared memory per CTA, the same arithmetic as the kernel's SharedStorage."""
    d, dv = problem.head_dim, problem.value_head_dim
    barriers = 8 * (2 * config.q_stages + 4 * config.kv_stages)
    offset = barriers
    buffers = [
        config.q_stages * config.tile_m * d * ELEM_BYTES,
        config.kv_stages * config.tile_n * d * ELEM_BYTES,
        config.kv_stages * config.tile_n * dv * ELEM_BYTES,
        config.tile_m * config.tile_n * ELEM_BYTES if config.pv_operand == "ss" else 0,
    ]
    for size in buffers:
        offset = -(-offset // BUFFER_ALIGN) * BUFFER_ALIGN + size
    return -(-offset // BUFFER_ALIGN) * BUFFER_ALIGN if offset % BUFFER_ALIGN else offset


def estimated_registers(config: Config, problem: AttentionProblem) -> int:
    """Accumulator registers per consumer thread: O (64 x Dv fp32 over 128 threads), S (64 x tile_n
    fp32) and what of P stays resident: with P in registers (rs) the 16-bit P feeds the value MMA
    while the next S arrives (half of S); through shared memory (ss) only a conversion chunk.

    Fitted to what ptxas reports over every tile shape, head dim, P operand, overlap and mask
    (`benchmarks/sm90_register_sweep.py`, table in `results/sm90_register_table.json`; tests/test_sm90_model.py
    holds the model to it): with three consumer warpgroups (160 registers) 192x128 at D=64 and
    192x80 at D=128 fit with P in registers, 192x96 at D=128 and 192x144 at D=64 spill. The same
    model holds at D=96, 192 and 256 (swept too; it admits nothing there that spills): with three
    consumer warpgroups D=96 fits 192x96 with P in registers (192x128 spills) and 192x128 with P
    through shared memory; D=256 fits nothing (O alone is 128 registers a thread: ptxas refuses
    192x64 with P in registers, and P through shared memory does not fit shared memory). With one or
    two consumer warpgroups shared memory, not registers, is the limit at D=192 and 256. Refused
    though clean: 192x112 (P in registers), 192x144 and 192x160 (P in shared memory) at D=96, 192x64
    (P in shared memory) at D=192."""
    regs_o = 64 * problem.value_head_dim // 128
    regs_s = 64 * config.tile_n // 128
    regs_p = regs_s // 2 if config.pv_operand == "rs" else regs_s // 8
    return regs_o + regs_s + regs_p


def register_budget(config: Config) -> int:
    wg = _num_consumer_warpgroups(config)
    reserve = RESERVED_REGISTERS[wg]
    if config.pv_operand == "ss" and not config.softmax_overlap:
        reserve += SS_WITHOUT_OVERLAP_RESERVE
    return REGISTER_SPLIT[wg][1] - reserve


def resources(config: Config, problem: AttentionProblem, device: Optional[DeviceDescription] = None) -> dict:
    """What the configuration uses beside the limits of `device` (default: the reference H200)."""
    device = device or REFERENCE_DEVICE
    return {
        "smem_bytes": smem_bytes(config, problem),
        "smem_limit_bytes": device.smem_per_block_bytes,
        "registers_per_consumer_thread": estimated_registers(config, problem),
        "register_budget": register_budget(config),
        "consumer_warpgroups": _num_consumer_warpgroups(config),
        "threads": 128 * (_num_consumer_warpgroups(config) + 1),
    }


def resource_reasons(config: Config, problem: AttentionProblem,
                     device: Optional[DeviceDescription] = None) -> list[str]:
    """Every reason this configuration cannot run this problem on `device` (default: the reference
    H200) within one block (shared memory, registers, layout); CUDA's grid limits are
    `launch_reasons`'."""
    if config.arch != ARCH:
        return [f"configuration is for {config.arch}, not {ARCH}"]
    reasons = []
    if unsupported_by_family(problem, ARCH, SUPPORTED_HEAD_DIMS, SUPPORTED_HEAD_DIM_PAIRS):
        return reasons  # can_implement says why
    res = resources(config, problem, device)
    if res["smem_bytes"] > res["smem_limit_bytes"]:
        reasons.append(f"shared memory {res['smem_bytes']} B > {res['smem_limit_bytes']} B per block "
                       f"({(device or REFERENCE_DEVICE).name})")
    if res["registers_per_consumer_thread"] > res["register_budget"]:
        reasons.append(
            f"registers: about {res['registers_per_consumer_thread']} accumulator registers per "
            f"consumer thread > budget {res['register_budget']} with "
            f"{res['consumer_warpgroups']} consumer warpgroup(s)")
    if config.pv_operand == "rs" and not config.softmax_overlap:
        reasons.append("pv_operand=rs without softmax_overlap: ptxas serialises the value wgmma for "
                       "some tile widths (seen at 128x80, D=128 and 128x96, D=64 under the causal "
                       "mask); overlap or P through shared memory avoid it")
    if config.tile_n % 16:
        reasons.append(f"tile_n={config.tile_n}: the value MMA's K must be a multiple of 16")
    if config.q_stages == 2 and config.scheduler not in PERSISTENT_SCHEDULERS:
        reasons.append(f"q_stages=2 needs a persistent scheduler ({'/'.join(PERSISTENT_SCHEDULERS)}): "
                       f"with one tile per CTA the second Q buffer is never used")
    ratio = problem.gqa_ratio
    if config.pack_gqa and problem.varlen:
        reasons.append("pack_gqa under varlen: a packed sequence's rows have no packed TMA view in the kernel")
    if config.pack_gqa:
        if ratio == 1:
            reasons.append("pack_gqa needs a GQA ratio > 1 (Hq == Hkv: nothing to pack)")
        elif config.tile_m % ratio:
            reasons.append(f"pack_gqa: GQA ratio {ratio} does not divide tile_m={config.tile_m} "
                           f"(a packed tile must hold whole groups of query heads)")
    return reasons
