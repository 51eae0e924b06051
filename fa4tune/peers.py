"""The implementations we compare against, and the references we validate against.

Peers (timed by `fa4tune.timing.time_cuda`, the same method as our kernel):
- "sdpa_flash":   torch SDPA restricted to its flash backend (FlashAttention-2 inside PyTorch)
- "sdpa_cudnn":   torch SDPA restricted to its cuDNN backend
- "flash_attn_4": `flash_attn.cute.flash_attn_func` (the flash-attn-4 package), when importable

Every tensor is in our layout, (batch, seqlen, heads, head_dim); SDPA gets transposed views. GQA goes
to SDPA as `enable_gqa=True`; when a backend refuses that, K and V are expanded to the query heads
once, before timing, and the result says so ("kv_expanded": true). Causal masks are bottom-right
aligned everywhere (key j is masked for query i when j > i + seqlen_k - seqlen_q), as flash-attn;
SDPA's `is_causal` is top-left aligned, so for seqlen_q != seqlen_k it gets `causal_lower_right`.

References (validation):
- `reference_fp32`: fp32 math with an explicit bottom-right mask; returns out and lse. Rows with no
  visible key give out = 0 and lse = -inf (the flash-attn convention).
- `sdpa_reference`: SDPA in the problem's dtype (whatever backend torch picks), the "same-precision
  PyTorch" answer.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

PEER_NAMES = ("sdpa_flash", "sdpa_cudnn", "flash_attn_4")


def softmax_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def make_inputs(problem, device: str = "cuda", seed: int = 0):
    """Random q, k, v (standard normal) in our layout and the problem's dtype, deterministic by seed."""
    import torch

    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[problem.dtype]
    gen = torch.Generator(device="cpu").manual_seed(seed)
    shape_q = (problem.batch, problem.seqlen_q, problem.heads_q, problem.head_dim)
    shape_kv = (problem.batch, problem.seqlen_k, problem.heads_kv, problem.head_dim)
    q = torch.randn(shape_q, generator=gen).to(device=device, dtype=dtype)
    k = torch.randn(shape_kv, generator=gen).to(device=device, dtype=dtype)
    v = torch.randn(shape_kv, generator=gen).to(device=device, dtype=dtype)
    return q, k, v


def causal_mask(seqlen_q: int, seqlen_k: int, device) -> "torch.Tensor":
    """Boolean (seqlen_q, seqlen_k), True where the key is visible (bottom-right aligned)."""
    import torch

    i = torch.arange(seqlen_q, device=device).unsqueeze(1)
    j = torch.arange(seqlen_k, device=device).unsqueeze(0)
    return j <= i + (seqlen_k - seqlen_q)


