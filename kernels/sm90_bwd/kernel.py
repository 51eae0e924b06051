"""Attention backward for Hopper (sm_90a) in CuTe DSL: the main kernel (FA2/FA3 structure).

The tile algorithm is `fa4.kernels.backward_emulation`'s. One CTA per (key block of `tile_n` rows,
KV head, batch): it loads its K and V block once, then walks the query heads of the KV head's group
and, for each, the query blocks of `tile_m` rows that see a key of the block (causal: bottom-right
aligned; blocks left of the first visible row are skipped). dK and dV accumulate in registers over the
whole group (GQA is reduced inside the CTA), and are written once at the end.

Warp roles (384 threads): warpgroup 0 is the producer (warp 0 issues the TMA loads: K and V once, then
Q and dO of each (head, query block) into a `q_stages` ring; the warpgroup gives its registers away
with setmaxnreg); warpgroups 1 and 2 run the MMAs (wgmma) and the elementwise math.

Per (query block, key block), in the two MMA warpgroups:
  S = Q K^T, dP = dO V^T                  (fp32, each warpgroup a half of the tile_m x tile_n tile)
  P = exp2(S * scale_log2 - LSE2)         (LSE2 = LSE * log2 e from the preprocess: +inf on rows that
                                           see no key and on padding rows, so P = 0 there)
  dS = P * (dP - D)
  P, dS -> 16-bit -> shared memory        (both warpgroups' halves; named barriers around it)
  dV += P^T dO, dK += dS^T Q              (fp32 registers; each warpgroup owns half of the key rows
                                           or of the head dim)
  dQ_accum += dS K                        (fp32, red.global.add.f32 per element into (B, Sq, Hq, D);
                                           the scale is applied by the postprocess)
At the end: dK * scale and dV -> 16-bit -> shared memory (the K and V buffers) -> TMA store.

Masks are applied only on boundary blocks: the query blocks that cross the causal diagonal, and every
block when the key block is the last, partial one (keys >= Sk).
"""

# no `from __future__ import annotations`: cute.struct reads its field annotations as objects

import math

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.memory
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as hopper_helpers
from cutlass.tensor_utils import LayoutEnum

from ..sm90 import layouts as L

LOG2_E = math.log2(math.e)

# named barrier ids (0 is __syncthreads)
BAR_PDS_FREE = 1   # every MMA warpgroup is done reading the previous block's P and dS
BAR_PDS_READY = 2  # this block's P and dS are in shared memory
BAR_EPILOGUE = 3


def smem_layout(dtype, rows: int, cols: int, major_mode_size: int, stages=None):
    """Row-major (columns contiguous) swizzled layout whose swizzle atom is at most `major_mode_size`
    columns wide: a buffer that one MMA reads transposed (MN-major) must not swizzle across the
    columns one warpgroup's share of that MMA covers."""
    atom = warpgroup.make_smem_layout_atom(
        hopper_helpers.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, major_mode_size), dtype)
    shape = (rows, cols) if stages is None else (rows, cols, stages)
    order = (0, 1) if stages is None else (0, 1, 2)
    return cute.tile_to_shape(atom, shape, order=order)


