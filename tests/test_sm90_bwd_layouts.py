"""The sm90 backward's register <-> shared-memory layouts, checked on a CPU: the DSL evaluates static
layouts while tracing, so each lane's fragment coordinates can be read out and its data movement
replayed by the PTX semantics, without a GPU.

- P / dS stores (`pds_store_atom`, `pds_store_view`): stmatrix.x4 moves lane t's 32-bit register r of
  instruction k (fragment row t // 4, columns 2 (t % 4) + {0, 1} of 8x8 matrix r) to the memory row
  (column, with .trans) whose address lane 8 r + row provides, 16 contiguous bytes. Replayed for
  every lane of a warp of each warpgroup: every value lands at its own (query, key) and every row the
  lanes address is contiguous in the swizzled buffer, with sdp_swap's transposed store and without
  (the layout that passed on the H200).
- P^T and dS^T as the A operand of dV and dK (sdp_swap): the register view `acc_as_operand_a` of an
  S^T accumulator holds, element for element, the coordinates the register-sourced wgmma's A
  fragment expects.
- fp32 tiles a TMA reduce-add reads (`fp32_tile_store`): a block's dQ (dQ^T at tile_m 80, one 32-bit
  store an element into the transposed view) and a split group's dK / dV: every element once, at the
  swizzled offset of its (row, column), and each store instruction of a warp on distinct banks.
"""

from __future__ import annotations

import pytest

pytest.importorskip("cutlass")

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402

from fa4.kernels.dsl_internals import dsl_target  # noqa: E402
from fa4.kernels.sm90 import layouts as L  # noqa: E402
from fa4.kernels.sm90_bwd.kernel import FlashAttentionBackwardSm90  # noqa: E402

LANES = tuple(range(32)) + tuple(range(128, 160))   # the first warp of each MMA warpgroup


def _kernel(sdp_swap: bool, tile_m: int) -> FlashAttentionBackwardSm90:
    return FlashAttentionBackwardSm90(dtype="bf16", head_dim=128, causal=True, tile_m=tile_m, tile_n=128,
                                      q_stages=2, dq_accum="bulk", sdp_swap=sdp_swap, scheduler="single",
                                      pds_stages=1, group_split=1)


def _trace(fn) -> None:
    """Trace `fn` as DSL code, its Python loops as Python (no AST rewriting): static layouts evaluate to
    integers while it runs."""
    with dsl_target("sm_90a"):
        cute.compile(cute.jit(preprocess=False)(fn))


def _store_lanes(kern: FlashAttentionBackwardSm90, the_other_stmatrix: bool = False) -> dict:
    """{thread: (the tile coordinate of each value it stores, in copy order; the coordinates of the
    address runs it provides; their offsets in the P/dS buffer)}, for the kernel's S tiled MMA, P/dS
    buffer and view, and stmatrix (or the other stmatrix: transposed where the kernel's is not, and
    the reverse)."""
    lanes = {}

    def probe():
        kern._make_layouts()
        sdp, _, _ = kern._tiled_mmas()
        shape = (kern.tile_n, kern.tile_m) if kern.sdp_swap else (kern.tile_m, kern.tile_n)
        ident = cute.make_identity_tensor(shape)
        atom = kern.pds_store_atom()
        assert atom.op.transpose == kern.sdp_swap
        if the_other_stmatrix:
            atom = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=not kern.sdp_swap,
                                                                         num_matrices=4), kern.dtype)
        store = cute.make_tiled_copy_C(atom, sdp)
        for t in LANES:
            acc = sdp.get_slice(t).partition_C(ident)
            thr = store.get_slice(t)
            runs = thr.partition_D(ident)
            order = thr.retile(cute.make_identity_tensor(acc.shape))
            n = cute.size(runs)
            # the buffer is (query, key); S^T's coordinates are (key, query)
            offsets = [cute.crd2idx(tuple(reversed(runs[j])) if kern.sdp_swap else runs[j], kern.sPdS_layout)
                       for j in range(n)]
            lanes[t] = ([acc[order[j]] for j in range(n)], [runs[j] for j in range(n)], offsets)

    _trace(probe)
    return lanes


