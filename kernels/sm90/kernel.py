"""FA4-style attention forward for Hopper (sm_90a) in CuTe DSL.

Warp-specialised: warpgroup 0 is the producer (one warp issues TMA loads of Q and of K/V blocks into
a shared-memory ring; the warpgroup gives its registers away with setmaxnreg), warpgroups 1..W are
consumers, each owning 64 rows of the Q tile: they issue wgmma for S = Q K^T and O += P V, run the
online softmax in registers and write O (and LSE) in the epilogue. Consumer warpgroups ping-pong
through named barriers so one warpgroup's softmax runs under another's MMAs; with softmax_overlap
each warpgroup also issues the next block's S = Q K^T before this block's softmax.

Math (docs/design.md, section 1): exp2 with scale * log2(e) folded; per row a max basis that moves
only when the new block max exceeds it by more than `rescale_threshold` (log2 units); O and l stay
on the row's basis and are normalised once, at the end. Causal is bottom-right aligned and split in
three regions: blocks right of the diagonal are never loaded, blocks on it are masked before the
max, blocks left of it do no mask work. A sliding window (compile-time: which sides are bounded;
runtime: their widths) narrows each tile's block range from both sides, so blocks outside it are never
loaded, and masks only the blocks its edges cross; a softcap (compile-time flag, runtime value) turns
each score into tanh(s * scale / c) on the MUFU tanh before the mask, the softmax then working in
units of c (docs/design.md, section 1). Variable-length batches (compile-time `varlen`, `call_varlen`):
Q, K, V and O are flash-attn's packed (total, H, D) tensors seen as batch 1; a tile (m_block, head,
sequence) reads its sequence's offsets and lengths from cu_seqlens, shifts the TMA coordinates of Q,
K and V by them (rows past the sequence's end read the next sequence's rows or TMA's zeros and are
masked or never stored), skips m_blocks past its sequence's end, and stores O with row-predicated
128-bit copies from shared memory (a TMA store would write the next sequence's rows).
"""



import math
from typing import Any, NamedTuple, Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.memory
from cutlass import Boolean, Float32, Int32, Uint32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as hopper_helpers

from . import layouts as L
from .plan import REGISTER_SPLIT, varlen_threads_per_row
from ..fast_exp2 import exp2_poly, poly_column
from .scheduler import (ONE_CTA_PER_TASK, TileScheduler, head_group_size, longest_first_tile,
                        varlen_grid_tasks)

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)

# named barrier ids (0 is __syncthreads)
BAR_EPILOGUE = 1
BAR_STORE = 2
BAR_PINGPONG_FIRST = 3  # one per consumer warpgroup: 3, 4, 5

ILP_CHAINS = 4  # independent partial reductions per softmax row (see online_softmax)


def _tree(values: list, combine):
    """Combine a list pairwise (a balanced tree: log2(n) dependent steps, not n)."""
    while len(values) > 1:
        values = [combine(values[i], values[i + 1]) if i + 1 < len(values) else values[i]
                  for i in range(0, len(values), 2)]
    return values[0]


class TileContext(NamedTuple):
    """What every block step of one tile reads (trace-time values; loop-invariant in the tile)."""
    tSrQ: Any
    tSrK: Any
    tOrP: Any
    tOrVt: Any
    tPsP: Any
    p_store: Any
    acc_O: Any
    row_max: Any
    row_sum: Any
    tScS: Any
    t0ScS: Any
    s_shape: Any
    tiled_mma_qk: Any
    tiled_mma_pv: Any
    pipe_k: Any
    pipe_v: Any
    scale_log2: Any
    m_block: Any
    seqlen_q: Any
    seqlen_k: Any
    # ping-pong named barriers: this warpgroup's turn and the next one's, computed once per
    # warpgroup so the block loop does not re-derive the warpgroup index (a shuffle) each block
    bar_turn: Any
    bar_next: Any
    # two Q buffers: the previous tile's Q buffer (holding its O for the TMA store) is released in
    # this tile's first block, once its S MMA is issued, not at the end of the previous epilogue
    pipe_q: Any
    q_prev: Any
    q_prev_pending: Any
    tidx: Any
    # a sliding window's bounded sides (keys left / right of the diagonal) and the softcap's
    # pre-tanh factor (scale / c): runtime values, None where the kernel has none
    window_left: Any = None
    window_right: Any = None
    softcap_scale: Any = None


class SequenceTile(NamedTuple):
    """Where one tile's sequence lives: its first query and key row in the packed tensors, its
    lengths, and the batch index the tensors are indexed with (0 under varlen: batch 1)."""
    offset_q: Any
    offset_k: Any
    seqlen_q: Any
    seqlen_k: Any
    batch_idx: Any


