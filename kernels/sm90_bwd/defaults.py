"""The sm90 backward's default configuration: what an untuned problem runs.

Kept out of the backward's source fingerprint (as the forward's rules are out of theirs): a rule picks
among configurations, it does not change what any configuration compiles to.

Every knob but `group_split` comes from timings beside flash-attn-4's backward (the declared defaults
in `fa4.kernels.knobs` are the kernel's plain form, 2.0-2.8x slower):
- S^T/dP^T swapped, dQ by TMA reduce-add, two P/dS buffers, two Q/dO stages, 128 keys a CTA: each
  the faster value of its knob on every shape timed (H200, `results/h200/training/2026-12-03b/`,
  `benchmarks/sm90_bwd_configs.py` over every admitted configuration);
- dQ staged in fragment order at head dim 64, row order (bulk) at 128: fragment order was faster on
  4 of 5 head-dim-64 shapes on the H200 (by 2-7 %, back-to-back calls,
  `results/h200/training/2026-12-06/bwd_fragment`) and on 3 of the grid's 4 on the H100 (by 0.6-3.4 %,
  the fourth 0.6 % slower; CUDA-graph replay, `results/h100/training/2026-12-06-loops/`); at head dim
  128 faster on some shapes, slower on others (by up to 5 %) in both;
- 80 query rows a block at head dim 128, with either mask (flash-attn-4 takes 80 without a mask,
  64 with one): faster than 64 rows on 19 of 22 shapes at head dim 128 on the H100 (by 2-18 %;
  3-4 % slower at B16 S1024 H32/8 and B1 S16384 H16/2 causal longest first and B3 S3000 H24/8
  causal), `results/h100/training/2026-12-06/`; 128 rows at head dim 64
  (1.05-1.16x faster than 64 there, H200; 80 was slower at head dim 64 on the H100);
- under a causal mask with GQA, longest first within sections of groups whose rows fit 128 MiB
  (sectioned_lpt: longest first's balance, the plain order's L2 reuse between sections); with one
  query head a KV head (MHA), the longest key block first (single_lpt) while Q, dO and dQ's
  accumulator stream at most `LONGEST_FIRST_STREAMED_BYTES`, else the plain order. The plain order
  without a mask (every key block equally long; longest first took 2x at B16 S1024 full, H100).
  H200, every fast-space configuration on 26 shapes (`results/h200/training/2026-12-06/bwd_space`):
  over its 17 causal shapes the default's time / the best configuration's went from geomean 1.075
  (worst 1.25) to 1.029 (worst 1.16), 14 of 17 within 5 %; leave-one-out over the candidate rules
  (the order rule x the split floor below) 1.042. The MHA exception rests on one large shape: B16
  S2048 H16/16 D64 causal, where any longest-first order took 1.25-1.28x the plain order (132 CTAs
  side by side each streaming its own head's rows). Before (H100, no sectioned order timed): the
  plain order beat longest first on 10 of 12 causal shapes of 211-512 MiB.

`group_split` (how many CTAs share a key block's GQA group) comes from a model of the grid,
`split_makespan` below, over splits that leave a CTA at most `MAX_HEADS_PER_CTA` query heads: the
model splits where one CTA per group leaves SMs idle or one long CTA ends last (B1 S1024 H32/8 runs 64
CTAs on 132 SMs unsplit); the floor is timed, not modelled (GQA 8, below).
"""

from __future__ import annotations

import heapq
from typing import Optional

from ..device import DeviceDescription
from ..knobs import Config, knob
from ..problem import AttentionProblem
from .feasibility import KNOB_SET, REFERENCE_DEVICE, heads_per_part, launch_grid, split_reasons
from .plan import ROW_BYTES_PER_COLUMN, SECTION_BYTES, launch_order, section_groups

