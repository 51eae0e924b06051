"""Which implementation `fa4.attention_varlen` runs, the configuration our varlen kernel runs in, and why;
`fa4.explain_varlen`.

A call is described by the varlen problem our kernel compiles (`fa4.varlen.varlen_problem`: sequences,
the max lengths, heads, head dim, dtype, mask) and its total query tokens, q's rows (no read of the
offsets: the same inside a CUDA-graph capture); the database keys a varlen batch by these
(`fa4.varlen_batch` says why), its entries written by `fa4tune search --varlen` with the GPU time of
ours, the peers' varlen kernels and "per_sequence" on one batch (`backend_us`).

- Our configuration (`tuned`): the varlen entry of the call's bucket on this GPU model, else the nearest
  within the forward's distance rule (`fa4.database.BestConfigDB.lookup`, the tokens a fourth log2 term;
  a neighbour only where it beat the default at its own batch), current by the sm90 kernel fingerprint
  and feasible for the call; else the heuristic default (`fa4.kernels.default_config`).
- The implementation under backend="auto" (`decide`), as `fa4.backward.choose` picks a backward: ours
  where the exact entry, else a prediction from the nearest measured varlen batches (`fa4.prediction`),
  says ours was at least as fast as the first varlen peer that runs here (GPU time; within
  `fa4.dispatch.TIMING_NOISE` ours is kept); else that peer; else ours where it runs; else
  "per_sequence". With nothing measured the peer runs: ours is not known to be as fast. Host time per
  eager call is not measured for varlen calls: GPU time decides in both modes.
- Inside a CUDA-graph capture with the offsets on the GPU (`captured`), the peer's path costs more than
  its kernel: the offsets cannot be read, so its rows without keys are cleared by device ops over every
  row of O (`fa4.varlen._peer`). Ours needs no such pass where its kernel takes the rows after the last
  sequence as one more sequence (one CTA per task, `fa4.varlen.tail_fits_a_sequence`); with a
  persistent scheduler it clears them by the same kind of pass (`fa4.varlen._ours`). A measured
  comparison charges each side its pass (`device_clear_us`); a prediction cannot (it votes, without
  times): a note says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from fa4 import dispatch, prediction
from fa4.database import bucket

ARCH = "sm90"   # the family with a varlen kernel (`fa4.varlen.ours_unsupported`)
# What the peer's clearing pass inside a capture costs per MB of O (and LSE), from H100 bench runs of
# the features grid: `fa4.attention_varlen` through flash-attn-4 captured, less its kernel alone, at 16,384
# tokens x 32 heads x D128 bf16 (134 MB of O): 196.5 us (1.46 us/MB, results/h100/training/2026-12-07f/)
# and 184.1 us (1.37, 2026-12-07d/); ours' own pass of the same kind at 30,482 tokens (250 MB): 352.6 us
# (1.41). A GPU with faster memory (the H200) pays less: there the estimate leans towards the side
# without a pass.
DEVICE_CLEAR_US_PER_MB = 1.4


def device_clear_us(q, v, return_lse: bool) -> float:
    """The estimated GPU time of clearing a peer's rows without keys inside a capture: a read and a write
    of every row of O (total_q x Hq x v's head dim) and, where returned, of LSE (fp32)."""
    out_bytes = q.shape[0] * q.shape[1] * v.shape[-1] * q.element_size()
    lse_bytes = q.shape[0] * q.shape[1] * 4 if return_lse else 0
    return DEVICE_CLEAR_US_PER_MB * (out_bytes + lse_bytes) / 1e6


@dataclass
class VarlenChoice:
    """What a varlen call runs and why (`decide`); `str()` reads as `fa4.explain_varlen`'s report."""

    problem: str                       # the batch's label
    device: str
    implementation: str                # "ours", a peer's name, or "per_sequence"
    why: str
    config: Any = None                 # ours' configuration (where ours can run)
    source: Optional[str] = None       # "exact", "nearest", "default"
    entry: Any = None                  # the database entry of the configuration
    measured: dict = field(default_factory=dict)    # backend_us of the exact entry
    predicted: Any = None              # the `fa4.prediction.Prediction` where nothing was measured here
    notes: list = field(default_factory=list)
    forced: Optional[str] = None       # backend= when it names an implementation

    def __str__(self) -> str:
        lines = [f"fa4.attention_varlen on {self.problem} ({self.device})",
                 f"  runs: {self.implementation}" + (f" (forced: backend={self.forced!r})" if self.forced else "")
                 + f": {self.why}"]
        if self.config is not None:
            lines.append(f"  configuration{'' if self.implementation == 'ours' else ' (if our kernel ran)'}: "
                         f"{self.config.label()}")
            lines.append(f"  chosen by: {describe_config(self.config, self.source, self.entry)}")
        if self.measured:
            lines.append("  measured at this bucket (GPU us): "
                         + ", ".join(f"{name} {us:g}" for name, us in sorted(self.measured.items())))
        if self.predicted is not None:
            lines.append(f"  predicted from the nearest measured batches: {self.predicted.reason}")
            lines += [f"    neighbour {n}" for n in self.predicted.neighbours]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def describe_config(config, source: Optional[str], entry) -> str:
    if entry is None:
        return f"the heuristic default ({config.label()}): no usable varlen entry for this batch"
    what = "exact" if source == "exact" else "nearest"
    return f"tuned, {what} entry {entry.key}, {entry.us:g} us ({entry.study})"


# lookups per (device, problem, tokens bucket) of the database object in use (`fa4.state.database`;
# another object, after `fa4.use_config_db`, starts afresh): a lookup walks the entries, calls repeat
_FOUND: dict = {"db": None, "found": {}, "predicted": {}}


def _database_view(problem, tokens: int, device_name: str, device) -> tuple:
    """(config, source, entry, measured backend_us or None, region entries, notes) for ours on this
    device, cached per bucket."""
    from fa4 import kernels, planning, state
    from fa4.kernels import Config

    db = state.database()
    if _FOUND["db"] is not db:
        _FOUND.update(db=db, found={}, predicted={})
    key = (device_name, problem, bucket(tokens))
    if key in _FOUND["found"]:
        return _FOUND["found"][key]
    notes: list[str] = []
    config, source, entry, measured, region = kernels.default_config(ARCH, problem, device), "default", None, None, []
    found = None
    if db is not None:
        fingerprint = state.fingerprint(ARCH)
        try:
            found = db.lookup(ARCH, device_name, problem, fingerprint, max_distance=planning._max_distance(),
                              broken=state.STATE.db_broken, tokens=tokens)
        except Exception as exc:  # a malformed entry must not break a forward pass
            state.warn_once("varlen-db-lookup", f"fa4: varlen database lookup failed ({type(exc).__name__}: {exc}); "
                                                "our varlen kernel runs its default configuration")
            notes.append(f"database lookup failed: {exc}")
    if found is not None:
        notes += list(found.passed_over)
        if found.stale:
            notes.append(f"{len(found.stale)} varlen entr{'y' if len(found.stale) == 1 else 'ies'} of this kind "
                         f"tuned on other kernel sources not used ({found.stale[0].key}, ...): re-run fa4tune search")
        if found.entry is not None:
            try:
                tuned_config = Config.from_dict(ARCH, found.entry.config)
                why_not = kernels.feasible(tuned_config, problem, device)
            except (ValueError, KeyError, TypeError) as exc:   # knobs renamed since the tuning
                why_not = [str(exc)]
            if why_not:
                notes.append(f"entry {found.entry.key} cannot run this batch ({'; '.join(why_not)}): the default runs")
            else:
                config, source, entry = tuned_config, found.kind, found.entry
                if found.kind == "exact" and len(found.entry.backend_us) > 1:   # times of what runs here
                    measured = dict(found.entry.backend_us)
        if measured is None:
            region = prediction.region(db.current_entries(fingerprint, state.STATE.db_broken), ARCH, device_name,
                                       problem)
    result = (config, source, entry, measured, region, notes)
    _FOUND["found"][key] = result
    return result


def decide(q, k, v, problem=None, backend: str = "auto", *, empty: bool = False,
           captured: bool = False) -> VarlenChoice:
    """What a call runs (module docstring). `problem`: `fa4.varlen.varlen_problem` of the call (None:
    not given, no entry is read). `empty`: no sequence has a query and a key, so there is nothing to
    launch: ours, where it runs, only writes O = 0 and LSE = -inf. `captured`: the call is inside a
    CUDA-graph capture with its offsets on the GPU (a pass over O: module docstring). Raises
    `InvalidInputError` for an unknown backend and `UnsupportedInputError` for a forced one that cannot
    run these inputs."""
    from fa4 import state, varlen
    from fa4.checks import InvalidInputError, UnsupportedInputError

    if backend != "auto" and backend not in varlen.implementations():
        raise InvalidInputError(f"fa4.attention_varlen: backend={backend!r} is not one of auto, "
                                f"{', '.join(varlen.implementations())}")
    tokens = q.shape[0]
    label = ("a batch without a (query, key) pair" if empty else "a varlen batch" if problem is None
             else f"{problem.label()}, {tokens} query tokens")
    choice = VarlenChoice(label, str(q.device), "", "")
    ours_why_not = varlen.ours_unsupported(q, k, v)
    region, device_name = [], None
    if ours_why_not is None and problem is not None:
        device = state.device_description(q.device)
        device_name = device.name
        config, source, entry, measured, region, notes = _database_view(problem, tokens, device.name, device)
        choice.config, choice.source, choice.entry, choice.notes = config, source, entry, list(notes)
        choice.measured = measured or {}
    if backend != "auto":
        why = varlen.unsupported(backend, q, k, v)
        if why:
            raise UnsupportedInputError(f"fa4.attention_varlen: backend={backend!r} cannot run here: {why}")
        choice.implementation, choice.forced, choice.why = backend, backend, "named by the call"
        return choice
    if empty and ours_why_not is None:
        choice.implementation = varlen.OURS
        choice.why = "nothing to launch: no sequence has both a query and a key (O = 0, LSE = -inf)"
        return choice
    peer = next((p for p in varlen.varlen_peers() if p.varlen_unsupported(q) is None), None)
    if peer is not None and ours_why_not is None:
        if not choice.measured and region:
            choice.predicted = _predicted(region, problem, tokens, device_name, peer.name)
        clear_us = (device_clear_us(q, v if v is not None else q, problem.return_lse)
                    if captured and problem is not None else 0.0)
        # ours clears by the same pass only where its kernel cannot take the tail as a sequence
        ours_clears = clear_us and not varlen.tail_fits_a_sequence(choice.config, q, problem.batch)
        ours_clear_us = clear_us if ours_clears else 0.0
        faster = _ours_as_fast(choice, peer, clear_us, ours_clear_us)
        if faster:
            choice.implementation, choice.why = varlen.OURS, faster
        else:
            choice.implementation = peer.name
            choice.why = _peer_why(choice, peer, clear_us, ours_clear_us)
            if captured and not choice.measured:
                choice.notes.append(f"inside this capture {peer.title}'s path also clears its rows without keys "
                                    f"by a pass over O (about {clear_us:.0f} us), not counted: nothing was measured "
                                    "at this bucket")
        return choice
    if peer is not None:
        choice.implementation = peer.name
        choice.why = f"{peer.title}'s varlen kernel; ours cannot run here: {ours_why_not}"
        return choice
    peers_why_not = [f"{p.title}: {p.varlen_unsupported(q)}" for p in varlen.varlen_peers()]
    if ours_why_not is None:
        choice.implementation = varlen.OURS
        choice.why = "our varlen kernel, the one launch for the batch here (" + (
            "; ".join(peers_why_not) or "no peer with a varlen kernel is registered") + ")"
        return choice
    choice.implementation = varlen.PER_SEQUENCE
    choice.why = "; ".join([f"ours: {ours_why_not}"] + peers_why_not)
    return choice


def _predicted(region: list, problem, tokens: int, device_name: str, peer_name: str):
    """The prediction between ours and `peer_name` from the measured varlen batches near this one
    (GPU time), cached with the lookups."""
    key = (device_name, problem, bucket(tokens), peer_name)
    if key not in _FOUND["predicted"]:
        _FOUND["predicted"][key] = prediction.predict(region, problem, "graph", {}, lambda name: name == peer_name,
                                                      tokens=tokens)
    return _FOUND["predicted"][key]


def _clearing(clear_us: float) -> str:
    return f" plus about {clear_us:.0f} us clearing its rows without keys inside a capture" if clear_us else ""


def _ours_as_fast(choice: VarlenChoice, peer, clear_us: float = 0.0, ours_clear_us: float = 0.0) -> Optional[str]:
    """Why ours runs instead of `peer` (measured, each time with its pass over O inside a capture added:
    `clear_us` the peer's, `ours_clear_us` ours', or predicted at least as fast), or None."""
    if choice.measured:
        ours_us, peer_us = choice.measured.get(dispatch.OURS), choice.measured.get(peer.name)
        if (ours_us is None or peer_us is None
                or ours_us + ours_clear_us > (peer_us + clear_us) * (1.0 + dispatch.TIMING_NOISE)):
            return None
        return (f"our varlen kernel, measured at least as fast as {peer.title}'s at this bucket: {ours_us:g} us"
                f"{_clearing(ours_clear_us)} against {peer_us:g} us{_clearing(clear_us)}")
    if choice.predicted is not None and choice.predicted.backend == dispatch.OURS:
        return f"our varlen kernel, predicted at least as fast as {peer.title}'s ({choice.predicted.reason})"
    return None


def _peer_why(choice: VarlenChoice, peer, clear_us: float = 0.0, ours_clear_us: float = 0.0) -> str:
    if choice.measured and peer.name in choice.measured:
        return (f"{peer.title}'s varlen kernel, measured faster at this bucket: {choice.measured[peer.name]:g} us"
                f"{_clearing(clear_us)} against ours {choice.measured.get(dispatch.OURS, float('nan')):g} us"
                f"{_clearing(ours_clear_us)}")
    if choice.predicted is not None:
        return f"{peer.title}'s varlen kernel, predicted faster ({choice.predicted.reason})"
    return (f"{peer.title}'s varlen kernel: no varlen batch near this one was measured, so ours is not known to "
            "be as fast (fa4tune search --varlen measures it)")


