"""The FA4 forward kernel for Blackwell (sm_100a), in CuTe DSL.

NOT RUN ON HARDWARE. No Blackwell GPU is available to this project: this kernel has only been traced
and compiled for sm_100a on a CPU (every configuration of `search_spaces/sm100.toml` that the
feasibility model accepts), and its tile algorithm is replayed numerically by `emulation.py`. Its
first launch on a B200 may fault or be wrong; `fa4.attention` uses it only when the user opts in.

Design contract: `docs/design.md` section 2. One CTA owns `q_stages` Q tiles of 128 rows each
(in packed-GQA row space when `pack_gqa`) of one (batch, head) and streams its KV blocks from the last
to the first. 512 threads in 16 warps:

    warps 0-3    softmax warpgroup 0 (Q stage 0): S (TMEM) -> registers, mask, max, P = exp2, P -> TMEM
    warps 4-7    softmax warpgroup 1 (Q stage 1); with q_stages=1 this warpgroup gives its registers
                 back and idles (the rows are not split: a 128-row tile is one tcgen05 MMA of M=128
                 whose accumulator rows map 1:1 onto the 128 TMEM lanes one warpgroup reads)
    warps 8-11   correction warpgroup: conditional O rescale in TMEM, final O / l, LSE, O -> SMEM
    warp 12      MMA warp: score MMA S = Q K^T and value MMA O += P V, in the interleaved order
    warp 13      load warp: TMA of Q (one per stage) and of the K/V ring
    warp 14      store warp: TMA store of O
    warp 15      idle (the CTA is four full warpgroups so `setmaxnreg` can split registers by group)

TMEM (512 columns x 128 lanes of 32 bit): O of stage q at columns [q*D, (q+1)*D); the S/P ring of
`tmem_stages` buffers of `tile_n` columns after that. Score MMA number k of the CTA (counted over all
tiles it runs, stage-minor) writes ring buffer k % tmem_stages; the softmax overwrites S with P packed
as 16-bit pairs in the buffer's first tile_n/2 columns; the value MMA reads P from there.

MMA issue order: with L = tmem_stages - 1, step s issues score MMA s and then value MMA s - L. With two
Q stages and two TMEM buffers that is the seed's order (S0 S1 P0 S2 P1 S3 ...): the softmax of one
stage runs while the tensor core works on the other stage. The load warp issues K and V tiles in the
order the MMA warp first needs them, into a ring of `kv_stages` slots shared by K and V.

Barriers (mbarriers in shared memory; three kinds):
    TMA (complete on bytes):         q_full[Q], kv_full[KV]
    tcgen05 (complete on MMA commit): q_empty[Q], kv_empty[KV], s_full[T], o_done[Q]
    plain (complete on arrivals):    p_full[T], mail_full[Q], mail_empty[Q], o_ready[Q],
                                     epi_full[Q], epi_empty[Q]
The value MMA of stage q waits on three: kv_full (V landed), p_full (softmax wrote P) and o_ready
(the correction warpgroup rescaled O, or released it without touching it). o_ready is arrived once per
value MMA: by the correction step of the block for blocks 1.., and for block 0 by the previous tile's
epilogue (or at start), which releases O only after it has read it. With tmem_stages == q_stages
(the default) the last two are one barrier: the correction warpgroup arrives on p_full[q] (S/P
buffer q is stage q's then) and the value MMA waits twice, kv_full and p_full (`p_o_merged`).
A score MMA does not wait for its S/P buffer: the value MMA that last read the buffer was issued
before it by the same thread, and tcgen05.mma from one thread execute in issue order (flash-attn-4
relies on the same). o_done is committed after every value MMA only when tmem_stages > q_stages; with
tmem_stages <= q_stages value MMA (i-1, q) is issued before score MMA (i, q), whose s_full commit
tracks it, so the softmax's wait and its mailbox already tell the correction warpgroup that O[q] is
settled, and o_done marks only the task's last value MMA (for the epilogue).

Mailbox (softmax -> correction, one slot per Q stage in shared memory, full/empty phases): per block
after the first, each row's O scale factor (exactly 1 when the row kept its basis) and one "some row of
this warp moved" flag per warp; at the end of a tile, each row's l and basis m. The correction warp that
owns the same 32 TMEM lanes skips the TMEM round trip when its flag is clear.

Cluster pair (knob `two_cta`, non-causal only): two consecutive CTAs form a cluster and one task.
Q stage q of pair task m is the 256-row tile m*Q + q: CTA v (its rank in the pair) holds rows
[128 v, 128 v + 128) of it in its own shared memory and TMEM, and half of every K tile (K-major: half
the keys) and V tile (MN-major: half the head dim). Only the leader (v = 0) runs the MMA warp's loop,
issuing cta_group::2 MMAs (M = 256) that read both CTAs' shared memory and write both CTAs' TMEM.
Every barrier exists in both CTAs at the same offset; what changes:
    both CTAs' cta_group::2 TMA loads complete on the leader's q_full / kv_full, armed by the leader
        for both halves (the peer's stay unused);
    every tcgen05.commit (q_empty, kv_empty, s_full, o_done) is multicast to both CTAs;
    p_full and o_ready are arrived on the leader's copy by both CTAs' warpgroups (256 arrivals);
    mailbox and epilogue barriers stay per CTA (each CTA's softmax, correction and store roles work
        on their own 128 rows exactly as without the pair);
    TMEM is allocated and freed as a pair (cta_group::2, the allocator's dealloc handshake), and a
        cluster barrier after the barrier init and before exit keeps either CTA from arriving on, or
        reading the shared memory of, a CTA that has not started or has left.
The peer's MMA warp only joins the TMEM handout. With a causal mask the two halves would need
different block ranges and masks, so the feasibility model rejects two_cta for causal problems.

Math (exp2 form, conditional rescale keeping the old basis, P in the inputs' 16-bit type, normalise
once at the end, O = 0 and LSE = -inf for a row that sees no key) is the one of the design contract.
"""

from __future__ import annotations

import math
from typing import Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.memory
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Boolean, Float32, Int32, Int64, Uint32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass.cute.nvgpu import cpasync, tcgen05
from cutlass.tensor_utils import LayoutEnum

from ..fast_exp2 import add_to_exponent
from .plan import EXP2_POLY, EXP2_POLY_CHUNK, EXP2_ROUND_MAGIC, MASK_CHUNK, KernelPlan
from .scheduler import TileScheduler

LOG2_E = math.log2(math.e)
TMEM_LANES = 128
WARP = 32

# Named barrier ids (0 is __syncthreads).
_BAR_TMEM_ALLOC = 1
_BAR_TMEM_FREE = 2


@dsl_user_op
def _shr_u32(value: Uint32, shift: Uint32, *, loc=None, ip=None) -> Uint32:
    """PTX shr.u32: a shift of 32 or more gives 0 (in LLVM IR such a shift is undefined)."""
    return Uint32(llvm.inline_asm(
        T.i32(),
        [Uint32(value).ir_value(loc=loc, ip=ip), Uint32(shift).ir_value(loc=loc, ip=ip)],
        "shr.u32 $0, $1, $2;", "=r,r,r", has_side_effects=False, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT))