# The grid model's costs, in units of one (query block, key block) step of the main loop. A CTA's
# fixed part (K/V load, pipeline fill, epilogue) is about one step; a split CTA's fp32 reduce-add of
# dK and dV (2 x tile_n x D x 4 bytes into L2) about one more. Whole-problem costs of a split (zeroing
# the fp32 accumulators, the postprocess that converts them) are HBM traffic, priced through
# STEP_FLOP_RATE: one SM ran 3.2 us a step (10.5 MFLOP, 64 x 128 at head dim 128) in our default at
# B4 S2048 H16/4 causal on the H200 (425.7 us for 17,408 steps on 132 SMs), 3.3 TFLOP/s a SM.
CTA_FIXED_STEPS = 1.0
SPLIT_REDUCE_STEPS = 1.0
STEP_FLOP_RATE = 3.3e12       # FLOP/s of one SM in the block loop
HBM_BYTES_PER_SECOND = 4.0e12  # the H200's 4.8 TB/s, at the rate large copies reach
# a larger split must beat the smaller by this much in the model (its costs the model leaves out:
# more K/V loads, more reduce traffic in L2)
SPLIT_MARGIN = 0.03
# longest first (single_lpt) under a causal mask only while Q, dO and dQ's accumulator stream at most
# this many bytes (`streamed_bytes`): past it, the plain order's L2 reuse is worth more than the
# balanced tail. H100, tile_m 80, the causal shapes of `results/h100/training/2026-12-06/`: longest
# first was faster on all 6 of 128 MiB or less (B1 S4096 H32/8: 817 us against 1003), the plain order
# on 10 of 12 of 211-512 MiB (B16 S2048 H16/16 D64: 976 against 1620), 2 % slower on the other two.
# The same evidence sizes sectioned_lpt's sections (`plan.SECTION_BYTES`): one budget.
LONGEST_FIRST_STREAMED_BYTES = SECTION_BYTES
# at or above this many CTAs per SM unsplit, the tail the model could shorten is at most a step or so
# of many: no split beyond the floor (and no simulation of a large grid)
WIDE_GRID_CTAS_PER_SM = 4
# a CTA walks at most this many query heads of its group (group_split >= ratio / 4): at GQA 8 two parts
# were faster than one wherever it was timed, which the grid model does not see (it prices no L2):
# H200 sectioned, B4 S2048 H64/8 causal 1.08x unsplit / split 2, B2 S16384 H8/1 1.07x, B1 S16384 H16/2
# 1.06x (`bwd_space`); H100 longest first, B2 S16384 H8/1 5169 us unsplit, 5033 split 2, 4748 split 4
# (results/h100/training/2026-12-06/bwd_split). GQA 4 ran fastest unsplit on 7 of 9 large shapes.
MAX_HEADS_PER_CTA = 4


def default_config(problem: AttentionProblem, device: Optional[DeviceDescription] = None) -> Config:
    """The configuration an untuned problem runs on `device` (default: the H200): the module
    docstring's choices, then `group_split` by `split_makespan`."""
    config = Config.make(KNOB_SET, tile_m=128 if problem.head_dim <= 64 else 80, tile_n=128, q_stages=2,
                         dq_accum="fragment" if problem.head_dim <= 64 else "bulk", sdp_swap=True, pds_stages=2,
                         scheduler=scheduler_for(problem))
    return config.replace(group_split=group_split_for(config, problem, device))


def scheduler_for(problem: AttentionProblem) -> str:
    """The order of key blocks (the module docstring): sectioned longest first under a causal mask
    with GQA; with MHA longest first while the streamed rows are small; the plain order without one."""
    if not problem.causal:
        return "single"
    if problem.gqa_ratio > 1:
        return "sectioned_lpt"
    return "single_lpt" if streamed_bytes(problem) <= LONGEST_FIRST_STREAMED_BYTES else "single"


def streamed_bytes(problem: AttentionProblem) -> int:
    """Bytes every key block's CTA streams through: Q and dO (16-bit) and dQ's fp32 accumulator, over
    all query rows and heads. Longest first runs the key blocks of many groups at once, each reading
    its group's share; the plain order runs one group's key blocks side by side over the same rows."""
    return max(problem.batch, 1) * problem.heads_q * problem.seqlen_q * problem.head_dim * ROW_BYTES_PER_COLUMN


