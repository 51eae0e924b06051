"""CPU emulation, in PyTorch, of the sm100 FA4 forward kernel's tile algorithm.

No Blackwell GPU is lent here, so the numerics of the sm100 kernel are checked by replaying its exact
tile algorithm on the CPU (design: `docs/design.md` section 2). What is replayed, because it changes
the numbers or the work done:

- CTA tasks (batch, kv_head, m_block) of `q_stages` Q stages of `tile_m` = 128 rows each (with
  `two_cta`, a cluster pair's task: both CTAs' Q stages, 2 * q_stages tiles sharing one KV loop; the
  kernel allows it only without a causal mask, where every row sees the same blocks); with
  `pack_gqa` the Hq/Hkv query heads of one KV head share the tile, packed row r being
  (seq = r // ratio, head = r % ratio); without it a task is (batch, q_head, m_block).
- KV blocks of `tile_n` keys visited from the last one the task needs down to the first.
- Per (m_block, n_block), decided once for the whole CTA (both Q stages ride the same KV loop): skipped
  (entirely above the bottom-right causal diagonal: never loaded), full (no mask work) or masked
  (straddles the diagonal or holds the key tail). Only masked blocks get a mask, so a wrong
  classification shows up as a wrong result; the mask is built as the kernel builds it, one 32-bit
  keep word per 32 keys (`keep_mask`).
- S = Q K^T in fp32; P = exp2(S * scale_log2 - basis * scale_log2) with scale * log2(e) folded; the
  last `exp2_poly_columns` keys of every 32 get the kernel's FMA polynomial exp2 (`exp2_polynomial`,
  relative error <= 8.6e-5), the others exact exp2 (MUFU.EX2's own error is not modelled).
- The conditional rescale: the row basis is raised only when the new row max exceeds it by more than
  `rescale_threshold` (log2 units); then O and l are multiplied by exp2((m_old - m_new) * scale_log2).
  Otherwise the OLD BASIS IS KEPT, P reaches at most 2^threshold, and l and O stay on one basis: that,
  not a factor close to 1, is why skipping is exact. The correction warpgroup rescales the 32 rows of O
  that one of its warps owns (32 TMEM lanes) only when some row of that warp raised its basis (the
  kernel's "any row moved" vote, `vote_any_sync` per warp); otherwise it releases O untouched. The
  counters also report the coarser per-tile (128-row Q stage) view.
- P rounded to the inputs' 16-bit type before the value MMA, fp32 accumulation of O and l (l sums the
  fp32 P, as the softmax warpgroup holds it before packing), O / l only at the end, and a row that sees
  no key gets O = 0, LSE = -inf.

What is not replayed because it cannot change a number beyond fp32 rounding: the kernel's row sum
in four partial sums (the emulation sums a block in torch's order), P released before that sum is
folded, the split of masked and unmasked blocks into two loops (the same blocks get the same mask),
KV/TMEM ring depths, RESCALE_TILE (the rescale
is a per-row multiply whichever column chunking does it), the register split and the scheduler (tasks
are independent). The order of the fp32 additions inside one MMA is the CPU matmul's, not the tensor
core's.

The emulation is vectorised over batch, heads and m_blocks; it loops only over KV blocks.

Rescale statistics per threshold, measured on this emulation: `fa4tune rescale-stats` (fa4tune/sm100/rescale_stats.py).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Callable, Optional

import torch

from fa4.kernels.knobs import Config
from fa4.kernels.sm100.plan import EXP2_POLY, EXP2_POLY_CHUNK, MASK_CHUNK

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)
_INPUT_DTYPES = (torch.float16, torch.bfloat16)


@dataclass
class RescaleStats:
    """Work counters of one or more emulated forward calls (pass the same object to accumulate).

    A "decision" is a visit of a tile (one Q stage of a task, one KV block) after the task's first KV
    block: the point where the softmax warpgroup tells the correction warpgroup whether O must be
    rescaled before the next value MMA. Row counters cover real query rows only (not tile padding).
    """

    tiles_visited: int = 0            # (task, Q stage, KV block) score tiles computed
    blocks_full: int = 0              # (task, KV block) pairs with no mask work
    blocks_masked: int = 0            # (task, KV block) pairs masked (causal diagonal or key tail)
    blocks_skipped_causal: int = 0    # (task, KV block) pairs above the diagonal, never loaded
    tile_decisions: int = 0           # tile visits after the task's first block
    tile_rescales: int = 0            # ... where some row raised its basis (some warp rescales)
    tile_skips_by_threshold: int = 0  # ... released without rescale although some row's max moved
    warp_decisions: int = 0           # the same per warp (32 rows): the kernel's unit of correction
    warp_rescales: int = 0            # ... where the warp's vote asks for the O round trip
    warp_skips_by_threshold: int = 0  # ... skipped although some row's max moved
    warp_rescales_from_empty: int = 0  # ... rescales voted only by rows seeing their first key (O = 0
    #                                      there, so the round trip could have been skipped)
    row_decisions: int = 0            # row visits after the task's first block
    row_max_moved: int = 0            # ... where the block's max exceeded the row's (finite) basis
    row_rescales: int = 0             # ... where the basis was raised (O and l multiplied)
    row_basis_from_empty: int = 0     # ... of which the row had seen no key yet (O = l = 0)
    max_p: float = 0.0                # largest P in fp32 (at most 2^threshold, up to rounding)
    max_p_16bit: float = 0.0          # largest P after rounding to the input dtype (<= 2^threshold)

    @property
    def tile_skips(self) -> int:
        """Decisions where the correction warpgroup released O without touching it."""
        return self.tile_decisions - self.tile_rescales

    @property
    def warp_skips(self) -> int:
        return self.warp_decisions - self.warp_rescales

    @property
    def row_rescales_skipped(self) -> int:
        """Rows whose max moved but stayed within the threshold: basis kept, no multiply."""
        return self.row_max_moved - (self.row_rescales - self.row_basis_from_empty)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["tile_skips"] = self.tile_skips
        out["warp_skips"] = self.warp_skips
        out["row_rescales_skipped"] = self.row_rescales_skipped
        return out

    def merge(self, other: "RescaleStats") -> None:
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            setattr(self, f.name, max(mine, theirs) if f.name.startswith("max_") else mine + theirs)


@dataclass(frozen=True)
class BasisUpdate:
    """What the softmax warpgroup decides for each row on a KV block after the first."""

    running_max: torch.Tensor  # new running max m (raw score units; -inf while no key seen)
    basis: torch.Tensor        # finite basis P is computed against (0 where no key seen yet)
    o_scale: torch.Tensor      # factor the correction warpgroup applies to O (1: untouched)
    l_scale: torch.Tensor      # factor applied to l
    raised: torch.Tensor       # bool: the row votes for a rescale of its tile


def choose_basis(running_max: torch.Tensor, block_max: torch.Tensor, threshold: float,
                 scale_log2: float) -> BasisUpdate:
    """The conditional rescale rule of the kernel (and of flash-attn 4's SoftmaxSm100).

    Keep the old basis while (m_old - m_new) * scale_log2 >= -threshold; otherwise raise it to m_new and
    scale O and l by exp2 of that difference. A row that sees its first key raises from -inf (factor 0,
    harmless since O = l = 0 there); a row that still sees none keeps -inf and does not vote.
    """
    candidate = torch.maximum(running_max, block_max)
    candidate_basis = torch.where(candidate == -math.inf, torch.zeros_like(candidate), candidate)
    old_basis = torch.where(running_max == -math.inf, torch.zeros_like(running_max), running_max)
    log2_factor = (running_max - candidate_basis) * scale_log2
    keep = (log2_factor >= -threshold) | (candidate == -math.inf)
    factor = torch.where(keep, torch.ones_like(log2_factor), torch.exp2(log2_factor))
    return BasisUpdate(
        running_max=torch.where(keep, running_max, candidate),
        basis=torch.where(keep, old_basis, candidate_basis),
        o_scale=factor,
        l_scale=factor,
        raised=~keep,
    )


def exp2_polynomial(x: torch.Tensor) -> torch.Tensor:
    """The kernel's FMA exp2 in fp32: clamp to -127, split into floor and fraction, degree-3 Horner
    on the fraction, scale by 2^floor (the kernel adds floor << 23 to the bits; ldexp is the same
    for every result that is not subnormal -- x in (-127, -126) -- and such a P rounds to 0 in 16
    bits and adds < 2^-126 to l)."""
    xc = torch.clamp(x.float(), min=-127.0)
    whole = torch.floor(xc)
    frac = xc - whole
    c0, c1, c2, c3 = (torch.tensor(c, dtype=torch.float32) for c in EXP2_POLY)
    poly = (c3 * frac + c2) * frac + c1
    poly = poly * frac + c0
    # below -127 the kernel's exponent addition wraps 1.0 to exactly +0
    return torch.where(xc <= -127.0, 0.0, torch.ldexp(poly, whole.to(torch.int32)))


def kernel_exp2(x: torch.Tensor, poly_columns: int) -> torch.Tensor:
    """exp2 of a block of scores (keys last) as the kernel computes it: the last `poly_columns` of
    every 32 keys by the polynomial, the rest by MUFU.EX2 (modelled as exact exp2)."""
    out = torch.exp2(x)
    if poly_columns:
        cols = torch.arange(x.shape[-1], device=x.device) % EXP2_POLY_CHUNK >= EXP2_POLY_CHUNK - poly_columns
        out[..., cols] = exp2_polynomial(x[..., cols])
    return out


def keep_mask(cols_visible: torch.Tensor, n_cols: int) -> torch.Tensor:
    """The kernel's mask of one block (`kernel._mask_row`): per 32 columns a keep word of all ones
    shifted right by the chunk's hidden columns (PTX shr.u32: 0 for a shift of 32 or more), column
    i of the chunk kept iff bit i is set. `cols_visible` (any shape, int) -> bool (..., n_cols)."""
    chunks = -(-n_cols // MASK_CHUNK)
    start = torch.arange(1, chunks + 1, device=cols_visible.device) * MASK_CHUNK
    hidden = torch.clamp(start - cols_visible[..., None].long(), min=0)
    word = torch.where(hidden >= 32, 0, 0xFFFFFFFF >> torch.clamp(hidden, max=31))
    bits = (word[..., None] >> torch.arange(MASK_CHUNK, device=word.device)) & 1
    return bits.flatten(-2)[..., :n_cols].bool()


# The rule in use; tests swap in a wrong rule to prove they would catch it.
_basis_rule: Callable[[torch.Tensor, torch.Tensor, float, float], BasisUpdate] = choose_basis


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: Config) -> None:
    if not isinstance(config, Config) or config.arch != "sm100":
        raise ValueError(f"the sm100 emulation needs an sm100 Config, got {config!r}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q must be (B, Sq, Hq, D) and k, v (B, Sk, Hkv, D)")
    if q.dtype not in _INPUT_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one of {_INPUT_DTYPES}, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.shape[2] == 0 or q.shape[2] % k.shape[2]:
        raise ValueError(f"heads_q ({q.shape[2]}) must be a positive multiple of heads_kv ({k.shape[2]})")


def _check_mode(config: Config, causal: bool) -> None:
    if config.two_cta and causal:
        raise ValueError("two_cta is non-causal only (the kernel's feasibility model rejects it)")


@dataclass(frozen=True)
class _BlockPlan:
    """Per m_block extents of the KV loop, decided once per CTA (the kernel's `_block_range`)."""

    n_blocks: int             # KV blocks of the whole key sequence
    block_end: torch.Tensor   # (M,) blocks [0, block_end) are visited; the rest is skipped (causal)
    full_end: torch.Tensor    # (M,) blocks [0, full_end) need no mask; [full_end, block_end) are masked


def _plan_blocks(num_m: int, rows_per_cta: int, packed_rows: int, ratio: int, seqlen_q: int,
                 seqlen_k: int, tile_n: int, causal: bool) -> _BlockPlan:
    n_blocks = -(-seqlen_k // tile_n)
    offset = seqlen_k - seqlen_q  # key j is visible from query i iff j <= i + offset (causal)
    block_end, full_end = [], []
    for m in range(num_m):
        first_row = m * rows_per_cta
        last_row = (m + 1) * rows_per_cta - 1  # padding rows included, as the kernel does: they only
        # ever add blocks the last real row needs anyway (a padding row's seq is >= Sq)
        seq_lo, seq_hi = first_row // ratio, last_row // ratio
        end, full = n_blocks, seqlen_k // tile_n  # the key tail block is always masked
        if causal:
            end = min(n_blocks, max(0, -(-(seq_hi + offset + 1) // tile_n)))
            full = min(full, max(0, (seq_lo + offset + 1) // tile_n))
        block_end.append(end)
        full_end.append(min(full, end))
    return _BlockPlan(n_blocks, torch.tensor(block_end), torch.tensor(full_end))


def emulate_fa4_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: Config,
                        causal: bool = False, softmax_scale: Optional[float] = None,
                        return_lse: bool = False, stats: Optional[RescaleStats] = None):
    """Run the sm100 kernel's tile algorithm on the CPU (or any torch device).

    q (B, Sq, Hq, D), k and v (B, Sk, Hkv, D), fp16 or bf16. Returns O like q, and with `return_lse`
    also LSE (B, Hq, Sq) fp32 in natural log. `stats`, when given, accumulates work counters.
    """
    _check(q, k, v, config)
    _check_mode(config, causal)
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    ratio = heads_q // heads_kv
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
    scale_log2 = scale * LOG2_E
    threshold = float(config.rescale_threshold)
    tile_m, q_stages, tile_n = int(config.tile_m), int(config.q_stages), int(config.tile_n)
    poly_columns = int(config.exp2_poly_columns)
    # rows that share one KV loop and its block decisions: one CTA's Q stages, or a pair's
    rows_per_cta = tile_m * q_stages * (2 if config.two_cta else 1)
    device = q.device

    # Task layout: (B, T, rows, D) with T the task heads and rows the (packed) query rows.
    if config.pack_gqa:
        q_rows = q.reshape(batch, seqlen_q, heads_kv, ratio, head_dim).permute(0, 2, 1, 3, 4)
        q_rows = q_rows.reshape(batch, heads_kv, seqlen_q * ratio, head_dim)
        k_task, v_task = k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)
        row_ratio = ratio
    else:
        q_rows = q.permute(0, 2, 1, 3)
        k_task = k.permute(0, 2, 1, 3).repeat_interleave(ratio, dim=1)
        v_task = v.permute(0, 2, 1, 3).repeat_interleave(ratio, dim=1)
        row_ratio = 1
    tasks, packed_rows = q_rows.shape[1], q_rows.shape[2]
    num_m = -(-packed_rows // rows_per_cta)
    padded_rows = num_m * rows_per_cta

    out_rows = torch.zeros(batch, tasks, padded_rows, head_dim, dtype=torch.float32, device=device)
    lse_rows = torch.full((batch, tasks, padded_rows), -math.inf, dtype=torch.float32, device=device)
    if num_m > 0 and seqlen_k > 0:
        q_f32 = torch.zeros(batch, tasks, padded_rows, head_dim, dtype=torch.float32, device=device)
        q_f32[:, :, :packed_rows] = q_rows.float()  # TMA zero-fills rows past the sequence
        plan = _plan_blocks(num_m, rows_per_cta, packed_rows, row_ratio, seqlen_q, seqlen_k, tile_n,
                            causal)
        _run_tasks(q_f32.view(batch, tasks, num_m, rows_per_cta, head_dim), k_task.float(),
                   v_task.float(), plan, q.dtype, tile_m, tile_n, row_ratio, packed_rows, seqlen_q,
                   seqlen_k, causal, scale_log2, threshold, out_rows, lse_rows, stats, poly_columns)

    # Back to (B, Sq, Hq, D) and (B, Hq, Sq).
    out_rows, lse_rows = out_rows[:, :, :packed_rows], lse_rows[:, :, :packed_rows]
    if config.pack_gqa:
        out = out_rows.reshape(batch, heads_kv, seqlen_q, ratio, head_dim).permute(0, 2, 1, 3, 4)
        out = out.reshape(batch, seqlen_q, heads_q, head_dim)
        lse = lse_rows.reshape(batch, heads_kv, seqlen_q, ratio).permute(0, 1, 3, 2)
        lse = lse.reshape(batch, heads_q, seqlen_q)
    else:
        out, lse = out_rows.permute(0, 2, 1, 3), lse_rows
    out = out.to(q.dtype).contiguous()
    return (out, lse.contiguous()) if return_lse else out


def _run_tasks(q_f32, k_f32, v_f32, plan: _BlockPlan, p_dtype, tile_m, tile_n, row_ratio, packed_rows,
               seqlen_q, seqlen_k, causal, scale_log2, threshold, out_rows, lse_rows,
               stats: Optional[RescaleStats], poly_columns: int = 0) -> None:
    """The KV loop of every CTA task at once: q_f32 (B, T, M, rows_per_cta, D), k/v (B, T, Sk, D)."""
    batch, tasks, num_m, rows_per_cta, head_dim = q_f32.shape
    q_stages = rows_per_cta // tile_m
    device = q_f32.device
    state_shape = (batch, tasks, num_m, rows_per_cta)
    running_max = torch.full(state_shape, -math.inf, device=device)
    basis = torch.zeros(state_shape, device=device)
    row_sum = torch.zeros(state_shape, device=device)
    acc_o = torch.zeros(*state_shape, head_dim, device=device)

    row_index = torch.arange(num_m * rows_per_cta, device=device).view(num_m, rows_per_cta)
    row_seq = row_index // row_ratio               # query position of each packed row
    row_valid = row_index < packed_rows            # tile padding rows are computed, never stored
    tasks_total = batch * tasks
    counts = RescaleStats()
    counts.blocks_skipped_causal = int((plan.n_blocks - plan.block_end).sum()) * tasks_total

    for n in range(plan.n_blocks - 1, -1, -1):
        active = n < plan.block_end
        if not bool(active.any()):
            continue
        m_idx = active.nonzero().flatten()
        m_dev = m_idx.to(device)
        everyone = m_idx.numel() == num_m
        first = (plan.block_end[m_idx] - 1 == n).to(device)
        masked = (n >= plan.full_end[m_idx]).to(device)
        counts.tiles_visited += m_idx.numel() * q_stages * tasks_total
        counts.blocks_masked += int(masked.sum()) * tasks_total
        counts.blocks_full += int((~masked).sum()) * tasks_total

        key_lo, key_hi = n * tile_n, min((n + 1) * tile_n, seqlen_k)
        k_blk = k_f32[:, :, key_lo:key_hi]
        v_blk = v_f32[:, :, key_lo:key_hi]
        if key_hi - key_lo < tile_n:  # TMA zero-fills keys past the sequence; the mask removes them
            pad = tile_n - (key_hi - key_lo)
            k_blk = torch.nn.functional.pad(k_blk, (0, 0, 0, pad))
            v_blk = torch.nn.functional.pad(v_blk, (0, 0, 0, pad))
        q_sel = q_f32 if everyone else q_f32.index_select(2, m_dev)
        scores = torch.matmul(q_sel, k_blk.transpose(-1, -2).unsqueeze(2))  # (B, T, m, rows, N)

        if bool(masked.any()):
            # the kernel's keep-mask: per row, the keys below its limit, as 32-bit words
            key_limit = torch.full_like(row_seq[m_dev], seqlen_k)
            if causal:
                key_limit = torch.minimum(key_limit, row_seq[m_dev] + 1 + (seqlen_k - seqlen_q))
            invisible = ~keep_mask(key_limit - key_lo, tile_n)
            scores = scores.masked_fill(invisible & masked[:, None, None], -math.inf)

        block_max = scores.amax(dim=-1)
        old_max = running_max if everyone else running_max.index_select(2, m_dev)
        update = _basis_rule(old_max, block_max, threshold, scale_log2)
        # First block of a task: the basis is the block's max (0 while the row sees no key).
        first_b = first[:, None]
        new_max = torch.where(first_b, block_max, update.running_max)
        new_basis = torch.where(first_b, torch.where(block_max == -math.inf, 0.0, block_max), update.basis)
        o_scale = torch.where(first_b, 0.0, update.o_scale)
        l_scale = torch.where(first_b, 0.0, update.l_scale)

        probs = kernel_exp2(scores * scale_log2 - (new_basis * scale_log2)[..., None], poly_columns)
        probs_16 = probs.to(p_dtype)
        if stats is not None:
            counts.max_p = max(counts.max_p, float(probs.max()))
            counts.max_p_16bit = max(counts.max_p_16bit, float(probs_16.max()))
            _count_decisions(counts, first, update, old_max, block_max, row_valid[m_dev], q_stages,
                             tile_m)

        old_sum = row_sum if everyone else row_sum.index_select(2, m_dev)
        old_o = acc_o if everyone else acc_o.index_select(2, m_dev)
        new_sum = old_sum * l_scale + probs.sum(dim=-1)
        new_o = old_o * o_scale[..., None] + torch.matmul(probs_16.float(), v_blk.unsqueeze(2))
        if everyone:
            running_max, basis, row_sum, acc_o = new_max, new_basis, new_sum, new_o
        else:
            running_max.index_copy_(2, m_dev, new_max)
            basis.index_copy_(2, m_dev, new_basis)
            row_sum.index_copy_(2, m_dev, new_sum)
            acc_o.index_copy_(2, m_dev, new_o)

    seen = row_sum > 0
    safe_sum = torch.where(seen, row_sum, torch.ones_like(row_sum))
    out = torch.where(seen[..., None], acc_o / safe_sum[..., None], 0.0)
    lse = torch.where(seen, (basis * scale_log2 + torch.log2(safe_sum)) * LN_2, -math.inf)
    out_rows.copy_(out.view_as(out_rows))
    lse_rows.copy_(lse.view_as(lse_rows))
    if stats is not None:
        stats.merge(counts)


WARP_ROWS = 32  # TMEM lanes one warp of the correction warpgroup owns


def _count_decisions(counts: RescaleStats, first: torch.Tensor, update: BasisUpdate,
                     old_max: torch.Tensor, block_max: torch.Tensor, row_valid: torch.Tensor,
                     q_stages: int, tile_m: int) -> None:
    later = ~first[:, None]                           # (m, 1): decisions happen after the first block
    real = (later & row_valid).expand_as(old_max)     # (B, T, m, rows)
    moved = (block_max > old_max) & real
    raised = update.raised & later.expand_as(old_max)  # padding rows vote too (they never move)
    counts.row_decisions += int(real.sum())
    counts.row_max_moved += int((moved & (old_max > -math.inf)).sum())
    counts.row_rescales += int((raised & real).sum())
    counts.row_basis_from_empty += int((raised & real & (old_max == -math.inf)).sum())
    moved_finite = moved & (old_max > -math.inf)
    for group, prefix in ((tile_m, "tile"), (WARP_ROWS, "warp")):
        shape = old_max.shape[:3] + (old_max.shape[3] // group, group)
        vote = raised.view(shape).any(dim=-1)
        group_moved = moved_finite.view(shape).any(dim=-1)
        decisions = int(later.sum()) * old_max.shape[0] * old_max.shape[1] * shape[3]
        setattr(counts, f"{prefix}_decisions", getattr(counts, f"{prefix}_decisions") + decisions)
        setattr(counts, f"{prefix}_rescales", getattr(counts, f"{prefix}_rescales") + int(vote.sum()))
        name = f"{prefix}_skips_by_threshold"
        setattr(counts, name, getattr(counts, name) + int((group_moved & ~vote).sum()))
    shape = old_max.shape[:3] + (old_max.shape[3] // WARP_ROWS, WARP_ROWS)
    vote = raised.view(shape).any(dim=-1)
    vote_with_data = (raised & (old_max > -math.inf)).view(shape).any(dim=-1)
    counts.warp_rescales_from_empty += int((vote & ~vote_with_data).sum())
