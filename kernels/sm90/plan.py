"""What the sm90 kernel compiles in beside its knobs: the head dims it implements and the setmaxnreg
register split per consumer-warpgroup count. In the source fingerprint (`SOURCE_FILES`): the kernel
sets these registers; the feasibility model (`feasibility.py`, outside it) reads them.
"""

SUPPORTED_HEAD_DIMS = (64, 96, 128, 192, 256)
# setmaxnreg split (producer, consumer) per consumer-warpgroup count, which the kernel sets; the
# block's 64K registers must cover 128 * (producer + W * consumer)
REGISTER_SPLIT = {1: (56, 256), 2: (24, 240), 3: (32, 160)}
