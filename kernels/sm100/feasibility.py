"""What the sm100 kernel can run: the problems it implements, the resources a configuration uses, and
every reason a configuration cannot run a problem (TMEM, shared memory, a register model calibrated on
sm_100a compiles, the spills measured outside it, GQA packing, the K/V ring, the cluster pair).

Kept out of the source fingerprint (`SOURCE_FILES`): the model judges configurations, it does not
change what any of them compiles to, so compile results (the whole-space shards, the disk cache) stay
current when a measured corner is added.
"""

from __future__ import annotations

from typing import Optional

from .. import launch
from ..device import DeviceDescription, reference_device
from ..knobs import Config
from ..family import unsupported_by_family
from ..problem import AttentionProblem
from .plan import (REGS_MIN, SUPPORTED_HEAD_DIMS, TILE_M, TMEM_COLUMNS, KernelPlan, device_key,
                   kv_ring_deadlock, make_plan)

ARCH = "sm100"
REFERENCE_DEVICE = reference_device(ARCH)  # what a compile without a GPU is for


def can_implement(problem: AttentionProblem) -> list[str]:
    """Reasons this kernel family cannot run the problem under any configuration (empty: it can)."""
    reasons = unsupported_by_family(problem, ARCH, SUPPORTED_HEAD_DIMS)
    if problem.window is not None:
        reasons.append("the sm100 kernel has no sliding window (the sm90 kernel has)")
    if problem.softcap is not None:
        reasons.append("the sm100 kernel has no softcap (the sm90 kernel has)")
    if problem.varlen:
        reasons.append("the sm100 kernel has no variable-length batches (the sm90 kernel has)")
    return reasons


def resources(config: Config, problem: AttentionProblem, device: Optional[DeviceDescription] = None) -> dict:
    """What the configuration uses, from the same plan the kernel is built from, beside the limits of
    `device` (default: the reference B200)."""
    device = device or REFERENCE_DEVICE
    plan = make_plan(config, problem, device)
    return {
        "smem_bytes": plan.smem_bytes,
        "smem_limit_bytes": device.smem_per_block_bytes,
        "tmem_columns": plan.tmem_columns,
        "tmem_alloc_columns": plan.tmem_alloc_columns,
        "tmem_limit_columns": TMEM_COLUMNS,
        "threads": 512,
        "regs_softmax": plan.regs_softmax,
        "regs_correction": plan.regs_correction,
        "regs_other": plan.regs_other,
        "mma_lag": plan.mma_lag,
        "barriers": plan.num_barriers,
    }


def _softmax_register_need(tile_n: int, busy: bool) -> int:
    """Registers a softmax thread needs: its row of S (tile_n fp32; P goes to TMEM 32 keys at a
    time from 16 more) plus about 48 for addresses, loop state, the partial sums and the row
    statistics, 56 when the problem is causal or returns the LSE or the LPT order is used (more row
    and task arithmetic).

    Measured on sm_100a compiles of this kernel: tile_n=128 at 176 registers is clean
    without those; with causal + LSE + LPT it was clean in four variants (D=64 bf16 and D=128, GQA
    packed or not, tmem_stages 1-3, exp2_poly_columns 0 and 8) but spilled 8 B with one Q stage,
    one TMEM stage and rescale_tile=32 without packing; at 184 that case is clean. tile_n=160 (not
    a knob value) spills 120-588 B at every softmax_regs from 176 to 200, plain or busy, most of it
    in the masked-block loop: 208 and 216 > 200.
    """
    return tile_n + (56 if busy else 48)


# Fewest registers per correction thread at which each RESCALE_TILE compiled without spills, over
# sm_100a compiles of causal/LSE/LPT and plain problems (D=64 and 128, one and two Q stages): one
# O chunk in fp32 (the round trip and the epilogue are rolled loops) plus what the warpgroup keeps
# live across its task loop. rescale_tile=32 spilled 12 B at 80 (static and LPT alike); 64 spilled
# at 96 (4 B, D=128) and at 80 (40 B, D=64); 16 and 8 were clean at 64 even with causal+LSE+LPT.
_CORRECTION_REGISTER_NEED = {8: 64, 16: 64, 32: 96, 64: 112}


