"""PyTorch SDPA in our conventions, for `fallback="sdpa"` (and as a reference in tests).

Our layout is (B, S, H, D) and causal masks are bottom-right aligned (key j is hidden from query i when
j > i + Sk - Sq, as flash-attn); SDPA takes (B, H, S, D) and its `is_causal` is top-left aligned. The
two agree only when Sq == Sk, so other causal calls get an explicit mask. Query rows that see no key
get O = 0 and LSE = -inf, as our kernels give them; the mask, that rule and the fp32 LSE come from
`fa4.reference`, where correctness is defined once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fa4.reference import lse_fp32, rows_without_keys, softmax_scale as default_scale, visible_keys


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                   softmax_scale: float | None, return_lse: bool):
    """O (B, Sq, Hq, D) contiguous, and LSE (B, Hq, Sq) fp32 when asked, computed with SDPA."""
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    scale = default_scale(head_dim) if softmax_scale is None else float(softmax_scale)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    gqa = heads_q != heads_kv
    mask = None
    is_causal = False
    if causal and seqlen_q == seqlen_k:
        is_causal = True
    elif causal:
        mask = visible_keys(seqlen_q, seqlen_k, q.device)
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
        out[:, :rows_without_keys(seqlen_q, seqlen_k, causal)] = 0  # a slice: no sync, graph-safe
    if not return_lse:
        return out, None
    return out, lse_fp32(q, k, causal, scale)
