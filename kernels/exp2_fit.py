"""The constants of the FMA-pipe exp2 (`fast_exp2.py` for sm90, the sm100 kernel's own softmax and its
CPU emulation): declared once, free of the DSL so the emulation can read them.

p is a degree-3 fit of 2^f with c0 = 1 exactly, minimising the largest relative error (8.6e-5 in fp32
Horner form, below half an ulp of fp16's 2^-11), by iteratively reweighted least squares on 20,001
points. c0 = 1 makes x <= -127 (a masked -inf, clamped) come out as exactly +0: the bits of 1.0 plus
-127 << 23 wrap to zero; a c0 below 1 would wrap to a NaN pattern. p(f) < 2 on [0, 1).
"""

EXP2_POLY = (1.0, 0.6951166987419128, 0.22764527797698975, 0.07706677168607712)
# x + 1.5 * 2^23 rounded down leaves floor(x) in the low mantissa bits (|x| < 2^22)
EXP2_ROUND_MAGIC = 12582912.0
# the polynomial takes `exp2_poly_columns` of every this many key columns of a row
EXP2_POLY_CHUNK = 32
