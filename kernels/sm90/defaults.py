"""The sm90 heuristic default configuration: the knobs' declared defaults plus per-problem rules.

Kept out of the source fingerprint (`SOURCE_FILES`): a rule picks among configurations, it does not
change what any configuration compiles to, so tuned database entries stay current when a rule moves.
"""

from __future__ import annotations

from typing import Optional

from ..device import DeviceDescription, apply_default_rules, reads_device, reference_device
from ..knobs import Config
from ..problem import AttentionProblem
from .feasibility import smem_bytes

ARCH = "sm90"


def _fits_192_rows(problem: AttentionProblem) -> bool:
    """192-row tiles pack whole query-head groups (where the ratio divides 192) and under 5 % of
    their rows are padding (head dim 128's 192 x 80 rule: at B2 S2000 H16 bf16 causal, 5.6 % padding,
    192 x 80 took 73.9 us against 128 x 128's 71.8)."""
    ratio = problem.gqa_ratio
    rows = problem.seqlen_q * (ratio if 192 % ratio == 0 else 1)
    return -(-rows // 192) * 192 <= rows * 1.05


def _padded_rows(problem: AttentionProblem, tile_m: int) -> int:
    """Query rows the tiles of `tile_m` rows cover over all heads, padding included, the heads of a
    group packed where the GQA ratio divides the tile (as `pack_gqa_when_it_divides` does)."""
    ratio = problem.gqa_ratio
    if ratio > 1 and tile_m % ratio == 0:
        return -(-problem.seqlen_q * ratio // tile_m) * tile_m * problem.heads_kv
    return -(-problem.seqlen_q // tile_m) * tile_m * problem.heads_q


def _192_rows_cover_no_more(problem: AttentionProblem) -> bool:
    """Head dims 64 and 96: 192-row tiles cover at most 5 % more rows than 128-row tiles would (padding and
    packing counted on both sides), rather than under 5 % padding beside the exact rows. On four
    shapes in neither the train nor the held-out set that the looser test flips (benchmarks/
    default_rule_ab.py, results/h200/wide/padding_rule_ab.json), 128 -> 192 rows: B4 S900 H24/8 bf16
    causal 44.2 -> 39.5 us (GQA 3: 192 packs the group, 128 cannot), B4 S2000 H16 bf16 causal 99.2
    -> 96.6, B4 S1000 H16/8 fp16 full 45.5 -> 42.9, B16 S900 H12/4 fp16 causal 84.1 -> 76.3."""
    return _padded_rows(problem, 192) <= _padded_rows(problem, 128) * 1.05


def _tiles(config: Config, problem: AttentionProblem) -> tuple[int, int]:
    """(m-blocks per head, tiles) of the configuration's tiling."""
    rows = problem.seqlen_q * (problem.gqa_ratio if config.pack_gqa else 1)
    m_blocks = -(-rows // config.tile_m)
    return m_blocks, m_blocks * (problem.heads_kv if config.pack_gqa else problem.heads_q) * problem.batch


def key_blocks_per_tile(config: Config, problem: AttentionProblem) -> int:
    """The most key blocks one tile visits, the measure of its work: every block of the keys, but under
    a sliding window bounded on both sides (causal bounds the right) only the blocks its rows' windows
    span, so a windowed tile costs the window, not the sequence (the kernel never loads the others)."""
    every = -(-problem.seqlen_k // config.tile_n)
    left, right = problem.window_left, problem.window_right
    if left is None or right is None:
        return every
    positions = -(-config.tile_m // (problem.gqa_ratio if config.pack_gqa else 1))
    return min(every, -(-(positions + left + right) // config.tile_n) + 1)   # +1: a span starting mid-block


def wide_tiles_at_head_dim_64(config: Config, problem: AttentionProblem) -> Config:
    """Head dim 64: 192-row tiles (three consumer warpgroups), as flash-attn-4 does: 84.9 -> 80.1 us
    at B1 S2048 H32/8 full, 55.7 -> 48.6 causal; also where the GQA ratio does not divide 192 (the
    heads then go unpacked: B1 S3000 H28/4 bf16 full 1.26x -> best of its search).
    Causal fp16: 96-key blocks (47.4 -> 44.1 us at B1 S2048 H32/8; 192 x 128 under the causal mask is
    the one fp16 tile where ptxas keeps the K/V stage index out of uniform registers and spends ~50
    more instructions per unmasked block converting descriptors; results/h200/variants_d64c.json).
    Causal bf16: 128-key blocks, whose unmasked block is the leanest per key (425 SASS instructions
    for 128 keys; 192 x 96 had its value wgmma serialised in bf16 until P was converted one K block
    at a time, kernel.py `write_p`). On the five bf16 D64 causal train shapes timed beside flash-attn-4
    before that change
    (results/h200/wide/d64_causal_variants.json), 192 x 64 with the exp2 polynomial (the rule
    before) -> this: B1 S4096 H32/8 164.6 -> 152.1 us (flash-attn-4 152.4), B8 S2048 H32/16 398.0 ->
    368.8 (365.3), B1 S16384 H16/16 1219.6 -> 1088.3 (1093.2), B1 S8192 H32/8 613.7 -> 551.6
    (554.3), B2 S12000 H16/2 1280.3 -> 1146.6 (1143.6); the polynomial on top costs 2-4 %."""
    if problem.head_dim > 64 or not _192_rows_cover_no_more(problem):
        return config
    if not problem.causal or problem.dtype == "bf16":
        return config.replace(tile_m=192)
    return config.replace(tile_m=192, tile_n=96)


def tiles_at_head_dim_96(config: Config, problem: AttentionProblem) -> Config:
    """Head dim 96: 192 x 128 tiles with P through shared memory (flash-attn-4's sm90 tile there,
    whose P-in-registers variant it measured at half the throughput; ours spills at 192 x 128 with P in
    registers, results/sm90_register_table.json), where 192-row tiles cover no more rows than 128-row
    ones (as at head dim 64); else the declared 128 x 128. Compiled on the CPU, not yet timed."""
    if problem.head_dim != 96 or not _192_rows_cover_no_more(problem):
        return config
    return config.replace(tile_m=192, tile_n=128, pv_operand="ss")


# Above head dim 128 the widest key block whose two-stage K/V ring and one 128-row Q buffer fit the
# H200's 227 KiB (flash-attn-4's sm90 tiles at these head dims too)
KEY_BLOCK_ABOVE_HEAD_DIM_128 = {192: 112, 256: 80}


def narrower_key_blocks_above_head_dim_128(config: Config, problem: AttentionProblem) -> Config:
    """Head dims 192 and 256: 128 x 112 and 128 x 80 tiles, P in registers with overlap; 128 x 128
    does not fit shared memory there, and three consumer warpgroups cannot hold O (D/2 registers a
    thread) beside S. Compiled on the CPU, not yet timed."""
    tile_n = KEY_BLOCK_ABOVE_HEAD_DIM_128.get(problem.head_dim)
    return config if tile_n is None else config.replace(tile_m=128, tile_n=tile_n)


def pack_gqa_when_it_divides(config: Config, problem: AttentionProblem) -> Config:
    """GQA packing when the ratio divides the tile rows (K/V loaded once per group); never under
    varlen, whose kernel has no packed view of a sequence's rows."""
    return config.replace(pack_gqa=(problem.gqa_ratio > 1 and config.tile_m % problem.gqa_ratio == 0
                                    and not problem.varlen))


@reads_device("sm_count", "smem_per_block_bytes")
def persistent_for_short_keys(config: Config, problem: AttentionProblem, device: DeviceDescription) -> Config:
    """Short key ranges (<= 8 key blocks) over >= 2 waves of tiles: persistent with two Q stages,
    whose next Q and K/V load under this tile's softmax. Full masks: `static` (B16 S1024 543.3 ->
    492.9; B8 S512 H16 D64 29.9 -> 25.3). Causal: `static` when a head has >= 16 m-blocks (B16 S1024:
    350.1 -> 313.1; `lpt` 342.3), else `lpt` (B8 S512 H16 D64: 24.3 -> 19.2; `static` 25.9, because
    with few m-blocks a static CTA keeps meeting the same m-block); but `static` again when the keys
    fit one block: every tile then costs the same, longest-first has nothing to order and its
    head-grouped order costs (B64 S128 H32/8 fp16 69.8 -> 56.2 us, B128 S128 H16/4 bf16 69.4 ->
    53.9; cuDNN 59.9 and 57.9; results/h200/wide/short_causal_variants.json). Not where the second Q
    buffer does not fit shared memory (head dims 192 and 256). Under a sliding window a tile's key
    range is its window's (`key_blocks_per_tile`): a narrow window over long sequences is short keys
    (not yet timed with a window)."""
    m_blocks, tiles = _tiles(config, problem)
    key_blocks = key_blocks_per_tile(config, problem)
    if key_blocks > 8 or tiles < 2 * device.sm_count:
        return config
    longest_first = problem.causal and m_blocks < 16 and key_blocks > 1
    persistent = config.replace(scheduler="lpt" if longest_first else "static", q_stages=2)
    return persistent if smem_bytes(persistent, problem) <= device.smem_per_block_bytes else config


def longest_first_for_varlen(config: Config, problem: AttentionProblem) -> Config:
    """Varlen, one CTA per tile: `single_lpt`, whatever the mask: each sequence's m-blocks from the last
    (the longest under a causal mask), in head groups sized to L2, the sequences in batch order
    (scheduler.py, `packed_varlen`). Not yet timed against `single`."""
    if problem.varlen and config.scheduler == "single":
        return config.replace(scheduler="single_lpt")
    return config


def longest_first_for_causal(config: Config, problem: AttentionProblem) -> Config:
    """Causal, one CTA per tile: longest first on a 1-D grid (`single_lpt`; B1 S1024: 27.5 us with
    `single`, whose heavy tiles land in the tail in m order)."""
    if problem.causal and config.scheduler == "single":
        return config.replace(scheduler="single_lpt")
    return config


def wide_tiles_for_causal_head_dim_128(config: Config, problem: AttentionProblem) -> Config:
    """Causal, head dim 128, one CTA per tile: 192 x 80 tiles (B1 S1024 22.2 -> 21.6 us, B1 S4096
    249.0 -> 233.9, B4 S2048 H64/8 572.0 -> 545.3; with longer keys, the 128 x 128 default in one
    bench (results/h200/s6/bench_warm_entries.json) -> this rule's default in the next
    (results/bench.json): B1 S8192 bf16 909.1 -> 836.9, B2 S16384 H8/1 bf16 1725.5 -> 1589.0)."""
    ratio = problem.gqa_ratio
    if (config.scheduler != "single_lpt" or problem.head_dim != 128
            or not _fits_192_rows(problem) or (config.pack_gqa and 192 % ratio)):
        return config
    return config.replace(tile_m=192, tile_n=80)


# applied in this order to the knobs' declared defaults; each measured on the H200's searches (the
# grid of the kernel issue, `fa4tune search`, and `benchmarks/sm90_variants.py`; GPU us, the old
# default -> the rule's), but the head-dim 96/192/256 tiles: chosen by the resource models and
# flash-attn-4's sm90 tiles, compiled clean on the CPU, not yet timed
DEFAULT_RULES = (wide_tiles_at_head_dim_64, tiles_at_head_dim_96, narrower_key_blocks_above_head_dim_128,
                 pack_gqa_when_it_divides, persistent_for_short_keys,
                 longest_first_for_varlen, longest_first_for_causal, wide_tiles_for_causal_head_dim_128)


def default_config(problem: AttentionProblem, device: Optional[DeviceDescription] = None) -> Config:
    """The knobs' declared defaults (128 x 128 tiles, P in registers with overlap, 2 K/V stages,
    rescale threshold 8, one CTA per tile), then `DEFAULT_RULES` in order, for `device` (default: the
    reference H200; the rules marked `reads_device` read it)."""
    return apply_default_rules(DEFAULT_RULES, Config.make(ARCH), problem, device or reference_device(ARCH))
