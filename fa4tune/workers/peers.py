"""The implementations we compare against, as the harness times them.

The peers are the registry's, `fa4.backends` (`peer_names()`, in the order every table and figure
shows them); each is timed by `fa4tune.workers.timing.time_cuda`, the same method as our kernel, through the
runner the runtime's fastest-backend dispatch calls: what is timed here is what `fa4.attention` runs.
A peer that refuses GQA inputs and says it may (`Backend.expand_kv_if_refused`: SDPA with some backends
pinned) is timed on K and V expanded to the query heads once, before timing, and the result says so
("kv_expanded": true; the runtime never dispatches to such a time: it does not expand per call).

What is correct is decided in one place, `fa4.reference` (fp32 reference, SDPA comparison, the rule
for rows that see no key); a peer's `max_err` is its distance to that fp32 reference.
"""

from __future__ import annotations

from typing import Callable, Optional

from fa4 import backends
from fa4.checks import inspect_inputs


def peer_call(name: str, q, k, v, causal: bool, scale: float, window=None,
              softcap=None) -> tuple[Callable[[], object], dict]:
    """(callable returning O, notes) for one peer on these inputs (and the problem's window and
    softcap), called as the runtime calls it (`fa4.backends.runner`); raises when the peer cannot run
    them."""
    if name not in backends.peer_names():
        raise ValueError(f"unknown peer {name!r}; known: {', '.join(backends.peer_names())}")
    peer = backends.get(name)
    why = backends.unsupported(name, inspect_inputs(q, k, v).problem(causal, False, window, softcap))
    if why:  # it would time another implementation under this peer's name
        raise RuntimeError(why)
    run = backends.runner(name, causal, **({} if window is None and softcap is None
                                           else {"window": window, "softcap": softcap}))
    group = q.shape[2] // k.shape[2]
    errors = []
    for expand in ((False, True) if peer.expand_kv_if_refused and group > 1 else (False,)):
        kk, vv = (k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)) if expand else (k, v)

        def call(kk=kk, vv=vv):
            return run(q, kk, vv, scale, False)[0]

        try:
            call()
            return call, {"kv_expanded": True} if expand else {}
        except RuntimeError as exc:  # the backend refuses these inputs (GQA, mask, dtype)
            errors.append(backends.first_error_line(exc))
    raise RuntimeError("; ".join(errors))


def peer_available(name: str) -> Optional[str]:
    """None when the peer can be tried here, else why not."""
    return backends.import_error(name)