# Register limits at which configurations spilled although the row and correction rules above allow
# them: corners of ptxas's allocation, measured on sm_100a compiles of this kernel, each
# bracketed by clean neighbours (ptxas is not monotonic here). A corner names plan values (a tuple:
# any of them; `busy`: causal, LSE or the LPT order), what spilled, and how it was measured.
_MEASURED_SPILL_CORNERS = (
    (dict(busy=(True,), exp2_poly_columns=(8,), softmax_regs=(192,)),
     "exp2_poly_columns=8 with causal/LSE/LPT work spilled 24 B at softmax_regs=192",
     "D=64 and D=128; clean at 184 and 200, and without that work at 176-200"),
    (dict(two_cta=(True,), exp2_poly_columns=(8,), softmax_regs=(192,), q_stages=(1,), tile_n=(128,),
          tmem_stages=(2, 3)),
     "two_cta with exp2_poly_columns=8, one Q stage, 128-key blocks and tmem_stages >= 2 spilled "
     "12-24 B at softmax_regs=192",
     "16 B with 3 TMEM stages and 24 B with 2 at D=128, 12 B with 2 at D=64; clean at 176, 184 and 200, "
     "with two Q stages, one TMEM stage or 64-key blocks"),
    (dict(two_cta=(True,), exp2_poly_columns=(4,), softmax_regs=(176,), q_stages=(2,), tile_n=(128,)),
     "two_cta with exp2_poly_columns=4, two Q stages and 128-key blocks spilled 8-16 B at "
     "softmax_regs=176",
     "whatever rescale_tile, tmem_stages, kv_stages, scheduler or packing, in a 400-configuration sample "
     "on the H200 host's cores; clean at 184 and 192, with 0 or 8 columns, one Q stage, 64-key blocks "
     "or one CTA"),
    (dict(two_cta=(False,), exp2_poly_columns=(4,), softmax_regs=(176,), q_stages=(1,), tile_n=(128,),
          tmem_stages=(2,)),
     "exp2_poly_columns=4 with one Q stage, two TMEM stages and 128-key blocks spilled 16 B at "
     "softmax_regs=176",
     "4 of 4 in a 1,200-configuration CPU sample, whatever scheduler, packing, kv_stages, rescale_tile "
     "or threshold; clean with one or three TMEM stages, two Q stages, 0 or 8 columns"),
    (dict(two_cta=(True,), scheduler=("lpt",), exp2_poly_columns=(8,), softmax_regs=(184,), q_stages=(2,),
          tmem_stages=(1,), tile_n=(128,), rescale_tile=(32,)),
     "two_cta with the LPT order, exp2_poly_columns=8, two Q stages, one TMEM stage, 128-key blocks "
     "and rescale_tile=32 spilled 32 B at softmax_regs=184",
     "1 of 1,156 in whole-space shard 0/40, then whatever kv_stages, threshold or packing, fp16 or bf16; "
     "clean with the static or single order, rescale_tile=16, 0 or 4 columns, one Q stage, two TMEM "
     "stages, 64-key blocks, or one CTA (2-3 KV stages); clean at D=64 but rejected there too"),
)


def _measured_spill_reasons(plan: KernelPlan, busy: bool) -> list[str]:
    values = {"busy": busy, "two_cta": plan.two_cta, "exp2_poly_columns": plan.exp2_poly_columns,
              "softmax_regs": plan.softmax_regs, "q_stages": plan.q_stages, "tile_n": plan.tile_n,
              "tmem_stages": plan.tmem_stages, "scheduler": plan.scheduler, "rescale_tile": plan.rescale_tile}
    return [f"registers: {what} (measured: {how})" for fields, what, how in _MEASURED_SPILL_CORNERS
            if all(values[name] in allowed for name, allowed in fields.items())]


def _correction_register_need(rescale_tile: int) -> int:
    return _CORRECTION_REGISTER_NEED.get(rescale_tile, rescale_tile + 48)


