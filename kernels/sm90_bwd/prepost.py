"""The backward's two small kernels around the main one (CuTe DSL; imported only when compiling).

- `Preprocess`: per query row, D = sum_d dO * O in fp32, and the row's LSE in log2 units for the
  main kernel's exp2. Both go to (B, Hq, Sq_padded) fp32 workspaces whose rows are padded to a
  multiple of the main kernel's tile_m, so the main kernel reads them without bounds checks: a padding
  row, and a row that sees no key (LSE = -inf), gets LSE2 = +inf (so P = exp2(S * scale_log2 -
  LSE2) = 0 without a branch) and D = 0. It also zeroes the row's fp32 dQ accumulator, which the main
  kernel adds into (as flash-attn-4's preprocess does): the same bytes a memset would write, without
  a kernel of its own between this one and the main one.
- `FragmentPostprocess` (dq_accum="fragment"): the same conversion from an accumulator in the main
  kernel's fragment order (its class docstring).
- `Postprocess`: dQ = dQ_accum * softmax_scale in the inputs' dtype. The scale is applied here, once
  per element, rather than to every key block's dS K product before its atomics (the same value up to
  fp32 rounding of the sum).

Both: one thread per 8 contiguous elements of a row (one 16-byte load of 16-bit data), `D / 8` threads
per row reduce with shuffles; a CTA of 128 threads covers `128 * 8 / D` rows of one (head, batch).
"""

from __future__ import annotations

import math

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from ..sm90 import layouts as L

LOG2_E = math.log2(math.e)
THREADS = 128
ELEMS_PER_THREAD = 8  # 16 bytes of 16-bit data


def rows_per_cta(head_dim: int) -> int:
    return THREADS * ELEMS_PER_THREAD // head_dim


class _RowKernel:
    """A kernel over query rows: `threads_per_row` threads per row of `head_dim` elements, `rows`
    rows per CTA (module docstring). `programmatic_launch` (`plan.PROGRAMMATIC_LAUNCH`): the preprocess
    lets the main kernel start as its programmatic dependent; a postprocess is the programmatic
    dependent of the kernel before it."""

    def __init__(self, *, dtype: str, head_dim: int, programmatic_launch: bool = False):
        self.dtype = {"fp16": cutlass.Float16, "bf16": cutlass.BFloat16}[dtype]
        self.head_dim = head_dim
        self.threads_per_row = head_dim // ELEMS_PER_THREAD
        self.rows = rows_per_cta(head_dim)
        self.programmatic_launch = programmatic_launch


@cute.jit
def follow_the_kernel_before(programmatic_launch: cutlass.Constexpr):
    """A postprocess launched as the programmatic dependent of the kernel before it (the main kernel, or
    a split group's dK converter before the dV one): its CTAs may start while that kernel's last ones
    run, so nothing it wrote is read before it has completed. It lets its own dependent (the next
    converter) start at once, as the main kernel lets it."""
    if const_expr(programmatic_launch):
        cute.arch.griddepcontrol_launch_dependents()
        cute.arch.griddepcontrol_wait()


