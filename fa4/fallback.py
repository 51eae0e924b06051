"""PyTorch SDPA in our conventions, for `fallback="sdpa"` (and as a reference in tests).

Our layout is (B, S, H, D) and causal masks are bottom-right aligned (key j is hidden from query i when
j > i + Sk - Sq, as flash-attn); SDPA takes (B, H, S, D) and its `is_causal` is top-left aligned. The
two agree only when Sq == Sk, so other causal calls get an explicit mask, as do sliding windows. SDPA
has no softcap: a call with one is computed by `fa4.reference.attention_fp32` (a query chunk at a time,
in fp32). Query rows that see no key
get O = 0 and LSE = -inf, as our kernels give them; the mask, that rule and the fp32 LSE come from
`fa4.reference`, where correctness is defined once.

Inputs holding inf or NaN get the reference's answer: NaN in every row that sees a NaN or +inf score
(as our kernels give it: their row maximum is +inf there, and exp2(inf - inf) is NaN), while a hidden
key's inf changes nothing (the kernels never load or select it). SDPA on the CPU gives finite rows
where the reference has NaN, and its additive mask turns a hidden +inf score into NaN, so CPU tensors
are checked and such inputs computed by `fa4.reference.attention_fp32`. CUDA tensors are not checked:
that needs a device sync per call (and none may happen during a CUDA-graph capture). SDPA on the H200
(torch 2.11) gave NaN in every row the reference has NaN (inf or NaN in one element or a whole row
of K, or in Q or V; 720 cases), and NaN in some rows the reference keeps finite (mostly a hidden
key's inf under the explicit causal mask): a wrong answer there is visible, never a plausible one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fa4.reference import (attention_fp32, key_bounds, lse_fp32, rows_without_keys,
                           softmax_scale as default_scale, visible_keys)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                   softmax_scale: float | None, return_lse: bool, *, window=None, softcap: float | None = None):
    """O (B, Sq, Hq, Dv) contiguous (Dv: v's head dim), and LSE (B, Hq, Sq) fp32 when asked, computed with SDPA (with a
    softcap: the fp32 reference). `window` (left, right), -1 unbounded; `softcap` c > 0 or None."""
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    scale = default_scale(head_dim) if softmax_scale is None else float(softmax_scale)
    mask_args = {"window": window, "softcap": softcap}
    if softcap is not None or (q.device.type == "cpu" and not all(_finite(t) for t in (q, k, v))):
        out, lse = attention_fp32(q, k, v, causal, scale, **mask_args)
        return out.to(q.dtype), (lse if return_lse else None)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    gqa = heads_q != heads_kv
    mask = None
    is_causal = False
    left, right = key_bounds(causal, window)
    if (left, right) == (None, 0) and seqlen_q == seqlen_k:
        is_causal = True
    elif (left, right) != (None, None):
        mask = visible_keys(seqlen_q, seqlen_k, q.device, (-1 if left is None else left,
                                                            -1 if right is None else right))
    if seqlen_k == 0:
        out = q.new_zeros((batch, seqlen_q, heads_q, v.shape[3]))
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
        out[:, :rows_without_keys(seqlen_q, seqlen_k, causal, window)] = 0  # a slice: no sync, graph-safe
    if not return_lse:
        return out, None
    return out, lse_fp32(q, k, causal, scale, **mask_args)


def _finite(t: torch.Tensor) -> bool:
    """Whether `t` holds no inf or NaN (amax propagates NaN); a broadcast dimension (stride 0) is read
    once, not once per repeat."""
    t = t[tuple(slice(None) if stride else slice(0, 1) for stride in t.stride())]
    return t.numel() == 0 or bool(torch.isfinite(t.abs().amax()))