class FlashAttentionSm90:
    """One compiled variant of the forward kernel.

    Problem constants (change the code): dtype ("fp16"/"bf16"), head_dim (of Q and K), head_dim_v
    (of V and O; None: head_dim; else one of plan.py's pairs, at most head_dim: O is staged in the Q
    buffer), causal,
    return_lse, the GQA ratio when rows are packed, which sides of a sliding window are bounded
    (bounded_left, bounded_right: the widths are runtime values) and whether scores are soft-capped
    (softcap; the cap is a runtime value).
    Device constants (the family's `device_key`): num_sms (the persistent grid), l2_bytes_for_kv (the
    longest-first orders' head groups).
    Knobs (kernels/knobs.py, sm90):
      tiles:      tile_m (64/128/192 -> 1/2/3 consumer warpgroups), tile_n
      pipelines:  kv_stages (K/V ring depth), q_stages (Q buffers; the epilogue stages O in the
                  current Q buffer, so with 1 the next tile's Q waits for this tile's O store)
      softmax:    rescale_threshold, softmax_overlap, pv_operand ("rs" registers / "ss" smem),
                  exp2_poly_columns (of every 32 exps of a row, how many by FMA polynomial)
      scheduling: scheduler ("single"/"static"/"lpt"), pack_gqa
    varlen (compile-time): flash-attn's packed layout with cu_seqlens (`call_varlen`); rows are not
    GQA-packed, and head_dim_v / 8 (the threads of a row's 128-bit O copies) divides a warpgroup.
    """

    def __init__(self, *, dtype: str, head_dim: int, causal: bool, return_lse: bool,
                 gqa_pack_ratio: Optional[int], tile_m: int, tile_n: int, kv_stages: int,
                 q_stages: int, rescale_threshold: float, scheduler: str, pv_operand: str,
                 softmax_overlap: bool, exp2_poly_columns: int, num_sms: int, l2_bytes_for_kv: int,
                 bounded_left: bool = False, bounded_right: bool = False, softcap: bool = False,
                 varlen: bool = False, head_dim_v: Optional[int] = None):
        self.dtype = {"fp16": cutlass.Float16, "bf16": cutlass.BFloat16}[dtype]
        self.head_dim = head_dim
        # Q, K and the score MMA use head_dim; V, O, the value MMA's N and the O accumulator head_dim_v
        self.head_dim_v = head_dim if head_dim_v is None else head_dim_v
        assert self.head_dim_v <= head_dim, "O is staged in the Q buffer: head_dim_v <= head_dim"
        self.causal = causal
        self.return_lse = return_lse
        assert not (causal and bounded_right), "under causal the right side is the causal bound"
        self.bounded_left = bounded_left
        self.bounded_right = bounded_right
        self.softcap = softcap
        self.varlen = varlen
        # one CTA per task of the sequences' own (scheduler.py: `packed_varlen`)
        self.packed_varlen = varlen and scheduler in ONE_CTA_PER_TASK
        assert not (varlen and gqa_pack_ratio is not None), "varlen tiles are not packed"
        self.pack_ratio = gqa_pack_ratio  # None: one query head per tile
        self.tile_m = tile_m
        self.tile_n = tile_n
        self.kv_stages = kv_stages
        self.q_stages = q_stages
        self.rescale_threshold = float(rescale_threshold)
        self.scheduler_kind = scheduler
        self.pv_from_smem = pv_operand == "ss"
        self.overlap = softmax_overlap
        self.exp2_poly_columns = exp2_poly_columns
        self.num_sms = num_sms
        self.l2_bytes_for_kv = l2_bytes_for_kv
        self._setup_attributes()

    def _setup_attributes(self) -> None:
        assert self.tile_m % 64 == 0 and self.tile_m // 64 in REGISTER_SPLIT
        self.num_wg = self.tile_m // 64
        self.num_consumer_threads = 128 * self.num_wg
        self.num_threads = 128 * (self.num_wg + 1)
        self.producer_regs, self.consumer_regs = REGISTER_SPLIT[self.num_wg]
        # Ping-pong between consumer warpgroups (FA3): with overlap for any count of warpgroups,
        # without it only for two (three warpgroups in strict turn serialise the softmaxes).
        self.pingpong = self.num_wg >= 2 if self.overlap else self.num_wg == 2
        if self.pack_ratio is not None:
            assert self.tile_m % self.pack_ratio == 0
        self.rows_per_thread = 2  # an m64 wgmma accumulator gives each thread rows r and r + 8
        # With two Q buffers the store warp need not wait for its O store to be read before the next
        # tile: the wait (and the Q buffer's release) moves under the next tile's first S MMA.
        self.defer_q_release = self.q_stages > 1
        # a window's masked blocks apply its whole mask (both sides, the key length): one mask code
        self.has_window = self.bounded_left or self.bounded_right
        # blocks right of some row's last key are skipped and the ones its edge crosses masked
        self.mask_right = self.causal or self.bounded_right

    # ------------------------------------------------------------------------------------------
    # shared memory
    # ------------------------------------------------------------------------------------------
    def _make_layouts(self) -> None:
        d = self.head_dim
        self.sQ_layout = L.smem_layout(self.dtype, self.tile_m, d, self.q_stages)
        self.sK_layout = L.smem_layout(self.dtype, self.tile_n, d, self.kv_stages)
        self.sV_layout = L.smem_layout(self.dtype, self.tile_n, self.head_dim_v, self.kv_stages)
        self.sO_layout = L.smem_layout(self.dtype, self.tile_m, self.head_dim_v)  # aliases one Q stage
        self.sP_layout = (L.smem_layout(self.dtype, self.tile_m, self.tile_n)
                          if self.pv_from_smem else None)

    def shared_storage(self):
        """The kernel's SharedStorage struct (its size_in_bytes() is the dynamic smem per CTA)."""
        self._make_layouts()
        align = 1024
        p_elems = cute.cosize(self.sP_layout) if self.sP_layout is not None else 0

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, self.q_stages * 2]
            mbar_k: cute.struct.MemRange[cutlass.Int64, self.kv_stages * 2]
            mbar_v: cute.struct.MemRange[cutlass.Int64, self.kv_stages * 2]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(self.sQ_layout)], align]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(self.sK_layout)], align]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(self.sV_layout)], align]
            sP: cute.struct.Align[cute.struct.MemRange[self.dtype, p_elems], align]

        return SharedStorage

    def _tiled_mmas(self):
        qk = hopper_helpers.make_trivial_tiled_mma(
            self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K,
            Float32, atom_layout_mnk=(self.num_wg, 1, 1), tiler_mn=(64, self.tile_n))
        pv = hopper_helpers.make_trivial_tiled_mma(
            self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN,
            Float32, atom_layout_mnk=(self.num_wg, 1, 1), tiler_mn=(64, self.head_dim_v),
            a_source=(warpgroup.OperandSource.SMEM if self.pv_from_smem
                      else warpgroup.OperandSource.RMEM))
        return qk, pv

    # ------------------------------------------------------------------------------------------
    # launch
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mLSE: Optional[cute.Tensor], softmax_scale: Float32, stream: cuda.CUstream):
        """Q, O: (B, Sq, Hq, D); K, V: (B, Sk, Hkv, D); LSE: (B, Hq, Sq) fp32 or None. A kernel with a
        window or softcap is called through `call_masked`."""
        self.launch_attention(mQ, mK, mV, mO, mLSE, softmax_scale, None, None, None, None, None, None,
                              stream)

    @cute.jit
    def call_masked(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                    mLSE: Optional[cute.Tensor], softmax_scale: Float32, window_left: Optional[Int32],
                    window_right: Optional[Int32], softcap: Optional[Float32], stream: cuda.CUstream):
        """`__call__` of a kernel with a sliding window or a softcap: the bounded sides' widths (keys
        left / right of the diagonal) and the cap c > 0, each None where the kernel has none."""
        self.launch_attention(mQ, mK, mV, mO, mLSE, softmax_scale, window_left, window_right, softcap,
                              None, None, None, stream)

    @cute.jit
    def call_varlen(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                    mLSE: Optional[cute.Tensor], softmax_scale: Float32, window_left: Optional[Int32],
                    window_right: Optional[Int32], softcap: Optional[Float32], mCuSeqlensQ: cute.Tensor,
                    mCuSeqlensK: cute.Tensor, max_seqlen_q: Int32, stream: cuda.CUstream):
        """`__call__` of a varlen kernel: Q, O (1, total_q, Hq, D), K, V (1, total_k, Hkv, D), LSE
        (1, Hq, total_q); cu_seqlens int32 (sequences + 1) on the GPU; max_seqlen_q sizes the grid.
        Rows no sequence covers are not written (the caller fills them)."""
        self.launch_attention(mQ, mK, mV, mO, mLSE, softmax_scale, window_left, window_right, softcap,
                              mCuSeqlensQ, mCuSeqlensK, max_seqlen_q, stream)

    @cute.jit
    def launch_attention(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                         mLSE: Optional[cute.Tensor], softmax_scale: Float32,
                         window_left: Optional[Int32], window_right: Optional[Int32],
                         softcap: Optional[Float32], mCuSeqlensQ: Optional[cute.Tensor],
                         mCuSeqlensK: Optional[cute.Tensor], max_seqlen_q: Optional[Int32],
                         stream: cuda.CUstream):
        if const_expr((mCuSeqlensQ is not None) != self.varlen or (mCuSeqlensK is not None) != self.varlen):
            raise TypeError("cu_seqlens must be given exactly when the kernel was built for varlen")
        if const_expr((window_left is not None) != self.bounded_left
                      or (window_right is not None) != self.bounded_right
                      or (softcap is not None) != self.softcap):
            raise TypeError("the window's sides and the softcap must be given exactly where the kernel "
                            "was built with them")
        if const_expr(mQ.element_type != self.dtype or mK.element_type != self.dtype
                      or mV.element_type != self.dtype or mO.element_type != self.dtype):
            raise TypeError("Q, K, V and O must all have the kernel's dtype")
        # (B, S, H, D) -> (S, D, H, B): rows, then the contiguous head dim, then heads and batch
        mQ, mK, mV, mO = [L.permute_modes(t, [1, 3, 2, 0]) for t in (mQ, mK, mV, mO)]
        if const_expr(mLSE is not None):
            mLSE = L.permute_modes(mLSE, [2, 1, 0])  # (Sq, Hq, B)
        seqlen_q = mQ.shape[0]
        seqlen_k = mK.shape[0]
        heads_q = mQ.shape[2]
        heads_kv = mK.shape[2]
        batch = mQ.shape[3]
        ratio_rt = heads_q // heads_kv

        SharedStorage = self.shared_storage()
        self.smem_bytes = int(SharedStorage.size_in_bytes())  # recorded at trace time for reports
        tiled_mma_qk, tiled_mma_pv = self._tiled_mmas()
        sQ_one = cute.select(self.sQ_layout, mode=[0, 1])
        sK_one = cute.select(self.sK_layout, mode=[0, 1])
        sV_one = cute.select(self.sV_layout, mode=[0, 1])
        load_op = cpasync.CopyBulkTensorTileG2SOp()
        store_op = cpasync.CopyBulkTensorTileS2GOp()
        if const_expr(self.varlen):
            # O is stored with predicated copies (`store_o_rows`), from the gmem tensor itself
            tma_atom_Q, tma_Q = cpasync.make_tiled_tma_atom(load_op, mQ, sQ_one,
                                                            (self.tile_m, self.head_dim))
            tma_atom_O, tma_O = None, mO
            rows_q = max_seqlen_q
            heads_tile = heads_q
            batch = mCuSeqlensQ.shape[0] - 1
        elif const_expr(self.pack_ratio is None):
            tma_atom_Q, tma_Q = cpasync.make_tiled_tma_atom(load_op, mQ, sQ_one,
                                                            (self.tile_m, self.head_dim))
            tma_atom_O, tma_O = cpasync.make_tiled_tma_atom(store_op, mO, self.sO_layout,
                                                            (self.tile_m, self.head_dim_v))
            rows_q = seqlen_q
            heads_tile = heads_q
        else:
            tma_atom_Q, tma_Q = L.packed_tma_atom(load_op, mQ, sQ_one, self.tile_m,
                                                  self.head_dim, self.pack_ratio)
            tma_atom_O, tma_O = L.packed_tma_atom(store_op, mO, self.sO_layout, self.tile_m,
                                                  self.head_dim_v, self.pack_ratio)
            if const_expr(mLSE is not None):
                mLSE = L.pack_rows(mLSE, self.pack_ratio, 1, heads_kv)
            rows_q = seqlen_q * self.pack_ratio
            heads_tile = heads_kv
        tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(load_op, mK, sK_one,
                                                        (self.tile_n, self.head_dim))
        tma_atom_V, tma_V = cpasync.make_tiled_tma_atom(load_op, mV, sV_one,
                                                        (self.tile_n, self.head_dim_v))
        self.q_bytes = cute.size_in_bytes(self.dtype, sQ_one)
        self.kv_bytes = cute.size_in_bytes(self.dtype, sK_one)
        self.v_bytes = cute.size_in_bytes(self.dtype, sV_one)

        num_m_blocks = (rows_q + self.tile_m - 1) // self.tile_m
        kv_rows = seqlen_k
        if const_expr(self.varlen):
            kv_rows = seqlen_k // cutlass.max(batch, 1)  # the longest-first head groups: a mean sequence
        # head groups sized by K's head dim: with a smaller Dv an over-estimate of a head's K and V bytes
        sched = TileScheduler.create(self.scheduler_kind, num_m_blocks, heads_tile, batch, kv_rows,
                                     self.head_dim, self.num_sms, self.l2_bytes_for_kv)
        grid = sched.grid_shape()
        if const_expr(self.packed_varlen):
            grid = (cutlass.max(varlen_grid_tasks(seqlen_q, batch, self.tile_m, heads_tile), 1), 1, 1)
        scale_log2 = softmax_scale * Float32(LOG2_E)
        softcap_scale = None
        if const_expr(self.softcap):
            # s -> c * tanh(s * scale / c): the kernel keeps tanh(s * scale / c) and works in units
            # of c, so its exponent factor is c * log2(e)
            softcap_scale = softmax_scale / softcap
            scale_log2 = softcap * Float32(LOG2_E)

        self.kernel(
            tma_Q, tma_K, tma_V, tma_O, mLSE, tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_O,
            scale_log2, seqlen_q, seqlen_k, ratio_rt, num_m_blocks, heads_tile, batch,
            sched.group_heads, window_left, window_right, softcap_scale, mCuSeqlensQ, mCuSeqlensK,
            tiled_mma_qk, tiled_mma_pv,
            self.sQ_layout, self.sK_layout, self.sV_layout, self.sP_layout, SharedStorage,
        ).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream,
                 min_blocks_per_mp=1)

    # ------------------------------------------------------------------------------------------
    # device code
    # ------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
               mLSE: Optional[cute.Tensor], tma_atom_Q: cute.CopyAtom, tma_atom_K: cute.CopyAtom,
               tma_atom_V: cute.CopyAtom, tma_atom_O: cute.CopyAtom, scale_log2: Float32,
               seqlen_q: Int32, seqlen_k: Int32, ratio_rt: Int32, num_m_blocks: Int32,
               num_heads: Int32, batch: Int32, group_heads: Int32, window_left: Optional[Int32],
               window_right: Optional[Int32], softcap_scale: Optional[Float32],
               mCuSeqlensQ: Optional[cute.Tensor], mCuSeqlensK: Optional[cute.Tensor],
               tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma,
               sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
               sV_layout: cute.ComposedLayout, sP_layout: Optional[cute.ComposedLayout],
               SharedStorage: cutlass.Constexpr):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            for atom in (tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_O):
                if const_expr(atom is not None):  # varlen stores O without TMA
                    cpasync.prefetch_descriptor(atom)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        one_thread = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        consumer_warps = pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                   self.num_consumer_threads // 32)
        # Q is released by the warp that stores O (O is staged in the Q buffer): one arrival.
        pipe_q = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_q.data_ptr(), num_stages=self.q_stages,
            producer_group=one_thread, consumer_group=one_thread, tx_count=self.q_bytes,
            defer_sync=True)
        pipe_k = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_k.data_ptr(), num_stages=self.kv_stages,
            producer_group=one_thread, consumer_group=consumer_warps, tx_count=self.kv_bytes,
            defer_sync=True)
        pipe_v = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_v.data_ptr(), num_stages=self.kv_stages,
            producer_group=one_thread, consumer_group=consumer_warps, tx_count=self.v_bytes,
            defer_sync=True)
        pipeline.pipeline_init_arrive(cluster_shape_mn=None, is_relaxed=True)

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sP = None
        if const_expr(self.pv_from_smem):
            sP = storage.sP.get_tensor(sP_layout.outer, swizzle=sP_layout.inner)

        sched = TileScheduler(self.scheduler_kind, num_m_blocks, num_heads, batch, group_heads,
                              self.num_sms)
        sched.packed_varlen = self.packed_varlen
        pipeline.pipeline_init_wait(cluster_shape_mn=None)

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                self.produce(mQ, mK, mV, sQ, sK, sV, tma_atom_Q, tma_atom_K, tma_atom_V,
                             pipe_q, pipe_k, pipe_v, sched, seqlen_q, seqlen_k, ratio_rt,
                             window_left, window_right, mCuSeqlensQ, mCuSeqlensK)
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            self.consume(mO, mLSE, sQ, sK, sV, sP, tma_atom_O, pipe_q, pipe_k, pipe_v, sched,
                         tiled_mma_qk, tiled_mma_pv, scale_log2, seqlen_q, seqlen_k,
                         window_left, window_right, softcap_scale, mCuSeqlensQ, mCuSeqlensK)

    # ---- block ranges --------------------------------------------------------------------------
    @cute.jit
    def kv_block_range(self, m_block: Int32, seqlen_q: Int32, seqlen_k: Int32,
                       window_left: Optional[Int32] = None, window_right: Optional[Int32] = None):
        """[n_min, n_max): the K/V blocks this tile must visit (causal and a window's right side skip
        those right of it, a window's left side those left of it; the range may be empty)."""
        n_max = (seqlen_k + self.tile_n - 1) // self.tile_n
        if const_expr(self.mask_right):
            last_row = (m_block + 1) * self.tile_m  # one past the tile's last (packed) row
            if const_expr(self.pack_ratio is not None):
                last_row = (last_row + self.pack_ratio - 1) // self.pack_ratio
            last_col = last_row + seqlen_k - seqlen_q  # one past the last visible key
            if const_expr(self.bounded_right):
                last_col = last_col + window_right
            n_max = cutlass.min(n_max, (last_col + self.tile_n - 1) // self.tile_n)
        if const_expr(self.bounded_left):
            first_row = m_block * self.tile_m
            if const_expr(self.pack_ratio is not None):
                first_row = first_row // self.pack_ratio
            first_col = first_row + seqlen_k - seqlen_q - window_left  # the first row's first key
            return cutlass.max(first_col, 0) // self.tile_n, n_max
        return Int32(0), n_max

    @cute.jit
    def first_masked_block(self, m_block: Int32, n_min: Int32, seqlen_q: Int32, seqlen_k: Int32,
                           window_right: Optional[Int32] = None):
        """Blocks below this index are left of the diagonal (plus a window's right side) for every row
        of the tile: no mask on that side."""
        first_row = m_block * self.tile_m
        if const_expr(self.pack_ratio is not None):
            first_row = first_row // self.pack_ratio
        first_row_limit = first_row + seqlen_k - seqlen_q  # last visible key of the first row
        if const_expr(self.bounded_right):
            first_row_limit = first_row_limit + window_right
        return cutlass.max(n_min, cutlass.max(first_row_limit, 0) // self.tile_n)

    @cute.jit
    def left_masked_blocks_end(self, m_block: Int32, n_min: Int32, seqlen_q: Int32, seqlen_k: Int32,
                               window_left: Int32):
        """Blocks below this index hold keys left of the last row's window: the window's left edge
        crosses them (or passes right of them for some row), so they carry its mask."""
        last_row = (m_block + 1) * self.tile_m - 1  # the tile's last (packed) row
        if const_expr(self.pack_ratio is not None):
            last_row = last_row // self.pack_ratio
        last_row_first = last_row + seqlen_k - seqlen_q - window_left  # its first visible key
        return cutlass.max(n_min, (cutlass.max(last_row_first, 0) + self.tile_n - 1) // self.tile_n)

    # ---- producer ------------------------------------------------------------------------------
    @cute.jit
    def first_task(self, sched: cutlass.Constexpr, mCuSeqlensQ: Optional[cute.Tensor],
                   mCuSeqlensK: Optional[cute.Tensor]):
        """(task, valid) of this CTA's first task: the scheduler's, or under varlen with one CTA per
        task the CTA's task among the sequences' own (`scheduler.py`, `packed_varlen`): each lane
        counts one sequence's tasks, a shuffle scan sums 32 sequences at a time and a ballot finds
        the sequence holding the CTA's; returned as static's index (m_block + m_blocks (head +
        heads batch)), valid False past the last task. Every lane of the calling warp takes part."""
        task, valid = sched.initial_work()
        if const_expr(sched.packed_varlen):
            lane = cute.arch.lane_idx()
            heads = sched.num_heads
            rest = task              # tasks left to pass, from the first sequence of this group of 32
            first = Int32(0)         # the group's first sequence
            task = Int32(0)
            valid = Boolean(False)
            searching = first < sched.batch
            while searching:
                seq = first + lane
                blocks = Int32(0)
                keys = Int32(0)      # single_lpt's head groups are sized by them
                if seq < sched.batch:
                    blocks = (mCuSeqlensQ[seq + 1] - mCuSeqlensQ[seq] + self.tile_m - 1) // self.tile_m
                    if const_expr(sched.kind == "single_lpt"):
                        keys = mCuSeqlensK[seq + 1] - mCuSeqlensK[seq]
                tasks = blocks * heads
                through = tasks      # tasks of the group's sequences up to this lane's, inclusive
                for step in cutlass.range_constexpr(5):
                    below = cute.arch.shuffle_sync_up(through, 1 << step)
                    if lane >= (1 << step):
                        through = through + below
                # the sequences the CTA's task is past (`through` never decreases along the lanes)
                passed = cute.arch.popc(cute.arch.vote_ballot_sync(through <= rest))
                if passed < 32:
                    seq_blocks = cute.arch.shuffle_sync(blocks, passed)
                    local = rest - (cute.arch.shuffle_sync(through, passed)
                                    - cute.arch.shuffle_sync(tasks, passed))
                    m_block = local % seq_blocks
                    head = local // seq_blocks
                    if const_expr(sched.kind == "single_lpt"):
                        # the dense order over this sequence's heads: groups whose K and V (its keys)
                        # fit the L2 budget, in a group the last m-block first, the heads fastest
                        group_heads = head_group_size(cute.arch.shuffle_sync(keys, passed), self.head_dim,
                                                      self.l2_bytes_for_kv)
                        m_block, head = longest_first_tile(local, seq_blocks, heads, group_heads)
                    task = ((first + passed) * heads + head) * sched.num_m_blocks + m_block
                    # a max_seqlen_q below a sequence's length (unchecked in a CUDA-graph capture) would
                    # alias another tile: that tile is dropped, as the grid of max_seqlen_q drops it
                    valid = m_block < sched.num_m_blocks
                    searching = Boolean(False)
                else:
                    rest = rest - cute.arch.shuffle_sync(through, 31)
                    first = first + 32
                    searching = first < sched.batch
        return task, valid

    @cute.jit
    def sequence_tile(self, batch_idx: Int32, seqlen_q: Int32, seqlen_k: Int32,
                      mCuSeqlensQ: Optional[cute.Tensor], mCuSeqlensK: Optional[cute.Tensor]):
        """The `SequenceTile` of batch entry `batch_idx`: the launch's lengths, or under varlen its
        sequence's offsets and lengths read from cu_seqlens (the tensors are then batch 1)."""
        if const_expr(not self.varlen):
            return SequenceTile(Int32(0), Int32(0), seqlen_q, seqlen_k, batch_idx)
        offset_q = mCuSeqlensQ[batch_idx]
        offset_k = mCuSeqlensK[batch_idx]
        return SequenceTile(offset_q, offset_k, mCuSeqlensQ[batch_idx + 1] - offset_q,
                            mCuSeqlensK[batch_idx + 1] - offset_k, Int32(0))

    def shift_rows(self, t: Optional[cute.Tensor], offset):
        """Under varlen, `t` (rows first, any rank) seen from row `offset` on: a packed sequence's own
        coordinates (for a TMA tensor the coordinates the copy sends; the bounds stay the whole packed
        tensor's). A dense kernel's `t` (or None) as it is."""
        if const_expr(not self.varlen or t is None):
            return t
        return cute.domain_offset((offset,) + (0,) * (cute.rank(t) - 1), t)

    def tile_has_rows(self, m_block, seq: SequenceTile):
        """Whether the tile holds rows of its sequence: under varlen the launch covers the longest
        sequence's m-blocks for every sequence, and the shorter ones' later tiles do nothing. A dense
        kernel: Python's True (the loop's `if` then emits no code)."""
        if const_expr(not self.varlen):
            return True
        return m_block * self.tile_m < seq.seqlen_q

    @cute.jit
    def produce(self, mQ, mK, mV, sQ, sK, sV, tma_atom_Q, tma_atom_K, tma_atom_V, pipe_q, pipe_k,
                pipe_v, sched: cutlass.Constexpr, seqlen_q: Int32, seqlen_k: Int32,
                ratio_rt: Int32, window_left: Optional[Int32], window_right: Optional[Int32],
                mCuSeqlensQ: Optional[cute.Tensor], mCuSeqlensK: Optional[cute.Tensor]):
        # The tile's body stays in the loop, not in a method: the DSL carries a loop's values in the
        # order their names first appear in its body, and a body moved into a method reorders them
        # (and the dense kernel's registers with them). Under varlen the body runs only for tiles with rows
        # (`tile_has_rows`); for a dense kernel that test is Python's True and emits nothing.
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.q_stages)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                self.kv_stages)
        task, valid = self.first_task(sched, mCuSeqlensQ, mCuSeqlensK)
        while valid:
            m_block, head, batch_idx = sched.decode(task)
            seq = self.sequence_tile(batch_idx, seqlen_q, seqlen_k, mCuSeqlensQ, mCuSeqlensK)
            if self.tile_has_rows(m_block, seq):
                mQ_seq = self.shift_rows(mQ, seq.offset_q)
                mK_seq = self.shift_rows(mK, seq.offset_k)
                mV_seq = self.shift_rows(mV, seq.offset_k)
                head_kv = head
                if const_expr(self.pack_ratio is None):
                    head_kv = head // ratio_rt
                gQ = cute.local_tile(mQ_seq[None, None, head, seq.batch_idx],
                                     (self.tile_m, self.head_dim), (m_block, 0))
                gK = cute.local_tile(mK_seq[None, None, head_kv, seq.batch_idx],
                                     (self.tile_n, self.head_dim), (None, 0))
                gV = cute.local_tile(mV_seq[None, None, head_kv, seq.batch_idx],
                                     (self.tile_n, self.head_dim_v), (None, 0))
                tQs, tQg = L.tma_copier(tma_atom_Q, sQ, gQ, smem_staged=True, gmem_tiled=False)
                tKs, tKg = L.tma_copier(tma_atom_K, sK, gK, smem_staged=True, gmem_tiled=True)
                tVs, tVg = L.tma_copier(tma_atom_V, sV, gV, smem_staged=True, gmem_tiled=True)

                n_min, n_max = self.kv_block_range(m_block, seq.seqlen_q, seq.seqlen_k, window_left,
                                                   window_right)
                n_count = n_max - n_min
                # K of the first (rightmost) block goes out before Q: with one Q buffer, Q waits for the
                # previous tile's O store, and this K load need not.
                if n_count > 0:
                    pipe_k.producer_acquire(kv_state)
                    cute.copy(tma_atom_K, tKg[None, n_max - 1], tKs[None, kv_state.index],
                              tma_bar_ptr=pipe_k.producer_get_barrier(kv_state))
                pipe_q.producer_acquire(q_state)
                cute.copy(tma_atom_Q, tQg, tQs[None, q_state.index],
                          tma_bar_ptr=pipe_q.producer_get_barrier(q_state))
                q_state.advance()
                if n_count > 0:
                    if const_expr(not self.overlap):
                        pipe_v.producer_acquire(kv_state)
                        cute.copy(tma_atom_V, tVg[None, n_max - 1], tVs[None, kv_state.index],
                                  tma_bar_ptr=pipe_v.producer_get_barrier(kv_state))
                        kv_state.advance()
                        for i in cutlass.range(n_count - 1, unroll=1):
                            n_block = n_max - 2 - i
                            pipe_k.producer_acquire(kv_state)
                            cute.copy(tma_atom_K, tKg[None, n_block], tKs[None, kv_state.index],
                                      tma_bar_ptr=pipe_k.producer_get_barrier(kv_state))
                            pipe_v.producer_acquire(kv_state)
                            cute.copy(tma_atom_V, tVg[None, n_block], tVs[None, kv_state.index],
                                      tma_bar_ptr=pipe_v.producer_get_barrier(kv_state))
                            kv_state.advance()
                    else:
                        # the consumer wants K of block n before V of block n + 1: load in that order
                        for i in cutlass.range(n_count - 1, unroll=1):
                            n_prev = n_max - 1 - i
                            prev_state = kv_state.clone()
                            kv_state.advance()
                            pipe_k.producer_acquire(kv_state)
                            cute.copy(tma_atom_K, tKg[None, n_prev - 1], tKs[None, kv_state.index],
                                      tma_bar_ptr=pipe_k.producer_get_barrier(kv_state))
                            pipe_v.producer_acquire(prev_state)
                            cute.copy(tma_atom_V, tVg[None, n_prev], tVs[None, prev_state.index],
                                      tma_bar_ptr=pipe_v.producer_get_barrier(prev_state))
                        pipe_v.producer_acquire(kv_state)
                        cute.copy(tma_atom_V, tVg[None, n_min], tVs[None, kv_state.index],
                                  tma_bar_ptr=pipe_v.producer_get_barrier(kv_state))
                        kv_state.advance()
            task, valid = sched.next_work(task)

    # ---- consumers -----------------------------------------------------------------------------
    @cute.jit
    def consume(self, mO, mLSE, sQ, sK, sV, sP, tma_atom_O, pipe_q, pipe_k, pipe_v,
                sched: cutlass.Constexpr, tiled_mma_qk, tiled_mma_pv, scale_log2: Float32,
                seqlen_q: Int32, seqlen_k: Int32, window_left: Optional[Int32],
                window_right: Optional[Int32], softcap_scale: Optional[Float32],
                mCuSeqlensQ: Optional[cute.Tensor], mCuSeqlensK: Optional[cute.Tensor]):
        tidx, _, _ = cute.arch.thread_idx()
        tidx = tidx - 128
        wg_idx = cute.arch.make_warp_uniform(tidx // 128)
        thr_mma_qk = tiled_mma_qk.get_slice(tidx)
        thr_mma_pv = tiled_mma_pv.get_slice(tidx)
        wg_mma_qk = tiled_mma_qk.get_slice(wg_idx * 128)
        wg_mma_pv = tiled_mma_pv.get_slice(wg_idx * 128)

        tSrQ = wg_mma_qk.make_fragment_A(wg_mma_qk.partition_A(sQ))
        tSrK = wg_mma_qk.make_fragment_B(wg_mma_qk.partition_B(sK))
        sVt = L.transpose_smem_view(sV)
        tOrVt = wg_mma_pv.make_fragment_B(wg_mma_pv.partition_B(sVt))
        acc_O = cute.make_rmem_tensor(
            wg_mma_pv.partition_shape_C((self.tile_m, self.head_dim_v)), Float32)
        tOrP = None
        tPsP = None
        p_store = None
        if const_expr(self.pv_from_smem):
            tOrP = wg_mma_pv.make_fragment_A(wg_mma_pv.partition_A(sP))
            p_store = cute.make_tiled_copy_C(L.store_atom_16b(self.dtype),
                                             tiled_mma_qk).get_slice(tidx)
            tPsP = p_store.partition_D(sP)
        else:
            tOrP = cute.make_rmem_tensor(
                wg_mma_pv.partition_shape_A((self.tile_m, self.tile_n)), self.dtype)
        s_shape = wg_mma_qk.partition_shape_C((self.tile_m, self.tile_n))

        # (row, col) coordinates of this thread's S fragment, and thread 0's (compile-time)
        ident_S = cute.make_identity_tensor((self.tile_m, self.tile_n))
        tScS = L.acc_rows_cols(thr_mma_qk.partition_C(ident_S))
        t0ScS = L.acc_rows_cols(tiled_mma_qk.get_slice(0).partition_C(ident_S))

        row_max = cute.make_rmem_tensor(self.rows_per_thread, Float32)
        row_sum = cute.make_rmem_tensor(self.rows_per_thread, Float32)
        bar_turn = BAR_PINGPONG_FIRST + wg_idx
        bar_next = BAR_PINGPONG_FIRST + (wg_idx + 1) % self.num_wg

        if const_expr(self.pingpong):
            if wg_idx == 0:  # the first consumer warpgroup takes the first turn
                cute.arch.barrier_arrive(barrier_id=BAR_PINGPONG_FIRST,
                                         number_of_threads=2 * 128)

        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.q_stages)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                                self.kv_stages)
        q_prev = q_state.clone()
        q_prev_pending = Boolean(False)
        task, valid = self.first_task(sched, mCuSeqlensQ, mCuSeqlensK)
        while valid:
            m_block, head, batch_idx = sched.decode(task)
            seq = self.sequence_tile(batch_idx, seqlen_q, seqlen_k, mCuSeqlensQ, mCuSeqlensK)
            if self.tile_has_rows(m_block, seq):  # the loop's text: see `produce`
                n_min, n_max = self.kv_block_range(m_block, seq.seqlen_q, seq.seqlen_k, window_left,
                                                   window_right)
                n_count = n_max - n_min
                row_max.fill(-Float32.inf)
                row_sum.fill(0.0)
                acc_O.fill(0.0)
                pipe_q.consumer_wait(q_state)
                tSrQ_cur = tSrQ[None, None, None, q_state.index]
                ctx = TileContext(tSrQ_cur, tSrK, tOrP, tOrVt, tPsP, p_store, acc_O, row_max, row_sum,
                                  tScS, t0ScS, s_shape, tiled_mma_qk, tiled_mma_pv, pipe_k, pipe_v,
                                  scale_log2, m_block, seq.seqlen_q, seq.seqlen_k, bar_turn, bar_next,
                                  pipe_q, q_prev, q_prev_pending, tidx, window_left, window_right,
                                  softcap_scale)
                if n_count > 0:
                    n_mask_from = n_min
                    if const_expr(self.mask_right):
                        n_mask_from = self.first_masked_block(m_block, n_min, seq.seqlen_q,
                                                              seq.seqlen_k, window_right)
                    n_left_end = n_min
                    if const_expr(self.bounded_left):
                        n_left_end = self.left_masked_blocks_end(m_block, n_min, seq.seqlen_q,
                                                                 seq.seqlen_k, window_left)
                    kv_state = self.mainloop(ctx, kv_state, n_min, n_max, n_mask_from, n_left_end)
                else:
                    self.release_previous_q(ctx)
                self.epilogue(acc_O, row_max, row_sum, scale_log2, sQ, self.shift_rows(mO, seq.offset_q),
                              self.shift_rows(mLSE, seq.offset_q), tma_atom_O, tiled_mma_pv, tidx, m_block,
                              head, seq.batch_idx, seq.seqlen_q, pipe_q, q_state)
                if const_expr(self.defer_q_release):
                    q_prev = q_state.clone()
                    q_prev_pending = Boolean(True)
                q_state.advance()
            task, valid = sched.next_work(task)
        if const_expr(self.defer_q_release):
            # the last tile's O store must be read before the CTA's shared memory goes away
            if q_prev_pending:
                if tidx < 32:
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
                    pipe_q.consumer_release(q_prev)

    @cute.jit
    def release_previous_q(self, ctx: TileContext):
        """With two Q buffers: wait for the previous tile's O store to be read out of its Q buffer
        and release the buffer to the producer (the store warp only; see defer_q_release)."""
        if const_expr(self.defer_q_release):
            if ctx.q_prev_pending:
                if ctx.tidx < 32:
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
                    ctx.pipe_q.consumer_release(ctx.q_prev)

    @cute.jit
    def mainloop(self, ctx, kv_state, n_min: Int32, n_max: Int32, n_mask_from: Int32,
                 n_left_end: Int32):
        """All K/V blocks of one tile, rightmost first: the first block carries the seqlen (and
        causal) mask, then the diagonal blocks the causal mask, then the full blocks none. With a
        window, the first block and those its right edge crosses carry its whole mask (`n_mask_from`
        up), the full blocks none, and the blocks its left edge crosses (below `n_left_end`) its whole
        mask again."""
        if const_expr(not self.overlap):
            self.pingpong_wait(ctx)
            kv_state = self.block_step(ctx, kv_state, n_max - 1, is_first=True, mask_seqlen=True,
                                       mask_causal=self.causal, mask_window=self.has_window)
            n_after_first = n_max - 1
            if const_expr(self.mask_right):
                n_diag = cutlass.max(n_after_first - n_mask_from, 0)
                for i in cutlass.range(n_diag, unroll=1):
                    kv_state = self.block_step(ctx, kv_state, n_after_first - 1 - i,
                                               is_first=False, mask_seqlen=False,
                                               mask_causal=self.causal, mask_window=self.has_window)
                n_after_first = cutlass.min(n_after_first, n_mask_from)
            if const_expr(self.bounded_left):
                n_full = cutlass.max(n_after_first - n_left_end, 0)
                for i in cutlass.range(n_full, unroll=1):
                    kv_state = self.block_step(ctx, kv_state, n_after_first - 1 - i, is_first=False,
                                               mask_seqlen=False, mask_causal=False)
                n_after_full = cutlass.min(n_after_first, n_left_end)
                for i in cutlass.range(n_after_full - n_min, unroll=1):
                    kv_state = self.block_step(ctx, kv_state, n_after_full - 1 - i, is_first=False,
                                               mask_seqlen=False, mask_causal=False, mask_window=True)
            else:
                for i in cutlass.range(n_after_first - n_min, unroll=1):
                    kv_state = self.block_step(ctx, kv_state, n_after_first - 1 - i, is_first=False,
                                               mask_seqlen=False, mask_causal=False)
            self.pingpong_pass(ctx)
        else:
            if const_expr(self.has_window):
                self.overlap_first_block(ctx, kv_state, n_max - 1, mask_seqlen=True)
            elif const_expr(self.causal):
                self.overlap_first_block(ctx, kv_state, n_max - 1, mask_seqlen=True)
            else:
                # the first (rightmost) block needs the key-length mask only when Sk is not a
                # multiple of tile_n; a masked block costs a third more softmax instructions
                if n_max * self.tile_n == ctx.seqlen_k:
                    self.overlap_first_block(ctx, kv_state, n_max - 1, mask_seqlen=False)
                else:
                    self.overlap_first_block(ctx, kv_state, n_max - 1, mask_seqlen=True)
            n_after_first = n_max - 1
            if const_expr(self.mask_right):
                n_diag = cutlass.max(n_after_first - n_mask_from, 0)
                for i in cutlass.range(n_diag, unroll=1):
                    kv_state = self.overlap_step(ctx, kv_state, n_after_first - 1 - i,
                                                 mask_causal=self.causal, mask_window=self.has_window)
                n_after_first = cutlass.min(n_after_first, n_mask_from)
            if const_expr(self.bounded_left):
                n_full = cutlass.max(n_after_first - n_left_end, 0)
                for i in cutlass.range(n_full, unroll=1):
                    kv_state = self.overlap_step(ctx, kv_state, n_after_first - 1 - i,
                                                 mask_causal=False)
                n_after_full = cutlass.min(n_after_first, n_left_end)
                for i in cutlass.range(n_after_full - n_min, unroll=1):
                    kv_state = self.overlap_step(ctx, kv_state, n_after_full - 1 - i,
                                                 mask_causal=False, mask_window=True)
            else:
                for i in cutlass.range(n_after_first - n_min, unroll=1):
                    kv_state = self.overlap_step(ctx, kv_state, n_after_first - 1 - i,
                                                 mask_causal=False)
            kv_state = self.overlap_last_pv(ctx, kv_state)
        return kv_state

    # ---- ping-pong between consumer warpgroups ------------------------------------------------
    @cute.jit
    def pingpong_wait(self, ctx: TileContext):
        """Wait for this warpgroup's turn to issue MMAs."""
        if const_expr(self.pingpong):
            cute.arch.barrier(barrier_id=ctx.bar_turn, number_of_threads=2 * 128)

    @cute.jit
    def pingpong_pass(self, ctx: TileContext):
        """Hand the turn to the next consumer warpgroup."""
        if const_expr(self.pingpong):
            cute.arch.barrier_arrive(barrier_id=ctx.bar_next, number_of_threads=2 * 128)

    # ---- one block without overlap -------------------------------------------------------------
    @cute.jit
    def block_step(self, ctx, kv_state, n_block: Int32, is_first: cutlass.Constexpr,
                   mask_seqlen: cutlass.Constexpr, mask_causal: cutlass.Constexpr,
                   mask_window: cutlass.Constexpr = False):
        (tSrQ, tSrK, tOrP, tOrVt, tPsP, p_store, acc_O, row_max, row_sum, tScS, t0ScS, s_shape,
         tiled_mma_qk, tiled_mma_pv, pipe_k, pipe_v, scale_log2, m_block, seqlen_q,
         seqlen_k, *_) = ctx
        acc_S = cute.make_rmem_tensor(s_shape, Float32)
        pipe_k.consumer_wait(kv_state)
        L.wgmma(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, kv_state.index],
                zero_init=True, wait_pending=-1)
        if const_expr(is_first):
            self.release_previous_q(ctx)
        self.pingpong_pass(ctx)
        warpgroup.wait_group(0)
        pipe_k.consumer_release(kv_state)
        if const_expr(self.softcap):
            self.apply_softcap(acc_S, ctx.softcap_scale)
        if const_expr(mask_window):
            self.apply_window_mask(ctx, acc_S, n_block, mask_seqlen)
        else:
            self.apply_mask(acc_S, tScS, t0ScS, m_block, n_block, seqlen_q, seqlen_k, mask_seqlen,
                            mask_causal)
        row_scale, any_moved = self.online_softmax(
            acc_S, row_max, row_sum, scale_log2, is_first,
            all_keys_visible=not (is_first or mask_seqlen or mask_causal or mask_window))
        self.write_p(acc_S, tOrP, tPsP, p_store)
        if const_expr(not is_first):
            self.rescale_o(acc_O, row_scale, any_moved)
        if const_expr(self.pv_from_smem):
            cute.arch.fence_view_async_shared()
            cute.arch.sync_warp()  # a warp's P rows feed only that warp's part of the MMA
        pipe_v.consumer_wait(kv_state)
        self.pingpong_wait(ctx)
        L.wgmma(tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, kv_state.index],
                zero_init=False, wait_pending=0)
        pipe_v.consumer_release(kv_state)
        kv_state.advance()
        return kv_state

    # ---- blocks with intra-warpgroup overlap ---------------------------------------------------
    @cute.jit
    def overlap_first_block(self, ctx, kv_state, n_block: Int32, mask_seqlen: cutlass.Constexpr):
        (tSrQ, tSrK, tOrP, tOrVt, tPsP, p_store, acc_O, row_max, row_sum, tScS, t0ScS, s_shape,
         tiled_mma_qk, tiled_mma_pv, pipe_k, pipe_v, scale_log2, m_block, seqlen_q,
         seqlen_k, *_) = ctx
        acc_S = cute.make_rmem_tensor(s_shape, Float32)
        pipe_k.consumer_wait(kv_state)
        L.wgmma(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, kv_state.index],
                zero_init=True, wait_pending=-1)
        self.release_previous_q(ctx)
        warpgroup.wait_group(0)
        pipe_k.consumer_release(kv_state)
        if const_expr(self.softcap):
            self.apply_softcap(acc_S, ctx.softcap_scale)
        if const_expr(self.has_window):
            self.apply_window_mask(ctx, acc_S, n_block, mask_seqlen)
        else:
            self.apply_mask(acc_S, tScS, t0ScS, m_block, n_block, seqlen_q, seqlen_k, mask_seqlen,
                            self.causal)
        self.online_softmax(acc_S, row_max, row_sum, scale_log2, True, all_keys_visible=False)
        self.write_p(acc_S, tOrP, tPsP, p_store)
        if const_expr(self.pv_from_smem):
            cute.arch.fence_view_async_shared()
            cute.arch.sync_warp()

    @cute.jit
    def overlap_step(self, ctx, kv_state, n_block: Int32, mask_causal: cutlass.Constexpr,
                     mask_window: cutlass.Constexpr = False):
        """S of block n_block is computed while P V of the previous block runs."""
        (tSrQ, tSrK, tOrP, tOrVt, tPsP, p_store, acc_O, row_max, row_sum, tScS, t0ScS, s_shape,
         tiled_mma_qk, tiled_mma_pv, pipe_k, pipe_v, scale_log2, m_block, seqlen_q,
         seqlen_k, *_) = ctx
        prev_state = kv_state.clone()
        kv_state.advance()
        acc_S = cute.make_rmem_tensor(s_shape, Float32)
        pipe_k.consumer_wait(kv_state)
        self.pingpong_wait(ctx)
        L.wgmma(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, kv_state.index],
                zero_init=True, wait_pending=-1)
        pipe_v.consumer_wait(prev_state)
        L.wgmma(tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, prev_state.index],
                zero_init=False, wait_pending=-1)
        self.pingpong_pass(ctx)
        warpgroup.wait_group(1)  # S is ready; P V may still run
        pipe_k.consumer_release(kv_state)
        if const_expr(self.softcap):
            self.apply_softcap(acc_S, ctx.softcap_scale)
        if const_expr(mask_window):
            self.apply_window_mask(ctx, acc_S, n_block, False)
        else:
            self.apply_mask(acc_S, tScS, t0ScS, m_block, n_block, seqlen_q, seqlen_k, False,
                            mask_causal)
        row_scale, any_moved = self.online_softmax(acc_S, row_max, row_sum, scale_log2, False,
                                                   all_keys_visible=not (mask_causal or mask_window))
        warpgroup.wait_group(0)  # P V done: its P registers / smem and O may be touched
        pipe_v.consumer_release(prev_state)
        self.write_p(acc_S, tOrP, tPsP, p_store)
        self.rescale_o(acc_O, row_scale, any_moved)
        if const_expr(self.pv_from_smem):
            cute.arch.fence_view_async_shared()
            cute.arch.sync_warp()
        return kv_state

    @cute.jit
    def overlap_last_pv(self, ctx, kv_state):
        (tSrQ, tSrK, tOrP, tOrVt, tPsP, p_store, acc_O, row_max, row_sum, tScS, t0ScS, s_shape,
         tiled_mma_qk, tiled_mma_pv, pipe_k, pipe_v, scale_log2, m_block, seqlen_q,
         seqlen_k, *_) = ctx
        pipe_v.consumer_wait(kv_state)
        L.wgmma(tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, kv_state.index],
                zero_init=False, wait_pending=0)
        pipe_v.consumer_release(kv_state)
        kv_state.advance()
        return kv_state

    # ---- masking -------------------------------------------------------------------------------
    @cute.jit
    def apply_mask(self, acc_S, tScS, t0ScS, m_block: Int32, n_block: Int32, seqlen_q: Int32,
                   seqlen_k: Int32, mask_seqlen: cutlass.Constexpr,
                   mask_causal: cutlass.Constexpr):
        """Set scores of invisible keys to -inf: columns >= Sk (mask_seqlen) and, under causal,
        key j > query i + Sk - Sq.

        Per row, the visible columns are a prefix of the thread's fragment. The limit becomes a
        32-bit keep-mask per 32 fragment elements (one shift), and each element is selected on its
        bit, which ptxas turns into R2P (7 predicates from one register) and one select per element,
        instead of a compare and a select per element."""
        if const_expr(mask_seqlen or mask_causal):
            S = L.acc_rows_cols(acc_S)
            num_cols = cute.size(S.shape[1])
            # fragment element c holds column c // 2 * 8 + c % 2 of thread 0 (L.acc_rows_cols)
            col_offset = tScS[0, 0][1]
            seqlen_limit = seqlen_k - n_block * self.tile_n - col_offset
            for r in cutlass.range_constexpr(cute.size(S.shape[0])):
                limit = seqlen_limit
                if const_expr(mask_causal):
                    row = m_block * self.tile_m + tScS[r, 0][0]
                    if const_expr(self.pack_ratio is not None):
                        row = row // self.pack_ratio
                    causal_limit = row + 1 + seqlen_k - seqlen_q - n_block * self.tile_n - col_offset
                    if const_expr(mask_seqlen):
                        limit = cutlass.min(limit, causal_limit)
                    else:
                        limit = causal_limit
                # column limit -> count of visible fragment elements (columns come in pairs every 8)
                limit = cutlass.max(limit, 0)
                visible = limit // 8 * 2 + cutlass.min(limit % 8, 2)
                for chunk in cutlass.range_constexpr((num_cols + 31) // 32):
                    hidden = cutlass.min(cutlass.max(Int32((chunk + 1) * 32) - visible, 0), 32)
                    keep = Uint32(0xFFFFFFFF) >> Uint32(cutlass.min(hidden, 31))
                    if hidden == 32:
                        keep = Uint32(0)
                    for i in cutlass.range_constexpr(min(32, num_cols - chunk * 32)):
                        c = chunk * 32 + i
                        S[r, c] = S[r, c] if Boolean(keep & Uint32(1 << i)) else -Float32.inf

    @cute.jit
    def apply_window_mask(self, ctx, acc_S, n_block: Int32, mask_seqlen: cutlass.Constexpr):
        """A window's whole mask on one block: per row, the keys from diag - left (a bounded left
        side) to diag + right (causal: right 0; an unbounded right side: no bound) and, with
        mask_seqlen, below Sk stay; the rest become -inf. The visible keys of a thread's row are a
        contiguous run of its fragment: two counts (fragment elements left of the run, elements up to
        its end) give one 32-bit keep word per 32 elements, each element selected on its bit (R2P),
        as `apply_mask` does for a prefix."""
        S = L.acc_rows_cols(acc_S)
        num_cols = cute.size(S.shape[1])
        tScS = ctx.tScS
        # fragment element c holds column c // 2 * 8 + c % 2 of thread 0 (L.acc_rows_cols); keys are
        # counted from this thread's fragment column 0
        block_key = n_block * self.tile_n + tScS[0, 0][1]
        bounded_above = mask_seqlen or self.mask_right
        for r in cutlass.range_constexpr(cute.size(S.shape[0])):
            row = ctx.m_block * self.tile_m + tScS[r, 0][0]
            if const_expr(self.pack_ratio is not None):
                row = row // self.pack_ratio
            diag = row + ctx.seqlen_k - ctx.seqlen_q - block_key  # the row's diagonal key
            end = Int32(0)  # one past the last visible key
            if const_expr(mask_seqlen):
                end = ctx.seqlen_k - block_key
            if const_expr(self.mask_right):
                right_end = diag + 1
                if const_expr(self.bounded_right):
                    right_end = right_end + ctx.window_right
                if const_expr(mask_seqlen):
                    end = cutlass.min(end, right_end)
                else:
                    end = right_end
            # key limits -> counts of fragment elements (columns come in pairs every 8)
            upto = Int32(0)
            if const_expr(bounded_above):
                end = cutlass.max(end, 0)
                upto = end // 8 * 2 + cutlass.min(end % 8, 2)
            before = Int32(0)
            if const_expr(self.bounded_left):
                start = cutlass.max(diag - ctx.window_left, 0)
                before = start // 8 * 2 + cutlass.min(start % 8, 2)
            for chunk in cutlass.range_constexpr((num_cols + 31) // 32):
                keep = Uint32(0xFFFFFFFF)
                if const_expr(bounded_above):
                    hidden = cutlass.min(cutlass.max(Int32((chunk + 1) * 32) - upto, 0), 32)
                    keep = Uint32(0xFFFFFFFF) >> Uint32(cutlass.min(hidden, 31))
                    if hidden == 32:
                        keep = Uint32(0)
                if const_expr(self.bounded_left):
                    skipped = cutlass.min(cutlass.max(before - Int32(chunk * 32), 0), 32)
                    keep = keep & (Uint32(0xFFFFFFFF) << Uint32(cutlass.min(skipped, 31)))
                    if skipped == 32:
                        keep = Uint32(0)
                for i in cutlass.range_constexpr(min(32, num_cols - chunk * 32)):
                    c = chunk * 32 + i
                    S[r, c] = S[r, c] if Boolean(keep & Uint32(1 << i)) else -Float32.inf

    @cute.jit
    def apply_softcap(self, acc_S, softcap_scale: Float32):
        """S -> tanh(S * scale / c) in place, on the MUFU tanh (as flash-attn-4's softcap): the capped
        score in units of c, which the softmax's exponent factor (c * log2(e)) carries."""
        acc_S.store(cute.math.tanh(acc_S.load() * softcap_scale, fastmath=True))

    # ---- softmax -------------------------------------------------------------------------------
    @cute.jit
    def online_softmax(self, acc_S, row_max, row_sum, scale_log2: Float32,
                       is_first: cutlass.Constexpr, all_keys_visible: cutlass.Constexpr):
        """S -> P = exp2(S * scale_log2 - basis * scale_log2) in place; returns (per-row O scale,
        whether any row of this warp moved its basis).

        The row max and row sum are reduced in ILP_CHAINS independent chains: a single chain of
        tile_n / 4 dependent FMNMX or FADD puts its whole latency on the softmax's critical path,
        which is what the other warpgroup's MMAs must hide (most visibly at head dim 64).

        all_keys_visible: no score of this block is masked, so every row's block max is finite and
        so is its basis after the update (a -inf basis jumps by +inf, past any threshold): the
        guard for rows that have seen no key yet is left out."""
        S = L.acc_rows_cols(acc_S)
        num_cols = cute.size(S.shape[1])
        chains = ILP_CHAINS if num_cols % ILP_CHAINS == 0 else 1
        row_scale = cute.make_rmem_tensor(self.rows_per_thread, Float32)
        moved = Boolean(False)
        for r in cutlass.range_constexpr(cute.size(S.shape[0])):
            part = [S[r, j] for j in range(chains)]
            for c in cutlass.range_constexpr(chains, num_cols, chains):
                for j in cutlass.range_constexpr(chains):
                    part[j] = cute.arch.fmax(part[j], S[r, c + j])
            blk_max = _tree(part, cute.arch.fmax)
            blk_max = cute.arch.warp_reduction_max(blk_max, threads_in_group=4)
            basis = blk_max
            scale = Float32(1.0)
            if const_expr(not is_first):
                old = row_max[r]
                new = cute.arch.fmax(old, blk_max)
                # in log2 units; +inf when the basis was still -inf, nan when both are -inf
                jump = (new - old) * scale_log2
                basis = old
                if jump > Float32(self.rescale_threshold):
                    basis = new
                    scale = cute.math.exp2(-jump, fastmath=True)  # the negation is free
                    moved = Boolean(True)
            row_max[r] = basis
            basis_safe = basis
            if const_expr(not all_keys_visible):
                if basis == -Float32.inf:  # no key seen yet: P = exp2(-inf) = 0, not nan
                    basis_safe = Float32(0.0)
            bias = basis_safe * scale_log2
            if const_expr(self.exp2_poly_columns == 0):
                p_row = cute.math.exp2(S[r, None].load() * scale_log2 - bias, fastmath=True)
                S[r, None].store(p_row)
            else:
                # at head dim 64 the exp unit, not the tensor core, bounds a block: a share of
                # the row goes through the FMA pipe instead (kernels/fast_exp2.py)
                for c in cutlass.range_constexpr(num_cols):
                    x = S[r, c] * scale_log2 - bias
                    if const_expr(poly_column(c, num_cols, self.exp2_poly_columns)):
                        S[r, c] = exp2_poly(x)
                    else:
                        S[r, c] = cute.math.exp2(x, fastmath=True)
            sums = [S[r, j] for j in range(chains)]
            for c in cutlass.range_constexpr(chains, num_cols, chains):
                for j in cutlass.range_constexpr(chains):
                    sums[j] = sums[j] + S[r, c + j]
            blk_sum = _tree(sums, lambda a, b: a + b)
            if const_expr(is_first):
                row_sum[r] = blk_sum
            else:
                row_sum[r] = row_sum[r] * scale + blk_sum
            row_scale[r] = scale
        any_moved = moved
        if const_expr(not is_first):
            any_moved = cute.arch.vote_any_sync(moved)
        return row_scale, any_moved

    @cute.jit
    def rescale_o(self, acc_O, row_scale, any_moved):
        """O *= scale per row, skipped when no row of the warp moved its basis."""
        if any_moved:
            O = L.acc_rows_cols(acc_O)
            for r in cutlass.range_constexpr(cute.size(O.shape[0])):
                O[r, None].store(O[r, None].load() * row_scale[r])

    @cute.jit
    def write_p(self, acc_S, tOrP, tPsP, p_store):
        """P (fp32 in the S registers) -> 16-bit A operand: in registers (rs) or shared memory (ss)."""
        P_view = L.acc_as_operand_a(acc_S)
        if const_expr(not self.pv_from_smem):
            # one K block of the value MMA at a time: converted as one tensor, bf16 P lands in a
            # scratch register that ptxas copies into the operand after the wgmma fence, and every
            # wgmma of P V then waits for the one before (192 x 80 at D 128: 8 warpgroup arrives per
            # block instead of 4, 369 -> 358 instructions; 192 x 96 at D 64: 20 arrives, 432 -> 340;
            # fp16 compiles the same either way)
            for k in cutlass.range_constexpr(cute.size(tOrP.shape[2])):
                tOrP[None, None, k].store(P_view[None, None, k].load().to(self.dtype))
        else:
            rP = cute.make_rmem_tensor_like(P_view, self.dtype)
            rP.store(P_view.load().to(self.dtype))
            cute.copy(p_store, p_store.retile(rP), tPsP)

    # ---- epilogue ------------------------------------------------------------------------------
    @cute.jit
    def epilogue(self, acc_O, row_max, row_sum, scale_log2: Float32, sQ, mO, mLSE, tma_atom_O,
                 tiled_mma_pv, tidx: Int32, m_block: Int32, head: Int32, batch_idx: Int32,
                 seqlen_q: Int32, pipe_q, q_state):
        """O / l -> 16-bit -> shared memory (this tile's Q buffer) -> TMA store; LSE from registers."""
        O = L.acc_rows_cols(acc_O)
        lse = cute.make_rmem_tensor(self.rows_per_thread, Float32)
        for r in cutlass.range_constexpr(self.rows_per_thread):
            total = row_sum[r]
            total = total + cute.arch.shuffle_sync_bfly(total, offset=1)
            total = total + cute.arch.shuffle_sync_bfly(total, offset=2)
            empty = total == Float32(0.0) or total != total
            inv = Float32(1.0)
            lse[r] = -Float32.inf
            if not empty:
                inv = cute.arch.rcp_approx(total)
                lse[r] = (row_max[r] * scale_log2 + cute.math.log2(total, fastmath=True)) * Float32(LN_2)
            O[r, None].store(O[r, None].load() * inv)
        rO = cute.make_rmem_tensor_like(acc_O, self.dtype)
        rO.store(acc_O.load().to(self.dtype))

        # every consumer warpgroup is done reading this Q buffer (its S MMAs have completed)
        cute.arch.barrier(barrier_id=BAR_EPILOGUE, number_of_threads=self.num_consumer_threads)
        sO = sQ[None, None, q_state.index]  # O is staged in this tile's Q buffer
        if const_expr(self.head_dim_v != self.head_dim):
            # the first tile_m x Dv elements of the buffer, in O's own layout (both 128-byte swizzled;
            # built here: the host's sO_layout is no value of the kernel's region)
            sO = cute.make_tensor(sO.iterator, L.smem_layout(self.dtype, self.tile_m, self.head_dim_v).outer)
        o_store = cute.make_tiled_copy_C(L.store_atom_16b(self.dtype), tiled_mma_pv).get_slice(tidx)
        cute.copy(o_store, o_store.retile(rO), o_store.partition_D(sO))

        if const_expr(self.return_lse):
            ident_O = cute.make_identity_tensor((self.tile_m, self.head_dim_v))
            tOcO = L.acc_rows_cols(tiled_mma_pv.get_slice(tidx).partition_C(ident_O))
            lse_rows = mLSE[None, head, batch_idx]
            row_limit = seqlen_q
            if const_expr(self.pack_ratio is not None):
                row_limit = seqlen_q * self.pack_ratio
            if tOcO[0, 0][1] == 0:
                for r in cutlass.range_constexpr(self.rows_per_thread):
                    row = m_block * self.tile_m + tOcO[r, 0][0]
                    if row < row_limit:
                        lse_rows[row] = lse[r]

        if const_expr(self.varlen):
            # every row of sO written; stored by all consumer threads, rows past the sequence's end
            # left alone; the second barrier: sO is read before any thread may release the buffer
            cute.arch.barrier(barrier_id=BAR_EPILOGUE, number_of_threads=self.num_consumer_threads)
            gO = cute.local_tile(mO[None, None, head, batch_idx], (self.tile_m, self.head_dim_v),
                                 (m_block, 0))
            self.store_o_rows(sO, gO, tidx, seqlen_q - m_block * self.tile_m)
            cute.arch.barrier(barrier_id=BAR_EPILOGUE, number_of_threads=self.num_consumer_threads)
            if const_expr(not self.defer_q_release):
                if tidx < 32:
                    pipe_q.consumer_release(q_state)
        else:
            self.store_o_tma(sO, mO, tma_atom_O, tidx, m_block, head, batch_idx, pipe_q, q_state)

    @cute.jit
    def store_o_rows(self, sO, gO, tidx: Int32, rows: Int32):
        """The first `rows` rows of the O tile from shared memory to `gO` in 128-bit copies, a row's
        head dim spread over neighbouring threads (coalesced; `varlen_threads_per_row`); the other rows
        belong to the next sequence (or to no sequence) and are not written."""
        threads_per_row = varlen_threads_per_row(self.head_dim_v)
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128)
        threads = cute.make_ordered_layout(
            (self.num_consumer_threads // threads_per_row, threads_per_row), order=(1, 0))
        row_copy = cute.make_tiled_copy_tv(atom, threads, cute.make_layout((1, 8)))
        thr_copy = row_copy.get_slice(tidx)
        tOsO = thr_copy.partition_S(sO)
        tOrO = cute.make_rmem_tensor_like(tOsO, self.dtype)
        cute.autovec_copy(tOsO, tOrO)
        tOgO = thr_copy.partition_D(gO)
        tOcO = thr_copy.partition_S(cute.make_identity_tensor((self.tile_m, self.head_dim_v)))
        for m in cutlass.range_constexpr(cute.size(tOrO.shape[1])):
            if tOcO[0, m, 0][0] < rows:
                cute.copy(row_copy, tOrO[None, m, None], tOgO[None, m, None])

    @cute.jit
    def store_o_tma(self, sO, mO, tma_atom_O, tidx: Int32, m_block: Int32, head: Int32,
                    batch_idx: Int32, pipe_q, q_state):
        """The O tile from shared memory by one TMA store (the store warp)."""
        cute.arch.fence_view_async_shared()
        cute.arch.barrier_arrive(barrier_id=BAR_STORE,
                                 number_of_threads=self.num_consumer_threads + 32)
        if tidx < 32:
            cute.arch.barrier(barrier_id=BAR_STORE,
                              number_of_threads=self.num_consumer_threads + 32)
            gO = cute.local_tile(mO[None, None, head, batch_idx], (self.tile_m, self.head_dim_v),
                                 (m_block, 0))
            tOs, tOg = L.tma_copier(tma_atom_O, sO, gO, smem_staged=False, gmem_tiled=False)
            cute.copy(tma_atom_O, tOs, tOg)
            cute.arch.cp_async_bulk_commit_group()
            if const_expr(not self.defer_q_release):
                cute.arch.cp_async_bulk_wait_group(0, read=True)
                # the Q buffer (holding O) may now be refilled
                pipe_q.consumer_release(q_state)