def reference_fp32(q, k, v, causal: bool, scale: float, max_chunk_bytes: int = 2**30):
    """fp32 attention in our layout; (out (B,Sq,Hq,D) fp32, lse (B,Hq,Sq) fp32). Chunks query heads
    so the fp32 score matrix stays under `max_chunk_bytes`."""
    import torch

    batch, seqlen_q, heads_q, _ = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    group = heads_q // heads_kv
    qf = q.float().transpose(1, 2)                                 # B, Hq, Sq, D
    kf = k.float().transpose(1, 2).repeat_interleave(group, dim=1)  # B, Hq, Sk, D
    vf = v.float().transpose(1, 2).repeat_interleave(group, dim=1)
    visible = causal_mask(seqlen_q, seqlen_k, q.device) if causal else None
    per_head = batch * seqlen_q * seqlen_k * 4
    step = max(1, min(heads_q, max_chunk_bytes // max(per_head, 1)))
    outs, lses = [], []
    for h0 in range(0, heads_q, step):
        s = torch.matmul(qf[:, h0:h0 + step], kf[:, h0:h0 + step].transpose(-1, -2)) * scale
        if visible is not None:
            s = s.masked_fill(~visible, float("-inf"))
        lse = torch.logsumexp(s, dim=-1)
        empty = torch.isneginf(lse)
        p = torch.exp(s - torch.where(empty, torch.zeros_like(lse), lse).unsqueeze(-1))
        o = torch.matmul(p, vf[:, h0:h0 + step])
        outs.append(o.masked_fill(empty.unsqueeze(-1), 0.0))
        lses.append(lse)
    out = torch.cat(outs, dim=1).transpose(1, 2).contiguous()
    return out, torch.cat(lses, dim=1)


def _sdpa_call(q, k, v, causal: bool, scale: float, expand_kv: bool):
    """A closure computing SDPA on our layout; the K/V expansion (if asked) happens once, here."""
    import torch
    import torch.nn.functional as F

    group = q.shape[2] // k.shape[2]
    qt = q.transpose(1, 2)
    if expand_kv and group > 1:
        kt = k.repeat_interleave(group, dim=2).transpose(1, 2)
        vt = v.repeat_interleave(group, dim=2).transpose(1, 2)
        gqa = {}
    else:
        kt, vt = k.transpose(1, 2), v.transpose(1, 2)
        gqa = {"enable_gqa": True} if group > 1 else {}
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    mask_kw: dict = {}
    if causal and seqlen_q == seqlen_k:
        mask_kw = {"is_causal": True}
    elif causal:
        from torch.nn.attention.bias import causal_lower_right

        mask_kw = {"attn_mask": causal_lower_right(seqlen_q, seqlen_k)}

    def call():
        return F.scaled_dot_product_attention(qt, kt, vt, scale=scale, **mask_kw, **gqa).transpose(1, 2)

    return call


def sdpa_reference(q, k, v, causal: bool, scale: float):
    """SDPA in the inputs' dtype with an explicit bottom-right boolean mask, in our layout."""
    import torch.nn.functional as F

    group = q.shape[2] // k.shape[2]
    qt = q.transpose(1, 2)
    kt = k.repeat_interleave(group, dim=2).transpose(1, 2)
    vt = v.repeat_interleave(group, dim=2).transpose(1, 2)
    mask = causal_mask(q.shape[1], k.shape[1], q.device) if causal else None
    out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale)
    return out.transpose(1, 2)


def peer_call(name: str, q, k, v, causal: bool, scale: float) -> tuple[Callable[[], object], dict]:
    """(callable, notes) for one peer on these inputs; raises when the peer cannot run them."""
    if name in ("sdpa_flash", "sdpa_cudnn"):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = SDPBackend.FLASH_ATTENTION if name == "sdpa_flash" else SDPBackend.CUDNN_ATTENTION
        errors = []
        for expand in (False, True):
            inner = _sdpa_call(q, k, v, causal, scale, expand)

            def call(inner=inner):
                with sdpa_kernel([backend]):
                    return inner()

            try:
                call()
                return call, {"kv_expanded": expand} if expand else {}
            except RuntimeError as exc:  # the backend refuses these inputs (GQA, mask, dtype)
                errors.append(_short(exc))
        raise RuntimeError("; ".join(errors))
    if name == "flash_attn_4":
        from flash_attn.cute import flash_attn_func

        def call():
            out = flash_attn_func(q, k, v, softmax_scale=scale, causal=causal)
            return out[0] if isinstance(out, tuple) else out

        call()
        return call, {}
    raise ValueError(f"unknown peer {name!r}; known: {', '.join(PEER_NAMES)}")


def peer_available(name: str) -> Optional[str]:
    """None when the peer can be tried here, else why not."""
    if name == "flash_attn_4":
        try:
            import flash_attn.cute  # noqa: F401
        except Exception as exc:  # ImportError, or the package failing to initialise
            return f"flash-attn-4 not importable: {_short(exc)}"
    return None


def _short(exc: BaseException, limit: int = 300) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()
    line = text[0] if text else type(exc).__name__
    return line[:limit]
