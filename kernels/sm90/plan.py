"""What the sm90 kernel compiles in beside its knobs: the head dims it implements (and the (D, Dv)
pairs with a value head dim of its own) and the setmaxnreg
register split per consumer-warpgroup count. In the source fingerprint (`SOURCE_FILES`): the kernel
sets these registers; the feasibility model (`feasibility.py`, outside it) reads them.
"""

import math

SUPPORTED_HEAD_DIMS = (64, 96, 128, 192, 256)
# (D, Dv) with Dv != D: DeepSeek's query/key 192, value 128 (flash-attn-4 and FA3 run it on sm90). O is
# staged in the Q buffer, so Dv <= D
SUPPORTED_HEAD_DIM_PAIRS = ((192, 128),)
# setmaxnreg split (producer, consumer) per consumer-warpgroup count, which the kernel sets; the
# block's 64K registers must cover 128 * (producer + W * consumer)
REGISTER_SPLIT = {1: (56, 256), 2: (24, 240), 3: (32, 160)}


def varlen_threads_per_row(head_dim_v: int) -> int:
    """Threads that store one row of O under varlen (128-bit copies, row-predicated: the kernel's
    `store_o_rows`): as many of the row's head_dim / 8 copies as divide a warp, each thread taking the
    rest in turn (64: 8, 96: 4, 128: 16, 192: 8, 256: 32), so that the rows a pass covers, the
    consumer threads (2 x tile_m) over this, always divide tile_m."""
    return math.gcd(head_dim_v // 8, 32)
