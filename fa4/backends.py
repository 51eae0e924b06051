"""How to call each implementation other than ours: flash-attn-4 and SDPA with one backend pinned.

The one home of these calls: the runtime dispatches to them (`fa4.attention`, backend="auto" or a
name), and the harness times them (`fa4tune.peers` binds its timed closures to the same `runner`),
so what is measured is what runs.

Every tensor is in our layout, (batch, seqlen, heads, head_dim). Semantics are ours (docs/design.md):
- causal masks are bottom-right aligned: flash-attn-4 aligns them so natively; SDPA's `is_causal` is
  top-left aligned, so for Sq != Sk it gets `causal_lower_right`;
- GQA: flash-attn-4 natively; SDPA with `enable_gqa=True` (where a backend refuses that, the
  harness times it on K and V expanded to the query heads once, outside the timing, and says so; the
  runtime never expands: a copy per call is not what was timed);
- LSE (B, Hq, Sq) fp32 natural log: flash-attn-4 returns it; SDPA has none, so SDPA cannot serve a
  call with return_lse (`inapplicable`);
- rows that see no key (causal with Sq > Sk) get O = 0 and LSE = -inf: `fix_rows_without_keys`,
  applied by the runtime after a peer (a slice assignment: no sync, graph-safe).

flash-attn-4 is an optional dependency (the `peer` extra): nothing here imports it at module load.
"""

from __future__ import annotations

import importlib.util
import math
from typing import Callable, Optional

from fa4.dispatch import OURS, PEERS, TITLES

SDPA_PEERS = ("sdpa_cudnn", "sdpa_flash")
# the Python module each peer needs at run time
PEER_MODULES = {"flash_attn_4": "flash_attn.cute", "sdpa_cudnn": "torch", "sdpa_flash": "torch"}


def unavailable(name: str) -> Optional[str]:
    """Why a peer cannot run in this process (its package is not installed), else None. Cheap: finds
    the module without importing it."""
    if name == OURS:
        return None
    if name not in PEERS:
        raise ValueError(f"unknown backend {name!r}; known: {', '.join((OURS,) + PEERS)}")
    module = PEER_MODULES[name]
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that is missing
        found = False
    return None if found else f"{TITLES[name]} is not installed here (no module {module})"


def import_error(name: str) -> Optional[str]:
    """None when the peer imports here, else why not (an import can fail where the module exists:
    a package that cannot initialise)."""
    if name == "flash_attn_4":
        try:
            import flash_attn.cute  # noqa: F401
        except Exception as exc:  # ImportError, or the package failing to initialise
            return f"flash-attn-4 not importable: {short_error(exc)}"
    return unavailable(name)


def inapplicable(name: str, *, return_lse: bool, causal: bool = False, seqlen_q: int = 0,
                 seqlen_k: int = 0) -> list[str]:
    """Why a peer cannot give our semantics for a call, or would not be the implementation that runs
    (empty: it can). Scale and GQA every peer handles (see the module docstring); LSE only
    flash-attn-4 returns. A bottom-right causal mask with Sq != Sk reaches SDPA as
    `causal_lower_right`, which torch computes with its own flash or memory-efficient kernel where
    those take the inputs, whatever backend is pinned: for cuDNN that call would not be cuDNN's."""
    why = []
    if name in SDPA_PEERS and return_lse:
        why.append(f"{TITLES[name]} returns no LSE (return_lse=True)")
    if name == "sdpa_cudnn" and causal and seqlen_q != seqlen_k:
        why.append("SDPA cuDNN with a bottom-right causal mask and Sq != Sk: torch runs its own flash or "
                   "memory-efficient kernel for causal_lower_right, not cuDNN")
    return why


def _sdpa_mask(seqlen_q: int, seqlen_k: int, causal: bool) -> dict:
    """SDPA's mask arguments for our bottom-right causal mask (its `is_causal` is top-left aligned)."""
    if causal and seqlen_q == seqlen_k:
        return {"is_causal": True}
    if causal:
        from torch.nn.attention.bias import causal_lower_right

        return {"attn_mask": causal_lower_right(seqlen_q, seqlen_k)}
    return {}


def sdpa_backend(name: str):
    """The `torch.nn.attention.SDPBackend` a SDPA peer pins."""
    from torch.nn.attention import SDPBackend

    return {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}[name]


def runner(name: str, causal: bool) -> Callable:
    """What the runtime calls for a peer: `run(q, k, v, scale, return_lse) -> (O, LSE or None)`, in
    our semantics except rows without keys (`fix_rows_without_keys`). Imports the peer now, so a
    missing package fails when the plan is made, not at a launch."""
    if name == "flash_attn_4":
        from flash_attn.cute import flash_attn_func

        def run(q, k, v, scale, return_lse):
            result = flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, return_lse=return_lse)
            out, lse = result if isinstance(result, tuple) else (result, None)
            return out, (lse if return_lse else None)

        return run
    if name in SDPA_PEERS:
        import torch.nn.functional as F
        from torch.nn.attention import sdpa_kernel

        backend = [sdpa_backend(name)]

        def run(q, k, v, scale, return_lse):
            if return_lse:  # `inapplicable` keeps such calls away; a guard, not a path
                raise ValueError(f"{TITLES[name]} returns no LSE")
            mask_kw = _sdpa_mask(q.shape[1], k.shape[1], causal)
            gqa = {"enable_gqa": True} if q.shape[2] != k.shape[2] else {}
            with sdpa_kernel(backend):
                out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                     scale=scale, **mask_kw, **gqa)
            return out.transpose(1, 2), None

        return run
    raise ValueError(f"unknown peer {name!r}; known: {', '.join(PEERS)}")


def fix_rows_without_keys(out, lse, rows: int) -> None:
    """Our rule for the first `rows` query rows that see no key: O = 0, LSE = -inf (in place)."""
    if rows:
        out[:, :rows] = 0
        if lse is not None:
            lse[:, :, :rows] = -math.inf


def short_error(exc: BaseException, limit: int = 300) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()
    line = text[0] if text else type(exc).__name__
    return line[:limit]