def _broken_runs(lanes: dict) -> int:
    """Address runs (8 values of one stmatrix row) that are not 16 contiguous bytes of the buffer."""
    broken = 0
    for _, _, offsets in lanes.values():
        for k in range(0, len(offsets), 8):
            broken += offsets[k:k + 8] != list(range(offsets[k], offsets[k] + 8))
    return broken


def _misplaced(lanes: dict, transposed: bool) -> int:
    """Values that stmatrix.x4 (.trans) would put somewhere other than their own coordinate."""
    wrong = 0
    for t, (values, _, _) in lanes.items():
        warp, lane = divmod(t, 32)
        for j, want in enumerate(values):
            k, rest = divmod(j, 8)
            matrix, half = divmod(rest, 2)
            row, col = lane // 4, 2 * (lane % 4) + half
            mem_row, mem_col = (col, row) if transposed else (row, col)
            got = lanes[warp * 32 + 8 * matrix + mem_row][1][8 * k + mem_col]
            wrong += got != want
    return wrong


@pytest.mark.parametrize("sdp_swap, tile_m", [(False, 64), (False, 128), (True, 64), (True, 80), (True, 128)],
                         ids=["direct-64", "direct-128", "swapped-64", "swapped-80", "swapped-128"])
def test_p_and_ds_land_where_their_coordinates_say(sdp_swap, tile_m):
    kern = _kernel(sdp_swap, tile_m)
    lanes = _store_lanes(kern)
    assert sum(len(v) for v, _, _ in lanes.values()) == len(LANES) * tile_m * 128 // 256
    assert _misplaced(lanes, transposed=sdp_swap) == 0 and _broken_runs(lanes) == 0
    # the other stmatrix moves the data consistently (the DSL builds its copy to match) but its rows
    # run across the buffer's rows, where stmatrix writes 16 contiguous bytes: the check can fail
    other = _store_lanes(kern, the_other_stmatrix=True)
    assert _misplaced(other, transposed=not sdp_swap) == 0 and _broken_runs(other) > 0


@pytest.mark.parametrize("tile_m", [64, 80, 128])
def test_swapped_p_and_ds_registers_are_the_dv_dk_a_operand(tile_m):
    kern = _kernel(True, tile_m)
    pairs = []

    def probe():
        sdp, dkv, _ = kern._tiled_mmas()
        ident = cute.make_identity_tensor((kern.tile_n, kern.tile_m))     # (key, query)
        for t in LANES:
            as_a = L.acc_as_operand_a(sdp.get_slice(t).partition_C(ident))
            expected = dkv.get_slice(t).partition_A(ident)
            assert cute.size(as_a) == cute.size(expected)
            for k in range(cute.size(expected.shape[2])):
                for i in range(cute.size(expected[None, None, k])):
                    pairs.append((as_a[None, None, k][i], expected[None, None, k][i]))

    _trace(probe)
    assert len(pairs) == len(LANES) * 64 * tile_m // 128
    assert all(got == want for got, want in pairs), [p for p in pairs if p[0] != p[1]][:4]


@pytest.mark.parametrize("tile_m, tile_n, q_stages, head_dim", [
    (64, 128, 2, 128), (64, 128, 1, 128), (128, 128, 2, 64), (64, 64, 1, 128), (64, 64, 2, 64)])
