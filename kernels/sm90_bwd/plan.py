"""What the sm90 backward compiles in beside its knobs: the head dims it implements, its warpgroups and
their setmaxnreg split. The kernel sets these; the feasibility model (`feasibility.py`) reads them."""

SUPPORTED_HEAD_DIMS = (64, 128)
DTYPES = ("fp16", "bf16")
MMA_WARPGROUPS = 2
# setmaxnreg split (producer warpgroup, each MMA warpgroup): 128 * (24 + 2 * 240) <= 64K
REGISTER_SPLIT = (24, 240)
THREADS = 128 * (1 + MMA_WARPGROUPS)
# a wgmma's M: 64 rows a warpgroup (a tile side that is no multiple of it can only be an N)
WGMMA_M = 64
# a TMA load's shared-memory destination must be 128-byte aligned: each Q/dO stage's LSE2 and D rows
# start at a multiple of 32 floats (at tile_m 80 a compact ring would put stage 1 at byte 320)
TMA_SMEM_ALIGN_BYTES = 128


def row_stage_floats(tile_m: int) -> int:
    """Floats from one stage's LSE2 (or D) rows to the next: tile_m rounded up to the TMA alignment."""
    align = TMA_SMEM_ALIGN_BYTES // 4
    return -(-tile_m // align) * align
