"""Autotune on first use (opt in): `fa4.attention` tunes a shape without a database entry on its first
call, within a wall-clock budget, records the winner in the user's database and runs it.

    FA4_AUTOTUNE=quick python train.py        # or, in Python: fa4.autotune("quick")
    FA4_AUTOTUNE_BUDGET_S=20                  # another budget (seconds)

Efforts (`EFFORTS`, the same counts as `fa4tune search --effort`) bound the configurations tried, and
`BUDGET_S` the wall time of a tune: waiting for another process tuning the same shape, starting the
tuner's worker processes, compiling, validating and timing. At the deadline the tuner stops (it kills
its workers) and the best configuration measured so far is recorded; with none, the call runs what it
would have run untuned. After the tune the call compiles the winner in this process as any first call
of a shape does (`fa4.compile_cache`; seconds cold, milliseconds from the disk cache).

When: a call whose plan runs our kernel in some mode with a configuration that is no exact database
entry (the nearest bucket's or the heuristic default), no `config=`, once per shape and process. Never
inside a CUDA-graph capture or a torch.compile trace (nor in the custom op torch.compile runs): there
the untuned plan runs and one warning says to call `fa4.attention` (or `fa4.warmup`) once eagerly
with the same shapes before capturing or compiling.

Who tunes: a tuner, `tuner(TuneRequest) -> TuneResult`, registered with `register_tuner` or found
through the entry point group `TUNER_GROUP` (the harness registers `fa4tune.autotune:tune`, which
evaluates each configuration in the search's worker processes: the search's validation against the
fp32 reference and SDPA, its CUDA-graph timing, and a fault in a candidate kills a worker, never this
process). The runtime does not import the harness by name (layers: kernels <- fa4 <- fa4tune).

Concurrency: a per-shape lock (`filelock`, in the results folder's `autotune/`) makes a second process
wait for the first (within its own budget) and then find the entry; the database write itself is
`fa4.database.record` (locked, atomic, the faster entry per key wins).
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from fa4.kernels import AttentionProblem, DeviceDescription

ENV_VAR = "FA4_AUTOTUNE"
BUDGET_ENV_VAR = "FA4_AUTOTUNE_BUDGET_S"
TUNER_GROUP = "fa4.tuners"
# Configurations a study (`fa4tune search --effort`) or a tune on first use tries. From the searches'
# own curves (the wide set's 48 cold-start studies of 30, results/h200/wide/*.journal.gz): a
# configuration within 1 % of a study's best came at the 1st (the default) on the median study, within
# the first 10 on 41 of 48, within 20 on 45. "default" is the length of the grid's searches, which the
# packaged grid entries came from; "full" is for shapes far from anything tuned.
EFFORTS = {"quick": 10, "default": 40, "full": 100}
# the wall-clock budget of a tune on first use, per effort (seconds)
BUDGET_S = {"quick": 30.0, "default": 120.0, "full": 300.0}
_OFF = ("", "0", "off", "false", "no", "none")

log = logging.getLogger("fa4")


@dataclass(frozen=True)
class Settings:
    effort: str
    budget_s: float


@dataclass(frozen=True)
class TuneRequest:
    """What a tuner gets: the problem, the GPU (its description and torch index in this process), how
    many configurations at most, and the deadline (`time.monotonic()` seconds) it must stop by."""

    arch: str
    problem: AttentionProblem
    device: DeviceDescription
    gpu_index: int
    max_configs: int
    deadline: float


@dataclass(frozen=True)
class Measured:
    """One configuration the tuner validated and timed (GPU time by CUDA-graph replay)."""

    config: dict
    us: float
    max_err: Optional[float] = None
    is_default: bool = False


@dataclass
class TuneResult:
    measured: list = field(default_factory=list)   # [Measured], ok outcomes only
    tried: int = 0                                  # configurations handed to the evaluator
    versions: dict = field(default_factory=dict)    # recorded with the entry (`fa4.database.Entry.versions`)
    notes: list = field(default_factory=list)       # what went wrong or was cut by the deadline


_api_settings: Any = None   # None: the environment decides; False: off; Settings: on
_tuners: list[Callable[[TuneRequest], TuneResult]] = []


def autotune(effort: Optional[str] = "quick", budget_s: Optional[float] = None) -> None:
    """Turn autotune on first use on for this process (`effort` "quick", "default" or "full"; `budget_s`
    the wall-clock budget of one tune, default `BUDGET_S[effort]`), or off with `effort=None` (which
    also overrides $FA4_AUTOTUNE)."""
    global _api_settings
    if effort is None or effort is False:
        _api_settings = False
        return
    _api_settings = _settings(effort, budget_s, "fa4.autotune")


def _settings(effort: Any, budget_s: Any, where: str) -> Settings:
    from fa4.checks import InvalidInputError

    if effort not in EFFORTS:
        raise InvalidInputError(f"{where}: effort must be one of {', '.join(EFFORTS)}, got {effort!r}")
    budget = BUDGET_S[effort] if budget_s in (None, "") else budget_s
    try:
        budget = float(budget)
    except (TypeError, ValueError):
        budget = float("nan")
    if not 0 < budget < float("inf"):
        raise InvalidInputError(f"{where}: the budget must be a positive number of seconds, got {budget_s!r}")
    return Settings(effort, budget)


def settings() -> Optional[Settings]:
    """The mode in force: `autotune(...)`'s, else $FA4_AUTOTUNE's (None: off). A malformed variable
    warns once and leaves autotune off."""
    if _api_settings is not None:
        return _api_settings or None
    raw = os.environ.get(ENV_VAR, "").strip().lower()
    if raw in _OFF:
        return None
    try:
        return _settings(raw, os.environ.get(BUDGET_ENV_VAR), f"${ENV_VAR}")
    except ValueError as exc:
        _warn(f"env:{raw}:{os.environ.get(BUDGET_ENV_VAR)}", f"fa4: {exc}; autotune stays off")
        return None


def register_tuner(tuner: Optional[Callable[[TuneRequest], TuneResult]]) -> None:
    """Use `tuner` for autotune on first use (None: forget registered ones, use the entry point's)."""
    _tuners.clear()
    if tuner is not None:
        _tuners.append(tuner)


def _tuner() -> Optional[Callable[[TuneRequest], TuneResult]]:
    if _tuners:
        return _tuners[0]
    from importlib.metadata import entry_points

    for point in sorted(entry_points(group=TUNER_GROUP), key=lambda p: p.name):
        try:
            _tuners.append(point.load())
            return _tuners[0]
        except Exception as exc:  # a broken plugin must not break a forward pass
            _warn(f"tuner:{point.value}", f"fa4: cannot load the tuner {point.value} ({type(exc).__name__}: "
                                          f"{exc}); autotune is off")
    return None


def _warn(tag: str, message: str) -> None:
    from fa4.state import warn_once

    warn_once(f"autotune:{tag}", message)


# ---------------------------------------------------------------------------------------------------
# the runtime's hook

def wanted(plan) -> bool:
    """Whether this plan is one autotune would tune (cheap: the slow path asks on every first call)."""
    from fa4 import dispatch

    from fa4.state import STATE

    expl = plan.explanation
    # a database pinned by `fa4.use_config_db` is read alone: an entry in the user's layer would not count
    return (settings() is not None and STATE.db_path is None and expl.path == "kernel" and expl.source in ("nearest", "default")
            and plan.device is not None and plan.problem is not None
            and dispatch.OURS in (expl.runs or {}).values())


def tune_first(plan, in_graph: bool) -> bool:
    """Tune `plan`'s shape if autotune is on and the plan wants it (`wanted`); True when the database
    now has an exact entry for it (the caller plans again). Guards: never under CUDA-graph capture or
    torch.compile (a warning says what to warm up), never without a CUDA GPU, once per shape."""
    if not wanted(plan):
        return False
    import torch

    from fa4.state import STATE

    if in_graph or torch.compiler.is_compiling() or _capturing():
        _warn(f"graph:{plan.explanation.problem}",
              f"fa4: {ENV_VAR} does not tune {plan.explanation.problem} inside a CUDA-graph capture or a "
              "torch.compile trace; it runs untuned. Call fa4.attention once eagerly with these shapes "
              "(or fa4.warmup([(q, k, v)], ...)) before capturing or compiling, and that call tunes it")
        return False
    if not torch.cuda.is_available():
        return False
    key = _shape_key(plan)
    if key in STATE.autotuned:
        return False
    STATE.autotuned[key] = "started"
    outcome = tune_and_record(plan, settings())
    STATE.autotuned[key] = outcome
    return outcome in ("recorded", "found")


def _capturing() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _shape_key(plan) -> str:
    return f"{plan.explanation.arch}|{plan.device.name}|{plan.problem.label()}"


def tune_and_record(plan, mode: Settings, tuner: Optional[Callable] = None) -> str:
    """Tune the plan's shape within `mode.budget_s` and record the winner in the user's database;
    returns "recorded", "found" (another process tuned it meanwhile), or why not ("no tuner",
    "busy", "nothing measured", "failed")."""
    from fa4 import database, state

    tuner = tuner or _tuner()
    expl, problem = plan.explanation, plan.problem
    if tuner is None:
        _warn("no-tuner", f"fa4: {ENV_VAR} is set but no tuner is installed (the fa4tune harness registers "
                          f"one under the entry point group {TUNER_GROUP!r}); running untuned")
        return "no tuner"
    start = time.monotonic()
    deadline = start + mode.budget_s
    db_path = database.default_path()
    from filelock import FileLock, Timeout  # here: `import fa4` stays cheap

    lock_dir = db_path.parent / "autotune"
    lock_dir.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(lock_dir / (hashlib.sha256(_shape_key(plan).encode()).hexdigest()[:16] + ".lock")))
    try:
        lock.acquire(timeout=max(0.0, deadline - time.monotonic()))
    except Timeout:
        _warn(f"busy:{expl.problem}", f"fa4: another process was still tuning {expl.problem} after "
                                      f"{mode.budget_s:g} s; running untuned")
        return "busy"
    try:
        if _exact_entry(plan):   # another process tuned it while this one waited
            return "found"
        log.warning("fa4: autotuning %s (%s: up to %d configurations, at most %g s)", expl.problem,
                    mode.effort, EFFORTS[mode.effort], mode.budget_s)
        request = TuneRequest(arch=expl.arch, problem=problem, device=plan.device,
                              gpu_index=plan.spec.device.index if plan.spec.device.index is not None else 0,
                              max_configs=EFFORTS[mode.effort], deadline=deadline)
        try:
            result = tuner(request)
        except Exception as exc:  # the tuner's own failure: run untuned, say why once
            _warn(f"failed:{expl.problem}", f"fa4: autotuning {expl.problem} failed ({type(exc).__name__}: "
                                            f"{exc}); running untuned")
            return "failed"
        if not result.measured:
            _warn(f"nothing:{expl.problem}", f"fa4: autotuning {expl.problem} measured no configuration in "
                                             f"{mode.budget_s:g} s ({'; '.join(result.notes) or 'none finished'}); "
                                             "running untuned")
            return "nothing measured"
        best = min(result.measured, key=lambda m: m.us)
        default = next((m for m in result.measured if m.is_default), None)
        entry = database.Entry.from_result(
            arch=expl.arch, device=plan.device.name, problem=problem, config=best.config, us=best.us,
            tflops=round(problem.flops() / best.us / 1e6, 2), default_us=default.us if default else None,
            peers_us={}, max_err=best.max_err, kernel_fingerprint=state.fingerprint(expl.arch) or "",
            versions=result.versions, study=f"autotune-{mode.effort}", trial=None)
        database.record(entry, db_path)
        log.warning("fa4: autotuned %s in %.1f s: %d of %d configurations measured, best %.2f us%s; "
                    "recorded in %s", expl.problem, time.monotonic() - start, len(result.measured),
                    result.tried, best.us, f" ({default.us / best.us:.3f}x the default)" if default else "",
                    db_path)
        with state.STATE.lock:   # read the database again, and plan this shape's signatures again
            state.use_config_db(state.STATE.db_path)
        return "recorded"
    finally:
        lock.release()


def _exact_entry(plan) -> bool:
    """Whether the user's database (as the default layers read it now) has an exact entry for the
    plan's shape."""
    from fa4 import database, state

    try:
        db = database.BestConfigDB.load_layers() if state.STATE.db_path is None else \
            database.BestConfigDB.load(state.STATE.db_path)
        found = db.lookup(plan.explanation.arch, plan.device.name, plan.problem,
                          state.fingerprint(plan.explanation.arch), max_distance=0)
    except Exception:
        return False
    return found is not None and found.kind == "exact"
