"""fp32 PyTorch reference of the forward contract (explicit bottom-right causal mask), for tests and
benchmarks. Imports torch lazily; nothing here touches the DSL."""

from __future__ import annotations

import math


def attention_reference(q, k, v, causal: bool, softmax_scale=None):
    """O (B, Sq, Hq, D) and LSE (B, Hq, Sq) in fp32. A row that sees no key: O = 0, LSE = -inf."""
    import torch
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    ratio = hq // hkv
    qf = q.float().transpose(1, 2)                                    # (B, Hq, Sq, D)
    kf = k.float().transpose(1, 2).repeat_interleave(ratio, dim=1)   # (B, Hq, Sk, D)
    vf = v.float().transpose(1, 2).repeat_interleave(ratio, dim=1)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    if causal:
        i = torch.arange(sq, device=q.device).view(-1, 1)
        j = torch.arange(sk, device=q.device).view(1, -1)
        s = s.masked_fill(j > i + (sk - sq), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)                                  # -inf for empty rows
    p = torch.exp(s - lse.unsqueeze(-1).masked_fill(torch.isinf(lse).unsqueeze(-1), 0.0))
    p = torch.nan_to_num(p, nan=0.0)
    o = torch.matmul(p, vf).transpose(1, 2)                          # (B, Sq, Hq, D)
    return o, lse


def sdpa_reference(q, k, v, causal: bool, softmax_scale=None):
    """torch SDPA in the inputs' dtype, with an explicit bottom-right mask (SDPA's is_causal is
    top-left). Rows that see no key come back as NaN from SDPA; they are set to 0 here."""
    import torch
    import torch.nn.functional as F
    sq, sk = q.shape[1], k.shape[1]
    ratio = q.shape[2] // k.shape[2]
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    kt = kt.repeat_interleave(ratio, dim=1)
    vt = vt.repeat_interleave(ratio, dim=1)
    mask = None
    if causal:
        i = torch.arange(sq, device=q.device).view(-1, 1)
        j = torch.arange(sk, device=q.device).view(1, -1)
        mask = j <= i + (sk - sq)
    o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=softmax_scale)
    return torch.nan_to_num(o.transpose(1, 2), nan=0.0)