def test_a_split_groups_fp32_dk_dv_tiles_are_whole_and_fit_the_buffers_they_reuse(tile_m, tile_n, q_stages,
                                                                                  head_dim):
    """group_split > 1: the MMA threads' 64-bit stores of dK / dV (the dkv tiled MMA's C fragments)
    cover the tile_n x D tile once each, two neighbouring fp32 values a store, at the offsets of the
    swizzled fp32 layout the TMA reduce-add reads (a bijection onto the tile's elements), and the
    tile is exactly sK and sV's bytes (and fits sQ and sdO's where the kernel puts dV there)."""
    kern = FlashAttentionBackwardSm90(dtype="bf16", head_dim=head_dim, causal=False, tile_m=tile_m,
                                      tile_n=tile_n, q_stages=q_stages, dq_accum="bulk",
                                      sdp_swap=tile_n == 128, scheduler="single", pds_stages=1, group_split=2)
    found = {}

    def probe():
        kern._make_layouts()
        _, dkv, _ = kern._tiled_mmas()
        f32 = cutlass.Float32
        store = kern.fp32_tile_store(dkv)
        ident = cute.make_identity_tensor((kern.tile_n, kern.head_dim))
        coords, pairs = [], []
        for t in range(256):   # both MMA warpgroups
            runs = store.get_slice(t).partition_D(ident)
            values = [runs[j] for j in range(cute.size(runs))]
            offsets = [cute.crd2idx(c, kern.sdKV32_layout) for c in values]
            coords += values
            pairs += [(offsets[j], offsets[j + 1]) for j in range(0, len(offsets), 2)]
        found.update(
            coords=coords, pairs=pairs, offsets=sorted(o for pair in pairs for o in pair),
            tile_bytes=cute.size_in_bytes(f32, kern.sdKV32_layout),
            kv_bytes=cute.size_in_bytes(kern.dtype, kern.sK_layout) + cute.size_in_bytes(kern.dtype, kern.sV_layout),
            qdo_bytes=cute.size_in_bytes(kern.dtype, kern.sQ_layout) + cute.size_in_bytes(kern.dtype, kern.sdO_layout))

    _trace(probe)
    elements = tile_n * head_dim
    assert len(found["coords"]) == elements and len(set(found["coords"])) == elements
    assert found["offsets"] == list(range(elements))
    assert all(a % 2 == 0 and b == a + 1 for a, b in found["pairs"])   # 8-byte aligned neighbours
    assert found["tile_bytes"] == found["kv_bytes"] == 4 * elements
    assert kern.dkv32_in_qdo == (q_stages * tile_m >= tile_n)
    if kern.dkv32_in_qdo:
        assert found["tile_bytes"] <= found["qdo_bytes"]


def _swizzled_byte(coord, layout, element_bytes: int) -> int:
    """The byte a coordinate of a swizzled shared-memory layout lands on: the swizzle of a shared-memory
    tensor acts on byte addresses (its pointer's), so it is applied to the unswizzled offset in bytes
    (the layout's own crd2idx applies it to element offsets, which is the same map only for bytes)."""
    byte = cute.crd2idx(coord, layout.outer) * element_bytes
    sw = layout.inner
    mask = ((1 << sw.num_bits) - 1) << (sw.num_base + sw.num_shift)
    return byte ^ ((byte & mask) >> sw.num_shift)


def _bank_wavefronts(offsets_per_lane: list[list[int]], words: int) -> int:
    """Shared-memory wavefronts of the worst store instruction of one warp: each lane's j-th store
    writes `words` 32-bit words from its offsets; a bank hit by n distinct words takes n wavefronts."""
    worst = 0
    for j in range(0, len(offsets_per_lane[0]), words):
        banks = {}
        for offsets in offsets_per_lane:
            for word in offsets[j:j + words]:
                banks.setdefault(word % 32, set()).add(word)
        worst = max(worst, max(len(v) for v in banks.values()))
    return worst


def _dq_kernel(tile_m: int, head_dim: int, dq_accum: str, sdp_swap: bool = True) -> FlashAttentionBackwardSm90:
    return FlashAttentionBackwardSm90(dtype="bf16", head_dim=head_dim, causal=False, tile_m=tile_m, tile_n=128,
                                      q_stages=2, dq_accum=dq_accum, sdp_swap=sdp_swap, scheduler="single",
                                      pds_stages=2, group_split=1)


def _dq_mma_and_tile(kern: FlashAttentionBackwardSm90):
    """(the dQ tiled MMA, the identity tensor of its C tile: (D, tile_m) for dQ^T), while tracing."""
    kern._make_layouts()
    _, _, dq = kern._tiled_mmas()
    shape = (kern.head_dim, kern.tile_m) if kern.dq_swap else (kern.tile_m, kern.head_dim)
    return dq, cute.make_identity_tensor(shape)


