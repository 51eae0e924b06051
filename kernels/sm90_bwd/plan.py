"""What the sm90 backward compiles in beside its knobs: the head dims it implements, its warpgroups and
their setmaxnreg split. The kernel sets these; the feasibility model (`feasibility.py`) reads them."""

SUPPORTED_HEAD_DIMS = (64, 128)
DTYPES = ("fp16", "bf16")
MMA_WARPGROUPS = 2
# setmaxnreg split (producer warpgroup, each MMA warpgroup): 128 * (24 + 2 * 240) <= 64K
REGISTER_SPLIT = (24, 240)
THREADS = 128 * (1 + MMA_WARPGROUPS)
# The main kernel as a programmatic dependent launch of the preprocess (its CTAs start in the
# preprocess's tail and load K and V first), and each postprocess of the kernel before it (its CTAs
# start in that kernel's last wave and wait). Off: on an H100 (2026-12-07, the 14 grid shapes through
# autograd) the first link alone took 0.998x the plain launch's time, geomean, within the runs' noise
# (docs/backward.md);
# turning it on changes every entry's main-kernel SASS, so it would go with a re-tune of the packaged
# backward entries. `FA4_BWD_PROGRAMMATIC_LAUNCH=0|1` overrides it at compile time, for an A/B.
PROGRAMMATIC_LAUNCH = False
# Deterministic gradients: the order of a query block's dQ adds. Ascending (off): key block 0 first,
# the CTAs launched in each scheduler's order. Descending (on): the last key block that sees the query
# block first, the CTAs launched last key block first (`launch_order(descending=True)`) and each walking
# its masked (diagonal) query blocks first, so under a causal mask a key block's CTA reaches each query
# block after the block above it has added there (a block of slack) instead of just behind the block
# below it (in lockstep, each add waiting for a handoff: 1.27x the plain backward's time on an H100,
# 1.55x at B1 S1024 causal). Off: on an H100 (2026-12-07f) descending took 1.154x ascending's time,
# geomean over the 14 grid shapes: 0.92 at B1 S1024 causal, but up to 1.73 at the large causal ones,
# whose least-work CTAs (the last key blocks) it launches first. `FA4_BWD_DETERMINISTIC_ORDER=
# ascending|descending` overrides it at compile time, for an A/B.
DESCENDING_TURNS = False
# a wgmma's M: 64 rows a warpgroup (a tile side that is no multiple of it can only be an N)
WGMMA_M = 64
# a TMA load's shared-memory destination must be 128-byte aligned: each Q/dO stage's LSE2 and D rows
# start at a multiple of 32 floats (at tile_m 80 a compact ring would put stage 1 at byte 320)
TMA_SMEM_ALIGN_BYTES = 128


def row_stage_floats(tile_m: int) -> int:
    """Floats from one stage's LSE2 (or D) rows to the next: tile_m rounded up to the TMA alignment."""
    align = TMA_SMEM_ALIGN_BYTES // 4
    return -(-tile_m // align) * align


# scheduler "sectioned_lpt": the GQA groups (part of a KV head's group, batch) in sections whose rows
# (Q and dO in 16 bits, dQ's fp32 accumulator: 8 bytes a row and head dim column) total at most this
# many bytes, key block outermost (the longest first) within a section, the sections in order: the
# balanced tail of single_lpt inside each section, the L2 reuse of single across them (H100: longest
# first over the whole grid won up to 128 MiB of such rows and lost above, defaults.py)
SECTION_BYTES = 128 * 2**20
ROW_BYTES_PER_COLUMN = 2 + 2 + 4


def section_groups(rows_per_group, head_dim: int, maximum=max):
    """GQA groups a section holds: as many as `SECTION_BYTES` of rows admit, at least one.
    `rows_per_group` = query heads a CTA walks x Sq (an Int32 in the kernel, `maximum` cutlass.max)."""
    return maximum(SECTION_BYTES // (ROW_BYTES_PER_COLUMN * head_dim) // rows_per_group, 1)


def sectioned_tile(index, section, n_blocks, groups, minimum=min):
    """(key block, group) of the `index`-th CTA of a sectioned grid (n_blocks x groups CTAs in all):
    section s holds groups [s * section, s * section + its size), its CTAs key block outermost
    (every group's key block 0 first), the group fastest. In the kernel the values are Int32 and
    `minimum` is cutlass.min; the grid model (defaults.py) runs the same function on ints."""
    first = index // (section * n_blocks) * section     # the section's first group
    size = minimum(section, groups - first)
    rank = index - first * n_blocks                     # the CTA's place in its section
    n_block = rank // size
    return n_block, first + rank - n_block * size


def launch_order(scheduler: str, n_blocks: int, head_slots: int, batch: int, section: int = 1,
                 descending: bool = False):
    """The CTAs' tiles, (key block, head slot, batch), in the order the hardware hands them out: the
    kernel's grid (`kernel.py` `__call__`) x fastest. single: key blocks fastest, then head slots
    (a KV head's parts neighbours), then batches; single_lpt: head slots fastest, key block
    outermost; sectioned_lpt: `sectioned_tile` on a one-axis grid (`section` groups a section).
    `descending` (deterministic, `DESCENDING_TURNS`): the same order with the key blocks numbered
    from the last."""
    if descending:
        for n_block, slot, batch_idx in launch_order(scheduler, n_blocks, head_slots, batch, section):
            yield n_blocks - 1 - n_block, slot, batch_idx
        return
    if scheduler == "sectioned_lpt":
        for index in range(n_blocks * head_slots * batch):
            n_block, group = sectioned_tile(index, section, n_blocks, head_slots * batch)
            yield n_block, group % head_slots, group // head_slots
    elif scheduler == "single_lpt":
        for n_block in range(n_blocks):
            for batch_idx in range(batch):
                for slot in range(head_slots):
                    yield n_block, slot, batch_idx
    else:
        for batch_idx in range(batch):
            for slot in range(head_slots):
                for n_block in range(n_blocks):
                    yield n_block, slot, batch_idx