@cute.jit
def tcgen05_fence_before_sync():
    """Order this thread's prior tcgen05 ld/st/mma before the barrier arrive that follows."""
    llvm.inline_asm(None, [], "tcgen05.fence::before_thread_sync;", "", has_side_effects=True,
                    is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


@cute.jit
def tcgen05_fence_after_sync():
    """Order the tcgen05 ld/st/mma that follow a barrier wait after the other side's arrive."""
    llvm.inline_asm(None, [], "tcgen05.fence::after_thread_sync;", "", has_side_effects=True,
                    is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


class _Barriers:
    """The kernel's mbarriers: one Int64 array in shared memory, a fixed slice per barrier kind.

    Phases are derived from use counters kept by each role (use u of a slot waits parity u & 1 as the
    consumer; a producer waiting for a free slot waits parity (u & 1) ^ 1, which passes on first use).
    """

    def __init__(self, plan: KernelPlan, base):
        self.plan = plan
        self.base = base

    # lets the DSL carry the object through dynamic control flow (only the pointer is a value)
    def __extract_mlir_values__(self):
        return cutlass.extract_mlir_values(self.base)

    def __new_from_mlir_values__(self, values):
        return _Barriers(self.plan, cutlass.new_from_mlir_values(self.base, values))

    def ptr(self, kind: str, index=0):
        return self.base + (self.plan.barrier_offsets[kind] + index)

    def init(self):
        p = self.plan
        counts = p.barrier_arrivals
        for kind, (offset, size) in p.barrier_slices.items():
            for i in range(size):
                cute.arch.mbarrier_init(self.base + (offset + i), counts[kind])

    def wait(self, kind: str, index, phase):
        cute.arch.mbarrier_wait(self.ptr(kind, index), phase)

    def arrive(self, kind: str, index=0):
        cute.arch.mbarrier_arrive(self.ptr(kind, index))

    def arrive_one(self, kind: str, index=0):
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive(self.ptr(kind, index))

    def arrive_leader(self, kind: str, index=0):
        """Arrive on the barrier the MMA warp waits on: in a CTA pair the leader's (rank 0 of the
        cluster pair; its p_full and o_ready count both CTAs' warpgroups), else this CTA's own."""
        if const_expr(self.plan.two_cta):
            cute.arch.mbarrier_arrive(self.ptr(kind, index), Int32(0))
        else:
            cute.arch.mbarrier_arrive(self.ptr(kind, index))

    def commit(self, kind: str, index=0):
        # tcgen05.commit: arrives when every MMA this thread issued so far has completed; a pair's
        # leader signals the same barrier in both CTAs (multicast mask 0b11)
        with cute.arch.elect_one():
            if const_expr(self.plan.two_cta):
                tcgen05.commit(self.ptr(kind, index), Int32(0b11), tcgen05.CtaGroup.TWO)
            else:
                tcgen05.commit(self.ptr(kind, index))

    def expect_bytes(self, kind: str, index, nbytes: int):
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(self.ptr(kind, index), nbytes)

    @cute.jit
    def expect_pair_bytes(self, kind: cutlass.Constexpr, index, nbytes_per_cta: cutlass.Constexpr,
                          is_leader):
        """A TMA load barrier the MMA warp waits on: in a pair both CTAs' cta_group::2 TMA loads
        complete on the leader's barrier, so only the leader arms it, for both halves."""
        if const_expr(self.plan.two_cta):
            if is_leader:
                self.expect_bytes(kind, index, nbytes_per_cta * 2)
        else:
            self.expect_bytes(kind, index, nbytes_per_cta)


class FlashAttentionForwardSm100:
    """FA4 forward on sm_100a: warp-specialised, S/P/O in TMEM, conditional rescale.

    Knobs (all from `fa4.kernels.knobs`, resolved into a `KernelPlan` by `plan.make_plan`):
      tiles      tile_m (=128 rows per Q stage), tile_n (keys per KV block)
      pipelines  q_stages (1-2 Q tiles, one softmax warpgroup each), kv_stages (K/V SMEM ring depth),
                 tmem_stages (S/P TMEM ring depth; also sets the MMA issue lag)
      softmax    rescale_threshold (log2 headroom before the basis is raised), rescale_tile (O columns
                 per TMEM -> register -> TMEM round trip of the correction warpgroup)
      schedule   scheduler (single / static persistent / LPT persistent), pack_gqa, two_cta (a
                 cluster pair sharing 256-row MMAs, non-causal)
      registers  softmax_regs (setmaxnreg of the softmax warpgroups; the rest is split by the plan)
    Problem constants: head_dim, dtype, causal, return_lse, gqa ratio (only when pack_gqa), num_sms.
    """

    def __init__(self, plan: KernelPlan):
        self.plan = plan
        self._setup_attributes()

    # ------------------------------------------------------------------------------------------
    def _setup_attributes(self):
        p = self.plan
        self.head_dim = p.head_dim
        self.tile_m = p.tile_m
        self.tile_n = p.tile_n
        self.q_stages = p.q_stages
        self.kv_stages = p.kv_stages
        self.tmem_stages = p.tmem_stages
        self.mma_lag = p.tmem_stages - 1
        # The correction warpgroup must know that value MMA (i-1, q) completed before it rescales
        # O[q] for block i. When tmem_stages <= q_stages that value MMA is issued before score MMA
        # (i, q), whose tcgen05.commit (s_full) tracks every MMA issued before it: the softmax's
        # s_full wait, then its mailbox, already imply it, and o_done is committed once per task
        # (for the epilogue). With a deeper S/P ring the score MMA runs ahead, so o_done is
        # committed and waited for every block.
        self.o_done_every_block = p.tmem_stages > p.q_stages
        # With tmem_stages == q_stages (`plan.p_o_merged`) "P written" and "O safe" for value MMA
        # (i, q) are one barrier, p_full[q]: score MMA k = score_base + i*Q + q writes buffer
        # k % T = q (score_base is a multiple of Q = T), and its phase k // T = block_base + i is
        # o_ready's. A phase completes on the 128 softmax and the 128 correction arrivals of that
        # (i, q) (twice that in a pair), and no thread can arrive for (i+1, q) before it completes:
        # the softmax arrives for i+1 after S(i+1, q), and the correction (after its mailbox) or its
        # epilogue (after o_done) only after the softmax did or the last value MMA completed, and
        # the MMA warp issues score MMA (i+1, q), and the next task's, only after value MMA (i, q),
        # i.e. after that wait (lag L = T - 1 < Q). Ordering of the data: the softmax's P stores and
        # the correction's O rescale are each fenced (tcgen05 before_thread_sync) before their
        # arrive, the MMA warp fences after the wait, as with two barriers. Saves one wait per value
        # MMA (flash-attn-4 does the same with its S/P/O pipeline).
        self.p_o_merged = p.p_o_merged
        self.o_ready_kind = "p_full" if p.p_o_merged else "o_ready"
        self.rescale_tile = p.rescale_tile
        self.rescale_threshold = float(p.rescale_threshold)
        self.causal = p.causal
        self.return_lse = p.return_lse
        self.pack_gqa = p.pack_gqa
        self.gqa_ratio = p.gqa_ratio  # static only when pack_gqa
        self.scheduler = p.scheduler
        self.num_sms = p.num_sms
        self.cta_rows = self.q_stages * self.tile_m
        # a CTA pair (two_cta) runs one task of both CTAs' rows: Q stage q of pair task m is the
        # 256-row MMA tile m*Q + q, its 128-row halves going to CTA 0 and CTA 1
        self.two_cta = p.two_cta
        self.cta_group = p.cta_group
        self.mma_m = p.mma_m
        self.task_rows = self.cta_rows * self.cta_group

        self.softmax_warps = [tuple(range(4 * q, 4 * q + 4)) for q in range(2)]
        self.correction_warps = (8, 9, 10, 11)
        self.mma_warp = 12
        self.load_warp = 13
        self.store_warp = 14
        self.threads_per_cta = 16 * WARP

        self.tmem_o_offset = [q * self.head_dim for q in range(self.q_stages)]
        self.tmem_s_offset = self.q_stages * self.head_dim
        self.tmem_columns = p.tmem_alloc_columns
        self.regs_softmax = p.regs_softmax
        self.regs_correction = p.regs_correction
        self.regs_other = p.regs_other
        self.regs_idle_softmax = p.regs_idle_softmax

        # threads that read the TMEM base address after allocation
        self.tmem_user_threads = WARP * (4 * self.q_stages + 4 + 1)
        self.qk_mma_tiler = (self.mma_m, self.tile_n, self.head_dim)
        self.pv_mma_tiler = (self.mma_m, self.head_dim, self.tile_n)
        self.epi_tile = (self.tile_m, self.head_dim)
        self.buffer_align_bytes = 1024

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (B, Sq, Hq, D)
        mK: cute.Tensor,  # (B, Sk, Hkv, D)
        mV: cute.Tensor,  # (B, Sk, Hkv, D)
        mO: cute.Tensor,  # (B, Sq, Hq, D)
        mLSE: Optional[cute.Tensor],  # (B, Hq, Sq) fp32, or None
        softmax_scale: Float32,
        stream: cuda.CUstream,
    ):
        self.dtype = mQ.element_type
        if const_expr(mK.element_type != self.dtype or mV.element_type != self.dtype
                      or mO.element_type != self.dtype):
            raise TypeError("Q, K, V and O must share one 16-bit type")
        if const_expr(self.dtype not in (cutlass.Float16, cutlass.BFloat16)):
            raise TypeError(f"unsupported input type {self.dtype}")
        if const_expr((mLSE is not None) != self.return_lse):
            raise ValueError("an LSE tensor must be passed exactly when the kernel was built with return_lse")

        batch = mQ.shape[0]
        seqlen_q = mQ.shape[1]
        seqlen_k = mK.shape[1]
        heads_q = mQ.shape[2]
        heads_kv = mK.shape[2]

        # Views with the row mode first: (rows, D, head, batch); V as (D, keys, head, batch).
        qv = self._rows_view(mQ, heads_kv)
        ov = self._rows_view(mO, heads_kv)
        kv_k = cute.make_tensor(mK.iterator, cute.make_layout(
            (mK.shape[1], mK.shape[3], mK.shape[2], mK.shape[0]),
            stride=(mK.stride[1], mK.stride[3], mK.stride[2], mK.stride[0])))
        kv_v = cute.make_tensor(mV.iterator, cute.make_layout(
            (mV.shape[3], mV.shape[1], mV.shape[2], mV.shape[0]),
            stride=(mV.stride[3], mV.stride[1], mV.stride[2], mV.stride[0])))
        lse_view = None
        if const_expr(mLSE is not None):
            lse_view = self._lse_view(mLSE, heads_kv)

        cta_group = tcgen05.CtaGroup.TWO if const_expr(self.two_cta) else tcgen05.CtaGroup.ONE
        qk_tiled_mma = sm100_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K,
            Float32, cta_group, self.qk_mma_tiler[:2])
        pv_tiled_mma = sm100_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN,
            Float32, cta_group, self.pv_mma_tiler[:2], tcgen05.OperandSource.TMEM)
        cluster_vmnk = cute.tiled_divide(cute.make_layout((self.cta_group, 1, 1)),
                                         (qk_tiled_mma.thr_id.shape,))

        sQ_layout = sm100_utils.make_smem_layout_a(qk_tiled_mma, self.qk_mma_tiler, self.dtype,
                                                   self.q_stages)
        sK_layout = sm100_utils.make_smem_layout_b(qk_tiled_mma, self.qk_mma_tiler, self.dtype,
                                                   self.kv_stages)
        sV_layout = sm100_utils.make_smem_layout_b(pv_tiled_mma, self.pv_mma_tiler, self.dtype,
                                                   self.kv_stages)
        tP_layout = sm100_utils.make_smem_layout_a(pv_tiled_mma, self.pv_mma_tiler, self.dtype, 1)
        self.o_layout_enum = LayoutEnum.from_tensor(ov)
        sO_layout = sm100_utils.make_smem_layout_epi(self.dtype, self.o_layout_enum, self.epi_tile,
                                                     self.q_stages)

        tma_load = cpasync.CopyBulkTensorTileG2SOp(cta_group)
        tma_store = cpasync.CopyBulkTensorTileS2GOp()
        tma_atom_q, tma_q = cute.nvgpu.make_tiled_tma_atom_A(
            tma_load, qv, cute.select(sQ_layout, mode=[0, 1, 2]), self.qk_mma_tiler, qk_tiled_mma,
            cluster_vmnk.shape)
        tma_atom_k, tma_k = cute.nvgpu.make_tiled_tma_atom_B(
            tma_load, kv_k, cute.select(sK_layout, mode=[0, 1, 2]), self.qk_mma_tiler, qk_tiled_mma,
            cluster_vmnk.shape)
        tma_atom_v, tma_v = cute.nvgpu.make_tiled_tma_atom_B(
            tma_load, kv_v, cute.select(sV_layout, mode=[0, 1, 2]), self.pv_mma_tiler, pv_tiled_mma,
            cluster_vmnk.shape)
        tma_atom_o, tma_o = cpasync.make_tiled_tma_atom(
            tma_store, ov, cute.select(sO_layout, mode=[0, 1]), self.epi_tile)
        self.q_tile_bytes = cute.size_in_bytes(self.dtype, cute.select(sQ_layout, mode=[0, 1, 2]))
        self.kv_tile_bytes = cute.size_in_bytes(self.dtype, cute.select(sK_layout, mode=[0, 1, 2]))

        plan = self.plan

        @cute.struct
        class SharedStorage:
            # the 1 KiB-aligned tiles first, so the small fields after them cost no padding
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)],
                                  self.buffer_align_bytes]
            sKV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)],
                                   self.buffer_align_bytes]
            sO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sO_layout)],
                                  self.buffer_align_bytes]
            barriers: cute.struct.MemRange[Int64, plan.num_barriers]
            # mailbox: per block a row's O scale, at the end of a task its l (same slot) and m
            mail_a: cute.struct.MemRange[Float32, plan.q_stages * TMEM_LANES]
            mail_b: cute.struct.MemRange[Float32, plan.q_stages * TMEM_LANES]
            mail_moved: cute.struct.MemRange[Int32, plan.q_stages * 4]
            tmem_base: Int32

        self.shared_storage = SharedStorage

        # tasks: (m_block, head, batch); head is the KV head when packing GQA, else the query head
        if const_expr(self.pack_gqa):
            rows_per_head = seqlen_q * self.gqa_ratio
            task_heads = heads_kv
        else:
            rows_per_head = seqlen_q
            task_heads = heads_q
        # a task runs on one CTA, or on one cluster pair of consecutive CTAs (two_cta): its rows
        # are both CTAs' Q stages
        num_m_blocks = (rows_per_head + self.task_rows - 1) // self.task_rows
        sched = TileScheduler.create(self.scheduler, num_m_blocks, task_heads, batch, seqlen_k,
                                     self.head_dim, self.num_sms, self.plan.lpt_l2_bytes,
                                     cta_group=self.cta_group)
        scale_log2 = softmax_scale * Float32(LOG2_E)
        self.kernel(
            qk_tiled_mma, pv_tiled_mma,
            tma_atom_q, tma_q, tma_atom_k, tma_k, tma_atom_v, tma_v, tma_atom_o, tma_o,
            lse_view, softmax_scale, scale_log2,
            seqlen_q, seqlen_k, heads_q // heads_kv, sched.num_m_blocks, sched.task_heads,
            sched.num_tasks, sched.lpt_group, sQ_layout, sK_layout, sV_layout, tP_layout, sO_layout,
        ).launch(
            grid=sched.grid_shape(),
            block=[self.threads_per_cta, 1, 1],
            cluster=[self.cta_group, 1, 1],
            stream=stream,
            min_blocks_per_mp=1,
        )

    @cute.jit
    def _rows_view(self, t: cute.Tensor, heads_kv):
        """(B, S, H, D) -> (rows, D, head, batch); with pack_gqa rows = (ratio, S) and head = KV head."""
        if const_expr(self.pack_gqa):
            r = self.gqa_ratio
            layout = cute.make_layout(
                ((r, t.shape[1]), t.shape[3], heads_kv, t.shape[0]),
                stride=((t.stride[2], t.stride[1]), t.stride[3], t.stride[2] * r, t.stride[0]))
        else:
            layout = cute.make_layout(
                (t.shape[1], t.shape[3], t.shape[2], t.shape[0]),
                stride=(t.stride[1], t.stride[3], t.stride[2], t.stride[0]))
        return cute.make_tensor(t.iterator, layout)

    @cute.jit
    def _lse_view(self, t: cute.Tensor, heads_kv):
        """(B, H, S) -> (rows, head, batch), rows packed like Q's."""
        if const_expr(self.pack_gqa):
            r = self.gqa_ratio
            layout = cute.make_layout(
                ((r, t.shape[2]), heads_kv, t.shape[0]),
                stride=((t.stride[1], t.stride[2]), t.stride[1] * r, t.stride[0]))
        else:
            layout = cute.make_layout(
                (t.shape[2], t.shape[1], t.shape[0]),
                stride=(t.stride[2], t.stride[1], t.stride[0]))
        return cute.make_tensor(t.iterator, layout)

    # ------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        qk_tiled_mma: cute.TiledMma,
        pv_tiled_mma: cute.TiledMma,
        tma_atom_q: cute.CopyAtom, tma_q: cute.Tensor,
        tma_atom_k: cute.CopyAtom, tma_k: cute.Tensor,
        tma_atom_v: cute.CopyAtom, tma_v: cute.Tensor,
        tma_atom_o: cute.CopyAtom, tma_o: cute.Tensor,
        lse_view: Optional[cute.Tensor],
        softmax_scale: Float32,
        scale_log2: Float32,
        seqlen_q: Int32,
        seqlen_k: Int32,
        gqa_ratio_rt: Int32,
        num_m_blocks: Int32,
        task_heads: Int32,
        num_tasks: Int32,
        lpt_group: Int32,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        tP_layout: cute.ComposedLayout,
        sO_layout: cute.ComposedLayout,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()

        if warp_idx == self.load_warp:
            cpasync.prefetch_descriptor(tma_atom_q)
            cpasync.prefetch_descriptor(tma_atom_k)
            cpasync.prefetch_descriptor(tma_atom_v)
        if warp_idx == self.store_warp:
            cpasync.prefetch_descriptor(tma_atom_o)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        bars = _Barriers(self.plan, storage.barriers.data_ptr())
        if warp_idx == self.load_warp:
            with cute.arch.elect_one():
                bars.init()
        cute.arch.mbarrier_init_fence()

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sKV.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        # V tiles share the K/V ring: same bytes per slot, V's own (MN-major) layout
        sV = cute.make_tensor(cute.recast_ptr(sK.iterator, sV_layout.inner, dtype=self.dtype),
                              sV_layout.outer)
        sO = storage.sO.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)
        mail = (storage.mail_a.get_tensor(cute.make_layout((TMEM_LANES, self.q_stages))),
                storage.mail_b.get_tensor(cute.make_layout((TMEM_LANES, self.q_stages))),
                storage.mail_moved.get_tensor(cute.make_layout((4, self.q_stages))))

        tmem = cutlass.memory.TmemAllocator(
            storage.tmem_base.ptr,
            barrier_for_retrieve=pipeline.NamedBarrier(barrier_id=_BAR_TMEM_ALLOC,
                                                       num_threads=self.tmem_user_threads),
            allocator_warp_id=self.correction_warps[0],
            is_two_cta=self.two_cta,
            two_cta_tmem_dealloc_mbar_ptr=bars.ptr("tmem_dealloc") if const_expr(self.two_cta) else None,
            initialize_mbarrier=False,  # bars.init() did (plan.barrier_arrivals)
        )
        # every barrier initialised before any role touches one (in a pair: the peer's too, since
        # each CTA arrives on the other's barriers)
        if const_expr(self.two_cta):
            cute.arch.cluster_arrive_relaxed()
            cute.arch.cluster_wait()
        else:
            cute.arch.barrier()

        # The tiled MMAs reach the kernel as parameters, so their runtime fields (negate A/B, the
        # disable-output-lane mask) would be kernel-parameter values: the instruction descriptor a
        # select on them and the 128-bit lane mask a runtime operand of every tcgen05.mma, which
        # ptxas keeps per MMA in uniform registers (reloaded by R2UR each iteration). Fix them to
        # the constants they already hold (no negation, no lane disabled) so the descriptor and mask
        # fold to immediates. Same MMAs, same results. (Set here, before any role's branch:
        # a field set inside the MMA warp's branch would not dominate the other roles' uses.)
        lanes_off = [0] * (4 * self.cta_group)
        for tiled_mma in (qk_tiled_mma, pv_tiled_mma):
            tiled_mma.set(tcgen05.Field.NEGATE_A, False)
            tiled_mma.set(tcgen05.Field.NEGATE_B, False)
            tiled_mma.set(tcgen05.Field.DISABLE_OUTPUT_LANE, lanes_off)
        # this CTA's half of a pair's MMA (0: the leader, which issues the MMAs; always 0 alone)
        cta_v = self._cta_v()
        qk_thr_mma = qk_tiled_mma.get_slice(cta_v)
        pv_thr_mma = pv_tiled_mma.get_slice(cta_v)
        sched = TileScheduler(self.scheduler, num_m_blocks, task_heads, num_tasks, lpt_group,
                              self.num_sms, cta_group=self.cta_group)

        if warp_idx == self.load_warp:
            cute.arch.setmaxregister_decrease(self.regs_other)
            self.load_role(bars, tma_atom_q, tma_q, tma_atom_k, tma_k, tma_atom_v, tma_v,
                           sQ, sK, sV, qk_thr_mma, pv_thr_mma,
                           seqlen_q, seqlen_k, gqa_ratio_rt, sched)
        if warp_idx == self.store_warp:
            cute.arch.setmaxregister_decrease(self.regs_other)
            self.store_role(bars, tma_atom_o, tma_o, sO, sched, seqlen_q, seqlen_k)
        if warp_idx == self.store_warp + 1:
            cute.arch.setmaxregister_decrease(self.regs_other)
        if warp_idx == self.mma_warp:
            cute.arch.setmaxregister_decrease(self.regs_other)
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(Float32)
            # in a pair only the leader issues (cta_group::2 MMAs read both CTAs' shared memory
            # and write both CTAs' TMEM); the peer's MMA warp only took part in the TMEM handout
            if cta_v == 0:
                self.mma_role(bars, qk_tiled_mma, pv_tiled_mma, qk_thr_mma, pv_thr_mma, sQ, sK, sV,
                              tP_layout, tmem_ptr, seqlen_q, seqlen_k, sched)
        if warp_idx < 4:
            cute.arch.setmaxregister_increase(self.regs_softmax)
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(Float32)
            self.softmax_role(0, bars, mail, qk_thr_mma, tmem_ptr, scale_log2, seqlen_q, seqlen_k,
                              sched)
        if warp_idx >= 4 and warp_idx < 8:
            if const_expr(self.q_stages == 2):
                cute.arch.setmaxregister_increase(self.regs_softmax)
                tmem.wait_for_alloc()
                tmem_ptr = tmem.retrieve_ptr(Float32)
                self.softmax_role(1, bars, mail, qk_thr_mma, tmem_ptr, scale_log2, seqlen_q,
                                  seqlen_k, sched)
            else:
                cute.arch.setmaxregister_decrease(self.regs_idle_softmax)
        if warp_idx >= 8 and warp_idx < 12:
            cute.arch.setmaxregister_decrease(self.regs_correction)
            tmem.allocate(self.tmem_columns)
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(Float32)
            self.correction_role(bars, mail, pv_thr_mma, pv_tiled_mma.get_slice(0), tmem_ptr, sO,
                                 lse_view, softmax_scale, scale_log2, seqlen_q, seqlen_k, sched)
            # every TMEM reader and writer is done once the last epilogue has read O (the base is
            # read again rather than kept live in a register across the whole task loop); a pair
            # frees together (the allocator's tmem_dealloc handshake)
            tmem.relinquish_alloc_permit()
            pipeline.NamedBarrier(barrier_id=_BAR_TMEM_FREE, num_threads=4 * WARP).arrive_and_wait()
            tmem.free(tmem.retrieve_ptr(Float32))
        if const_expr(self.two_cta):
            # neither CTA of a pair exits while the other may still arrive on its barriers (the
            # correction warpgroup releases O to the leader after its last epilogue) or the
            # leader's MMAs may still read its shared memory
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
        return

    # ------------------------------------------------------------------------------------------
    # Pair rank, tile rows and block ranges (every role computes the same values; the task order,
    # a pair's included, is scheduler.py's)
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def _cta_v(self):
        """This CTA's rank in its pair (0 = leader); 0 without two_cta."""
        if const_expr(self.two_cta):
            bidx, _, _ = cute.arch.block_idx()
            return cute.arch.make_warp_uniform(Int32(bidx) % 2)
        else:
            return 0  # a compile-time 0: single-CTA code is built as it was without the pair mode

    @cute.jit
    def _tile_row0(self, m_block: Int32, stage: int):
        """First (packed) row of this CTA's 128-row tile of Q stage `stage` of task `m_block`: in a
        pair the stage's 256-row MMA tile is split CTA 0 then CTA 1."""
        tile = (m_block * self.q_stages + stage) * self.cta_group + self._cta_v()
        return tile * self.tile_m

    @cute.jit
    def _block_range(self, m_block: Int32, seqlen_q: Int32, seqlen_k: Int32):
        """(n_end, n_full): the CTA visits KV blocks n_end-1 .. 0; blocks n >= n_full need a mask.

        Decided once for the whole CTA (all Q stages share the KV loop). Causal is bottom-right
        aligned: row seq i sees keys j <= i + seqlen_k - seqlen_q.
        """
        n_total = (seqlen_k + self.tile_n - 1) // self.tile_n
        n_end = n_total
        n_full = seqlen_k // self.tile_n
        if const_expr(self.causal):
            first_row = m_block * self.task_rows
            last_row = first_row + self.task_rows - 1
            seq_lo = first_row
            seq_hi = last_row
            if const_expr(self.pack_gqa):
                seq_lo = first_row // self.gqa_ratio
                seq_hi = last_row // self.gqa_ratio
            offset = seqlen_k - seqlen_q
            visible_hi = seq_hi + 1 + offset  # keys seen by the lowest row of the tile
            n_end = cutlass.min(n_total, (cutlass.max(visible_hi, Int32(0)) + self.tile_n - 1)
                                // self.tile_n)
            visible_lo = seq_lo + 1 + offset  # keys seen by the top row of the tile
            n_full = cutlass.min(n_full, cutlass.max(visible_lo, Int32(0)) // self.tile_n)
        return n_end, n_full

    # ------------------------------------------------------------------------------------------
    # TMEM views
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def _tmem_S(self, qk_thr_mma, tmem_ptr, slot):
        acc_shape = qk_thr_mma.partition_shape_C((self.mma_m, self.tile_n))
        fake = qk_thr_mma.make_fragment_C(acc_shape)
        return cute.make_tensor(tmem_ptr + (self.tmem_s_offset + slot * self.tile_n), fake.layout)

    @cute.jit
    def _tmem_O(self, pv_thr_mma, tmem_ptr, stage):
        acc_shape = pv_thr_mma.partition_shape_C((self.mma_m, self.head_dim))
        fake = pv_thr_mma.make_fragment_C(acc_shape)
        return cute.make_tensor(tmem_ptr + stage * self.head_dim, fake.layout)

    # ------------------------------------------------------------------------------------------
    # Load warp
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def load_role(self, bars, tma_atom_q, tma_q, tma_atom_k, tma_k, tma_atom_v, tma_v,
                  sQ, sK, sV, qk_thr_mma, pv_thr_mma,
                  seqlen_q, seqlen_k, gqa_ratio_rt, sched: cutlass.Constexpr):
        Q = self.q_stages
        L = self.mma_lag
        R = self.kv_stages
        kv_count = Int32(0)  # K/V ring items issued by this CTA
        q_count = Int32(0)   # Q tile loads (one per non-empty task)
        is_leader = self._cta_v() == 0
        task, valid = sched.initial_work()
        while valid:
            m_block, head, batch = sched.decode(task)
            n_end, n_full = self._block_range(m_block, seqlen_q, seqlen_k)
            head_kv = head
            if const_expr(not self.pack_gqa):
                head_kv = head // gqa_ratio_rt
            if n_end > 0:
                # Q: (128, D, stage) tiles of this CTA's rows
                gQ = cute.local_tile(tma_q[None, None, head, batch],
                                     (self.task_rows, self.head_dim), (m_block, 0))
                gQ = cute.flat_divide(gQ, (self.mma_m,))  # (MMA M, Q, D); a CTA loads its half
                gQ = cute.make_tensor(gQ.iterator, cute.select(gQ.layout, mode=[0, 2, 1]))
                tSgQ = qk_thr_mma.partition_A(gQ)
                tQsQ, tQgQ = cpasync.tma_partition(
                    tma_atom_q, 0, cute.make_layout(1),
                    cute.group_modes(sQ, 0, 3), cute.group_modes(tSgQ, 0, 3))
                for q in cutlass.range_constexpr(Q):
                    bars.wait("q_empty", q, (q_count & 1) ^ 1)
                    bars.expect_pair_bytes("q_full", q, self.q_tile_bytes, is_leader)
                    cute.copy(tma_atom_q, tQgQ[None, q], tQsQ[None, q],
                              tma_bar_ptr=bars.ptr("q_full", q))
                q_count += 1

                gK = cute.local_tile(tma_k[None, None, head_kv, batch],
                                     cute.select(self.qk_mma_tiler, mode=[1, 2]), (None, 0))
                gV = cute.local_tile(tma_v[None, None, head_kv, batch],
                                     cute.select(self.pv_mma_tiler, mode=[1, 2]), (0, None))
                tSgK = qk_thr_mma.partition_B(gK)
                tOgV = pv_thr_mma.partition_B(gV)
                tKsK, tKgK = cpasync.tma_partition(
                    tma_atom_k, 0, cute.make_layout(1),
                    cute.group_modes(sK, 0, 3), cute.group_modes(tSgK, 0, 3))
                tVsV, tVgV = cpasync.tma_partition(
                    tma_atom_v, 0, cute.make_layout(1),
                    cute.group_modes(sV, 0, 3), cute.group_modes(tOgV, 0, 3))

                total = n_end * Q
                for s in cutlass.range(total + L, unroll=1):
                    # the K tile of a block is first needed by the block's first score MMA ...
                    if s < total and s % Q == 0:
                        n = n_end - 1 - s // Q
                        slot = kv_count % R
                        bars.wait("kv_empty", slot, ((kv_count // R) & 1) ^ 1)
                        bars.expect_pair_bytes("kv_full", slot, self.kv_tile_bytes, is_leader)
                        cute.copy(tma_atom_k, tKgK[None, n], tKsK[None, slot],
                                  tma_bar_ptr=bars.ptr("kv_full", slot))
                        kv_count += 1
                    # ... its V tile by the block's first value MMA, L steps later
                    p = s - L
                    if p >= 0 and p < total and p % Q == 0:
                        n = n_end - 1 - p // Q
                        slot = kv_count % R
                        bars.wait("kv_empty", slot, ((kv_count // R) & 1) ^ 1)
                        bars.expect_pair_bytes("kv_full", slot, self.kv_tile_bytes, is_leader)
                        cute.copy(tma_atom_v, tVgV[None, n], tVsV[None, slot],
                                  tma_bar_ptr=bars.ptr("kv_full", slot))
                        kv_count += 1
            task, valid = sched.next_work(task)

    # ------------------------------------------------------------------------------------------
    # MMA warp
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def mma_role(self, bars, qk_tiled_mma, pv_tiled_mma, qk_thr_mma, pv_thr_mma, sQ, sK, sV,
                 tP_layout, tmem_ptr, seqlen_q, seqlen_k, sched: cutlass.Constexpr):
        Q = self.q_stages
        T = self.tmem_stages
        L = self.mma_lag
        R = self.kv_stages
        tSrQ = qk_thr_mma.make_fragment_A(sQ)
        tSrK = qk_thr_mma.make_fragment_B(sK)
        tOrV = pv_thr_mma.make_fragment_B(sV)
        # P as the A operand of the value MMA, read from TMEM (16-bit, packed in pairs)
        tP = cute.make_tensor(tmem_ptr, tP_layout.outer)
        tOrP_proto = pv_thr_mma.make_fragment_A(tP)[None, None, None, 0]

        kv_count = Int32(0)
        q_count = Int32(0)
        score_base = Int32(0)  # score MMAs issued by this CTA before this task
        block_base = Int32(0)  # value MMAs per stage before this task
        k_slot = Int32(0)
        v_slot = Int32(0)
        task, valid = sched.initial_work()
        while valid:
            m_block, head, batch = sched.decode(task)
            n_end, n_full = self._block_range(m_block, seqlen_q, seqlen_k)
            total = n_end * Q
            # Step s = b*Q + q issues score MMA s, then value MMA s - L (the order of the module
            # docstring). The Q stages of a block are unrolled, so every stage index, TMEM column
            # and Q descriptor is a compile-time constant and the stage tests are gone; value MMA
            # s - L belongs to stage pq = (q - L) mod Q of block b + off (static pq and off).
            for b in cutlass.range(n_end + (L + Q - 1) // Q, unroll=1):
                for q in cutlass.range_constexpr(Q):
                    if b < n_end:
                        # ---- score MMA s: S[slot] = Q[q] K[n]^T
                        k = score_base + b * Q + q
                        slot = k % T
                        if b == 0:
                            bars.wait("q_full", q, q_count & 1)
                        if const_expr(q == 0):
                            k_slot = kv_count % R
                            bars.wait("kv_full", k_slot, (kv_count // R) & 1)
                            kv_count += 1
                        # No wait for the S/P buffer: the value MMA that last read it (score MMA
                        # k - T's P) was issued earlier by this thread, and tcgen05.mma from one
                        # thread execute in issue order; the softmax finished with that buffer
                        # before that value MMA was released (p_full).
                        tcgen05_fence_after_sync()
                        tStS = self._tmem_S(qk_thr_mma, tmem_ptr, slot)
                        tSrQ_s = tSrQ[None, None, None, q]
                        tSrK_s = tSrK[None, None, None, k_slot]
                        for kp in cutlass.range_constexpr(cute.size(tSrQ_s, mode=[2])):
                            qk_tiled_mma.set(tcgen05.Field.ACCUMULATE, kp != 0)
                            cute.gemm(qk_tiled_mma, tStS, tSrQ_s[None, None, kp],
                                      tSrK_s[None, None, kp], tStS)
                        bars.commit("s_full", slot)
                        if const_expr(q == Q - 1):
                            bars.commit("kv_empty", k_slot)  # K[n] read by every stage
                        if b == n_end - 1:
                            bars.commit("q_empty", q)  # last score MMA of this stage's Q tile
                    pq = (q - L) % Q
                    off = (q - L - pq) // Q  # <= 0
                    pb = b + off
                    if pb >= 0 and pb < n_end:
                        # ---- value MMA p: O[pq] += P[slot] V[n]
                        k = score_base + pb * Q + pq
                        slot = k % T
                        if const_expr(pq == 0):
                            v_slot = kv_count % R
                            bars.wait("kv_full", v_slot, (kv_count // R) & 1)
                            kv_count += 1
                        bars.wait("p_full", slot, (k // T) & 1)
                        if const_expr(not self.p_o_merged):
                            bars.wait("o_ready", pq, (block_base + pb) & 1)
                        tcgen05_fence_after_sync()
                        tOtO = self._tmem_O(pv_thr_mma, tmem_ptr, pq)
                        tOrP = cute.make_tensor(
                            cute.recast_ptr(tmem_ptr + (self.tmem_s_offset + slot * self.tile_n),
                                            dtype=tOrP_proto.element_type),
                            tOrP_proto.layout)
                        tOrV_s = tOrV[None, None, None, v_slot]
                        for kp in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
                            pv_tiled_mma.set(tcgen05.Field.ACCUMULATE, pb != 0 or kp != 0)
                            cute.gemm(pv_tiled_mma, tOtO, tOrP[None, None, kp],
                                      tOrV_s[None, None, kp], tOtO)
                        if const_expr(self.o_done_every_block):
                            bars.commit("o_done", pq)
                        else:
                            if pb == n_end - 1:
                                bars.commit("o_done", pq)  # the epilogue's "O is final"
                        if const_expr(pq == Q - 1):
                            bars.commit("kv_empty", v_slot)
            if n_end > 0:
                q_count += 1
            score_base += total
            block_base += n_end
            task, valid = sched.next_work(task)

    # ------------------------------------------------------------------------------------------
    # Softmax warpgroups
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def softmax_role(self, stage: int, bars, mail, qk_thr_mma, tmem_ptr, scale_log2, seqlen_q,
                     seqlen_k, sched: cutlass.Constexpr):
        Q = self.q_stages
        T = self.tmem_stages
        N = self.tile_n
        tidx, _, _ = cute.arch.thread_idx()
        row = tidx % TMEM_LANES  # the TMEM lane, i.e. the tile row, this thread owns
        warp_in_group = row // WARP
        mail_a, mail_b, mail_moved = mail

        # TMEM -> registers: each thread gets its lane's N columns of S
        tStS0 = self._tmem_S(qk_thr_mma, tmem_ptr, 0)
        load_atom = cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(32)),
                                        Float32)
        tiled_load = tcgen05.make_tmem_copy(load_atom, tStS0)
        thr_load = tiled_load.get_slice(row)
        cS = cute.make_identity_tensor((self.mma_m, N))
        tScS = qk_thr_mma.partition_C(cS)
        tLcS = thr_load.partition_D(tScS)
        # registers -> TMEM: P as 16-bit pairs, written over the buffer's first N/2 columns in chunks
        # of P_CHUNK keys (P_CHUNK/2 columns), so a whole second copy of the row is never live
        P_CHUNK = 32
        chunk_cols = P_CHUNK // 2
        p_chunk = cute.make_layout((TMEM_LANES, chunk_cols))
        tStP0 = cute.make_tensor(tStS0.iterator, cute.composition(tStS0.layout, p_chunk))
        tScP = cute.make_tensor(tScS.iterator, cute.composition(tScS.layout, p_chunk))
        store_atom = cute.make_copy_atom(
            tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(chunk_cols)), Float32)
        tiled_store = tcgen05.make_tmem_copy(store_atom, tStP0)
        thr_store = tiled_store.get_slice(row)
        tSPcP = thr_store.partition_S(tScP)

        threshold = Float32(self.rescale_threshold)
        score_base = Int32(0)
        mail_count = Int32(0)
        task, valid = sched.initial_work()
        while valid:
            m_block, head, batch = sched.decode(task)
            n_end, n_full = self._block_range(m_block, seqlen_q, seqlen_k)
            # this thread's query position (packed rows map to seq = row // ratio)
            packed_row = self._tile_row0(m_block, stage) + row
            seq = packed_row
            if const_expr(self.pack_gqa):
                seq = packed_row // self.gqa_ratio
            key_limit = seqlen_k  # keys j < key_limit are visible to this row
            if const_expr(self.causal):
                key_limit = cutlass.min(seqlen_k, seq + 1 + seqlen_k - seqlen_q)

            row_max = -Float32.inf  # the basis m
            row_sum = Float32(0.0)
            # Blocks run from the last to the first, so the ones that need a mask (the causal
            # diagonal, the key tail) come first: one loop for them, then a steady-state loop that
            # is compiled without any mask code.
            n_masked = cutlass.max(n_end - cutlass.max(n_full, Int32(0)), Int32(0))
            for i in cutlass.range(n_masked, unroll=1):
                row_max, row_sum, mail_count = self._softmax_block(
                    True, stage, i, n_end, score_base, key_limit, row, warp_in_group, row_max,
                    row_sum, mail_count, threshold, scale_log2, bars, mail, qk_thr_mma, tmem_ptr,
                    tiled_load, thr_load, tLcS, tStP0, tSPcP, tiled_store, thr_store)
            for i in cutlass.range(n_masked, n_end, unroll=1):
                row_max, row_sum, mail_count = self._softmax_block(
                    False, stage, i, n_end, score_base, key_limit, row, warp_in_group, row_max,
                    row_sum, mail_count, threshold, scale_log2, bars, mail, qk_thr_mma, tmem_ptr,
                    tiled_load, thr_load, tLcS, tStP0, tSPcP, tiled_store, thr_store)

            # end of the task: the row's l and basis for the epilogue
            bars.wait("mail_empty", stage, (mail_count & 1) ^ 1)
            mail_a[row, stage] = row_sum
            mail_b[row, stage] = row_max
            bars.arrive("mail_full", stage)
            mail_count += 1
            score_base += n_end * Q
            task, valid = sched.next_work(task)

    @cute.jit
    def _softmax_block(self, masked: cutlass.Constexpr, stage: int, i, n_end, score_base,
                       key_limit, row, warp_in_group, row_max, row_sum, mail_count, threshold,
                       scale_log2, bars, mail, qk_thr_mma, tmem_ptr, tiled_load, thr_load, tLcS,
                       tStP0, tSPcP, tiled_store, thr_store):
        """One KV block of one softmax thread's row: S -> (mask) -> max -> basis -> P -> TMEM.

        Returns the new (row_max, row_sum, mail_count). `masked` is a compile-time flag: the
        steady-state loop instantiates this with False and carries no mask instruction at all.
        """
        Q = self.q_stages
        T = self.tmem_stages
        N = self.tile_n
        P_CHUNK = 32  # keys per TMEM store of P (16 columns of packed 16-bit pairs)
        chunk_cols = P_CHUNK // 2
        mail_a, mail_b, mail_moved = mail
        n = n_end - 1 - i
        k = score_base + i * Q + stage
        slot = k % T
        bars.wait("s_full", slot, (k // T) & 1)
        tcgen05_fence_after_sync()
        tStS = self._tmem_S(qk_thr_mma, tmem_ptr, slot)
        tLtS = thr_load.partition_S(tStS)
        rS = cute.make_rmem_tensor(tLcS.shape, Float32)
        cute.copy(tiled_load, tLtS, rS)
        cute.arch.fence_view_async_tmem_load()
        if const_expr(masked):
            # straddling or tail block: keys beyond this row's limit -> -inf before the max
            self._mask_row(rS, key_limit - n * N)
        block_max = rS.load().reduce(cute.ReductionOp.MAX, -Float32.inf, 0)

        basis = row_max
        scale = Float32(1.0)
        moved = Boolean(False)
        if i == 0:
            basis = block_max
        else:
            # raise the basis only when the max moved by more than the threshold (log2
            # units); otherwise keep the old one: P <= 2^threshold and O, l stay consistent
            if (block_max - row_max) * scale_log2 > threshold:
                basis = block_max
                scale = cute.math.exp2((row_max - block_max) * scale_log2, fastmath=True)
                moved = Boolean(True)
            # mailbox: tell the correction warpgroup which rows of O to rescale
            bars.wait("mail_empty", stage, (mail_count & 1) ^ 1)
            mail_a[row, stage] = scale
            any_moved = cute.arch.vote_any_sync(moved)
            if row % WARP == 0:
                flag = Int32(0)
                if any_moved:
                    flag = Int32(1)
                mail_moved[warp_in_group, stage] = flag
            bars.arrive("mail_full", stage)
            mail_count += 1
        basis_safe = basis
        if basis == -Float32.inf:
            basis_safe = Float32(0.0)  # a row that saw no key yet: P = 0, not NaN
        neg_basis = -basis_safe * scale_log2
        # P = exp2(S * scale_log2 - basis * scale_log2), two elements per packed FFMA2; the block's
        # sum in four partial sums (two packed pairs, FADD2) so no single serial chain of N adds.
        # Each 32-key chunk of P goes to TMEM as soon as it is computed, and P is released to the
        # value MMA before the partial sums are folded (early P release).
        partial = [(Float32(0.0), Float32(0.0)), (Float32(0.0), Float32(0.0))]
        tStP = thr_store.partition_D(cute.make_tensor(tStS.iterator, tStP0.layout))
        for c in cutlass.range_constexpr(N // P_CHUNK):
            rP32 = cute.make_rmem_tensor(tSPcP.shape, Float32)
            rP16 = cute.make_tensor(cute.recast_ptr(rP32.iterator, dtype=self.dtype),
                                    cute.make_layout(P_CHUNK))
            for j in cutlass.range_constexpr(0, P_CHUNK, 2):
                col = c * P_CHUNK + j
                x0, x1 = cute.arch.fma_packed_f32x2((rS[col], rS[col + 1]),
                                                    (scale_log2, scale_log2),
                                                    (neg_basis, neg_basis))
                p0, p1 = self._exp2_pair(x0, x1, col)
                partial[(j // 2) % 2] = cute.arch.add_packed_f32x2(partial[(j // 2) % 2], (p0, p1))
                rP16[j] = p0.to(self.dtype)
                rP16[j + 1] = p1.to(self.dtype)
            cute.copy(tiled_store, rP32, cute.make_tensor(tStP.iterator + c * chunk_cols, tStP.layout))
        cute.arch.fence_view_async_tmem_store()
        tcgen05_fence_before_sync()
        bars.arrive_leader("p_full", slot)
        block_sum = (partial[0][0] + partial[1][0]) + (partial[0][1] + partial[1][1])
        row_sum = row_sum * scale + block_sum
        row_max = basis
        return row_max, row_sum, mail_count

    @cute.jit
    def _mask_row(self, rS, cols_visible: Int32):
        """rS[j] = -inf for the columns j >= cols_visible of this thread's row (register j of a
        32x32b TMEM load holds column j of the thread's lane).

        Per 32 columns one keep-mask word, all ones shifted right by the number of hidden columns
        of the chunk (shr.u32 gives 0 for a shift of 32 or more, so a fully hidden chunk needs no
        branch), and per element a select on its bit: ptxas moves 7 bits at a time into
        predicates with R2P, so an element costs one FSEL instead of an ISETP and an FSEL. (A
        select, not an `if`: a branch per element would carry the whole row through every branch.)
        """
        for c in cutlass.range_constexpr((cute.size(rS) + MASK_CHUNK - 1) // MASK_CHUNK):
            hidden = cutlass.max(Int32((c + 1) * MASK_CHUNK) - cols_visible, Int32(0))
            keep = _shr_u32(Uint32(0xFFFFFFFF), Uint32(hidden))
            for i in cutlass.range_constexpr(min(MASK_CHUNK, cute.size(rS) - c * MASK_CHUNK)):
                j = c * MASK_CHUNK + i
                rS[j] = rS[j] if Boolean(keep & Uint32(1 << i)) else -Float32.inf

    @cute.jit
    def _exp2_pair(self, x0: Float32, x1: Float32, col: cutlass.Constexpr):
        """exp2 of two adjacent elements of a row: MUFU.EX2 each, or, for the last
        `exp2_poly_columns` keys of every 32, the FMA polynomial (the exp unit is the bottleneck
        of a 128-key block at 16 exp2 per clock; the FMA pipe has room)."""
        if const_expr(col % EXP2_POLY_CHUNK >= EXP2_POLY_CHUNK - self.plan.exp2_poly_columns):
            return self._exp2_poly_pair(x0, x1)
        return (cute.math.exp2(x0, fastmath=True), cute.math.exp2(x1, fastmath=True))

    @cute.jit
    def _exp2_poly_pair(self, x0: Float32, x1: Float32):
        """2^x = 2^floor(x) * p(x - floor(x)) for two elements with packed f32x2 arithmetic.

        x <= rescale_threshold <= 12 here; at or below -127 the result is exactly +0 (what a masked
        -inf needs): x clamps to -127, p(0) = c0 = 1.0, and 1.0's bits plus -127 << 23 wrap to 0.
        """
        magic = Float32(EXP2_ROUND_MAGIC)
        xc = (cute.arch.fmax(x0, Float32(-127.0)), cute.arch.fmax(x1, Float32(-127.0)))
        rounded = cute.arch.add_packed_f32x2(xc, (magic, magic), rnd="rm")  # floor in low bits
        whole = cute.arch.sub_packed_f32x2(rounded, (magic, magic))
        frac = cute.arch.sub_packed_f32x2(xc, whole)  # in [0, 1), exact
        c0, c1, c2, c3 = (Float32(c) for c in EXP2_POLY)
        poly = cute.arch.fma_packed_f32x2((c3, c3), frac, (c2, c2))
        poly = cute.arch.fma_packed_f32x2(poly, frac, (c1, c1))
        poly = cute.arch.fma_packed_f32x2(poly, frac, (c0, c0))
        return (add_to_exponent(rounded[0], poly[0]), add_to_exponent(rounded[1], poly[1]))

    # ------------------------------------------------------------------------------------------
    # Correction warpgroup
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def correction_role(self, bars, mail, pv_thr_mma, pv_thr_mma0, tmem_ptr, sO, lse_view,
                        softmax_scale, scale_log2, seqlen_q, seqlen_k, sched: cutlass.Constexpr):
        Q = self.q_stages
        D = self.head_dim
        RT = self.rescale_tile
        tidx, _, _ = cute.arch.thread_idx()
        row = tidx % TMEM_LANES
        warp_in_group = row // WARP
        mail_a, mail_b, mail_moved = mail

        # RESCALE_TILE-wide TMEM <-> register copies of O
        tOtO0 = self._tmem_O(pv_thr_mma, tmem_ptr, 0)
        cO = cute.make_identity_tensor((self.mma_m, D))
        tOcO = pv_thr_mma.partition_C(cO)
        chunk = cute.make_layout((TMEM_LANES, RT))
        tOtO0_c = cute.make_tensor(tOtO0.iterator, cute.composition(tOtO0.layout, chunk))
        tOcO_c = cute.make_tensor(tOcO.iterator, cute.composition(tOcO.layout, chunk))
        ld_atom = cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(RT)), Float32)
        st_atom = cute.make_copy_atom(tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(RT)), Float32)
        tiled_ld = tcgen05.make_tmem_copy(ld_atom, tOtO0_c)
        tiled_st = tcgen05.make_tmem_copy(st_atom, tOtO0_c)
        thr_ld = tiled_ld.get_slice(row)
        thr_st = tiled_st.get_slice(row)
        tLcO = thr_ld.partition_D(tOcO_c)

        # O is free before the first value MMA of each stage
        for q in cutlass.range_constexpr(Q):
            bars.arrive_leader(self.o_ready_kind, q)

        mail_count = Int32(0)
        o_done_count = Int32(0)
        epi_count = Int32(0)
        task, valid = sched.initial_work()
        while valid:
            m_block, head, batch = sched.decode(task)
            n_end, n_full = self._block_range(m_block, seqlen_q, seqlen_k)
            for i in cutlass.range(1, n_end, unroll=1):
                for q in cutlass.range_constexpr(Q):
                    bars.wait("mail_full", q, mail_count & 1)
                    moved = mail_moved[warp_in_group, q] != 0
                    scale = mail_a[row, q]
                    bars.arrive("mail_empty", q)
                    # the previous value MMA into O[q] must be complete before O is touched and
                    # before the next one is released (see `o_done_every_block`)
                    if const_expr(self.o_done_every_block):
                        bars.wait("o_done", q, o_done_count & 1)
                    if moved:
                        tcgen05_fence_after_sync()
                        self._rescale_O(q, pv_thr_mma, tmem_ptr, thr_ld, thr_st, tiled_ld, tiled_st,
                                        tLcO, scale)
                        cute.arch.fence_view_async_tmem_store()
                        tcgen05_fence_before_sync()
                    bars.arrive_leader(self.o_ready_kind, q)
                mail_count += 1
                if const_expr(self.o_done_every_block):
                    o_done_count += 1
            for q in cutlass.range_constexpr(Q):
                bars.wait("mail_full", q, mail_count & 1)
                row_sum = mail_a[row, q]
                row_max = mail_b[row, q]
                bars.arrive("mail_empty", q)
                if n_end > 0:
                    bars.wait("o_done", q, o_done_count & 1)
                    tcgen05_fence_after_sync()
                bars.wait("epi_empty", q, (epi_count & 1) ^ 1)
                self._epilogue_stage(q, pv_thr_mma, pv_thr_mma0, tmem_ptr, sO, lse_view, row, row_sum, row_max,
                                     softmax_scale, n_end, m_block, head, batch, seqlen_q)
                cute.arch.fence_view_async_shared()
                bars.arrive("epi_full", q)
                if n_end > 0:
                    # O has been read: the next task's first value MMA may overwrite it
                    cute.arch.fence_view_async_tmem_load()
                    tcgen05_fence_before_sync()
                    bars.arrive_leader(self.o_ready_kind, q)
            mail_count += 1
            if n_end > 0:
                o_done_count += 1
            epi_count += 1
            task, valid = sched.next_work(task)

    @cute.jit
    def _rescale_O(self, stage: int, pv_thr_mma, tmem_ptr, thr_ld, thr_st, tiled_ld, tiled_st,
                   tLcO, scale: Float32):
        """O[stage] *= scale, RESCALE_TILE columns per TMEM -> register -> TMEM round trip."""
        RT = self.rescale_tile
        tOtO = self._tmem_O(pv_thr_mma, tmem_ptr, stage)
        chunk = cute.make_layout((TMEM_LANES, RT))
        tOtO_c = cute.make_tensor(tOtO.iterator, cute.composition(tOtO.layout, chunk))
        tLtO = thr_ld.partition_S(tOtO_c)
        tStO = thr_st.partition_D(tOtO_c)
        # a rolled loop: one chunk of O in registers at a time (unrolled, ptxas overlaps chunks)
        for c in cutlass.range(self.head_dim // RT, unroll=1):
            rO = cute.make_rmem_tensor(tLcO.shape, Float32)
            cute.copy(tiled_ld, cute.make_tensor(tLtO.iterator + c * RT, tLtO.layout), rO)
            cute.arch.fence_view_async_tmem_load()  # tcgen05.wait::ld before the registers are read
            for j in cutlass.range_constexpr(0, cute.size(rO), 2):
                rO[j], rO[j + 1] = cute.arch.mul_packed_f32x2((rO[j], rO[j + 1]), (scale, scale))
            cute.copy(tiled_st, rO, cute.make_tensor(tStO.iterator + c * RT, tStO.layout))

    @cute.jit
    def _epilogue_stage(self, stage: int, pv_thr_mma, pv_thr_mma0, tmem_ptr, sO, lse_view, row, row_sum,
                        row_max, softmax_scale, n_end, m_block, head, batch, seqlen_q):
        """O[stage] / l -> 16-bit -> sO[stage]; LSE. A row with l = 0 saw no key: O = 0, LSE = -inf."""
        D = self.head_dim
        inv_sum = Float32(0.0)
        if row_sum > Float32(0.0):
            inv_sum = Float32(1.0) / row_sum
        tOtO = self._tmem_O(pv_thr_mma, tmem_ptr, stage)
        cO = cute.make_identity_tensor((self.mma_m, D))
        tOcO = pv_thr_mma.partition_C(cO)
        dest = sO[None, None, stage]
        # sO holds this CTA's 128 rows only: partitioned as the pair's first half (pv_thr_mma0 is
        # the MMA slice of CTA 0; the same as pv_thr_mma without two_cta)
        tOsO = pv_thr_mma0.partition_C(dest)
        cols = 32 * 8 // self.dtype.width  # 16 columns: one 256-bit shared-memory store per thread
        tile = cute.make_layout((TMEM_LANES, cols))
        tOtO_i = cute.logical_divide(tOtO, tile)
        tOcO_i = cute.logical_divide(tOcO, tile)
        tOsO_i = cute.logical_divide(tOsO, tile)
        ld_atom = sm100_utils.get_tmem_load_op(self.pv_mma_tiler, self.o_layout_enum, self.dtype,
                                               Float32, (self.tile_m, cols),
                                               use_2cta_instrs=self.two_cta)
        tiled_ld = tcgen05.make_tmem_copy(ld_atom, tOtO_i[(None, None), 0])
        thr_ld = tiled_ld.get_slice(row)
        tLtO = thr_ld.partition_S(tOtO_i[(None, None), None])
        tLsO = thr_ld.partition_D(tOsO_i[(None, None), None])
        tLcO = thr_ld.partition_D(tOcO_i[(None, None), None])
        st_atom = sm100_utils.get_smem_store_op(self.o_layout_enum, self.dtype, Float32, tiled_ld)
        tiled_st = cute.make_tiled_copy_D(st_atom, tiled_ld)
        # (one branch around each whole loop: a branch per chunk would carry every chunk's registers)
        if n_end > 0:
            # a rolled loop: unrolled, ptxas hoists every chunk's tcgen05.ld and runs out of registers
            for c in cutlass.range(D // cols, unroll=1):
                rO = cute.make_rmem_tensor(tLcO[None, 0, 0, 0].shape, Float32)
                cute.copy(tiled_ld, tLtO[None, 0, 0, c], rO)
                cute.arch.fence_view_async_tmem_load()  # tcgen05.wait::ld before reading rO
                for j in cutlass.range_constexpr(0, cute.size(rO), 2):
                    rO[j], rO[j + 1] = cute.arch.mul_packed_f32x2((rO[j], rO[j + 1]),
                                                                  (inv_sum, inv_sum))
                r16 = cute.make_rmem_tensor(rO.shape, self.dtype)
                r16.store(rO.load().to(self.dtype))
                cute.copy(tiled_st, r16, tLsO[None, 0, 0, c])
        else:
            # no key block at all (causal, Sq > Sk): O was never written; store zeros
            for c in cutlass.range_constexpr(D // cols):
                r16 = cute.make_rmem_tensor(tLcO[None, 0, 0, c].shape, self.dtype)
                r16.fill(0.0)
                cute.copy(tiled_st, r16, tLsO[None, 0, 0, c])
        if const_expr(self.return_lse):
            packed_row = self._tile_row0(m_block, stage) + row
            seq = packed_row
            if const_expr(self.pack_gqa):
                seq = packed_row // self.gqa_ratio
            if seq < seqlen_q:
                lse = -Float32.inf
                if row_sum > Float32(0.0):
                    lse = row_max * softmax_scale + cute.math.log(row_sum, fastmath=True)
                lse_view[packed_row, head, batch] = lse

    # ------------------------------------------------------------------------------------------
    # Store warp
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def store_role(self, bars, tma_atom_o, tma_o, sO, sched: cutlass.Constexpr,
                   seqlen_q, seqlen_k):
        epi_count = Int32(0)
        task, valid = sched.initial_work()
        while valid:
            m_block, head, batch = sched.decode(task)
            gO = cute.local_tile(tma_o[None, None, head, batch], self.epi_tile, (None, 0))
            tOsO, tOgO = cpasync.tma_partition(
                tma_atom_o, 0, cute.make_layout(1),
                cute.group_modes(sO, 0, 2), cute.group_modes(gO, 0, 2))
            for q in cutlass.range_constexpr(self.q_stages):
                bars.wait("epi_full", q, epi_count & 1)
                cute.copy(tma_atom_o, tOsO[None, q],
                          tOgO[None, self._tile_row0(m_block, q) // self.tile_m])
                cute.arch.cp_async_bulk_commit_group()
            for q in cutlass.range_constexpr(self.q_stages):
                # shared memory of stage q may be reused once the bulk store has read it
                cute.arch.cp_async_bulk_wait_group(self.q_stages - 1 - q, read=True)
                bars.arrive_one("epi_empty", q)
            epi_count += 1
            task, valid = sched.next_work(task)
        # drain before the CTA exits
        cute.arch.cp_async_bulk_wait_group(0, read=False)
