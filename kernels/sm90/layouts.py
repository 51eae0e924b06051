"""Small layout and MMA helpers for the sm90 kernel (CuTe DSL; imported only when compiling).

Hopper wgmma accumulators hold, per thread, fragments shaped ((2, 2, N/8), MMA_M, MMA_N): two
rows (r and r + 8) and pairs of neighbouring columns. The softmax wants a (rows, columns) view of
that fragment, and the register-operand value MMA wants the same registers viewed as an A operand.
These are pure re-layouts of the same registers: no data moves.
"""

from __future__ import annotations

from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup
import cutlass.utils.hopper_helpers as hopper_helpers
from cutlass.tensor_utils import LayoutEnum


def permute_modes(t: cute.Tensor, order: list[int]) -> cute.Tensor:
    """The same data with its modes reordered."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=order))


def transpose_smem_view(t: cute.Tensor) -> cute.Tensor:
    """Swap the first two modes of a (possibly swizzled, staged) shared-memory tensor."""
    shape = (t.shape[1], t.shape[0], *t.shape[2:])
    order = (1, 0, *range(2, cute.rank(t)))
    return cute.composition(t, cute.make_ordered_layout(shape, order=order))


def smem_layout(dtype, rows: int, cols: int, stages: Optional[int] = None):
    """Row-major (columns contiguous) swizzled layout of a rows x cols tile, optionally staged."""
    atom = warpgroup.make_smem_layout_atom(
        hopper_helpers.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, cols), dtype)
    shape = (rows, cols) if stages is None else (rows, cols, stages)
    order = (0, 1) if stages is None else (0, 1, 2)
    return cute.tile_to_shape(atom, shape, order=order)


def acc_rows_cols(acc: cute.Tensor) -> cute.Tensor:
    """View an sm90 accumulator fragment ((2, 2, V), M, N) as ((2, M), (2, V, N)): rows x columns."""
    lay = cute.make_layout(acc.layout.shape)  # column-major over the fragment's own modes
    shape = ((lay.shape[0][1], lay.shape[1]), (lay.shape[0][0], *lay.shape[0][2:], lay.shape[2]))
    stride = ((lay.stride[0][1], lay.stride[1]),
              (lay.stride[0][0], *lay.stride[0][2:], lay.stride[2]))
    return cute.make_tensor(acc.iterator,
                            cute.composition(acc.layout, cute.make_layout(shape, stride=stride)))


def acc_as_operand_a(acc: cute.Tensor) -> cute.Tensor:
    """View an sm90 accumulator ((2, 2, V), M, N) as a 16-bit A-operand fragment ((2, 2, 2), M, (V/2, N))."""
    lay = acc.layout
    assert lay.shape[0][2] % 2 == 0, "the value MMA's K (tile_n) must be a multiple of 16"
    div = cute.logical_divide(lay, ((None, None, 2), None, None))
    view = cute.make_layout(
        ((div.shape[0][0], div.shape[0][1], div.shape[0][2][0]), div.shape[1],
         (div.shape[0][2][1], div.shape[2])),
        stride=((div.stride[0][0], div.stride[0][1], div.stride[0][2][0]), div.stride[1],
                (div.stride[0][2][1], div.stride[2])),
    )
    return cute.make_tensor(acc.iterator, view)


def wgmma(tiled_mma: cute.TiledMma, acc: cute.Tensor, frag_a: cute.Tensor, frag_b: cute.Tensor,
          zero_init: bool, wait_pending: int) -> None:
    """Issue one warpgroup MMA over all K blocks; wait until at most `wait_pending` groups are in
    flight (-1: do not wait)."""
    warpgroup.fence()
    atom = cute.make_mma_atom(tiled_mma.op)  # a fresh atom: its ACCUMULATE field is mutated below
    atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
    for k in range(cute.size(frag_a.shape[2])):
        cute.gemm(atom, acc, frag_a[None, None, k], frag_b[None, None, k], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()
    if const_expr(wait_pending >= 0):
        warpgroup.wait_group(wait_pending)


def pack_rows(t: cute.Tensor, ratio: int, head_mode: int, heads_kv) -> cute.Tensor:
    """Fold the `ratio` query heads of one KV head into the row mode.

    (S, [D,] Hq, B) -> ((ratio, S), [D,] Hkv, B): row r of a KV head's packed view is query head
    kv_head * ratio + r % ratio at sequence position r // ratio.
    """
    head_stride = t.stride[head_mode]
    shape = ((ratio, t.shape[0]), *[t.shape[i] for i in range(1, head_mode)], heads_kv,
             *[t.shape[i] for i in range(head_mode + 1, cute.rank(t))])
    stride = ((head_stride, t.stride[0]), *[t.stride[i] for i in range(1, head_mode)],
              head_stride * ratio, *[t.stride[i] for i in range(head_mode + 1, cute.rank(t))])
    return cute.make_tensor(t.iterator, cute.make_layout(shape, stride=stride))


def packed_tma_atom(op, t: cute.Tensor, smem_one_stage, tile_rows: int, head_dim: int, ratio: int):
    """TMA atom for a row-packed Q or O view, keeping the descriptor 4-D.

    The global tensor (S, D, Hq, B) is regrouped as ((Hq, S), D, B) and tiled by
    ((ratio, tile_rows / ratio), D); the coordinate tensor is then re-expressed as
    ((ratio, S), D, Hkv, B) so that kernels index it like the unpacked case.
    """
    assert tile_rows % ratio == 0
    heads_first = permute_modes(t, [2, 1, 0, 3])  # (Hq, D, S, B)
    heads_first = permute_modes(heads_first, [0, 2, 1, 3])  # (Hq, S, D, B)
    grouped = cute.group_modes(heads_first, 0, 2)  # ((Hq, S), D, B)
    atom, coords = cpasync.make_tiled_tma_atom(
        op, grouped, smem_one_stage, ((ratio, tile_rows // ratio), head_dim))
    shape = ((ratio, coords.shape[0][1]), coords.shape[1], coords.shape[0][0] // ratio,
             coords.shape[2])
    stride = ((coords.stride[0][0], coords.stride[0][1]), coords.stride[1],
              coords.stride[0][0] * ratio, coords.stride[2])
    return atom, cute.make_tensor(coords.iterator, cute.make_layout(shape, stride=stride))


def tma_copier(atom, smem: cute.Tensor, gmem: cute.Tensor, smem_staged: bool, gmem_tiled: bool):
    """Partition a TMA copy; returns (smem view, gmem view) whose last mode (if any) selects the
    stage / tile, and whose first mode is the TMA atom's."""
    smem_rank = cute.rank(smem) - (1 if smem_staged else 0)
    gmem_rank = cute.rank(gmem) - (1 if gmem_tiled else 0)
    s, g = cpasync.tma_partition(atom, 0, cute.make_layout(1),
                                 cute.group_modes(smem, 0, smem_rank),
                                 cute.group_modes(gmem, 0, gmem_rank))
    return s, g


def store_atom_16b(dtype):
    """stmatrix (four 8x8 matrices per warp) for 16-bit register -> shared-memory stores."""
    return cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4),
                               dtype)