def group_split_for(config: Config, problem: AttentionProblem,
                    device: Optional[DeviceDescription] = None) -> int:
    """The `group_split` whose modelled backward time (`split_makespan`) is least among those that
    leave a CTA at most `MAX_HEADS_PER_CTA` query heads (the smallest such is the floor), a larger
    split taken only when it beats every smaller one by `SPLIT_MARGIN`."""
    sm_count = (device or REFERENCE_DEVICE).sm_count
    splits = [s for s in knob(KNOB_SET, "group_split").choices
              if not split_reasons(config.replace(group_split=s), problem)]
    floor = next((s for s in splits if heads_per_part(config.replace(group_split=s), problem)
                  <= MAX_HEADS_PER_CTA), splits[-1])
    lowest = config.replace(group_split=floor)
    grid = launch_grid(lowest, problem)
    if grid[0] * grid[1] * grid[2] >= WIDE_GRID_CTAS_PER_SM * sm_count:
        return floor
    best_split, best_seconds = floor, split_makespan(lowest, problem, sm_count)
    for split in splits:
        candidate = config.replace(group_split=split)
        if split <= floor:
            continue
        seconds = split_makespan(candidate, problem, sm_count)
        if seconds < best_seconds * (1 - SPLIT_MARGIN):
            best_split, best_seconds = split, seconds
    return best_split


def key_block_steps(config: Config, problem: AttentionProblem) -> list[int]:
    """Query blocks each key block visits for one query head (the kernel's `query_block_range`)."""
    tm, tn = config.tile_m, config.tile_n
    m_max = -(-max(problem.seqlen_q, 1) // tm)
    n_blocks = -(-max(problem.seqlen_k, 1) // tn)
    offset = problem.seqlen_k - problem.seqlen_q
    steps = []
    for n_block in range(n_blocks):
        m_min = max(n_block * tn - offset, 0) // tm if problem.causal else 0
        steps.append(max(m_max - m_min, 0))
    return steps


def split_makespan(config: Config, problem: AttentionProblem, sm_count: int) -> float:
    """Modelled seconds of the main kernel and, when split, of the work a split adds: the grid's CTAs
    in launch order, each given to the SM that frees first (one CTA an SM: the kernel takes all of
    one's registers), a CTA costing its steps (query heads x query blocks) plus `CTA_FIXED_STEPS`
    (+ `SPLIT_REDUCE_STEPS` when split); plus, when split, zeroing, reducing into and converting the
    fp32 dK/dV accumulators at HBM speed."""
    steps = key_block_steps(config, problem)
    ratio = problem.gqa_ratio
    split = config.group_split
    per_part = heads_per_part(config, problem)
    part_heads = [min(per_part, ratio - part * per_part) for part in range(split)]
    fixed = CTA_FIXED_STEPS + (SPLIT_REDUCE_STEPS if split > 1 else 0.0)

    def costs():   # in launch order
        n_blocks, slots = len(steps), problem.heads_kv * split
        section = section_groups(per_part * max(problem.seqlen_q, 1), problem.head_dim)
        for n_block, slot, _ in launch_order(config.scheduler, n_blocks, slots, max(problem.batch, 1), section):
            yield part_heads[slot % split] * steps[n_block] + fixed

    free_at = [0.0] * sm_count
    for cost in costs():
        heapq.heapreplace(free_at, free_at[0] + cost)
    step_seconds = 2 * 5 * config.tile_m * config.tile_n * problem.head_dim / STEP_FLOP_RATE
    seconds = max(free_at) * step_seconds
    if split > 1:
        accumulator_bytes = 2 * max(problem.batch, 1) * problem.seqlen_k * problem.heads_kv * problem.head_dim * 4
        # zeroed (write), converted (read fp32, write 16 bits): 2.5x their bytes; the reduce-adds
        # land in L2 with the steps
        seconds += accumulator_bytes * 2.5 / HBM_BYTES_PER_SECOND
    return seconds
