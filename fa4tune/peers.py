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

What is correct is decided in one place, `fa4.reference` (fp32 reference, SDPA comparison, the rule
for rows that see no key); a peer's `max_err` is its distance to that fp32 reference.
"""

from __future__ import annotations

from typing import Callable, Optional

from fa4.dispatch import PEERS, TITLES

# the one list of peers (declared with the runtime's dispatch, which chooses among them), in the order
# every table and figure shows them, and how they are titled
PEER_NAMES = PEERS
PEER_TITLES = {name: TITLES[name] for name in PEERS}


def _sdpa_call(q, k, v, causal: bool, scale: float, expand_kv: bool):
    """A closure computing SDPA on our layout; the K/V expansion (if asked) happens once, here."""
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
