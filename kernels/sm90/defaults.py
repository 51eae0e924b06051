"""The sm90 heuristic default configuration: the knobs' declared defaults plus per-problem rules.

Kept out of the source fingerprint (`SOURCE_FILES`): a rule picks among configurations, it does not
change what any configuration compiles to, so tuned database entries stay current when a rule moves.
"""

from __future__ import annotations

from ..knobs import Config
from ..problem import AttentionProblem

ARCH = "sm90"

TYPICAL_SM_COUNT = 132  # the H200's; the default's wave arithmetic only needs the order of magnitude


def default_config(problem: AttentionProblem) -> Config:
    """The knobs' declared defaults (128 x 128 tiles, P in registers with overlap, 2 K/V stages,
    rescale threshold 8, one CTA per tile), then per-problem rules. Each rule is what the H200's
    searches found best at the grid shapes (session 3's journal, `fa4tune search`, and
    `benchmarks/sm90_variants.py`; the numbers are GPU us, old default -> rule):

    - head dim 64: 192-row tiles (three consumer warpgroups), as flash-attn-4 does: 84.9 -> 80.1 us
      at B1 S2048 H32/8 full, 55.7 -> 48.6 causal (unless over 5 % of the rows would be padding);
      causal with 96-key blocks: 47.4 -> 44.1 us there (192 x 128 under the causal mask is the one
      tile where ptxas keeps the K/V stage index out of uniform registers and spends ~50 more
      instructions per unmasked block converting descriptors; results/h200/variants_d64c.json);
    - GQA packing when the ratio divides the tile rows (K/V loaded once per group);
    - short key ranges (<= 8 key blocks) over >= 2 waves of tiles: persistent with two Q stages,
      whose next Q and K/V load under this tile's softmax. Full masks: `static` (B16 S1024
      543.3 -> 492.9; B8 S512 H16 D64 29.9 -> 25.3). Causal: `static` when a head has >= 16 m-blocks
      (B16 S1024: 350.1 -> 313.1; `lpt` 342.3), else `lpt` (B8 S512 H16 D64: 24.3 -> 19.2; `static`
      25.9, because with few m-blocks a static CTA keeps meeting the same m-block);
    - otherwise causal, head dim 128, Sk <= 4096: 192 x 80 tiles, one CTA per tile longest first
      (`single_lpt`): B1 S1024 22.2 -> 21.6, B1 S4096 249.0 -> 233.9, B4 S2048 H64/8 572.0 -> 545.3
      (longer keys were not measured at this tile: they keep 128 x 128);
    - otherwise causal: `single_lpt` (B1 S1024: 27.5 with `single`, whose heavy tiles land in the
      tail in m order)."""
    config = Config.make(ARCH)
    ratio = problem.gqa_ratio
    # 192-row tiles when they pack whole query-head groups and under 5 % of their rows are padding
    rows_192 = problem.seqlen_q * (ratio if 192 % ratio == 0 else 1)
    fits_192 = -(-rows_192 // 192) * 192 <= rows_192 * 1.05
    if problem.head_dim <= 64 and fits_192 and (ratio == 1 or 192 % ratio == 0):
        config = config.replace(tile_m=192)
        if problem.causal:
            config = config.replace(tile_n=96)
    pack = ratio > 1 and config.tile_m % ratio == 0
    config = config.replace(pack_gqa=pack)
    rows = problem.seqlen_q * (ratio if pack else 1)
    m_blocks = -(-rows // config.tile_m)
    tiles = m_blocks * (problem.heads_kv if pack else problem.heads_q) * problem.batch
    short_keys = -(-problem.seqlen_k // config.tile_n) <= 8
    if short_keys and tiles >= 2 * TYPICAL_SM_COUNT:
        persistent = "lpt" if problem.causal and m_blocks < 16 else "static"
        config = config.replace(scheduler=persistent, q_stages=2)
    elif problem.causal:
        config = config.replace(scheduler="single_lpt")
        if problem.head_dim == 128 and problem.seqlen_k <= 4096 and fits_192 and (
                not pack or 192 % ratio == 0):
            config = config.replace(tile_m=192, tile_n=80)
    return config
