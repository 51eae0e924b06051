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
