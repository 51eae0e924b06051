"""The implementations `fa4.attention` can run besides our kernel ("peers"): one protocol, one registry.

A peer is one object behind the `Backend` protocol, declared in its own module of this package (which
calls `register` on import); every module of this package is imported below, in name order, and that
order is the order every table and figure shows the peers in. Dispatch (`fa4.dispatch`), planning and
`fa4.explain`, the runtime's launches, the harness's peer timing (`fa4tune.workers.peers`), the bench, the
host-time table, the report and the recorded versions all read this registry: adding a peer is one new
module here and its test. "ours" is the registry's own name for our kernel (`OURS`); it is no
`Backend` (our kernel's plan, compile and launch are the runtime's own).

The runtime dispatches to a peer (backend="auto" or its name) and the harness times the same runner, so
what is measured is what runs. Every tensor is in our layout, (batch, seqlen, heads, head_dim), and the
semantics are ours (docs/design.md), whichever implementation runs:
- causal masks are bottom-right aligned;
- GQA without copying K and V per call (a peer that refuses GQA is timed on K and V expanded once,
  outside the timing, and the result says so; the runtime never dispatches to such a time);
- LSE (B, Hq, Sq) fp32 natural log where asked, or the peer does not support the call;
- a sliding window (left, right) and a softcap as `fa4.kernels.AttentionProblem` defines them, or the
  peer does not support the call (`supports` says why);
- rows that see no key (causal with Sq > Sk, or a window right of every key) get O = 0 and LSE = -inf:
  `fix_rows_without_keys`, applied by the runtime after a peer (a slice assignment: no sync, graph-safe).

Nothing here imports a peer's package at module load (flash-attn-4 is an optional dependency, the
`peer` extra); nor torch.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import pkgutil
import re
from importlib import metadata
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol, runtime_checkable

if TYPE_CHECKING:
    from fa4.kernels import AttentionProblem

OURS = "ours"  # our kernel, in `backend_us`, bench rows, backend= and every title
AUTO = "auto"  # fa4.attention(backend=AUTO): the fastest measured implementation (`fa4.dispatch`)
RESERVED = (OURS, AUTO)  # names no peer can take

# run(q, k, v, scale, return_lse) -> (O, LSE or None), in our semantics except rows without keys
Runner = Callable[..., tuple]


@runtime_checkable
class Backend(Protocol):
    """An implementation of attention we compare against and can dispatch to.

    name: the key of database entries (`backend_us`), bench rows and fa4.attention(backend=...), a
        lower-case identifier; title: how messages, tables and the report name it; color: its colour in
        the report's figures ("#rrggbb");
    distribution: the pip distribution whose version every result records under `name`
        (`recorded_versions`); None where it is part of torch, whose version is recorded anyway;
    compiles_on_first_call: its first call on a shape compiles (a JIT), which cannot happen inside a
        CUDA-graph capture: the runtime asks for a warm-up instead;
    expand_kv_if_refused: where it refuses GQA inputs, the harness times it on K and V expanded to the
        query heads (once, outside the timing) and marks the result, which dispatch never uses;
    direct_row: the row of `benchmarks/bench_overhead.py` that calls it with nothing of fa4 around it
        (`direct_call`), the host-time table's fallback for runs without a row through fa4.attention;
        None: no such row.
    """

    name: str
    title: str
    color: str
    distribution: Optional[str]
    compiles_on_first_call: bool
    expand_kv_if_refused: bool
    direct_row: Optional[str]

    def unavailable(self) -> Optional[str]:
        """Why it cannot run in this process (e.g. its package is not installed), else None. Cheap:
        imports nothing."""

    def supports(self, problem: "AttentionProblem") -> Optional[str]:
        """Why it cannot give a call of `problem` our semantics, or would not be the implementation
        that runs (None: it can)."""

    def runner(self, causal: bool, window: Optional[tuple] = None, softcap: Optional[float] = None) -> Runner:
        """What the runtime calls and the harness times: `run(q, k, v, scale, return_lse) -> (O, LSE or
        None)`, with the problem's mask (`window`, `softcap`: `AttentionProblem`'s, asked only where
        `supports` says yes). Imports the package now, so a broken install fails when a plan is made,
        not at a launch."""

    def direct_call(self, q, k, v, causal: bool) -> tuple[Callable[[], Any], str]:
        """(a call of its own API on these tensors returning O, a note saying what the call includes):
        the overhead bench's baseline for what fa4.attention adds (only asked where `direct_row`)."""


