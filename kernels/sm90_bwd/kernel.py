"""Attention backward for Hopper (sm_90a) in CuTe DSL: the main kernel (FA2/FA3 structure).

The tile algorithm is `fa4.kernels.backward_emulation`'s. One CTA per (key block of `tile_n` rows,
KV head, batch) and part of the KV head's group of query heads (`group_split` parts): it loads its K
and V block once, then walks its query heads and, for each, the query blocks of `tile_m` rows that see
a key of the block (causal: bottom-right aligned; blocks left of the first visible row are skipped).
dK and dV accumulate in registers over the CTA's query heads. With one part (the whole group reduced
inside the CTA) they are written once at the end in 16 bits; with several, each CTA adds its partial
sums to (B, Sk, Hkv, D) fp32 accumulators by TMA reduce-add (through shared memory the K/V and Q/dO
buffers no longer need) and a postprocess converts them.

Warp roles (384 threads): warpgroup 0 is the producer (warp 0 issues the TMA loads: K and V once, then
Q and dO of each (head, query block) into a `q_stages` ring, with their rows' LSE2 and D when
`sdp_swap`; warp 1 adds each block's dQ to global memory when `dq_accum` is "bulk" or "fragment"; the warpgroup
gives its registers away with setmaxnreg); warpgroups 1 and 2 run the MMAs (wgmma) and the
elementwise math.

Per (query block, key block), in the two MMA warpgroups, with `sdp_swap` off:
  S = Q K^T, dP = dO V^T                  (fp32, each warpgroup a half of the tile_m x tile_n tile)
  P = exp2(S * scale_log2 - LSE2)         (LSE2 = LSE * log2 e from the preprocess: +inf on rows that
                                           see no key and on padding rows, so P = 0 there)
  dS = P * (dP - D)
  P, dS -> 16-bit -> shared memory        (both warpgroups' halves; named barriers around it)
  dV += P^T dO, dK += dS^T Q              (fp32 registers; each warpgroup owns half of the key rows
                                           or of the head dim)
  dQ = dS K                               (fp32, added to the (B, Sq, Hq, D) accumulator: `dq_accum`)
With `sdp_swap` on (tile_n = 128: each warpgroup owns 64 key rows throughout):
  S^T = K Q^T, dP^T = V dO^T              (the same tile transposed: keys are the wgmma's M)
  P^T = exp2(S^T * scale_log2 - LSE2)     (while dP^T's wgmma still runs; LSE2 and D come from
                                           shared memory, loaded with Q and dO)
  dV += P^T dO                            (P^T from registers: it already is the A operand; no P in
                                           shared memory; issued before the dS math at tile_m 64,
                                           after it at 128, where registers are short)
  dS^T = P^T * (dP^T - D); dS -> shared memory (transposed stmatrix), one named barrier
  dQ = dS K, then dK += dS^T Q            (dS^T from registers; dQ is added while dK's wgmma runs)
At tile_m = 80 (no multiple of a wgmma's 64-row M: query rows are only ever an N) dQ is swapped too:
  dQ^T = K^T dS^T                         (the head dim as M; its fp32 fragment goes to the tile_m x D
                                           dQ tile one 32-bit store an element, its neighbours being
                                           the tile's rows; "bulk" or "fragment" only)
dQ reaches the accumulator (`dq_accum`) by one red.global.add.f32 per element ("atomic"), or
("bulk") through an fp32 shared-memory tile that warp 1 adds with one TMA reduce-add
(cp.reduce.async.bulk.tensor .add) per block, or ("fragment") the same with the tile in the order of
the MMA threads' fragments: value group g (4 fp32) of MMA thread t at g * 4 * threads + 4 t, so each
thread stores its dQ with 128-bit stores (a warp's store covers 512 contiguous bytes), and the (B, Hq,
Sq padded, D) accumulator holds every query block's tile_m x D elements in that order, which the
postprocess (`prepost.FragmentPostprocess`) undoes. The scale is applied by the postprocess.
`pds_stages` = 2 double-buffers P and dS, so the barrier that waits for the previous block's readers
before they are overwritten goes.
At the end: dK * scale and dV -> 16-bit -> shared memory (the K and V buffers) -> TMA store, or
(`group_split` > 1) dK and dV in fp32 -> shared memory -> TMA reduce-add into the accumulators.

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
from .plan import row_stage_floats, section_groups, sectioned_tile

LOG2_E = math.log2(math.e)

# named barrier ids (0 is __syncthreads)
BAR_PDS_FREE = 1   # every MMA warpgroup is done reading the previous block's P and dS
BAR_PDS_READY = 2  # this block's P and dS are in shared memory
BAR_EPILOGUE = 3
BAR_DQ_EMPTY = 4   # the dQ warp's last reduce has read the dQ tile: the MMA warpgroups may write it
BAR_DQ_FULL = 5    # the MMA warpgroups have written this block's dQ tile
BAR_DQ_TURN = 6    # deterministic, dq_accum "atomic": the MMA warpgroups wait for, and pass on, a dQ tile's turn

# what this code implements, per knob (the declarations in fa4.kernels.knobs may only offer these)
IMPLEMENTED = {"tile_m": (64, 80, 128), "tile_n": (64, 128), "q_stages": (1, 2),
               "dq_accum": ("atomic", "bulk", "fragment", "fragment_atomic"), "sdp_swap": (False, True),
               "scheduler": ("single", "single_lpt", "sectioned_lpt"), "pds_stages": (1, 2),
               "group_split": (1, 2, 4, 8)}


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
    Knobs (declared in `fa4.kernels.knobs`, knob set "sm90_bwd"): tile_m (query rows per inner block),
    tile_n (key rows per CTA), q_stages (Q/dO ring depth), dq_accum (how dQ reaches global memory:
    "atomic", "bulk" or "fragment"), sdp_swap (S^T = K Q^T, P^T and dS^T as register operands), pds_stages (P/dS
    buffers), group_split (CTAs per key block and KV head; > 1: dK and dV by fp32 reduce-adds). A
    value this code does not implement (`IMPLEMENTED`) or a combination it cannot build raises;
    nothing is changed into something else.
    """

    def __init__(self, *, dtype: str, head_dim: int, causal: bool, tile_m: int, tile_n: int,
                 q_stages: int, dq_accum: str, sdp_swap: bool, scheduler: str, pds_stages: int,
                 group_split: int, deterministic: bool = False, descending_turns: bool = False,
                 programmatic_launch: bool = False):
        from .plan import MMA_WARPGROUPS, REGISTER_SPLIT, SUPPORTED_HEAD_DIMS, WGMMA_M
        for name, value, implemented in [(n, v, IMPLEMENTED[n]) for n, v in (
                ("tile_m", tile_m), ("tile_n", tile_n), ("q_stages", q_stages), ("dq_accum", dq_accum),
                ("sdp_swap", sdp_swap), ("scheduler", scheduler), ("pds_stages", pds_stages),
                ("group_split", group_split))] + [
                ("head_dim", head_dim, SUPPORTED_HEAD_DIMS)]:
            if value not in implemented:
                raise ValueError(f"sm90 backward: {name}={value!r} is not implemented (one of {implemented})")
        if sdp_swap and tile_n != 64 * MMA_WARPGROUPS:
            raise ValueError(f"sm90 backward: sdp_swap needs tile_n={64 * MMA_WARPGROUPS} (each MMA "
                             f"warpgroup owns 64 key rows); got tile_n={tile_n}")
        # a block of tile_m = 80 query rows (no multiple of a wgmma's M) is only ever an N, so S and
        # dP must be swapped (keys as M) and dQ too (dQ^T = K^T dS^T, the head dim as M)
        self.dq_swap = tile_m % WGMMA_M != 0
        if self.dq_swap and not sdp_swap:
            raise ValueError(f"sm90 backward: tile_m={tile_m} (not a multiple of {WGMMA_M}) needs sdp_swap: "
                             f"query rows can only be the N of a wgmma")
        if self.dq_swap and dq_accum == "atomic":
            raise ValueError(f"sm90 backward: tile_m={tile_m} computes dQ^T, which reaches the accumulator "
                             f"in fragment order or by a bulk path only (dq_accum 'bulk', 'fragment' or "
                             f"'fragment_atomic'); got {dq_accum!r}")
        self.dtype = {"fp16": cutlass.Float16, "bf16": cutlass.BFloat16}[dtype]
        self.head_dim = head_dim
        self.causal = causal
        self.tile_m = tile_m
        self.tile_n = tile_n
        self.q_stages = q_stages
        self.dq_bulk = dq_accum in ("bulk", "fragment")
        self.dq_fragment = dq_accum == "fragment"
        # fragment_atomic: the fragment-ordered accumulator, 128-bit reds from the MMA warpgroups
        self.dq_vector_atomics = dq_accum == "fragment_atomic"
        self.sdp_swap = sdp_swap
        self.longest_first = scheduler == "single_lpt"
        self.sectioned = scheduler == "sectioned_lpt"
        # sdp_swap issues dV as soon as P^T is in registers, so its wgmma runs under the dS math; at
        # 128 query rows that keeps too much live (S^T, dP^T, P^T, dK, dV: 384 bytes of spills and
        # serialised wgmma at head dim 64), so dV waits until dS^T is computed there
        self.early_dv = tile_m == 64
        self.pds_stages = pds_stages
        self.group_split = group_split
        # the sums in global memory (dQ's, a split group's dK and dV) added in a fixed order: see
        # `wait_turn`
        self.deterministic = deterministic
        # deterministic: a query block's dQ adds come last key block first (`plan.DESCENDING_TURNS`):
        # the key blocks launched from the last, each CTA walking its masked query blocks first
        self.descending_turns = deterministic and descending_turns
        # launched as a programmatic dependent of the preprocess (`plan.PROGRAMMATIC_LAUNCH`): the CTAs
        # start during its tail and load K and V, then wait for its LSE2, D and zeroed dQ accumulator
        self.programmatic_launch = programmatic_launch
        self.num_mma_threads = 128 * MMA_WARPGROUPS
        self.num_threads = 128 + self.num_mma_threads
        self.producer_regs, self.mma_regs = REGISTER_SPLIT
        # how the two MMA warpgroups split each product (M, N, K atoms): a 64-row wgmma per
        # warpgroup, so a 64-row side is split along the other dimension
        if sdp_swap:
            self.sdp_atoms = (2, 1, 1)                                # S^T, dP^T: tile_n x tile_m
        else:
            self.sdp_atoms = (2, 1, 1) if tile_m == 128 else (1, 2, 1)   # S, dP: tile_m x tile_n
        self.dkv_atoms = (2, 1, 1) if tile_n == 128 else (1, 2, 1)   # dK, dV: tile_n x D
        # dQ: tile_m x D; dQ^T: D x tile_m (its M the head dim)
        dq_m = head_dim if self.dq_swap else tile_m
        self.dq_atoms = (2, 1, 1) if dq_m == 128 else (1, 2, 1)

    # ------------------------------------------------------------------------------------------
    # shared memory and MMAs
    # ------------------------------------------------------------------------------------------
    def _make_layouts(self) -> None:
        d = self.head_dim
        dkv_n = d // self.dkv_atoms[1]      # head-dim columns of one warpgroup's dK / dV
        # head-dim columns of one warpgroup's dQ (dQ^T: its head-dim rows, the M of K^T)
        dq_n = d // (self.dq_atoms[0] if self.dq_swap else self.dq_atoms[1])
        sdp_n = self.tile_n // self.sdp_atoms[1]
        dkv_m = self.tile_n // self.dkv_atoms[0]
        # Q and dO are read transposed by dK / dV (N = head dim), K transposed by dQ, P and dS
        # transposed by dV / dK (M = keys); with sdp_swap dS is written transposed, 64 keys a warpgroup
        self.sQ_layout = smem_layout(self.dtype, self.tile_m, d, dkv_n, self.q_stages)
        self.sdO_layout = smem_layout(self.dtype, self.tile_m, d, dkv_n, self.q_stages)
        self.sK_layout = smem_layout(self.dtype, self.tile_n, d, dq_n)
        self.sV_layout = smem_layout(self.dtype, self.tile_n, d, d)
        pds_major = 64 if self.sdp_swap else math.gcd(sdp_n, dkv_m)
        stages = None if self.pds_stages == 1 else self.pds_stages
        self.sPdS_layout = smem_layout(self.dtype, self.tile_m, self.tile_n, pds_major, stages)
        # fp32 dQ tile of the bulk reduce: rows of 128-byte swizzled 32-column atoms (TMA's widest);
        # "fragment": the same bytes unswizzled, in fragment order (`dq_fragment_layout`)
        self.sdQ_layout = smem_layout(Float32, self.tile_m, d, d)
        if const_expr(self.dq_fragment):
            self.sdQ_layout = cute.make_composed_layout(cute.make_swizzle(0, 4, 3), 0,
                                                        self.dq_fragment_layout())
        # the rows' LSE2 and D, one tile_m vector per Q stage (sdp_swap), each stage TMA-aligned
        self.sRow_layout = cute.make_layout((self.tile_m, self.q_stages), stride=(1, row_stage_floats(self.tile_m)))
        # group_split > 1: an fp32 dK or dV tile of the epilogue's reduce-add, in the bytes of sK and sV
        # (one such tile exactly) and, where they hold one too, of sQ and sdO
        self.sdKV32_layout = smem_layout(Float32, self.tile_n, d, d)
        self.dkv32_in_qdo = self.q_stages * self.tile_m >= self.tile_n

    def shared_storage(self):
        self._make_layouts()
        align = 1024
        # the epilogue's fp32 tiles span two neighbouring buffers (sK then sV, sQ then sdO): the struct
        # places each buffer at the next multiple of `align`, so a pair is contiguous when the first
        # one's bytes are a multiple of it
        for layout in (self.sK_layout, self.sQ_layout):
            assert cute.size_in_bytes(self.dtype, layout) % align == 0, "fp32 tiles would straddle a gap"

        def buffer(layout, dtype=self.dtype, used=True):
            return cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(layout) if used else 0], align]

        @cute.struct
        class SharedStorage:
            mbar_qdo: cute.struct.MemRange[cutlass.Int64, self.q_stages * 2]
            mbar_kv: cute.struct.MemRange[cutlass.Int64, 2]
            sQ: buffer(self.sQ_layout)
            sdO: buffer(self.sdO_layout)
            sK: buffer(self.sK_layout)
            sV: buffer(self.sV_layout)
            sP: buffer(self.sPdS_layout, used=not self.sdp_swap)
            sdS: buffer(self.sPdS_layout)
            sdQ: buffer(self.sdQ_layout, Float32, used=self.dq_bulk)
            sLSE2: buffer(self.sRow_layout, Float32, used=self.sdp_swap)
            sDelta: buffer(self.sRow_layout, Float32, used=self.sdp_swap)

        return SharedStorage

    def _tiled_mmas(self):
        K, MN = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        if const_expr(self.sdp_swap):
            sdp = hopper_helpers.make_trivial_tiled_mma(
                self.dtype, self.dtype, K, K, Float32, atom_layout_mnk=self.sdp_atoms,
                tiler_mn=(64, self.tile_m))
            # P^T and dS^T are the A operands, in the registers of the warpgroup that computed them
            dkv = hopper_helpers.make_trivial_tiled_mma(
                self.dtype, self.dtype, K, MN, Float32, atom_layout_mnk=self.dkv_atoms,
                tiler_mn=(64, self.head_dim // self.dkv_atoms[1]), a_source=warpgroup.OperandSource.RMEM)
        else:
            sdp = hopper_helpers.make_trivial_tiled_mma(
                self.dtype, self.dtype, K, K, Float32, atom_layout_mnk=self.sdp_atoms,
                tiler_mn=(64, self.tile_n // self.sdp_atoms[1]))
            dkv = hopper_helpers.make_trivial_tiled_mma(
                self.dtype, self.dtype, MN, MN, Float32, atom_layout_mnk=self.dkv_atoms,
                tiler_mn=(64, self.head_dim // self.dkv_atoms[1]))
        if const_expr(self.dq_swap):
            # dQ^T = K^T dS^T: A = K^T (head dim contiguous: MN-major), B = dS^T (keys contiguous)
            dq = hopper_helpers.make_trivial_tiled_mma(
                self.dtype, self.dtype, MN, K, Float32, atom_layout_mnk=self.dq_atoms,
                tiler_mn=(64, self.tile_m // self.dq_atoms[1]))
        else:
            dq = hopper_helpers.make_trivial_tiled_mma(
                self.dtype, self.dtype, K, MN, Float32, atom_layout_mnk=self.dq_atoms,
                tiler_mn=(64, self.head_dim // self.dq_atoms[1]))
        return sdp, dkv, dq

    def pds_store_atom(self):
        """stmatrix of the 16-bit P / dS fragments: transposed with sdp_swap, whose fragments are
        (key, query) while the buffers hold rows of keys per query (tests/test_sm90_bwd_layouts.py
        replays its lanes against the PTX semantics)."""
        return cute.make_copy_atom(
            cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=self.sdp_swap, num_matrices=4), self.dtype)

    def fp32_tile_store(self, tiled_mma, transposed: bool = False):
        """The tiled copy of an fp32 accumulator of `tiled_mma` into an fp32 shared-memory tile that a
        TMA reduce-add reads (dQ's per block, a split group's dK and dV at the end): 64-bit stores, two
        neighbouring columns of a fragment each; `transposed` (dQ^T into the tile_m x D dQ tile): a
        fragment's neighbouring columns are neighbouring rows of the tile, so one 32-bit store an
        element (tests/test_sm90_bwd_layouts.py replays them)."""
        bits = 32 if transposed else 64
        return cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=bits), tiled_mma)

    def dq_fragment_values(self) -> int:
        """fp32 dQ values per MMA thread in a block: a multiple of 4 (one 128-bit store each 4)."""
        return self.tile_m * self.head_dim // self.num_mma_threads

    def dq_fragment_thread_layout(self):
        """dq_accum="fragment": where each MMA thread's dQ values go in a block's tile (and its
        accumulator block), ((4, MMA threads), values / 4): value 4 g + e of thread t at
        g * 4 * threads + 4 t + e. Sliced at ((None, t), None), a thread's 4-value groups are
        16-byte aligned (128-bit stores and loads) and a warp's group covers 512 contiguous bytes."""
        threads = self.num_mma_threads
        return cute.make_layout(((4, threads), self.dq_fragment_values() // 4), stride=((1, 4), 4 * threads))

    def dq_fragment_value_layout(self):
        """dq_accum="fragment": a thread's dQ values as (4, values / 4), the register fragment's value v
        (its storage order) at (v % 4, v // 4): the register side of `dq_fragment_thread_layout`, in
        the main kernel's stores and the postprocess's loads alike."""
        return cute.make_layout((4, self.dq_fragment_values() // 4))

    def dq_fragment_layout(self):
        """dq_accum="fragment": a block's tile_m x D dQ values, in fragment order, as the TMA box
        (256, tile_m * D / 256), rows contiguous (a box dimension holds at most 256 elements)."""
        return cute.make_layout((256, self.tile_m * self.head_dim // 256))

    def pds_store_view(self, buffer):
        """The P / dS buffer (tile_m x tile_n) as the S fragments index it: transposed with sdp_swap."""
        return L.transpose_smem_view(buffer) if self.sdp_swap else buffer

    # ------------------------------------------------------------------------------------------
    # launch
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                 mLSE2: cute.Tensor, mDelta: cute.Tensor, mdQaccum: cute.Tensor,
                 mdK: cute.Tensor, mdV: cute.Tensor, softmax_scale: Float32,
                 stream: cuda.CUstream, mdQturn: cute.Tensor = None, mdKVturn: cute.Tensor = None):
        """Q, dO: (B, Sq, Hq, D); K, V, dK, dV: (B, Sk, Hkv, D) (dK, dV: fp32 accumulators, zeroed,
        when `group_split` > 1); LSE2, D: (B, Hq, Sq padded to tile_m) fp32 (the preprocess's);
        dQ_accum: (B, Sq, Hq, D) fp32, zeroed. Deterministic only: dQ_turn, (B, Hq, query blocks)
        int32, and (`group_split` > 1) dKV_turn, (B, Hkv, key blocks) int32, zeroed."""
        if const_expr(self.deterministic != (mdQturn is not None)
                      or (self.deterministic and self.group_split > 1) != (mdKVturn is not None)):
            raise TypeError("the turn counters come with deterministic (dKV's with group_split > 1) only")
        for t in (mQ, mK, mV, mdO):
            if const_expr(t.element_type != self.dtype):
                raise TypeError("Q, K, V and dO must all have the kernel's dtype")
        dkv_type = self.dtype if const_expr(self.group_split == 1) else Float32
        for t in (mdK, mdV):
            if const_expr(t.element_type != dkv_type):
                raise TypeError(f"dK and dV must be {dkv_type} (group_split={self.group_split}: "
                                f"{'the gradients' if self.group_split == 1 else 'their fp32 accumulators'})")
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
        if const_expr(self.group_split == 1):
            tma_atom_dK, tma_dK = cpasync.make_tiled_tma_atom(store_op, mdK, self.sK_layout,
                                                              (self.tile_n, d))
            tma_atom_dV, tma_dV = cpasync.make_tiled_tma_atom(store_op, mdV, self.sV_layout,
                                                              (self.tile_n, d))
        else:
            reduce_op = cpasync.CopyReduceBulkTensorTileS2GOp()
            tma_atom_dK, tma_dK = cpasync.make_tiled_tma_atom(reduce_op, mdK, self.sdKV32_layout,
                                                              (self.tile_n, d))
            tma_atom_dV, tma_dV = cpasync.make_tiled_tma_atom(reduce_op, mdV, self.sdKV32_layout,
                                                              (self.tile_n, d))
        self.qdo_bytes = cute.size_in_bytes(self.dtype, sQ_one) + cute.size_in_bytes(self.dtype, sdO_one)
        self.kv_bytes = (cute.size_in_bytes(self.dtype, self.sK_layout)
                         + cute.size_in_bytes(self.dtype, self.sV_layout))
        tma_atom_dQ, tma_dQ = None, mdQaccum
        if const_expr(self.dq_fragment):
            # (B, Hq, Sq padded, D) contiguous in each head (passed as its (Sq padded, D, Hq, B) view):
            # each query block's tile_m x D elements as the fragment layout's rows, one box
            fragment = self.dq_fragment_layout()
            blocks = mdQaccum.shape[0] // self.tile_m
            mdQaccum = cute.make_tensor(mdQaccum.iterator, cute.make_layout(
                (fragment.shape[0], fragment.shape[1], blocks, mdQaccum.shape[2], mdQaccum.shape[3]),
                stride=(1, fragment.shape[0], self.tile_m * d, mdQaccum.stride[2], mdQaccum.stride[3])))
            tma_atom_dQ, tma_dQ = cpasync.make_tiled_tma_atom(
                cpasync.CopyReduceBulkTensorTileS2GOp(), mdQaccum, fragment, fragment.shape)
        elif const_expr(self.dq_bulk):
            tma_atom_dQ, tma_dQ = cpasync.make_tiled_tma_atom(
                cpasync.CopyReduceBulkTensorTileS2GOp(), mdQaccum, self.sdQ_layout, (self.tile_m, d))
        tma_atom_LSE2, tma_LSE2, tma_atom_Delta, tma_Delta = None, mLSE2, None, mDelta
        if const_expr(self.sdp_swap):
            row_one = cute.select(self.sRow_layout, mode=[0])
            tma_atom_LSE2, tma_LSE2 = cpasync.make_tiled_tma_atom(load_op, mLSE2, row_one, (self.tile_m,))
            tma_atom_Delta, tma_Delta = cpasync.make_tiled_tma_atom(load_op, mDelta, row_one, (self.tile_m,))
            self.qdo_bytes += 2 * cute.size_in_bytes(Float32, row_one)

        num_n_blocks = (seqlen_k + self.tile_n - 1) // self.tile_n
        scale_log2 = softmax_scale * Float32(LOG2_E)
        # the hardware hands CTAs out in grid order, x fastest: longest first puts the key blocks
        # outermost, block 0 (the most query blocks under causal) first for every head and batch;
        # the parts of a KV head's group are neighbours on the head axis
        head_slots = heads_kv * self.group_split
        grid = (num_n_blocks, head_slots, batch)
        if const_expr(self.longest_first):
            grid = (head_slots, batch, num_n_blocks)
        if const_expr(self.sectioned):   # one axis; the kernel finds its tile (plan.sectioned_tile)
            grid = (num_n_blocks * head_slots * batch, 1, 1)
        self.kernel(
            tma_Q, tma_dO, tma_K, tma_V, tma_dK, tma_dV, tma_LSE2, tma_Delta, tma_dQ,
            tma_atom_Q, tma_atom_dO, tma_atom_K, tma_atom_V, tma_atom_dK, tma_atom_dV,
            tma_atom_LSE2, tma_atom_Delta, tma_atom_dQ, mdQturn, mdKVturn,
            softmax_scale, scale_log2, seqlen_q, seqlen_k, ratio,
            tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq,
            self.sQ_layout, self.sdO_layout, self.sK_layout, self.sV_layout, self.sPdS_layout,
            self.sdQ_layout, self.sRow_layout, self.sdKV32_layout, SharedStorage,
        ).launch(grid=grid, block=[self.num_threads, 1, 1],
                 stream=stream, min_blocks_per_mp=1, use_pdl=self.programmatic_launch)

    # ------------------------------------------------------------------------------------------
    # device code
    # ------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mdO: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor,
               mdK: cute.Tensor, mdV: cute.Tensor, mLSE2: cute.Tensor, mDelta: cute.Tensor,
               mdQaccum: cute.Tensor, tma_atom_Q: cute.CopyAtom, tma_atom_dO: cute.CopyAtom,
               tma_atom_K: cute.CopyAtom, tma_atom_V: cute.CopyAtom, tma_atom_dK: cute.CopyAtom,
               tma_atom_dV: cute.CopyAtom, tma_atom_LSE2, tma_atom_Delta, tma_atom_dQ,
               mdQturn, mdKVturn, softmax_scale: Float32, scale_log2: Float32,
               seqlen_q: Int32, seqlen_k: Int32, ratio: Int32,
               tiled_mma_sdp: cute.TiledMma, tiled_mma_dkv: cute.TiledMma,
               tiled_mma_dq: cute.TiledMma, sQ_layout: cute.ComposedLayout,
               sdO_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
               sV_layout: cute.ComposedLayout, sPdS_layout: cute.ComposedLayout,
               sdQ_layout: cute.ComposedLayout, sRow_layout: cute.Layout,
               sdKV32_layout: cute.ComposedLayout, SharedStorage: cutlass.Constexpr):
        if const_expr(self.programmatic_launch):
            # the postprocess may start once every CTA here has started (it waits for this grid's
            # end before reading what it writes)
            cute.arch.griddepcontrol_launch_dependents()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            for atom in (tma_atom_Q, tma_atom_dO, tma_atom_K, tma_atom_V, tma_atom_dK, tma_atom_dV,
                         tma_atom_LSE2, tma_atom_Delta, tma_atom_dQ):
                if const_expr(atom is not None):
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
        sP = None
        if const_expr(not self.sdp_swap):
            sP = storage.sP.get_tensor(sPdS_layout.outer, swizzle=sPdS_layout.inner)
        sdS = storage.sdS.get_tensor(sPdS_layout.outer, swizzle=sPdS_layout.inner)
        sdQ = None
        if const_expr(self.dq_bulk):
            sdQ = storage.sdQ.get_tensor(sdQ_layout.outer, swizzle=sdQ_layout.inner)
        sLSE2, sDelta = None, None
        if const_expr(self.sdp_swap):
            sLSE2 = storage.sLSE2.get_tensor(sRow_layout)
            sDelta = storage.sDelta.get_tensor(sRow_layout)
        pipeline.pipeline_init_wait(cluster_shape_mn=None)

        n_block, head_slot, batch_idx = cute.arch.block_idx()
        if const_expr(self.longest_first):
            head_slot, batch_idx, n_block = cute.arch.block_idx()
        if const_expr(self.sectioned):
            n_block, head_slot, batch_idx = self.sectioned_block(cute.arch.block_idx()[0], mK, seqlen_q,
                                                                 seqlen_k, ratio)
        if const_expr(self.descending_turns):   # the grid's key blocks from the last (`plan.launch_order`)
            n_block = (seqlen_k + self.tile_n - 1) // self.tile_n - 1 - n_block
        m_min, m_max, m_unmasked = self.query_block_range(n_block, seqlen_q, seqlen_k)

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                self.produce(mQ, mdO, mK, mV, mLSE2, mDelta, sQ, sdO, sK, sV, sLSE2, sDelta,
                             tma_atom_Q, tma_atom_dO, tma_atom_K, tma_atom_V, tma_atom_LSE2,
                             tma_atom_Delta, pipe_qdo, pipe_kv, n_block, head_slot, batch_idx, ratio,
                             m_min, m_max, m_unmasked)
            if const_expr(self.dq_bulk):
                if warp_idx == 1:
                    self.store_dq(mdQaccum, sdQ, tma_atom_dQ, mdQturn, n_block, head_slot, batch_idx, ratio,
                                  m_min, m_max, m_unmasked, seqlen_q, seqlen_k)
        else:
            cute.arch.setmaxregister_increase(self.mma_regs)
            sdK32, sdV32 = None, None
            if const_expr(self.group_split > 1):
                sdK32 = storage.sK.get_tensor(sdKV32_layout.outer, swizzle=sdKV32_layout.inner, dtype=Float32)
                sdV32 = sdK32
                if const_expr(self.dkv32_in_qdo):
                    sdV32 = storage.sQ.get_tensor(sdKV32_layout.outer, swizzle=sdKV32_layout.inner,
                                                  dtype=Float32)
            self.consume(mdK, mdV, mLSE2, mDelta, mdQaccum, mdQturn, mdKVturn, sQ, sdO, sK, sV, sP, sdS,
                         sdQ, sLSE2, sDelta, sdK32, sdV32, tma_atom_dK, tma_atom_dV, pipe_qdo, pipe_kv,
                         tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq, softmax_scale, scale_log2,
                         seqlen_q, seqlen_k, ratio, n_block, head_slot, batch_idx, m_min, m_max,
                         m_unmasked)

    # ---- block ranges --------------------------------------------------------------------------
    @cute.jit
    def sectioned_block(self, index: Int32, mK: cute.Tensor, seqlen_q: Int32, seqlen_k: Int32, ratio: Int32):
        """(n_block, head_slot, batch) of the `index`-th CTA under "sectioned_lpt": sections of GQA
        groups (a head slot of a batch, slots fastest, as single_lpt orders them) sized by
        `plan.section_groups`, key block outermost within each (`plan.sectioned_tile`)."""
        head_slots = mK.shape[2] * self.group_split      # mK: (Sk, D, Hkv, B)
        groups = head_slots * mK.shape[3]
        n_blocks = (seqlen_k + self.tile_n - 1) // self.tile_n
        # at least one row a group: an empty Sq must not divide by zero (every tile is still visited)
        section = section_groups(self.heads_per_part(ratio) * cutlass.max(seqlen_q, 1), self.head_dim,
                                 maximum=cutlass.max)
        n_block, group = sectioned_tile(index, section, n_blocks, groups, minimum=cutlass.min)
        return n_block, group % head_slots, group // head_slots

    def heads_per_part(self, ratio):
        """Query heads a part of a KV head's group holds: ceil(ratio / group_split) (the last part
        may hold fewer; `feasibility.heads_per_part`'s arithmetic)."""
        return (ratio + self.group_split - 1) // self.group_split

    @cute.jit
    def query_heads(self, head_slot: Int32, ratio: Int32):
        """(head_kv, query head count) of the CTA on `head_slot` of the grid's head axis: part
        `head_slot % group_split` of KV head `head_slot // group_split`'s group of `ratio` query
        heads, ceil(ratio / group_split) heads a part (the last may hold fewer; the model refuses a
        split that leaves a part empty)."""
        head_kv = head_slot
        head_count = ratio
        if const_expr(self.group_split > 1):
            head_kv = head_slot // self.group_split
            per_part = self.heads_per_part(ratio)
            head_count = cutlass.min(per_part, ratio - head_slot % self.group_split * per_part)
        return head_kv, head_count

    @cute.jit
    def query_head(self, index: Int32, head_slot: Int32, ratio: Int32):
        """The query head of the CTA's `index`-th head (`query_heads`). Unsplit, the expression the
        block loops always had (their code stays as it was)."""
        head = head_slot * ratio + index
        if const_expr(self.group_split > 1):
            per_part = self.heads_per_part(ratio)
            head = (head_slot // self.group_split * ratio + head_slot % self.group_split * per_part
                    + index)
        return head

    @cute.jit
    def query_block_range(self, n_block: Int32, seqlen_q: Int32, seqlen_k: Int32):
        """(m_min, m_max, m_unmasked): the query blocks [m_min, m_max) that see a key of this block;
        [m_min, m_unmasked) carry a mask, [m_unmasked, m_max) none."""
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
        return m_min, m_max, cutlass.max(m_mask_end, m_min)

    @cute.jit
    def block_of(self, t: Int32, m_min: Int32, m_max: Int32, m_unmasked: Int32):
        """(index of the query head, query block) of the t-th block a CTA walks: per query head the
        unmasked blocks [m_unmasked, m_max) first, then the masked ones [m_min, m_unmasked): the MMA
        warps' two loops (`consume`), which the producer and the dQ warp follow."""
        m_count = m_max - m_min
        if const_expr(self.descending_turns):   # masked first (`walk`): the query blocks ascending
            return t // m_count, m_min + t % m_count
        return t // m_count, m_min + (t % m_count + m_unmasked - m_min) % m_count

    def walk(self, m_min, m_max, m_unmasked):
        """The MMA warps' loops over a query head's blocks, (first, end, masked) each: the unmasked
        blocks, then the masked ones; with descending turns the masked (diagonal) ones first."""
        loops = ((m_unmasked, m_max, False), (m_min, m_unmasked, True))
        return loops[::-1] if self.descending_turns else loops

    # ---- producer ------------------------------------------------------------------------------
    @cute.jit
    def produce(self, mQ, mdO, mK, mV, mLSE2, mDelta, sQ, sdO, sK, sV, sLSE2, sDelta, tma_atom_Q,
                tma_atom_dO, tma_atom_K, tma_atom_V, tma_atom_LSE2, tma_atom_Delta, pipe_qdo,
                pipe_kv, n_block: Int32, head_slot: Int32, batch_idx: Int32, ratio: Int32,
                m_min: Int32, m_max: Int32, m_unmasked: Int32):
        d = self.head_dim
        head_kv, head_count = self.query_heads(head_slot, ratio)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        gK = cute.local_tile(mK[None, None, head_kv, batch_idx], (self.tile_n, d), (n_block, 0))
        gV = cute.local_tile(mV[None, None, head_kv, batch_idx], (self.tile_n, d), (n_block, 0))
        tKs, tKg = L.tma_copier(tma_atom_K, sK, gK, smem_staged=False, gmem_tiled=False)
        tVs, tVg = L.tma_copier(tma_atom_V, sV, gV, smem_staged=False, gmem_tiled=False)
        pipe_kv.producer_acquire(kv_state)
        cute.copy(tma_atom_K, tKg, tKs, tma_bar_ptr=pipe_kv.producer_get_barrier(kv_state))
        cute.copy(tma_atom_V, tVg, tVs, tma_bar_ptr=pipe_kv.producer_get_barrier(kv_state))
        self.wait_for_the_preprocess()   # LSE2 and D come with Q and dO (sdp_swap)

        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.q_stages)
        m_count = cutlass.max(m_max - m_min, 0)
        for t in cutlass.range(head_count * m_count, unroll=1):
            head_index, m_block = self.block_of(t, m_min, m_max, m_unmasked)
            head = self.query_head(head_index, head_slot, ratio)
            gQ = cute.local_tile(mQ[None, None, head, batch_idx], (self.tile_m, d), (m_block, 0))
            gdO = cute.local_tile(mdO[None, None, head, batch_idx], (self.tile_m, d), (m_block, 0))
            tQs, tQg = L.tma_copier(tma_atom_Q, sQ, gQ, smem_staged=True, gmem_tiled=False)
            tdOs, tdOg = L.tma_copier(tma_atom_dO, sdO, gdO, smem_staged=True, gmem_tiled=False)
            pipe_qdo.producer_acquire(q_state)
            cute.copy(tma_atom_Q, tQg, tQs[None, q_state.index],
                      tma_bar_ptr=pipe_qdo.producer_get_barrier(q_state))
            cute.copy(tma_atom_dO, tdOg, tdOs[None, q_state.index],
                      tma_bar_ptr=pipe_qdo.producer_get_barrier(q_state))
            if const_expr(self.sdp_swap):
                for atom, m_rows, s_rows in ((tma_atom_LSE2, mLSE2, sLSE2), (tma_atom_Delta, mDelta, sDelta)):
                    g_rows = cute.local_tile(m_rows[None, head, batch_idx], (self.tile_m,), (m_block,))
                    t_s, t_g = L.tma_copier(atom, s_rows, g_rows, smem_staged=True, gmem_tiled=False)
                    cute.copy(atom, t_g, t_s[None, q_state.index],
                              tma_bar_ptr=pipe_qdo.producer_get_barrier(q_state))
            q_state.advance()

    # ---- the dQ warp ---------------------------------------------------------------------------
    @cute.jit
    def store_dq(self, mdQaccum, sdQ, tma_atom_dQ, mdQturn, n_block: Int32, head_slot: Int32,
                 batch_idx: Int32, ratio: Int32, m_min: Int32, m_max: Int32, m_unmasked: Int32,
                 seqlen_q: Int32, seqlen_k: Int32):
        """dq_accum="bulk": per block, wait for the MMA warpgroups' dQ tile and add it to the fp32
        accumulator with one TMA reduce-add (rows >= Sq fall outside the tensor and are not added);
        release the tile once the reduce has read it. Deterministic: the reduce waits for the block's
        turn and passes it on once complete."""
        d = self.head_dim
        both = self.num_mma_threads + 32
        self.wait_for_the_preprocess()   # the accumulator it adds into is zeroed there
        _, head_count = self.query_heads(head_slot, ratio)
        m_count = cutlass.max(m_max - m_min, 0)
        for t in cutlass.range(head_count * m_count, unroll=1):
            head_index, m_block = self.block_of(t, m_min, m_max, m_unmasked)
            head = self.query_head(head_index, head_slot, ratio)
            if const_expr(self.dq_fragment):
                gdQ = mdQaccum[None, None, m_block, head, batch_idx]
            else:
                gdQ = cute.local_tile(mdQaccum[None, None, head, batch_idx], (self.tile_m, d), (m_block, 0))
            tdQs, tdQg = L.tma_copier(tma_atom_dQ, sdQ, gdQ, smem_staged=False, gmem_tiled=False)
            cute.arch.cp_async_bulk_wait_group(0, read=True)   # the last reduce has read the tile
            cute.arch.barrier_arrive(barrier_id=BAR_DQ_EMPTY, number_of_threads=both)
            cute.arch.barrier(barrier_id=BAR_DQ_FULL, number_of_threads=both)
            if const_expr(self.deterministic):
                self.wait_turn(mdQturn, (batch_idx, head, m_block),
                               self.dq_turn(n_block, m_block, seqlen_q, seqlen_k), cute.arch.lane_idx())
                cute.arch.sync_warp()
            cute.copy(tma_atom_dQ, tdQs, tdQg)
            cute.arch.cp_async_bulk_commit_group()
            if const_expr(self.deterministic):
                cute.arch.cp_async_bulk_wait_group(0, read=False)   # added, not only read
                cute.arch.sync_warp()
                self.pass_turn(mdQturn, (batch_idx, head, m_block), cute.arch.lane_idx())
        cute.arch.cp_async_bulk_wait_group(0, read=True)

    # ---- MMA warpgroups ------------------------------------------------------------------------
    @cute.jit
    def consume(self, mdK, mdV, mLSE2, mDelta, mdQaccum, mdQturn, mdKVturn, sQ, sdO, sK, sV, sP, sdS, sdQ,
                sLSE2, sDelta, sdK32, sdV32, tma_atom_dK, tma_atom_dV, pipe_qdo, pipe_kv, tiled_mma_sdp,
                tiled_mma_dkv, tiled_mma_dq, softmax_scale: Float32, scale_log2: Float32,
                seqlen_q: Int32, seqlen_k: Int32, ratio: Int32, n_block: Int32, head_slot: Int32,
                batch_idx: Int32, m_min: Int32, m_max: Int32, m_unmasked: Int32):
        head_kv, head_count = self.query_heads(head_slot, ratio)
        tidx, _, _ = cute.arch.thread_idx()
        tidx = tidx - 128
        wg_idx = cute.arch.make_warp_uniform(tidx // 128)
        d = self.head_dim
        wg_sdp = tiled_mma_sdp.get_slice(wg_idx * 128)
        wg_dkv = tiled_mma_dkv.get_slice(wg_idx * 128)
        wg_dq = tiled_mma_dq.get_slice(wg_idx * 128)
        thr_sdp = tiled_mma_sdp.get_slice(tidx)
        thr_dq = tiled_mma_dq.get_slice(tidx)

        if const_expr(self.sdp_swap):
            # S^T = K Q^T, dP^T = V dO^T, dV += P^T dO and dK += dS^T Q (A from registers), dQ = dS K
            tSrQ = wg_sdp.make_fragment_B(wg_sdp.partition_B(sQ))
            tSrK = wg_sdp.make_fragment_A(wg_sdp.partition_A(sK))
            tdPrdO = wg_sdp.make_fragment_B(wg_sdp.partition_B(sdO))
            tdPrV = wg_sdp.make_fragment_A(wg_sdp.partition_A(sV))
            tdVrPt = cute.make_rmem_tensor(wg_dkv.partition_shape_A((self.tile_n, self.tile_m)), self.dtype)
            tdKrdSt = cute.make_rmem_tensor(wg_dkv.partition_shape_A((self.tile_n, self.tile_m)), self.dtype)
            s_shape = wg_sdp.partition_shape_C((self.tile_n, self.tile_m))
            ident_S = cute.make_identity_tensor((self.tile_n, self.tile_m))
            pds_store = cute.make_tiled_copy_C(self.pds_store_atom(), tiled_mma_sdp).get_slice(tidx)
            tPsP = None
            tdSsdS = pds_store.partition_D(self.pds_store_view(sdS))
        else:
            # operands: S = Q K^T, dP = dO V^T, dV += P^T dO, dK += dS^T Q, dQ = dS K
            tSrQ = wg_sdp.make_fragment_A(wg_sdp.partition_A(sQ))
            tSrK = wg_sdp.make_fragment_B(wg_sdp.partition_B(sK))
            tdPrdO = wg_sdp.make_fragment_A(wg_sdp.partition_A(sdO))
            tdPrV = wg_sdp.make_fragment_B(wg_sdp.partition_B(sV))
            tdVrPt = wg_dkv.make_fragment_A(wg_dkv.partition_A(L.transpose_smem_view(sP)))
            tdKrdSt = wg_dkv.make_fragment_A(wg_dkv.partition_A(L.transpose_smem_view(sdS)))
            s_shape = wg_sdp.partition_shape_C((self.tile_m, self.tile_n))
            ident_S = cute.make_identity_tensor((self.tile_m, self.tile_n))
            pds_store = cute.make_tiled_copy_C(self.pds_store_atom(), tiled_mma_sdp).get_slice(tidx)
            tPsP = pds_store.partition_D(self.pds_store_view(sP))
            tdSsdS = pds_store.partition_D(self.pds_store_view(sdS))
        tdVrdOt = wg_dkv.make_fragment_B(wg_dkv.partition_B(L.transpose_smem_view(sdO)))
        tdKrQt = wg_dkv.make_fragment_B(wg_dkv.partition_B(L.transpose_smem_view(sQ)))
        if const_expr(self.dq_swap):
            # dQ^T = K^T dS^T: dS is the B operand, K^T the A (the block step swaps them back)
            tdQrdS = wg_dq.make_fragment_B(wg_dq.partition_B(sdS))
            tdQrKt = wg_dq.make_fragment_A(wg_dq.partition_A(L.transpose_smem_view(sK)))
            dq_tile = (d, self.tile_m)
        else:
            tdQrdS = wg_dq.make_fragment_A(wg_dq.partition_A(sdS))
            tdQrKt = wg_dq.make_fragment_B(wg_dq.partition_B(L.transpose_smem_view(sK)))
            dq_tile = (self.tile_m, d)
        dq_shape = wg_dq.partition_shape_C(dq_tile)
        acc_dK = cute.make_rmem_tensor(wg_dkv.partition_shape_C((self.tile_n, d)), Float32)
        acc_dV = cute.make_rmem_tensor(wg_dkv.partition_shape_C((self.tile_n, d)), Float32)
        acc_dK.fill(0.0)
        acc_dV.fill(0.0)

        # (row, col) of this thread's S (S^T) and dQ fragment elements
        tScS = L.acc_rows_cols(thr_sdp.partition_C(ident_S))
        t0ScS = L.acc_rows_cols(tiled_mma_sdp.get_slice(0).partition_C(ident_S))  # compile-time
        tdQcdQ = thr_dq.partition_C(cute.make_identity_tensor(dq_tile))
        dq_store, tdQsdQ = None, None
        if const_expr(self.dq_fragment):
            # this thread's values of the fragment-ordered tile, (4, values / 4): 128-bit stores
            dq_store = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128)
            # sliced from the whole tile (not offset by hand): the offset's 16-byte alignment stays known
            tdQsdQ = cute.make_tensor(sdQ.iterator, self.dq_fragment_thread_layout())[(None, tidx), None]
        elif const_expr(self.dq_bulk):
            dq_store = self.fp32_tile_store(tiled_mma_dq, transposed=self.dq_swap).get_slice(tidx)
            tdQsdQ = dq_store.partition_D(L.transpose_smem_view(sdQ) if self.dq_swap else sdQ)

        operands = (tSrQ, tSrK, tdPrdO, tdPrV, tdVrPt, tdVrdOt, tdKrdSt, tdKrQt, tdQrdS, tdQrKt, tPsP,
                    tdSsdS)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        self.wait_for_the_preprocess()   # LSE2, D; the zeroed dQ accumulator of the atomics
        pipe_kv.consumer_wait(kv_state)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.q_stages)
        # Unmasked blocks [m_unmasked, m_max), then the masked ones [m_min, m_unmasked), in loops of
        # their own (`block_of` gives the producer and the dQ warp this order): one loop with both
        # bodies behind a branch costs ~76 instructions a block (ptxas then builds the wgmma
        # descriptors with 32-bit adds, carries and reloads), and of two loops the one written
        # first compiles to fewer (~18 at 80 x 128; benchmarks/sm90_bwd_sass.py).
        block_count = Int32(0)   # blocks done: the P/dS stage
        for h in cutlass.range(head_count, unroll=1):
            head = self.query_head(h, head_slot, ratio)
            for m_from, m_to, masked in self.walk(m_min, m_max, m_unmasked):
                for m_block in cutlass.range(m_from, m_to, unroll=1):
                    self.block_step(self.step_operands(operands, q_state, block_count), acc_dK, acc_dV,
                                    s_shape, dq_shape, tScS, t0ScS, tdQcdQ, pds_store, dq_store, tdQsdQ,
                                    mLSE2, mDelta, sLSE2, sDelta, (mdQaccum, mdQturn), tiled_mma_sdp, tiled_mma_dkv,
                                    tiled_mma_dq, thr_dq, pipe_qdo, q_state, scale_log2, seqlen_q,
                                    seqlen_k, n_block, m_block, head, batch_idx, masked=masked)
                    q_state.advance()
                    block_count += 1
        if const_expr(self.group_split == 1):
            self.epilogue(acc_dK, acc_dV, softmax_scale, sK, sV, mdK, mdV, tma_atom_dK, tma_atom_dV,
                          tiled_mma_dkv, tidx, n_block, head_kv, batch_idx)
        else:
            self.epilogue_reduce(acc_dK, acc_dV, sdK32, sdV32, mdK, mdV, mdKVturn, tma_atom_dK, tma_atom_dV,
                                 tiled_mma_dkv, tidx, n_block, head_kv, batch_idx, head_slot)

    def step_operands(self, operands, q_state, block_count: Int32):
        """The block step's operands: the Q/dO stage `q_state` points at, the P/dS stage of the
        `block_count`-th block."""
        tSrQ, tSrK, tdPrdO, tdPrV, tdVrPt, tdVrdOt, tdKrdSt, tdKrQt, tdQrdS, tdQrKt, tPsP, tdSsdS = operands
        stage = q_state.index
        pds = 0 if const_expr(self.pds_stages == 1) else block_count % self.pds_stages
        return (tSrQ[None, None, None, stage], tSrK, tdPrdO[None, None, None, stage], tdPrV, tdVrPt,
                tdVrdOt[None, None, None, stage], tdKrdSt, tdKrQt[None, None, None, stage], tdQrdS, tdQrKt,
                tPsP, tdSsdS, pds)

    @cute.jit
    def block_step(self, step, acc_dK, acc_dV, s_shape, dq_shape, tScS, t0ScS, tdQcdQ, pds_store,
                   dq_store, tdQsdQ, mLSE2, mDelta, sLSE2, sDelta, dq_target, tiled_mma_sdp,
                   tiled_mma_dkv, tiled_mma_dq, thr_dq, pipe_qdo, q_state, scale_log2: Float32,
                   seqlen_q: Int32, seqlen_k: Int32, n_block: Int32, m_block: Int32, head: Int32,
                   batch_idx: Int32, masked: cutlass.Constexpr):
        """One (query block, key block) of one query head: the module docstring's five products."""
        if const_expr(self.sdp_swap):
            self.block_step_swapped(step, acc_dK, acc_dV, s_shape, dq_shape, tScS, t0ScS, tdQcdQ,
                                    pds_store, dq_store, tdQsdQ, sLSE2, sDelta, dq_target, tiled_mma_sdp,
                                    tiled_mma_dkv, tiled_mma_dq, thr_dq, pipe_qdo, q_state, scale_log2,
                                    seqlen_q, seqlen_k, n_block, m_block, head, batch_idx, masked)
        else:
            self.block_step_direct(step, acc_dK, acc_dV, s_shape, dq_shape, tScS, t0ScS, tdQcdQ,
                                   pds_store, dq_store, tdQsdQ, mLSE2, mDelta, dq_target, tiled_mma_sdp,
                                   tiled_mma_dkv, tiled_mma_dq, thr_dq, pipe_qdo, q_state, scale_log2,
                                   seqlen_q, seqlen_k, n_block, m_block, head, batch_idx, masked)

    @cute.jit
    def block_step_direct(self, step, acc_dK, acc_dV, s_shape, dq_shape, tScS, t0ScS, tdQcdQ,
                          pds_store, dq_store, tdQsdQ, mLSE2, mDelta, dq_target, tiled_mma_sdp,
                          tiled_mma_dkv, tiled_mma_dq, thr_dq, pipe_qdo, q_state, scale_log2: Float32,
                          seqlen_q: Int32, seqlen_k: Int32, n_block: Int32, m_block: Int32, head: Int32,
                          batch_idx: Int32, masked: cutlass.Constexpr):
        """sdp_swap off: S and dP with query rows as M; P and dS through shared memory."""
        (tSrQ, tSrK, tdPrdO, tdPrV, tdVrPt, tdVrdOt, tdKrdSt, tdKrQt, tdQrdS, tdQrKt, tPsP, tdSsdS,
         pds) = step
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

        if const_expr(self.pds_stages == 1):
            # both warpgroups' previous dV / dK / dQ products have read P and dS
            cute.arch.barrier(barrier_id=BAR_PDS_FREE, number_of_threads=self.num_mma_threads)
            cute.copy(pds_store, pds_store.retile(rP), tPsP)
            cute.copy(pds_store, pds_store.retile(rdS), tdSsdS)
        else:
            # the other buffer: its last readers (two blocks ago) finished before this block's
            # previous BAR_PDS_READY, which both warpgroups passed
            cute.copy(pds_store, pds_store.retile(rP), tPsP[None, None, None, pds])
            cute.copy(pds_store, pds_store.retile(rdS), tdSsdS[None, None, None, pds])
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=BAR_PDS_READY, number_of_threads=self.num_mma_threads)

        tdVrPt_cur, tdKrdSt_cur, tdQrdS_cur = tdVrPt, tdKrdSt, tdQrdS
        if const_expr(self.pds_stages > 1):
            tdVrPt_cur = tdVrPt[None, None, None, pds]
            tdKrdSt_cur = tdKrdSt[None, None, None, pds]
            tdQrdS_cur = tdQrdS[None, None, None, pds]
        acc_dQ = cute.make_rmem_tensor(dq_shape, Float32)
        L.wgmma(tiled_mma_dkv, acc_dV, tdVrPt_cur, tdVrdOt, zero_init=False, wait_pending=-1)
        if const_expr(not self.dq_bulk):
            L.wgmma(tiled_mma_dkv, acc_dK, tdKrdSt_cur, tdKrQt, zero_init=False, wait_pending=-1)
            L.wgmma(tiled_mma_dq, acc_dQ, tdQrdS_cur, tdQrKt, zero_init=True, wait_pending=0)
            pipe_qdo.consumer_release(q_state)
            self.accumulate_dq(acc_dQ, tdQcdQ, thr_dq, dq_target, n_block, m_block, head, batch_idx, seqlen_q,
                               seqlen_k)
        else:
            # dQ before dK: its tile goes to shared memory while dK's wgmma runs
            L.wgmma(tiled_mma_dq, acc_dQ, tdQrdS_cur, tdQrKt, zero_init=True, wait_pending=-1)
            L.wgmma(tiled_mma_dkv, acc_dK, tdKrdSt_cur, tdKrQt, zero_init=False, wait_pending=1)
            self.stage_dq(acc_dQ, dq_store, tdQsdQ)
            warpgroup.wait_group(0)
            pipe_qdo.consumer_release(q_state)

    @cute.jit
    def block_step_swapped(self, step, acc_dK, acc_dV, s_shape, dq_shape, tScS, t0ScS, tdQcdQ,
                           pds_store, dq_store, tdQsdQ, sLSE2, sDelta, dq_target, tiled_mma_sdp,
                           tiled_mma_dkv, tiled_mma_dq, thr_dq, pipe_qdo, q_state, scale_log2: Float32,
                           seqlen_q: Int32, seqlen_k: Int32, n_block: Int32, m_block: Int32,
                           head: Int32, batch_idx: Int32, masked: cutlass.Constexpr):
        """sdp_swap on: S^T and dP^T with key rows as M; P^T and dS^T feed dV and dK from registers,
        only dS goes through shared memory (for dQ)."""
        (tSrQ, tSrK, tdPrdO, tdPrV, tdVrPt, tdVrdOt, tdKrdSt, tdKrQt, tdQrdS, tdQrKt, _, tdSsdS,
         pds) = step
        pipe_qdo.consumer_wait(q_state)
        acc_S = cute.make_rmem_tensor(s_shape, Float32)
        acc_dP = cute.make_rmem_tensor(s_shape, Float32)
        L.wgmma(tiled_mma_sdp, acc_S, tSrK, tSrQ, zero_init=True, wait_pending=-1)
        L.wgmma(tiled_mma_sdp, acc_dP, tdPrV, tdPrdO, zero_init=True, wait_pending=1)
        # S^T is ready; dP^T's wgmma may still run
        if const_expr(masked):
            self.apply_mask_swapped(acc_S, tScS, t0ScS, m_block, n_block, seqlen_q, seqlen_k)
        S = L.acc_rows_cols(acc_S)    # rows: keys, columns: queries
        cols = cute.size(S.shape[1])
        stage = q_state.index
        for c in cutlass.range_constexpr(cols):
            lse2 = sLSE2[tScS[0, c][1], stage]
            for r in cutlass.range_constexpr(cute.size(S.shape[0])):
                S[r, c] = cute.math.exp2(S[r, c] * scale_log2 - lse2, fastmath=True)
        # P^T -> 16-bit A operand of dV += P^T dO, one K block at a time (see the forward's write_p)
        P_view = L.acc_as_operand_a(acc_S)
        for k in cutlass.range_constexpr(cute.size(tdVrPt.shape[2])):
            tdVrPt[None, None, k].store(P_view[None, None, k].load().to(self.dtype))
        if const_expr(self.early_dv):
            L.wgmma(tiled_mma_dkv, acc_dV, tdVrPt, tdVrdOt, zero_init=False, wait_pending=1)
        else:
            warpgroup.wait_group(0)
        # dP^T is ready (dV's wgmma may still run)
        dP = L.acc_rows_cols(acc_dP)
        for c in cutlass.range_constexpr(cols):
            delta = sDelta[tScS[0, c][1], stage]
            for r in cutlass.range_constexpr(cute.size(dP.shape[0])):
                dP[r, c] = S[r, c] * (dP[r, c] - delta)
        dS_view = L.acc_as_operand_a(acc_dP)
        for k in cutlass.range_constexpr(cute.size(tdKrdSt.shape[2])):
            tdKrdSt[None, None, k].store(dS_view[None, None, k].load().to(self.dtype))
        tdQrdS_cur = tdQrdS
        if const_expr(self.pds_stages == 1):
            # both warpgroups' previous dQ products have read dS
            cute.arch.barrier(barrier_id=BAR_PDS_FREE, number_of_threads=self.num_mma_threads)
            cute.copy(pds_store, pds_store.retile(tdKrdSt), tdSsdS)
        else:
            cute.copy(pds_store, pds_store.retile(tdKrdSt), tdSsdS[None, None, None, pds])
            tdQrdS_cur = tdQrdS[None, None, None, pds]
        if const_expr(not self.early_dv):
            L.wgmma(tiled_mma_dkv, acc_dV, tdVrPt, tdVrdOt, zero_init=False, wait_pending=-1)
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=BAR_PDS_READY, number_of_threads=self.num_mma_threads)
        # dQ, then dK: dQ is added while dK's wgmma runs
        acc_dQ = cute.make_rmem_tensor(dq_shape, Float32)
        if const_expr(self.dq_swap):
            L.wgmma(tiled_mma_dq, acc_dQ, tdQrKt, tdQrdS_cur, zero_init=True, wait_pending=-1)
        else:
            L.wgmma(tiled_mma_dq, acc_dQ, tdQrdS_cur, tdQrKt, zero_init=True, wait_pending=-1)
        L.wgmma(tiled_mma_dkv, acc_dK, tdKrdSt, tdKrQt, zero_init=False, wait_pending=1)
        if const_expr(self.dq_bulk):
            self.stage_dq(acc_dQ, dq_store, tdQsdQ)
        else:
            self.accumulate_dq(acc_dQ, tdQcdQ, thr_dq, dq_target, n_block, m_block, head, batch_idx, seqlen_q,
                               seqlen_k)
        warpgroup.wait_group(0)
        pipe_qdo.consumer_release(q_state)

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
    def apply_mask_swapped(self, acc_S, tScS, t0ScS, m_block: Int32, n_block: Int32, seqlen_q: Int32,
                           seqlen_k: Int32):
        """`apply_mask` on S^T (rows: keys, columns: queries): a key row >= Sk is masked whole; under
        causal, element (key j, query i) is masked when i < j - (Sk - Sq), compared against thread
        0's column (a compile-time constant) as `apply_mask` does."""
        S = L.acc_rows_cols(acc_S)
        col_base = m_block * self.tile_m + tScS[0, 0][1]
        for r in cutlass.range_constexpr(cute.size(S.shape[0])):
            key = n_block * self.tile_n + tScS[r, 0][0]
            # element c is visible when its thread-0 column >= first (and the key exists)
            first = key - (seqlen_k - seqlen_q) - col_base if const_expr(self.causal) else Int32(0)
            if key >= seqlen_k:
                first = Int32(self.tile_m)
            for c in cutlass.range_constexpr(cute.size(S.shape[1])):
                if t0ScS[r, c][1] < first:
                    S[r, c] = -Float32.inf

    @cute.jit
    def stage_dq(self, acc_dQ, dq_store, tdQsdQ):
        """dq_accum="bulk": wait until the dQ warp's last reduce has read the tile, write this block's
        dQ fragment into it and hand it over."""
        both = self.num_mma_threads + 32
        cute.arch.barrier(barrier_id=BAR_DQ_EMPTY, number_of_threads=both)
        if const_expr(self.dq_fragment):
            values = cute.make_tensor(acc_dQ.iterator, self.dq_fragment_value_layout())
            cute.copy(dq_store, values, tdQsdQ)
        else:
            cute.copy(dq_store, dq_store.retile(acc_dQ), tdQsdQ)
        cute.arch.fence_view_async_shared()
        cute.arch.barrier_arrive(barrier_id=BAR_DQ_FULL, number_of_threads=both)

    @cute.jit
    def accumulate_dq(self, acc_dQ, tdQcdQ, thr_dq, dq_target, n_block: Int32, m_block: Int32, head: Int32,
                      batch_idx: Int32, seqlen_q: Int32, seqlen_k: Int32):
        """dQ_accum[rows of this block] += dS K from the MMA warpgroups' registers: one
        red.global.add.f32 per element (rows < Sq), or with dq_accum="fragment_atomic" one
        red.global.add.v4.f32 per 4 values into the fragment-ordered accumulator (whole blocks: it is
        padded); `dq_target`: (dQ_accum, dQ_turn or None). Deterministic: every MMA thread's adds wait
        for the block's turn, which passes on once all are done.

        The row-order path is addressed per row: one pointer per fragment row, the columns as
        compile-time offsets from it (the head dim is contiguous), so the loop keeps two pointers live,
        not one per element (per-element offsets hoisted out of the block loop spill at 128 x 128)."""
        mdQaccum, mdQturn = dq_target
        if const_expr(self.deterministic):
            self.wait_turn(mdQturn, (batch_idx, head, m_block), self.dq_turn(n_block, m_block, seqlen_q, seqlen_k),
                           cute.arch.thread_idx()[0] - 128)
            cute.arch.barrier(barrier_id=BAR_DQ_TURN, number_of_threads=self.num_mma_threads)
        gdQ = cute.local_tile(mdQaccum[None, None, head, batch_idx], (self.tile_m, self.head_dim),
                              (m_block, 0))
        if const_expr(self.dq_vector_atomics):
            # this thread's 4-value groups of the block, 16 bytes each (`dq_fragment_thread_layout`; a
            # warp's group covers 512 contiguous bytes), and the same groups of its registers
            mine = cute.make_tensor(gdQ.iterator, self.dq_fragment_thread_layout())[
                (None, cute.arch.thread_idx()[0] - 128), None]
            values = cute.make_tensor(acc_dQ.iterator, self.dq_fragment_value_layout())
            for g in cutlass.range_constexpr(cute.size(values.shape[1])):
                cute.arch.red(mine[None, g].iterator, values[None, g].load().ir_value(), op="add", dtype="f32",
                              sem="relaxed", scope="gpu")
        else:
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
        if const_expr(self.deterministic):
            cute.arch.barrier(barrier_id=BAR_DQ_TURN, number_of_threads=self.num_mma_threads)
            self.pass_turn(mdQturn, (batch_idx, head, m_block), cute.arch.thread_idx()[0] - 128)

    def wait_for_the_preprocess(self):
        """Programmatic launch: nothing the preprocess writes is read (or added into) before it has
        completed; a thread that reads none of it (K, V, Q, dO, written before) need not wait."""
        if const_expr(self.programmatic_launch):
            cute.arch.griddepcontrol_wait()

    # ---- the deterministic order ---------------------------------------------------------------
    @cute.jit
    def dq_turn(self, n_block: Int32, m_block: Int32, seqlen_q: Int32, seqlen_k: Int32):
        """This CTA's turn at query block `m_block`'s dQ: its key block (ascending), or with descending
        turns the key blocks after it that see the query block (the last of them adds first)."""
        turn = n_block
        if const_expr(self.descending_turns):
            last = (seqlen_k + self.tile_n - 1) // self.tile_n - 1
            if const_expr(self.causal):   # the last key block a row of the block sees (bottom-right)
                last = cutlass.min(((m_block + 1) * self.tile_m - 1 + seqlen_k - seqlen_q) // self.tile_n, last)
            turn = last - n_block
        return turn

    @cute.jit
    def wait_turn(self, turns: cute.Tensor, coord, turn: Int32, thread: Int32):
        """Deterministic: spin (one thread of the caller's group; the caller then syncs the group)
        until `turns[coord]` counts `turn`, that is until every writer of this sum before this CTA
        has added its part. The turn is the CTA's key block for dQ (the key blocks that see a query
        block are 0 .. n under any mask: `query_block_range`'s m_min never decreases) and its part
        for a split group's dK and dV. Every CTA waits only for CTAs launched before it (the grid
        hands CTAs out in order: key blocks, then parts, ascend along it under every scheduler;
        `plan.launch_order`), so the waits cannot deadlock."""
        if thread == 0:
            counter = turns.iterator + cute.crd2idx(coord, turns.layout)
            seen = cute.arch.load(counter, Int32, sem="acquire", scope="gpu")
            while seen != turn:
                seen = cute.arch.load(counter, Int32, sem="acquire", scope="gpu")
            # the sum's next adds come through the async proxy (TMA reduce-adds) too
            cute.arch.fence_proxy("async.global")

    @cute.jit
    def pass_turn(self, turns: cute.Tensor, coord, thread: Int32):
        """Deterministic: once the caller's group has completed its adds (and synced), hand the turn
        of `turns[coord]` to the next writer."""
        if thread == 0:
            counter = turns.iterator + cute.crd2idx(coord, turns.layout)
            cute.arch.fence_proxy("async.global")
            cute.arch.fence_acq_rel_gpu()
            cute.arch.red(counter, Int32(1), op="add", dtype="s32", sem="release", scope="gpu")

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

    @cute.jit
    def epilogue_reduce(self, acc_dK, acc_dV, sdK32, sdV32, mdK, mdV, mdKVturn, tma_atom_dK, tma_atom_dV,
                        tiled_mma_dkv, tidx: Int32, n_block: Int32, head_kv: Int32, batch_idx: Int32,
                        head_slot: Int32):
        """group_split > 1: this CTA's partial dK (unscaled: the postprocess scales the sum) and dV in
        fp32 -> shared memory -> one TMA reduce-add each into the (B, Sk, Hkv, D) accumulators (rows
        >= Sk fall outside the tensor and are not added). dK's tile is sK and sV's bytes; dV's is sQ
        and sdO's where they hold one (`dkv32_in_qdo`), else dK's again once its reduce has read it.
        Deterministic: the group's parts add in part order (the first reduce waits for the part's
        turn, the last passes it on once complete)."""
        d = self.head_dim
        store = self.fp32_tile_store(tiled_mma_dkv).get_slice(tidx)
        gdK = cute.local_tile(mdK[None, None, head_kv, batch_idx], (self.tile_n, d), (n_block, 0))
        gdV = cute.local_tile(mdV[None, None, head_kv, batch_idx], (self.tile_n, d), (n_block, 0))
        # every warpgroup's last products have read Q, dO, K and V (the producer loads nothing more)
        cute.arch.barrier(barrier_id=BAR_EPILOGUE, number_of_threads=self.num_mma_threads)
        cute.copy(store, store.retile(acc_dK), store.partition_D(sdK32))
        if const_expr(not self.dkv32_in_qdo):
            cute.arch.fence_view_async_shared()
            cute.arch.barrier(barrier_id=BAR_EPILOGUE, number_of_threads=self.num_mma_threads)
            if tidx < 32:
                if const_expr(self.deterministic):
                    self.wait_turn(mdKVturn, (batch_idx, head_kv, n_block), head_slot % self.group_split, tidx)
                    cute.arch.sync_warp()
                self.reduce_tile(tma_atom_dK, sdK32, gdK)
                cute.arch.cp_async_bulk_commit_group()
                cute.arch.cp_async_bulk_wait_group(0, read=True)
            # the reduce has read dK's tile: dV may overwrite it
            cute.arch.barrier(barrier_id=BAR_EPILOGUE, number_of_threads=self.num_mma_threads)
        cute.copy(store, store.retile(acc_dV), store.partition_D(sdV32))
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=BAR_EPILOGUE, number_of_threads=self.num_mma_threads)
        if tidx < 32:
            if const_expr(self.dkv32_in_qdo):
                if const_expr(self.deterministic):
                    self.wait_turn(mdKVturn, (batch_idx, head_kv, n_block), head_slot % self.group_split, tidx)
                    cute.arch.sync_warp()
                self.reduce_tile(tma_atom_dK, sdK32, gdK)
            self.reduce_tile(tma_atom_dV, sdV32, gdV)
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=not self.deterministic)   # deterministic: added
            if const_expr(self.deterministic):
                cute.arch.sync_warp()
                self.pass_turn(mdKVturn, (batch_idx, head_kv, n_block), tidx)

    @cute.jit
    def reduce_tile(self, tma_atom, smem_tile, gmem_tile):
        """One TMA reduce-add of an fp32 shared-memory tile into its global tile (the caller commits
        and waits)."""
        tile_s, tile_g = L.tma_copier(tma_atom, smem_tile, gmem_tile, smem_staged=False, gmem_tiled=False)
        cute.copy(tma_atom, tile_s, tile_g)