def resource_reasons(config: Config, problem: AttentionProblem,
                     device: Optional[DeviceDescription] = None) -> list[str]:
    """Every reason this configuration cannot run this problem on `device` (default: the reference
    B200) within one block (TMEM, SMEM, registers, layout); CUDA's grid limits are `launch_reasons`'."""
    if config.arch != ARCH:
        return [f"configuration is for {config.arch}, not {ARCH}"]
    device = device or REFERENCE_DEVICE
    reasons = []
    plan = make_plan(config, problem, device)
    if plan.tmem_columns > TMEM_COLUMNS:
        reasons.append(
            f"TMEM: q_stages*head_dim + tmem_stages*tile_n = {plan.q_stages}*{plan.head_dim} + "
            f"{plan.tmem_stages}*{plan.tile_n} = {plan.tmem_columns} > {TMEM_COLUMNS} columns")
    if plan.smem_bytes > device.smem_per_block_bytes:
        reasons.append(f"shared memory {plan.smem_bytes} B > {device.smem_per_block_bytes} B per block "
                       f"({device.name})")
    if plan.regs_correction < REGS_MIN:
        reasons.append(f"registers: softmax_regs={plan.softmax_regs} leaves {plan.regs_correction} "
                       f"per correction thread (< {REGS_MIN})")
    lpt = plan.scheduler == "lpt"
    busy = problem.causal or problem.return_lse or lpt
    need_sm = _softmax_register_need(plan.tile_n, busy)
    if plan.softmax_regs < need_sm:
        reasons.append(f"registers: a softmax thread holds a {plan.tile_n}-column row of S and P "
                       f"(~{need_sm} registers{' with causal/LSE/LPT work' if busy else ''}) > "
                       f"softmax_regs={plan.softmax_regs}")
    reasons += _measured_spill_reasons(plan, busy)
    need_corr = _correction_register_need(plan.rescale_tile)
    if plan.regs_correction < need_corr:
        reasons.append(f"registers: the correction warpgroup needs ~{need_corr} for rescale_tile="
                       f"{plan.rescale_tile}, but softmax_regs={plan.softmax_regs} leaves it "
                       f"{plan.regs_correction}")
    if problem.head_dim % plan.rescale_tile:
        reasons.append(f"rescale_tile {plan.rescale_tile} does not divide head_dim {problem.head_dim}")
    if config.pack_gqa and TILE_M % problem.gqa_ratio:
        reasons.append(f"pack_gqa: the GQA ratio {problem.gqa_ratio} must divide the 128-row Q tile "
                       f"(TMA view (ratio, seqlen))")
    deadlock = kv_ring_deadlock(plan.q_stages, plan.tmem_stages, plan.kv_stages)
    if deadlock:
        reasons.append(deadlock)
    reasons += _two_cta_reasons(plan, problem)
    return reasons


def _two_cta_reasons(plan: KernelPlan, problem: AttentionProblem) -> list[str]:
    """What the cluster-pair mode (two_cta) cannot run."""
    if plan.two_cta and problem.causal:
        return ["two_cta: non-causal only (the pair runs one KV loop for both CTAs' rows; with a "
                "causal mask the two halves need different block ranges and masks)"]
    return []


# ------------------------------------------------------------------------------------------------
# the launch: the grid the kernel's scheduler launches, against the device's limits

def tile_counts(config: Config, problem: AttentionProblem) -> tuple[int, int, int]:
    """(m blocks, task heads, batch) the kernel's `__call__` builds its tile scheduler from: a task
    holds `q_stages` tiles of `tile_m` rows per CTA of its cluster pair (`two_cta`: two CTAs)
    (`launch.tile_counts`)."""
    return launch.tile_counts(problem, config.tile_m * config.q_stages * (2 if config.two_cta else 1),
                              config.pack_gqa)


def launch_grid(config: Config, problem: AttentionProblem,
                device: Optional[DeviceDescription] = None) -> tuple[int, int, int]:
    """The grid (x, y, z) the kernel launches for `problem` on `device`: its own tile scheduler on plain
    integers (`launch.scheduler_grid`; imports the DSL)."""
    from .scheduler import TileScheduler

    compiled_in = dict(device_key(device or REFERENCE_DEVICE))
    return launch.scheduler_grid(TileScheduler, config.scheduler, tile_counts(config, problem), problem,
                                 compiled_in["num_sms"], compiled_in["lpt_l2_bytes"],
                                 2 if config.two_cta else 1)


def launch_reasons(config: Config, problem: AttentionProblem,
                   device: Optional[DeviceDescription] = None) -> list[str]:
    """Why launching `config` on `problem` would exceed `device`'s grid limits (empty: it would not)."""
    return launch.grid_reasons(config, tile_counts(config, problem), device or REFERENCE_DEVICE,
                               lambda: launch_grid(config, problem, device))