class Preprocess(_RowKernel):
    """D = rowsum(dO * O) and LSE2 = LSE * log2(e), rows padded (module docstring)."""

    @cute.jit
    def __call__(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mLSE2: cute.Tensor,
                 mDelta: cute.Tensor, mdQaccum: cute.Tensor, stream: cuda.CUstream):
        """O, dO (B, Sq, Hq, D); LSE (B, Hq, Sq) fp32; LSE2, Delta (B, Hq, Sq_padded) fp32 (written);
        dQ_accum (B, Sq, Hq, D) fp32, or (B, Sq_padded, Hq, D) for dq_accum="fragment" (zeroed)."""
        if const_expr(mO.element_type != self.dtype or mdO.element_type != self.dtype):
            raise TypeError("O and dO must have the kernel's dtype")
        if const_expr(mdQaccum.element_type != Float32):
            raise TypeError("dQ_accum must be fp32")
        mO, mdO, mdQaccum = [L.permute_modes(t, [1, 3, 2, 0]) for t in (mO, mdO, mdQaccum)]  # (Sq, D, Hq, B)
        mLSE, mLSE2, mDelta = [L.permute_modes(t, [2, 1, 0]) for t in (mLSE, mLSE2, mDelta)]
        padded_rows = mLSE2.shape[0]
        grid = ((padded_rows + self.rows - 1) // self.rows, mO.shape[2], mO.shape[3])
        self.kernel(mO, mdO, mLSE, mLSE2, mDelta, mdQaccum).launch(grid=grid, block=[THREADS, 1, 1],
                                                                   stream=stream)

    @cute.kernel
    def kernel(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mLSE2: cute.Tensor,
               mDelta: cute.Tensor, mdQaccum: cute.Tensor):
        if const_expr(self.programmatic_launch):
            # the main kernel's CTAs may start once every CTA here has started (they wait for this
            # grid's end before reading what it writes)
            cute.arch.griddepcontrol_launch_dependents()
        tidx, _, _ = cute.arch.thread_idx()
        bx, head, batch = cute.arch.block_idx()
        row = bx * self.rows + tidx // self.threads_per_row
        chunk = tidx % self.threads_per_row
        seqlen_q = mO.shape[0]
        dot = Float32(0.0)
        if row < seqlen_q:
            o = cute.local_tile(mO[row, None, head, batch], (ELEMS_PER_THREAD,), (chunk,))
            do = cute.local_tile(mdO[row, None, head, batch], (ELEMS_PER_THREAD,), (chunk,))
            prod = o.load().to(Float32) * do.load().to(Float32)
            dot = prod.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        if row < mdQaccum.shape[0]:
            # this thread's 8 columns of the row's dQ accumulator (a fragment-ordered one has the
            # padded rows: every element of its last block is added into)
            cute.local_tile(mdQaccum[row, None, head, batch], (ELEMS_PER_THREAD,), (chunk,)).fill(0.0)
        for i in cutlass.range_constexpr(int(math.log2(self.threads_per_row))):
            dot = dot + cute.arch.shuffle_sync_bfly(dot, offset=1 << i)
        if chunk == 0 and row < mLSE2.shape[0]:
            lse2 = Float32.inf
            if row < seqlen_q:
                lse = mLSE[row, head, batch]
                if lse != -Float32.inf:
                    lse2 = lse * Float32(LOG2_E)
            mLSE2[row, head, batch] = lse2
            mDelta[row, head, batch] = dot


class Postprocess(_RowKernel):
    """dQ = dQ_accum * softmax_scale, converted to the inputs' dtype."""

    @cute.jit
    def __call__(self, mdQaccum: cute.Tensor, mdQ: cute.Tensor, softmax_scale: Float32,
                 stream: cuda.CUstream):
        """dQ_accum (B, Sq, Hq, D) fp32; dQ (B, Sq, Hq, D) in the kernel's dtype (written)."""
        if const_expr(mdQ.element_type != self.dtype):
            raise TypeError("dQ must have the kernel's dtype")
        mdQaccum, mdQ = [L.permute_modes(t, [1, 3, 2, 0]) for t in (mdQaccum, mdQ)]
        grid = ((mdQ.shape[0] + self.rows - 1) // self.rows, mdQ.shape[2], mdQ.shape[3])
        self.kernel(mdQaccum, mdQ, softmax_scale).launch(grid=grid, block=[THREADS, 1, 1],
                                                         stream=stream, use_pdl=self.programmatic_launch)

    @cute.kernel
    def kernel(self, mdQaccum: cute.Tensor, mdQ: cute.Tensor, softmax_scale: Float32):
        follow_the_kernel_before(self.programmatic_launch)
        tidx, _, _ = cute.arch.thread_idx()
        bx, head, batch = cute.arch.block_idx()
        row = bx * self.rows + tidx // self.threads_per_row
        chunk = tidx % self.threads_per_row
        if row < mdQ.shape[0]:
            acc = cute.local_tile(mdQaccum[row, None, head, batch], (ELEMS_PER_THREAD,), (chunk,))
            out = cute.local_tile(mdQ[row, None, head, batch], (ELEMS_PER_THREAD,), (chunk,))
            out.store((acc.load() * softmax_scale).to(self.dtype))


class FragmentPostprocess:
    """dq_accum="fragment": dQ = dQ_accum * softmax_scale from an accumulator that holds each query
    block's tile_m x D values in the order of the main kernel's MMA fragments (value group g of MMA
    thread t at g * 4 * threads + 4 t: `FlashAttentionBackwardSm90.dq_fragment_thread_layout`). One CTA a
    (query block, head, batch) with the main kernel's MMA thread count: thread t reads its own
    fragment (128-bit loads, a warp's load 512 contiguous bytes), finds each value's (row, column)
    from the main kernel's dQ MMA, writes it into a shared-memory tile, and the CTA stores the tile's
    rows < Sq with 16-byte stores."""

    def __init__(self, main):
        self.main = main                       # the FlashAttentionBackwardSm90 whose dQ this converts
        # the main kernel's programmatic dependent where the main kernel is the preprocess's
        # (`plan.PROGRAMMATIC_LAUNCH`)
        self.programmatic_launch = main.programmatic_launch
        self.dtype = main.dtype
        self.head_dim = main.head_dim
        self.tile_m = main.tile_m
        self.threads = main.num_mma_threads
        self.values = main.dq_fragment_values()
        # rows of the tile padded by 16 bytes: a warp's scattered 16-bit stores (4 rows x 8 columns
        # of an MMA fragment) fall on distinct banks
        self.row_elems = self.head_dim + 8

    @cute.jit
    def __call__(self, mdQaccum: cute.Tensor, mdQ: cute.Tensor, softmax_scale: Float32,
                 stream: cuda.CUstream):
        """dQ_accum: the (B, Sq padded, Hq, D) view of a (B, Hq, Sq padded, D) fp32 tensor; dQ (B, Sq,
        Hq, D) in the kernel's dtype (written)."""
        if const_expr(mdQ.element_type != self.dtype):
            raise TypeError("dQ must have the kernel's dtype")
        if const_expr(mdQaccum.element_type != Float32):
            raise TypeError("dQ_accum must be fp32")
        mdQaccum, mdQ = [L.permute_modes(t, [1, 3, 2, 0]) for t in (mdQaccum, mdQ)]  # (S, D, H, B)
        grid = (mdQaccum.shape[0] // self.tile_m, mdQ.shape[2], mdQ.shape[3])
        self.kernel(mdQaccum, mdQ, softmax_scale).launch(grid=grid, block=[self.threads, 1, 1], stream=stream,
                                                         use_pdl=self.programmatic_launch)

    @cute.kernel
    def kernel(self, mdQaccum: cute.Tensor, mdQ: cute.Tensor, softmax_scale: Float32):
        follow_the_kernel_before(self.programmatic_launch)
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        d = self.head_dim
        _, _, tiled_mma_dq = self.main._tiled_mmas()
        dq_tile = (d, self.tile_m) if const_expr(self.main.dq_swap) else (self.tile_m, d)
        coords = tiled_mma_dq.get_slice(tidx).partition_C(cute.make_identity_tensor(dq_tile))

        # this thread's values, where the main kernel's stage put them
        block = cute.local_tile(mdQaccum[None, None, head, batch], (self.tile_m, d), (m_block, 0))
        fragment = cute.make_tensor(block.iterator, self.main.dq_fragment_thread_layout())[(None, tidx), None]
        values = cute.make_rmem_tensor(self.main.dq_fragment_value_layout(), Float32)
        load = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128)
        cute.copy(load, fragment, values)

        smem = cutlass.memory.SmemAllocator()
        tile = smem.allocate_tensor(self.dtype, cute.make_layout((self.tile_m, d), stride=(self.row_elems, 1)),
                                    byte_alignment=16)
        flat = cute.make_tensor(values.iterator, cute.make_layout(self.values))
        for v in cutlass.range_constexpr(self.values):
            row, col = coords[v]
            if const_expr(self.main.dq_swap):
                row, col = col, row
            tile[row, col] = (flat[v] * softmax_scale).to(self.dtype)
        cute.arch.sync_threads()

        # rows < Sq of the tile to dQ, 8 elements (16 bytes) a thread at a time
        chunks_per_row = d // ELEMS_PER_THREAD
        first_row = m_block * self.tile_m
        for i in cutlass.range_constexpr(-(-self.tile_m * chunks_per_row // self.threads)):
            chunk = tidx + i * self.threads
            row = chunk // chunks_per_row
            if row < self.tile_m and first_row + row < mdQ.shape[0]:
                col = chunk % chunks_per_row
                src = cute.local_tile(tile[row, None], (ELEMS_PER_THREAD,), (col,))
                dst = cute.local_tile(mdQ[first_row + row, None, head, batch], (ELEMS_PER_THREAD,), (col,))
                dst.store(src.load())