@pytest.mark.parametrize("tile_m, head_dim", [(64, 128), (128, 64), (80, 128), (80, 64)])
def test_the_dq_tile_stores_cover_the_tile_once_on_distinct_banks(tile_m, head_dim):
    """dq_accum="bulk": the MMA threads' stores of a block's dQ (dQ^T = K^T dS^T at tile_m 80) put every
    element of the tile_m x D fp32 tile once, at the swizzled offset of its (query, head-dim column) that
    the TMA reduce-add reads; one store instruction of a warp needs the fewest wavefronts its width
    allows (64-bit: two, 32-bit: one): no bank conflicts."""
    kern = _dq_kernel(tile_m, head_dim, "bulk")
    found = {}

    def probe():
        dq, ident = _dq_mma_and_tile(kern)
        store = kern.fp32_tile_store(dq, transposed=kern.dq_swap)
        lanes = {}
        for t in range(256):   # both MMA warpgroups
            runs = store.get_slice(t).partition_D(ident)
            coords = [runs[j] for j in range(cute.size(runs))]
            tile_coords = [tuple(reversed(c)) if kern.dq_swap else c for c in coords]   # (query, column)
            lanes[t] = (tile_coords, [cute.crd2idx(c, kern.sdQ_layout) for c in tile_coords],
                        [_swizzled_byte(c, kern.sdQ_layout, 4) // 4 for c in tile_coords])
        found.update(lanes=lanes, dq_swap=kern.dq_swap)

    _trace(probe)
    lanes = found["lanes"]
    assert found["dq_swap"] == (tile_m % 64 != 0)
    elements = tile_m * head_dim
    coords = [c for tile_coords, _, _ in lanes.values() for c in tile_coords]
    assert len(coords) == elements and len(set(coords)) == elements
    assert sorted(o for _, offsets, _ in lanes.values() for o in offsets) == list(range(elements))
    assert sorted(w for _, _, words in lanes.values() for w in words) == list(range(elements))
    width = 1 if found["dq_swap"] else 2
    if width == 2:   # a 64-bit store: two neighbouring, 8-byte aligned words
        assert all(words[j] % 2 == 0 and words[j + 1] == words[j] + 1
                   for _, _, words in lanes.values() for j in range(0, len(words), 2))
    for warp in range(8):
        warp_words = [lanes[t][2] for t in range(32 * warp, 32 * warp + 32)]
        assert _bank_wavefronts(warp_words, width) == width, f"warp {warp}"


@pytest.mark.parametrize("tile_m, head_dim, sdp_swap", [(64, 128, True), (80, 128, True), (128, 64, True),
                                                        (80, 64, True), (64, 64, False)])
def test_the_fragment_ordered_dq_holds_every_element_once(tile_m, head_dim, sdp_swap):
    """dq_accum="fragment": the MMA threads' values of a block's dQ go to `dq_fragment_thread_layout`'s
    offsets, which cover the tile_m x D block once, a thread's 4-value groups 16-byte aligned and each
    warp's group 512 contiguous bytes (one wavefront a 128 bytes: no bank conflict); the postprocess
    reads them back by the same layout and finds each value's element from the same dQ MMA, whose
    fragments cover every (query, head-dim column) once."""
    kern = _dq_kernel(tile_m, head_dim, "fragment", sdp_swap)
    found = {}

    def probe():
        dq, ident = _dq_mma_and_tile(kern)
        layout = kern.dq_fragment_thread_layout()
        groups = kern.dq_fragment_values() // 4
        lanes = {}
        for t in range(kern.num_mma_threads):
            coords = dq.get_slice(t).partition_C(ident)
            values = [coords[v] for v in range(cute.size(coords))]
            offsets = [layout(((v % 4, t), v // 4)) for v in range(4 * groups)]
            lanes[t] = ([tuple(reversed(c)) if kern.dq_swap else tuple(c) for c in values], offsets)
        found.update(lanes=lanes, values=kern.dq_fragment_values(), box=cute.size(kern.dq_fragment_layout()))

    _trace(probe)
    lanes, elements = found["lanes"], tile_m * head_dim
    assert found["values"] * len(lanes) == elements == found["box"]
    coords = [c for values, _ in lanes.values() for c in values]
    assert len(coords) == elements and set(coords) == {(q, c) for q in range(tile_m) for c in range(head_dim)}
    assert sorted(o for _, offsets in lanes.values() for o in offsets) == list(range(elements))
    for t, (_, offsets) in lanes.items():
        for g in range(0, len(offsets), 4):
            assert offsets[g] % 4 == 0 and offsets[g:g + 4] == list(range(offsets[g], offsets[g] + 4)), t
    for warp in range(len(lanes) // 32):
        for g in range(0, found["values"], 4):
            starts = sorted(lanes[t][1][g] for t in range(32 * warp, 32 * warp + 32))
            assert starts == list(range(starts[0], starts[0] + 128, 4)), (warp, g)
