"""PyTorch SDPA in our conventions, for `fallback="sdpa"` (and as a reference in tests).

Our layout is (B, S, H, D) and causal masks are bottom-right aligned (key j is hidden from query i when
j > i + Sk - Sq, as flash-attn); SDPA takes (B, H, S, D) and its `is_causal` is top-left aligned. The
two agree only when Sq == Sk, so other causal calls get an explicit mask. Query rows that see no key
(causal with Sq > Sk) get O = 0 and LSE = -inf, as our kernels give them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# Scores of at most this many bytes are materialised at once when computing the LSE.
_LSE_CHUNK_BYTES = 256 << 20


def bottom_right_causal_mask(seqlen_q: int, seqlen_k: int, device) -> torch.Tensor:
    """(Sq, Sk) bool, True where query i may see key j: j <= i + (Sk - Sq)."""
    rows = torch.arange(seqlen_q, device=device).unsqueeze(1)
    cols = torch.arange(seqlen_k, device=device).unsqueeze(0)
    return cols <= rows + (seqlen_k - seqlen_q)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                   softmax_scale: float | None, return_lse: bool):
    """O (B, Sq, Hq, D) contiguous, and LSE (B, Hq, Sq) fp32 when asked, computed with SDPA."""
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    gqa = heads_q != heads_kv
    mask = None
    is_causal = False
    if causal and seqlen_q == seqlen_k:
        is_causal = True
    elif causal:
        mask = bottom_right_causal_mask(seqlen_q, seqlen_k, q.device)
    if seqlen_k == 0:
        out = q.new_zeros(q.shape)
    else:
        try:
            out_t = F.scaled_dot_product_attention(
                qt, kt, vt, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=gqa)
        except (RuntimeError, TypeError):
            if not gqa:
                raise
            # a backend without GQA support: give every query head its own copy of K and V
            ratio = heads_q // heads_kv
            out_t = F.scaled_dot_product_attention(
                qt, kt.repeat_interleave(ratio, dim=1), vt.repeat_interleave(ratio, dim=1),
                attn_mask=mask, is_causal=is_causal, scale=scale)
        out = out_t.transpose(1, 2).contiguous()
        dead_rows = seqlen_q - seqlen_k if causal else 0
        if dead_rows > 0:
            out[:, :dead_rows] = 0
    if not return_lse:
        return out, None
    return out, reference_lse(q, k, causal, scale)


def reference_lse(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    """log(sum_j exp(scale * q_i . k_j)) over visible keys, fp32, (B, Hq, Sq); -inf where none is."""
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    lse = torch.full((batch, heads_q, seqlen_q), -math.inf, dtype=torch.float32, device=q.device)
    if seqlen_k == 0 or seqlen_q == 0 or batch == 0:
        return lse
    kf = k.transpose(1, 2).float().repeat_interleave(heads_q // heads_kv, dim=1)  # (B, Hq, Sk, D)
    rows_per_chunk = max(1, _LSE_CHUNK_BYTES // max(1, 4 * batch * heads_q * seqlen_k))
    for start in range(0, seqlen_q, rows_per_chunk):
        stop = min(seqlen_q, start + rows_per_chunk)
        qf = q[:, start:stop].transpose(1, 2).float()  # (B, Hq, rows, D)
        scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale
        if causal:
            visible = bottom_right_causal_mask(seqlen_q, seqlen_k, q.device)[start:stop]
            scores = scores.masked_fill(~visible, -math.inf)
        lse[:, :, start:stop] = torch.logsumexp(scores, dim=-1)
    return lse
