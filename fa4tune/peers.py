"""The implementations we compare against, and the references we validate against.

Peers (timed by `fa4tune.timing.time_cuda`, the same method as our kernel):
- "sdpa_flash":   torch SDPA restricted to its flash backend (FlashAttention-2 inside PyTorch)
- "sdpa_cudnn":   torch SDPA restricted to its cuDNN backend
- "flash_attn_4": `flash_attn.cute.flash_attn_func` (the flash-attn-4 package), when importable

How each peer is called (layout, bottom-right causal mask, GQA, scale) lives in one place,
`fa4.backends`, which the runtime's fastest-backend dispatch calls too: what is timed here is what
`fa4.attention` runs. GQA goes to SDPA as `enable_gqa=True`; when a backend refuses that, K and V are
expanded to the query heads once, before timing, and the result says so ("kv_expanded": true; the
runtime never dispatches to such a backend: it does not expand per call).

What is correct is decided in one place, `fa4.reference` (fp32 reference, SDPA comparison, the rule
for rows that see no key); a peer's `max_err` is its distance to that fp32 reference.
"""

from __future__ import annotations

from typing import Callable, Optional

from fa4.backends import SDPA_PEERS, import_error, inapplicable, runner, short_error
from fa4.dispatch import PEERS, TITLES

# the one list of peers (declared with the runtime's dispatch, which chooses among them), in the order
# every table and figure shows them, and how they are titled
PEER_NAMES = PEERS
PEER_TITLES = {name: TITLES[name] for name in PEERS}


def peer_call(name: str, q, k, v, causal: bool, scale: float) -> tuple[Callable[[], object], dict]:
    """(callable returning O, notes) for one peer on these inputs, called as the runtime calls it
    (`fa4.backends.runner`); raises when the peer cannot run them. A SDPA backend that refuses GQA is
    tried once more on K and V expanded to the query heads (before timing; notes say so)."""
    if name not in PEER_NAMES:
        raise ValueError(f"unknown peer {name!r}; known: {', '.join(PEER_NAMES)}")
    why = inapplicable(name, return_lse=False, causal=causal, seqlen_q=q.shape[1], seqlen_k=k.shape[1])
    if why:  # it would time another implementation under this peer's name
        raise RuntimeError("; ".join(why))
    run = runner(name, causal)
    group = q.shape[2] // k.shape[2]
    errors = []
    for expand in ((False, True) if name in SDPA_PEERS and group > 1 else (False,)):
        kk, vv = (k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)) if expand else (k, v)

        def call(kk=kk, vv=vv):
            return run(q, kk, vv, scale, False)[0]

        try:
            call()
            return call, {"kv_expanded": True} if expand else {}
        except RuntimeError as exc:  # the backend refuses these inputs (GQA, mask, dtype)
            errors.append(short_error(exc))
    raise RuntimeError("; ".join(errors))


def peer_available(name: str) -> Optional[str]:
    """None when the peer can be tried here, else why not."""
    return import_error(name)
