"""CPU emulation, in PyTorch, of the tile algorithm the attention backward kernel will run (FA2/FA3
style): the reference its numerics are held to before any GPU runs it.

What is replayed, because it changes the numbers or the memory a kernel needs:

- A preprocess: D_i = sum_d dO_id * O_id in fp32, per query row.
- One task per (batch, KV head, key block of `tile_n`): its dK and dV accumulate in fp32 over every
  query head of the KV head's group and every query block of `tile_m` rows that sees a key of the
  block. GQA is reduced inside the task: no per-query-head dK/dV copy, no O(S^2) buffer.
- Per (query block, key block): S = Q K^T in fp32 is recomputed and P = exp2(S * scale * log2 e -
  LSE * log2 e) comes from the forward's saved LSE (natural log of the scaled scores' sum) (no max, no sum); masked keys (bottom-right
  causal: key j is visible to query i when j <= i + Sk - Sq) and rows that see no key (LSE = -inf)
  give P = 0. P rounded to the inputs' 16-bit type feeds dV += P^T dO; dP = dO V^T in fp32;
  dS = P * (dP - D) in fp32, rounded to 16 bits for dK += dS^T Q * scale and dQ += dS K * scale.
- dQ accumulates in fp32 across key blocks (what the kernel's atomics, or its ordered deterministic
  mode, do into an fp32 buffer) and is converted once at the end (the postprocess); dK, dV are
  converted when their task ends.
- `group_split` > 1 splits a KV head's query heads into that many parts, ceil(ratio / split) heads a
  part (the last may hold fewer), one task per (batch, KV head, part, key block): each task's dK and
  dV partial sums (dK unscaled) are added, in part order, to fp32 accumulators, which are scaled and
  converted once at the end (the kernel's reduce-adds land in any order; fp32 rounding apart, the same).

Inputs are (B, S, H, D) as `fa4.attention` takes them; LSE is (B, Hq, Sq) fp32.
"""

from __future__ import annotations

import math

import torch

LOG2_E = math.log2(math.e)


def preprocess(out: torch.Tensor, dout: torch.Tensor) -> torch.Tensor:
    """D = rowsum(dO * O) in fp32, (B, Hq, Sq)."""
    return (dout.float() * out.float()).sum(-1).transpose(1, 2)


def query_block_order(j0: int, seqlen_q: int, seqlen_k: int, tile_m: int, tile_n: int, causal: bool) -> list[int]:
    """First rows of the query blocks the task of key block `j0` walks, in the kernel's order
    (`block_of`): those that need no mask first, then the masked ones (bottom-right causal: the
    blocks before the first row that sees the key block's last key; every block of a partial last
    key block). Blocks above the first row that sees key j0 are skipped."""
    offset = seqlen_k - seqlen_q
    m_min = max(0, j0 - offset) // tile_m if causal else 0
    m_max = -(-seqlen_q // tile_m)
    m_unmasked = 0
    if causal:
        m_unmasked = min(-(-max(0, j0 + tile_n - 1 - offset) // tile_m), m_max)
    if j0 + tile_n > seqlen_k:
        m_unmasked = m_max
    m_unmasked = max(m_unmasked, m_min)
    return [m * tile_m for m in list(range(m_unmasked, m_max)) + list(range(m_min, m_unmasked))]


def backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
             dout: torch.Tensor, causal: bool, scale: float, tile_m: int = 64,
             tile_n: int = 128, group_split: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dQ, dK, dV) in the inputs' dtype, computed block by block as the kernel will."""
    batch, seqlen_q, heads_q, _ = q.shape
    _, seqlen_k, heads_kv, _ = k.shape
    ratio = heads_q // heads_kv
    per_part = -(-ratio // group_split)
    if (group_split - 1) * per_part >= ratio:
        raise ValueError(f"group_split={group_split} leaves a part of {ratio} query heads empty")
    low = q.dtype
    delta = preprocess(out, dout)
    dq_accum = torch.zeros(q.shape, dtype=torch.float32)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    dk_accum = torch.zeros(k.shape, dtype=torch.float32)   # group_split > 1
    dv_accum = torch.zeros(v.shape, dtype=torch.float32)
    scale_log2 = scale * LOG2_E
    tasks = [(b, h_kv, part, j0) for b in range(batch) for h_kv in range(heads_kv)
             for part in range(group_split) for j0 in range(0, seqlen_k, tile_n)]
    for b, h_kv, part, j0 in tasks:
        j1 = min(j0 + tile_n, seqlen_k)
        kj, vj = k[b, j0:j1, h_kv].float(), v[b, j0:j1, h_kv].float()
        dk_acc = torch.zeros(kj.shape, dtype=torch.float32)
        dv_acc = torch.zeros(vj.shape, dtype=torch.float32)
        first_head = h_kv * ratio + part * per_part
        for h in range(first_head, min(first_head + per_part, (h_kv + 1) * ratio)):
            for i0 in query_block_order(j0, seqlen_q, seqlen_k, tile_m, tile_n, causal):
                i1 = min(i0 + tile_m, seqlen_q)
                qi, doi = q[b, i0:i1, h].float(), dout[b, i0:i1, h].float()
                lse_i, delta_i = lse[b, h, i0:i1], delta[b, h, i0:i1]
                s = qi @ kj.T
                visible = torch.isfinite(lse_i)[:, None].expand_as(s)
                if causal:
                    rows = torch.arange(i0, i1)[:, None]
                    cols = torch.arange(j0, j1)[None, :]
                    visible = visible & (cols <= rows + seqlen_k - seqlen_q)
                bias = torch.where(torch.isfinite(lse_i), lse_i, 0.0)[:, None] * LOG2_E
                p = torch.where(visible, torch.exp2(s * scale_log2 - bias), 0.0)
                dv_acc += p.to(low).float().T @ doi
                dp = doi @ vj.T
                ds = (p * (dp - delta_i[:, None])).to(low).float()
                dk_acc += ds.T @ qi
                dq_accum[b, i0:i1, h] += ds @ kj * scale
        if group_split == 1:
            dk[b, j0:j1, h_kv] = (dk_acc * scale).to(low)
            dv[b, j0:j1, h_kv] = dv_acc.to(low)
        else:
            dk_accum[b, j0:j1, h_kv] += dk_acc
            dv_accum[b, j0:j1, h_kv] += dv_acc
    if group_split > 1:
        dk, dv = (dk_accum * scale).to(low), dv_accum.to(low)
    return dq_accum.to(low), dk, dv