REGISTRY: dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
    """Add a peer (a module of this package calls this for its own); refuses an incomplete object, a
    name taken or reserved, and a colour another peer has."""
    if not isinstance(backend, Backend):
        raise TypeError(f"{backend!r} does not implement fa4.backends.Backend")
    name = backend.name
    if not isinstance(name, str) or not re.fullmatch(r"[a-z][a-z0-9_]*", name):
        raise ValueError(f"a backend's name is a lower-case identifier, got {name!r}")
    if name in RESERVED or name in REGISTRY:
        raise ValueError(f"backend name {name!r} is {'reserved' if name in RESERVED else 'registered already'}")
    if not re.fullmatch(r"#[0-9a-fA-F]{6}", str(backend.color)):
        raise ValueError(f"backend {name!r}: color must be '#rrggbb', got {backend.color!r}")
    taken = [b.name for b in REGISTRY.values() if b.color.lower() == backend.color.lower()]
    if taken:
        raise ValueError(f"backend {name!r}: color {backend.color} is {taken[0]}'s already")
    REGISTRY[name] = backend
    return backend


def peers() -> tuple[Backend, ...]:
    """Every registered peer, in registration order (the order of tables and figures)."""
    return tuple(REGISTRY.values())


def peer_names() -> tuple[str, ...]:
    return tuple(REGISTRY)


def implementations() -> tuple[str, ...]:
    """Ours and every peer: what dispatch compares and fa4.attention(backend=...) can force."""
    return (OURS,) + peer_names()


def get(name: str) -> Backend:
    try:
        return REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown backend {name!r}; known: {', '.join(implementations())}") from None


def title(name: str) -> str:
    """How an implementation is named to people; a name no peer has (a file written by another
    version) reads as itself."""
    if name == OURS:
        return OURS
    backend = REGISTRY.get(name)
    return backend.title if backend is not None else name


def unavailable(name: str) -> Optional[str]:
    """Why an implementation cannot run in this process, else None (ours: always None here; whether our
    kernel runs the inputs is the runtime's own question)."""
    return None if name == OURS else get(name).unavailable()


def import_error(name: str) -> Optional[str]:
    """None when the peer imports here, else why not (an import can fail where the package exists:
    one that cannot initialise). Imports the package, unlike `unavailable`."""
    backend = get(name)
    try:
        backend.runner(False)
    except Exception as exc:  # ImportError, or the package failing to initialise
        return f"{backend.title} not importable: {first_error_line(exc)}"
    return None


def unsupported(name: str, problem: "AttentionProblem") -> Optional[str]:
    """Why peer `name` cannot give a call of `problem` our semantics (None: it can)."""
    return get(name).supports(problem)


def runner(name: str, causal: bool, window: Optional[tuple] = None, softcap: Optional[float] = None) -> Runner:
    """The peer's runner (`Backend.runner`). The runtime calls it through this function: tests replace
    it to stand in for every peer at once."""
    if window is None and softcap is None:   # a dense call: the runner as every peer declares it
        return get(name).runner(causal)
    return get(name).runner(causal, window=window, softcap=softcap)


def recorded_versions() -> dict[str, Optional[str]]:
    """{peer name: installed version or None} of every peer with a distribution of its own, recorded
    with every result (`fa4tune.environment.versions`)."""
    return {b.name: distribution_version(b.distribution) for b in peers() if b.distribution}


def distribution_version(distribution: str) -> Optional[str]:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def module_missing(title: str, module: str) -> Optional[str]:
    """A peer's `unavailable` where it needs one Python module: found without importing it."""
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that is missing
        found = False
    return None if found else f"{title} is not installed here (no module {module})"


def fix_rows_without_keys(out, lse, rows: int) -> None:
    """Our rule for the first `rows` query rows that see no key: O = 0, LSE = -inf (in place)."""
    if rows:
        out[:, :rows] = 0
        if lse is not None:
            lse[:, :, :rows] = -math.inf


def first_error_line(exc: BaseException, limit: int = 300) -> str:
    """The first line of `exc`, for a message to the user of this process (a warning, an error): its
    paths stay as they are, they are this machine's. A reason that is recorded and shared is
    `fa4tune.workers.outcomes.portable_error` instead."""
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()
    line = text[0] if text else type(exc).__name__
    return line[:limit]


# Every module of this package declares and registers its peers; a private module (leading underscore)
# is a helper, not a peer.
for _module in sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")):
    importlib.import_module(f"{__name__}.{_module}")