class FlashAttentionBackwardSm90:
    """One compiled variant of the main backward kernel.

    Problem constants: dtype ("fp16"/"bf16"), head_dim (64/128), causal.
    Knobs (declared in `fa4.kernels.knobs`, knob set "sm90_bwd"): tile_m (query rows per inner block,
    64/128), tile_n (key rows per CTA, 64/128), q_stages (Q/dO ring depth, 1/2), dq_accum (how dQ
    reaches global memory: "atomic").
    """

    def __init__(self, *, dtype: str, head_dim: int, causal: bool, tile_m: int, tile_n: int,
                 q_stages: int, dq_accum: str):
        from .plan import MMA_WARPGROUPS, REGISTER_SPLIT, SUPPORTED_HEAD_DIMS
        # what this code implements; anything else is refused, never changed into something it runs
        for name, value, implemented in (("tile_m", tile_m, (64, 128)), ("tile_n", tile_n, (64, 128)),
                                         ("q_stages", q_stages, (1, 2)), ("dq_accum", dq_accum, ("atomic",)),
                                         ("head_dim", head_dim, SUPPORTED_HEAD_DIMS)):
            if value not in implemented:
                raise ValueError(f"sm90 backward: {name}={value!r} is not implemented (one of {implemented})")
        self.dq_accum = dq_accum
        self.dtype = {"fp16": cutlass.Float16, "bf16": cutlass.BFloat16}[dtype]
        self.head_dim = head_dim
        self.causal = causal
        self.tile_m = tile_m
        self.tile_n = tile_n
        self.q_stages = q_stages
        self.num_mma_threads = 128 * MMA_WARPGROUPS
        self.num_threads = 128 + self.num_mma_threads
        self.producer_regs, self.mma_regs = REGISTER_SPLIT
        # how the two MMA warpgroups split each product (M, N, K atoms): a 64-row wgmma per
        # warpgroup, so a 64-row side is split along the other dimension
        self.sdp_atoms = (2, 1, 1) if tile_m == 128 else (1, 2, 1)   # S, dP: tile_m x tile_n
        self.dkv_atoms = (2, 1, 1) if tile_n == 128 else (1, 2, 1)   # dK, dV: tile_n x D
        self.dq_atoms = (2, 1, 1) if tile_m == 128 else (1, 2, 1)    # dQ: tile_m x D

    # ------------------------------------------------------------------------------------------
    # shared memory and MMAs
    # ------------------------------------------------------------------------------------------
    def _make_layouts(self) -> None:
        d = self.head_dim
        dkv_n = d // self.dkv_atoms[1]      # head-dim columns of one warpgroup's dK / dV
        dq_n = d // self.dq_atoms[1]        # head-dim columns of one warpgroup's dQ
        sdp_n = self.tile_n // self.sdp_atoms[1]
        dkv_m = self.tile_n // self.dkv_atoms[0]
        # Q and dO are read transposed by dK / dV (N = head dim), K transposed by dQ, P and dS
        # transposed by dV / dK (M = keys)
        self.sQ_layout = smem_layout(self.dtype, self.tile_m, d, dkv_n, self.q_stages)
        self.sdO_layout = smem_layout(self.dtype, self.tile_m, d, dkv_n, self.q_stages)
        self.sK_layout = smem_layout(self.dtype, self.tile_n, d, dq_n)
        self.sV_layout = smem_layout(self.dtype, self.tile_n, d, d)
        self.sPdS_layout = smem_layout(self.dtype, self.tile_m, self.tile_n, math.gcd(sdp_n, dkv_m))

    def shared_storage(self):
        self._make_layouts()
        align = 1024

        def buffer(layout):
            return cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(layout)], align]

        @cute.struct
        class SharedStorage:
            mbar_qdo: cute.struct.MemRange[cutlass.Int64, self.q_stages * 2]
            mbar_kv: cute.struct.MemRange[cutlass.Int64, 2]
            sQ: buffer(self.sQ_layout)
            sdO: buffer(self.sdO_layout)
            sK: buffer(self.sK_layout)
            sV: buffer(self.sV_layout)
            sP: buffer(self.sPdS_layout)
            sdS: buffer(self.sPdS_layout)

        return SharedStorage

    def _tiled_mmas(self):
        K, MN = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        sdp = hopper_helpers.make_trivial_tiled_mma(
            self.dtype, self.dtype, K, K, Float32, atom_layout_mnk=self.sdp_atoms,
            tiler_mn=(64, self.tile_n // self.sdp_atoms[1]))
        dkv = hopper_helpers.make_trivial_tiled_mma(
            self.dtype, self.dtype, MN, MN, Float32, atom_layout_mnk=self.dkv_atoms,
            tiler_mn=(64, self.head_dim // self.dkv_atoms[1]))
        dq = hopper_helpers.make_trivial_tiled_mma(
            self.dtype, self.dtype, K, MN, Float32, atom_layout_mnk=self.dq_atoms,
            tiler_mn=(64, self.head_dim // self.dq_atoms[1]))
        return sdp, dkv, dq

    # ------------------------------------------------------------------------------------------
    # launch
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                 mLSE2: cute.Tensor, mDelta: cute.Tensor, mdQaccum: cute.Tensor,
                 mdK: cute.Tensor, mdV: cute.Tensor, softmax_scale: Float32,
                 stream: cuda.CUstream):
        """Q, dO: (B, Sq, Hq, D); K, V, dK, dV: (B, Sk, Hkv, D); LSE2, D: (B, Hq, Sq padded to
        tile_m) fp32 (the preprocess's); dQ_accum: (B, Sq, Hq, D) fp32, zeroed."""
        for t in (mQ, mK, mV, mdO, mdK, mdV):
            if const_expr(t.element_type != self.dtype):
                raise TypeError("Q, K, V, dO, dK and dV must all have the kernel's dtype")
        # (B, S, H, D) -> (S, D, H, B); (B, H, S) -> (S, H, B)
        mQ, mK, mV, mdO, mdQaccum, mdK, mdV = [L.permute_modes(t, [1, 3, 2, 0])
                                               for t in (mQ, mK, mV, mdO, mdQaccum, mdK, mdV)]
        mLSE2, mDelta = [L.permute_modes(t, [2, 1, 0]) for t in (mLSE2, mDelta)]
        seqlen_q = mQ.shape[0]
        seqlen_k = mK.shape[0]
        heads_kv = mK.shape[2]
        batch = mQ.shape[3]
        ratio = mQ.shape[2] // heads_kv

        SharedStorage = self.shared_storage()
        self.smem_bytes = int(SharedStorage.size_in_bytes())  # recorded at trace time for reports
        tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq = self._tiled_mmas()
        sQ_one = cute.select(self.sQ_layout, mode=[0, 1])
        sdO_one = cute.select(self.sdO_layout, mode=[0, 1])
        load_op = cpasync.CopyBulkTensorTileG2SOp()
        store_op = cpasync.CopyBulkTensorTileS2GOp()
        d = self.head_dim
        tma_atom_Q, tma_Q = cpasync.make_tiled_tma_atom(load_op, mQ, sQ_one, (self.tile_m, d))
        tma_atom_dO, tma_dO = cpasync.make_tiled_tma_atom(load_op, mdO, sdO_one, (self.tile_m, d))
        tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(load_op, mK, self.sK_layout, (self.tile_n, d))
        tma_atom_V, tma_V = cpasync.make_tiled_tma_atom(load_op, mV, self.sV_layout, (self.tile_n, d))
        tma_atom_dK, tma_dK = cpasync.make_tiled_tma_atom(store_op, mdK, self.sK_layout,
                                                          (self.tile_n, d))
        tma_atom_dV, tma_dV = cpasync.make_tiled_tma_atom(store_op, mdV, self.sV_layout,
                                                          (self.tile_n, d))
        self.qdo_bytes = cute.size_in_bytes(self.dtype, sQ_one) + cute.size_in_bytes(self.dtype, sdO_one)
        self.kv_bytes = (cute.size_in_bytes(self.dtype, self.sK_layout)
                         + cute.size_in_bytes(self.dtype, self.sV_layout))

        num_n_blocks = (seqlen_k + self.tile_n - 1) // self.tile_n
        scale_log2 = softmax_scale * Float32(LOG2_E)
        self.kernel(
            tma_Q, tma_dO, tma_K, tma_V, tma_dK, tma_dV, mLSE2, mDelta, mdQaccum,
            tma_atom_Q, tma_atom_dO, tma_atom_K, tma_atom_V, tma_atom_dK, tma_atom_dV,
            softmax_scale, scale_log2, seqlen_q, seqlen_k, ratio,
            tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq,
            self.sQ_layout, self.sdO_layout, self.sK_layout, self.sV_layout, self.sPdS_layout,
            SharedStorage,
        ).launch(grid=(num_n_blocks, heads_kv, batch), block=[self.num_threads, 1, 1],
                 stream=stream, min_blocks_per_mp=1)

    # ------------------------------------------------------------------------------------------
    # device code
    # ------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mdO: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor,
               mdK: cute.Tensor, mdV: cute.Tensor, mLSE2: cute.Tensor, mDelta: cute.Tensor,
               mdQaccum: cute.Tensor, tma_atom_Q: cute.CopyAtom, tma_atom_dO: cute.CopyAtom,
               tma_atom_K: cute.CopyAtom, tma_atom_V: cute.CopyAtom, tma_atom_dK: cute.CopyAtom,
               tma_atom_dV: cute.CopyAtom, softmax_scale: Float32, scale_log2: Float32,
               seqlen_q: Int32, seqlen_k: Int32, ratio: Int32,
               tiled_mma_sdp: cute.TiledMma, tiled_mma_dkv: cute.TiledMma,
               tiled_mma_dq: cute.TiledMma, sQ_layout: cute.ComposedLayout,
               sdO_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
               sV_layout: cute.ComposedLayout, sPdS_layout: cute.ComposedLayout,
               SharedStorage: cutlass.Constexpr):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            for atom in (tma_atom_Q, tma_atom_dO, tma_atom_K, tma_atom_V, tma_atom_dK, tma_atom_dV):
                cpasync.prefetch_descriptor(atom)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        one_thread = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        mma_warps = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_mma_threads // 32)
        pipe_qdo = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_qdo.data_ptr(), num_stages=self.q_stages,
            producer_group=one_thread, consumer_group=mma_warps, tx_count=self.qdo_bytes,
            defer_sync=True)
        pipe_kv = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_kv.data_ptr(), num_stages=1,
            producer_group=one_thread, consumer_group=mma_warps, tx_count=self.kv_bytes,
            defer_sync=True)
        pipeline.pipeline_init_arrive(cluster_shape_mn=None, is_relaxed=True)

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sdO = storage.sdO.get_tensor(sdO_layout.outer, swizzle=sdO_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sP = storage.sP.get_tensor(sPdS_layout.outer, swizzle=sPdS_layout.inner)
        sdS = storage.sdS.get_tensor(sPdS_layout.outer, swizzle=sPdS_layout.inner)
        pipeline.pipeline_init_wait(cluster_shape_mn=None)

        n_block, head_kv, batch_idx = cute.arch.block_idx()
        m_min, m_max, m_mask_end = self.query_block_range(n_block, seqlen_q, seqlen_k)

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                self.produce(mQ, mdO, mK, mV, sQ, sdO, sK, sV, tma_atom_Q, tma_atom_dO, tma_atom_K,
                             tma_atom_V, pipe_qdo, pipe_kv, n_block, head_kv, batch_idx, ratio,
                             m_min, m_max)
        else:
            cute.arch.setmaxregister_increase(self.mma_regs)
            self.consume(mdK, mdV, mLSE2, mDelta, mdQaccum, sQ, sdO, sK, sV, sP, sdS, tma_atom_dK,
                         tma_atom_dV, pipe_qdo, pipe_kv, tiled_mma_sdp, tiled_mma_dkv,
                         tiled_mma_dq, softmax_scale, scale_log2, seqlen_q, seqlen_k, ratio,
                         n_block, head_kv, batch_idx, m_min, m_max, m_mask_end)

    # ---- block ranges --------------------------------------------------------------------------
    @cute.jit
    def query_block_range(self, n_block: Int32, seqlen_q: Int32, seqlen_k: Int32):
        """(m_min, m_max, m_mask_end): the query blocks [m_min, m_max) that see a key of this block,
        and the end of the masked ones ([m_min, m_mask_end) carry a mask)."""
        m_max = (seqlen_q + self.tile_m - 1) // self.tile_m
        m_min = Int32(0)
        m_mask_end = Int32(0)
        offset = seqlen_k - seqlen_q  # key j is visible to query i when j <= i + offset
        if const_expr(self.causal):
            # the first row that sees the block's first key; blocks above it are skipped
            m_min = cutlass.max(n_block * self.tile_n - offset, 0) // self.tile_m
            # the first row that sees the block's last key: blocks from its block on need no mask
            full_row = cutlass.max((n_block + 1) * self.tile_n - 1 - offset, 0)
            m_mask_end = cutlass.min((full_row + self.tile_m - 1) // self.tile_m, m_max)
        if (n_block + 1) * self.tile_n > seqlen_k:  # the last key block is partial: keys >= Sk
            m_mask_end = m_max
        return m_min, m_max, m_mask_end

    # ---- producer ------------------------------------------------------------------------------
    @cute.jit
    def produce(self, mQ, mdO, mK, mV, sQ, sdO, sK, sV, tma_atom_Q, tma_atom_dO, tma_atom_K,
                tma_atom_V, pipe_qdo, pipe_kv, n_block: Int32, head_kv: Int32, batch_idx: Int32,
                ratio: Int32, m_min: Int32, m_max: Int32):
        d = self.head_dim
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        gK = cute.local_tile(mK[None, None, head_kv, batch_idx], (self.tile_n, d), (n_block, 0))
        gV = cute.local_tile(mV[None, None, head_kv, batch_idx], (self.tile_n, d), (n_block, 0))
        tKs, tKg = L.tma_copier(tma_atom_K, sK, gK, smem_staged=False, gmem_tiled=False)
        tVs, tVg = L.tma_copier(tma_atom_V, sV, gV, smem_staged=False, gmem_tiled=False)
        pipe_kv.producer_acquire(kv_state)
        cute.copy(tma_atom_K, tKg, tKs, tma_bar_ptr=pipe_kv.producer_get_barrier(kv_state))
        cute.copy(tma_atom_V, tVg, tVs, tma_bar_ptr=pipe_kv.producer_get_barrier(kv_state))

        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.q_stages)
        m_count = cutlass.max(m_max - m_min, 0)
        for t in cutlass.range(ratio * m_count, unroll=1):
            head = head_kv * ratio + t // m_count
            m_block = m_min + t % m_count
            gQ = cute.local_tile(mQ[None, None, head, batch_idx], (self.tile_m, d), (m_block, 0))
            gdO = cute.local_tile(mdO[None, None, head, batch_idx], (self.tile_m, d), (m_block, 0))
            tQs, tQg = L.tma_copier(tma_atom_Q, sQ, gQ, smem_staged=True, gmem_tiled=False)
            tdOs, tdOg = L.tma_copier(tma_atom_dO, sdO, gdO, smem_staged=True, gmem_tiled=False)
            pipe_qdo.producer_acquire(q_state)
            cute.copy(tma_atom_Q, tQg, tQs[None, q_state.index],
                      tma_bar_ptr=pipe_qdo.producer_get_barrier(q_state))
            cute.copy(tma_atom_dO, tdOg, tdOs[None, q_state.index],
                      tma_bar_ptr=pipe_qdo.producer_get_barrier(q_state))
            q_state.advance()

    # ---- MMA warpgroups ------------------------------------------------------------------------
    @cute.jit
    def consume(self, mdK, mdV, mLSE2, mDelta, mdQaccum, sQ, sdO, sK, sV, sP, sdS, tma_atom_dK,
                tma_atom_dV, pipe_qdo, pipe_kv, tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq,
                softmax_scale: Float32, scale_log2: Float32, seqlen_q: Int32, seqlen_k: Int32,
                ratio: Int32, n_block: Int32, head_kv: Int32, batch_idx: Int32, m_min: Int32,
                m_max: Int32, m_mask_end: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        tidx = tidx - 128
        wg_idx = cute.arch.make_warp_uniform(tidx // 128)
        d = self.head_dim
        wg_sdp = tiled_mma_sdp.get_slice(wg_idx * 128)
        wg_dkv = tiled_mma_dkv.get_slice(wg_idx * 128)
        wg_dq = tiled_mma_dq.get_slice(wg_idx * 128)
        thr_sdp = tiled_mma_sdp.get_slice(tidx)
        thr_dq = tiled_mma_dq.get_slice(tidx)

        # operands: S = Q K^T, dP = dO V^T, dV += P^T dO, dK += dS^T Q, dQ = dS K
        tSrQ = wg_sdp.make_fragment_A(wg_sdp.partition_A(sQ))
        tSrK = wg_sdp.make_fragment_B(wg_sdp.partition_B(sK))
        tdPrdO = wg_sdp.make_fragment_A(wg_sdp.partition_A(sdO))
        tdPrV = wg_sdp.make_fragment_B(wg_sdp.partition_B(sV))
        tdVrPt = wg_dkv.make_fragment_A(wg_dkv.partition_A(L.transpose_smem_view(sP)))
        tdVrdOt = wg_dkv.make_fragment_B(wg_dkv.partition_B(L.transpose_smem_view(sdO)))
        tdKrdSt = wg_dkv.make_fragment_A(wg_dkv.partition_A(L.transpose_smem_view(sdS)))
        tdKrQt = wg_dkv.make_fragment_B(wg_dkv.partition_B(L.transpose_smem_view(sQ)))
        tdQrdS = wg_dq.make_fragment_A(wg_dq.partition_A(sdS))
        tdQrKt = wg_dq.make_fragment_B(wg_dq.partition_B(L.transpose_smem_view(sK)))

        s_shape = wg_sdp.partition_shape_C((self.tile_m, self.tile_n))
        dq_shape = wg_dq.partition_shape_C((self.tile_m, d))
        acc_dK = cute.make_rmem_tensor(wg_dkv.partition_shape_C((self.tile_n, d)), Float32)
        acc_dV = cute.make_rmem_tensor(wg_dkv.partition_shape_C((self.tile_n, d)), Float32)
        acc_dK.fill(0.0)
        acc_dV.fill(0.0)

        # (row, col) of this thread's S and dQ fragment elements
        ident_S = cute.make_identity_tensor((self.tile_m, self.tile_n))
        tScS = L.acc_rows_cols(thr_sdp.partition_C(ident_S))
        t0ScS = L.acc_rows_cols(tiled_mma_sdp.get_slice(0).partition_C(ident_S))  # compile-time
        tdQcdQ = thr_dq.partition_C(cute.make_identity_tensor((self.tile_m, d)))
        pds_store = cute.make_tiled_copy_C(L.store_atom_16b(self.dtype), tiled_mma_sdp).get_slice(tidx)
        tPsP = pds_store.partition_D(sP)
        tdSsdS = pds_store.partition_D(sdS)

        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        pipe_kv.consumer_wait(kv_state)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.q_stages)
        m_count = cutlass.max(m_max - m_min, 0)
        for t in cutlass.range(ratio * m_count, unroll=1):
            head = head_kv * ratio + t // m_count
            m_block = m_min + t % m_count
            operands = (tSrQ[None, None, None, q_state.index], tSrK,
                        tdPrdO[None, None, None, q_state.index], tdPrV, tdVrPt,
                        tdVrdOt[None, None, None, q_state.index], tdKrdSt,
                        tdKrQt[None, None, None, q_state.index], tdQrdS, tdQrKt)
            if m_block < m_mask_end:
                self.block_step(operands, acc_dK, acc_dV, s_shape, dq_shape, tScS, t0ScS, tdQcdQ,
                                pds_store, tPsP, tdSsdS, mLSE2, mDelta, mdQaccum, tiled_mma_sdp,
                                tiled_mma_dkv, tiled_mma_dq, thr_dq, pipe_qdo, q_state,
                                scale_log2, seqlen_q, seqlen_k, n_block, m_block, head,
                                batch_idx, masked=True)
            else:
                self.block_step(operands, acc_dK, acc_dV, s_shape, dq_shape, tScS, t0ScS, tdQcdQ,
                                pds_store, tPsP, tdSsdS, mLSE2, mDelta, mdQaccum, tiled_mma_sdp,
                                tiled_mma_dkv, tiled_mma_dq, thr_dq, pipe_qdo, q_state,
                                scale_log2, seqlen_q, seqlen_k, n_block, m_block, head,
                                batch_idx, masked=False)
            q_state.advance()
        self.epilogue(acc_dK, acc_dV, softmax_scale, sK, sV, mdK, mdV, tma_atom_dK, tma_atom_dV,
                      tiled_mma_dkv, tidx, n_block, head_kv, batch_idx)

    @cute.jit
    def block_step(self, operands, acc_dK, acc_dV, s_shape, dq_shape, tScS, t0ScS, tdQcdQ, pds_store,
                   tPsP, tdSsdS, mLSE2, mDelta, mdQaccum, tiled_mma_sdp, tiled_mma_dkv,
                   tiled_mma_dq, thr_dq, pipe_qdo, q_state, scale_log2: Float32, seqlen_q: Int32,
                   seqlen_k: Int32, n_block: Int32, m_block: Int32, head: Int32, batch_idx: Int32,
                   masked: cutlass.Constexpr):
        """One (query block, key block) of one query head: the module docstring's five products."""
        tSrQ, tSrK, tdPrdO, tdPrV, tdVrPt, tdVrdOt, tdKrdSt, tdKrQt, tdQrdS, tdQrKt = operands
        # this thread's rows' LSE2 and D (the workspaces are padded to whole query blocks)
        rows = cute.size(tScS.shape[0])  # 2: an m64 wgmma gives each thread rows r and r + 8
        lse2 = cute.make_rmem_tensor(rows, Float32)
        delta = cute.make_rmem_tensor(rows, Float32)
        for r in cutlass.range_constexpr(rows):
            row = m_block * self.tile_m + tScS[r, 0][0]
            lse2[r] = mLSE2[row, head, batch_idx]
            delta[r] = mDelta[row, head, batch_idx]

        pipe_qdo.consumer_wait(q_state)
        acc_S = cute.make_rmem_tensor(s_shape, Float32)
        acc_dP = cute.make_rmem_tensor(s_shape, Float32)
        L.wgmma(tiled_mma_sdp, acc_S, tSrQ, tSrK, zero_init=True, wait_pending=-1)
        L.wgmma(tiled_mma_sdp, acc_dP, tdPrdO, tdPrV, zero_init=True, wait_pending=0)
        if const_expr(masked):
            self.apply_mask(acc_S, tScS, t0ScS, m_block, n_block, seqlen_q, seqlen_k)
        S = L.acc_rows_cols(acc_S)
        dP = L.acc_rows_cols(acc_dP)
        for r in cutlass.range_constexpr(cute.size(S.shape[0])):
            p_row = cute.math.exp2(S[r, None].load() * scale_log2 - lse2[r], fastmath=True)
            S[r, None].store(p_row)
            dP[r, None].store(p_row * (dP[r, None].load() - delta[r]))
        rP = cute.make_rmem_tensor_like(acc_S, self.dtype)
        rP.store(acc_S.load().to(self.dtype))
        rdS = cute.make_rmem_tensor_like(acc_dP, self.dtype)
        rdS.store(acc_dP.load().to(self.dtype))

        # both warpgroups' previous dV / dK / dQ products have read P and dS
        cute.arch.barrier(barrier_id=BAR_PDS_FREE, number_of_threads=self.num_mma_threads)
        cute.copy(pds_store, pds_store.retile(rP), tPsP)
        cute.copy(pds_store, pds_store.retile(rdS), tdSsdS)
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=BAR_PDS_READY, number_of_threads=self.num_mma_threads)

        L.wgmma(tiled_mma_dkv, acc_dV, tdVrPt, tdVrdOt, zero_init=False, wait_pending=-1)
        L.wgmma(tiled_mma_dkv, acc_dK, tdKrdSt, tdKrQt, zero_init=False, wait_pending=-1)
        acc_dQ = cute.make_rmem_tensor(dq_shape, Float32)
        L.wgmma(tiled_mma_dq, acc_dQ, tdQrdS, tdQrKt, zero_init=True, wait_pending=0)
        pipe_qdo.consumer_release(q_state)
        self.accumulate_dq(acc_dQ, tdQcdQ, thr_dq, mdQaccum, m_block, head, batch_idx, seqlen_q)

    @cute.jit
    def apply_mask(self, acc_S, tScS, t0ScS, m_block: Int32, n_block: Int32, seqlen_q: Int32,
                   seqlen_k: Int32):
        """Scores of invisible keys -> -inf: keys >= Sk and, under causal, key j > query i + Sk - Sq.

        A fragment element's column is this thread's first column plus thread 0's column of the
        same element (a compile-time constant), so each compare is against an immediate; comparing
        per-element thread columns would keep one register per element live across the block loop."""
        S = L.acc_rows_cols(acc_S)
        col_base = n_block * self.tile_n + tScS[0, 0][1]
        for r in cutlass.range_constexpr(cute.size(S.shape[0])):
            limit = seqlen_k - col_base  # element c is visible when its thread-0 column < limit
            if const_expr(self.causal):
                row = m_block * self.tile_m + tScS[r, 0][0]
                limit = cutlass.min(limit, row + 1 + seqlen_k - seqlen_q - col_base)
            for c in cutlass.range_constexpr(cute.size(S.shape[1])):
                if t0ScS[r, c][1] >= limit:
                    S[r, c] = -Float32.inf

    @cute.jit
    def accumulate_dq(self, acc_dQ, tdQcdQ, thr_dq, mdQaccum, m_block: Int32, head: Int32,
                      batch_idx: Int32, seqlen_q: Int32):
        """dQ_accum[rows of this block] += dS K, one red.global.add.f32 per element (rows < Sq).

        Addressed per row: one pointer per fragment row, the columns as compile-time offsets from
        it (the head dim is contiguous), so the loop keeps two pointers live, not one per element
        (per-element offsets hoisted out of the block loop spill at 128 x 128)."""
        gdQ = cute.local_tile(mdQaccum[None, None, head, batch_idx], (self.tile_m, self.head_dim),
                              (m_block, 0))
        dQ = L.acc_rows_cols(acc_dQ)
        gdQ_rows = L.acc_rows_cols(thr_dq.partition_C(gdQ))
        cdQ_rows = L.acc_rows_cols(tdQcdQ)
        row_limit = seqlen_q - m_block * self.tile_m
        for r in cutlass.range_constexpr(cute.size(dQ.shape[0])):
            if cdQ_rows[r, 0][0] < row_limit:
                g_row = gdQ_rows[r, None]
                for c in cutlass.range_constexpr(cute.size(dQ.shape[1])):
                    ptr = g_row.iterator + cute.crd2idx(c, g_row.layout)
                    cute.arch.red(ptr, dQ[r, c], op="add", dtype="f32", sem="relaxed", scope="gpu")

    # ---- epilogue ------------------------------------------------------------------------------
    @cute.jit
    def epilogue(self, acc_dK, acc_dV, softmax_scale: Float32, sK, sV, mdK, mdV, tma_atom_dK,
                 tma_atom_dV, tiled_mma_dkv, tidx: Int32, n_block: Int32, head_kv: Int32,
                 batch_idx: Int32):
        """dK * scale and dV -> 16-bit -> shared memory (the K and V buffers) -> TMA store."""
        rdK = cute.make_rmem_tensor_like(acc_dK, self.dtype)
        rdK.store((acc_dK.load() * softmax_scale).to(self.dtype))
        rdV = cute.make_rmem_tensor_like(acc_dV, self.dtype)
        rdV.store(acc_dV.load().to(self.dtype))
        # every warpgroup's last products have read K and V
        cute.arch.barrier(barrier_id=BAR_EPILOGUE, number_of_threads=self.num_mma_threads)
        store = cute.make_tiled_copy_C(L.store_atom_16b(self.dtype), tiled_mma_dkv).get_slice(tidx)
        cute.copy(store, store.retile(rdK), store.partition_D(sK))
        cute.copy(store, store.retile(rdV), store.partition_D(sV))
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=BAR_EPILOGUE, number_of_threads=self.num_mma_threads)
        if tidx < 32:
            d = self.head_dim
            gdK = cute.local_tile(mdK[None, None, head_kv, batch_idx], (self.tile_n, d), (n_block, 0))
            gdV = cute.local_tile(mdV[None, None, head_kv, batch_idx], (self.tile_n, d), (n_block, 0))
            tdKs, tdKg = L.tma_copier(tma_atom_dK, sK, gdK, smem_staged=False, gmem_tiled=False)
            tdVs, tdVg = L.tma_copier(tma_atom_dV, sV, gdV, smem_staged=False, gmem_tiled=False)
            cute.copy(tma_atom_dK, tdKs, tdKg)
            cute.copy(tma_atom_dV, tdVs, tdVg)
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)
