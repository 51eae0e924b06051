"""exp2 on the FMA pipe: 2^x = 2^floor(x) * p(x - floor(x)), p a degree-3 minimax polynomial.

Both kernel families spend one MUFU.EX2 per score element, and the exp unit runs at 16 results per
clock per SM on sm_90 and sm_100. Where that unit, not the tensor core, bounds a key block (head
dim 64 on Hopper; every head dim on Blackwell), a few columns of each row go through this polynomial
instead, moving their exps onto the FMA pipe. p's relative error (~1e-4) sits below the 16-bit P it
feeds (fp16 keeps 11 bits, bf16 8).

Which columns: `poly_column(col, num_cols, poly_per_32)` spreads `poly_per_32` of every 32 columns of
a thread's row evenly, so a row of any length gets its share (a 20-column row at 4 per 32: 2).
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Float32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from .exp2_fit import EXP2_POLY, EXP2_POLY_CHUNK, EXP2_ROUND_MAGIC

# below this 2^x is exactly +0 through the polynomial path (see exp2_poly)
EXP2_POLY_FLOOR = -127.0


def poly_column(col: int, num_cols: int, poly_per_32: int) -> bool:
    """Whether a thread's column `col` (of `num_cols` in its row) takes the polynomial: `poly_per_32`
    of every 32, spread evenly, at least none and at most all."""
    del num_cols  # the share depends on the column alone; kept in the signature for readers
    return (col + 1) * poly_per_32 // EXP2_POLY_CHUNK != col * poly_per_32 // EXP2_POLY_CHUNK


@dsl_user_op
def add_to_exponent(rounded: Float32, mantissa: Float32, *, loc=None, ip=None) -> Float32:
    """bits(mantissa) + (bits(rounded) << 23): scales `mantissa` by 2^k where k sits in the low
    bits of `rounded`. One shift-and-add on the integer pipe."""
    return Float32(llvm.inline_asm(
        T.f32(),
        [Float32(rounded).ir_value(loc=loc, ip=ip), Float32(mantissa).ir_value(loc=loc, ip=ip)],
        "{\n\t.reg .b32 k, m;\n\tmov.b32 k, $1;\n\tmov.b32 m, $2;\n\tshl.b32 k, k, 23;\n\t"
        "add.s32 m, m, k;\n\tmov.b32 $0, m;\n\t}",
        "=f,f,f", has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@cute.jit
def exp2_poly(x: Float32) -> Float32:
    """2^x for x <= 2^22 by FMAs (scalar: Hopper has no packed f32 arithmetic).

    At or below -127 the result is exactly +0 (what a masked -inf needs): x clamps to -127,
    p(0) = 1.0, and 1.0's bits plus -127 << 23 wrap to 0."""
    magic = Float32(EXP2_ROUND_MAGIC)
    xc = cute.arch.fmax(x, Float32(EXP2_POLY_FLOOR))
    rounded = _add_round_down(xc, magic)
    frac = xc - (rounded - magic)  # in [0, 1), exact
    c0, c1, c2, c3 = (Float32(c) for c in EXP2_POLY)
    poly = c3 * frac + c2
    poly = poly * frac + c1
    poly = poly * frac + c0
    return add_to_exponent(rounded, poly)


@dsl_user_op
def _add_round_down(a: Float32, b: Float32, *, loc=None, ip=None) -> Float32:
    """a + b rounded toward -inf (add.rm.f32): the magic-number floor needs the directed rounding."""
    return Float32(llvm.inline_asm(
        T.f32(),
        [Float32(a).ir_value(loc=loc, ip=ip), Float32(b).ir_value(loc=loc, ip=ip)],
        "add.rm.f32 $0, $1, $2;",
        "=f,f,f", has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))
