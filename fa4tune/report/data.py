"""What the HTML report shows, computed as plain structures (no plotting here).

Three inputs, each optional: the optuna storage of the searches, the best-config database
(`best_configs.json`) and the bench results (`bench.json`), by default all in one results folder. A
missing or unreadable input becomes a line in `ReportData.missing` and an empty section, and a malformed
study, database entry or bench row is skipped with such a line: never an exception, since a report of
what exists is more useful than no report. Inputs are only read (`fa4tune.searches.storage.open_for_reading`;
an `sqlite:///` URL naming no file is not opened, since opening it would create the file).

A report is committed and shared, so it names no machine's paths: inputs as `shown` prints them, and
every note (a missing input, a failed implementation's or a peer's error, why importance was not
computed) through `fa4tune.workers.outcomes.portable_note`, since an error's message names the files of the
machine it ran on.

`report_draw` turns a `ReportData` into figures and one HTML file. Everything that decides a number
(speedups, failure counts, staleness, knob importance) lives here, so it is unit-tested without a browser.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from statistics import geometric_mean
from typing import Any, Iterable, Mapping, Sequence

import optuna

from fa4 import backends
from fa4tune.workers.outcomes import ALL_OUTCOMES as OUTCOMES, portable_note
from fa4tune.workers.training import FA4 as TRAINING_FA4  # fa4.attention's training row
from fa4tune.searches.storage import find_storages, open_for_reading

DISPATCHED = "dispatched"  # `fa4.attention` itself, as `fa4tune bench` times it
DISPATCH_MODES = ("graph", "eager")  # as `fa4.dispatch.MODES` names them
DISPATCH_TOLERANCE = 0.02  # the dispatch bar: dispatched within 2 % of the fastest in the same run

DEFAULT_DATABASE = "best_configs.json"
DEFAULT_BENCH = "bench.json"


def impls() -> tuple[str, ...]:
    """Implementations compared per shape, in the order they are shown: "tuned" is ours with the best
    configuration, "default" ours with the heuristic default configuration, then the peers timed in the
    same run (`fa4.backends`), and "dispatched": `fa4.attention` itself as `fa4tune bench` times it
    (whichever backend fastest-backend dispatch ran)."""
    return ("tuned", "default") + backends.peer_names() + (DISPATCHED,)


def baselines() -> tuple[str, ...]:
    """What "tuned" is compared against (heatmaps, the speedup summary)."""
    return ("default",) + backends.peer_names()


# ------------------------------------------------------------------------------------------------
# inputs (the storage is only read: `fa4tune.searches.storage.open_for_reading` creates nothing)
# ------------------------------------------------------------------------------------------------

def shown(path: str | Path) -> str:
    """A path as the report prints it: relative to the working directory when it lies below it, else
    its last two parts. A report is committed and shared: it must not carry a machine's absolute paths."""
    text = str(path)
    if "://" in text:  # a storage URL: its scheme and the file name only
        return text.split("://", 1)[0] + "://…/" + Path(text.split("://", 1)[1]).name
    p = Path(text)
    if not p.is_absolute():
        return text
    try:
        return str(p.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(Path("…", *p.parts[-2:]))


def load_studies(storage: optuna.storages.BaseStorage) -> list[optuna.Study]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        summaries = optuna.get_all_study_summaries(storage, include_best_trial=False)
        return [optuna.load_study(study_name=s.study_name, storage=storage) for s in summaries]


# --------------------------------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------------------------------

def _finite(x: Any) -> float | None:
    if isinstance(x, bool) or x is None:
        return None
    try:
        value = float(x)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) and value > 0 else None


def problem_flops(problem: Mapping[str, Any]) -> int | None:
    from fa4.kernels import AttentionProblem
    try:
        return AttentionProblem(**{k: problem[k] for k in problem if k in _PROBLEM_FIELDS}).flops()
    except (TypeError, ValueError, KeyError):
        return None


_PROBLEM_FIELDS = ("batch", "seqlen_q", "seqlen_k", "heads_q", "heads_kv", "head_dim", "dtype", "causal",
                   "return_lse", "window", "softcap")
_INT_FIELDS = ("batch", "seqlen_q", "seqlen_k", "heads_q", "heads_kv", "head_dim")
# what a malformed input raises when it is read; such an input is skipped with a note, never fatal
MALFORMED = (TypeError, ValueError, KeyError, AttributeError)


def checked_problem(value: Any) -> dict:
    """The problem fields of a study, bench row or database entry; ValueError when they do not make an
    AttentionProblem (a missing field, a number given as text, ...)."""
    from fa4.kernels import AttentionProblem

    if not isinstance(value, Mapping):
        raise ValueError(f"problem is a {type(value).__name__}, not a mapping")
    bad = [k for k in _INT_FIELDS if not isinstance(value.get(k), int) or isinstance(value.get(k), bool)]
    if bad:
        raise ValueError(f"problem fields {', '.join(bad)} are not whole numbers")
    try:
        AttentionProblem(**{k: value[k] for k in value if k in _PROBLEM_FIELDS})
    except (TypeError, ValueError) as exc:
        raise ValueError(f"problem {dict(value)}: {exc}") from exc
    return dict(value)


def _mapping_attr(attrs: Mapping, name: str) -> dict:
    """A study attribute that must be a mapping when present; ValueError when it is something else."""
    value = attrs.get(name)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"study attribute {name!r} is a {type(value).__name__}, not a mapping")
    return dict(value)


def tflops_of(problem: Mapping[str, Any], us: float | None) -> float | None:
    flops = problem_flops(problem)
    if not flops or not us:
        return None
    return flops / (us * 1e-6) / 1e12


def problem_key(problem: Mapping[str, Any]) -> tuple:
    # a window is a JSON list: hashable as a tuple
    return tuple(tuple(v) if isinstance(v, list) else v for v in (problem.get(k) for k in _PROBLEM_FIELDS))


def problem_label(problem: Mapping[str, Any]) -> str:
    """Short, unambiguous: "B1 S1024 H32/8 D128 fp16 causal" (Sq and Sk shown apart when they differ)."""
    sq, sk = problem.get("seqlen_q"), problem.get("seqlen_k")
    seq = f"S{sq}" if sq == sk else f"Sq{sq} Sk{sk}"
    mask = "causal" if problem.get("causal") else "full"
    if problem.get("window") is not None:
        mask += f" window ({problem['window'][0]}, {problem['window'][1]})"
    if problem.get("softcap") is not None:
        mask += f" softcap {problem['softcap']:g}"
    lse = " +lse" if problem.get("return_lse") else ""
    return (f"B{problem.get('batch')} {seq} H{problem.get('heads_q')}/{problem.get('heads_kv')} "
            f"D{problem.get('head_dim')} {problem.get('dtype')} {mask}{lse}")


def device_name(device: Any) -> str:
    if isinstance(device, Mapping):
        return str(device.get("name") or "unknown device")
    return str(device) if device else "unknown device"


def current_fingerprints(archs: Iterable[str]) -> dict[str, str | None]:
    """kernel_fingerprint(arch) for each arch; None where the kernel sources cannot be read."""
    from fa4 import kernels
    out: dict[str, str | None] = {}
    for arch in sorted(set(archs)):
        try:
            out[arch] = kernels.kernel_fingerprint(arch)
        except Exception:  # an arch whose family is absent here cannot be compared: "unknown", not stale
            out[arch] = None
    return out


def fingerprint_state(recorded: str | None, current: str | None) -> str:
    """"current", "stale" (the kernel sources changed since the measurement) or "unknown"."""
    if not recorded or not current:
        return "unknown"
    return "current" if recorded == current else "stale"


# --------------------------------------------------------------------------------------------------
# studies
# --------------------------------------------------------------------------------------------------

def trial_outcome(trial: optuna.trial.FrozenTrial) -> str | None:
    """The failure class of a finished trial; None for one still running or waiting.

    The search records the class in user_attrs["outcome"]; the trial state alone cannot tell (a failed
    configuration may be COMPLETE with no value, FAIL or PRUNED, depending on how it was recorded).
    """
    outcome = trial.user_attrs.get("outcome")
    if outcome:
        return str(outcome)
    if trial.state in (optuna.trial.TrialState.RUNNING, optuna.trial.TrialState.WAITING):
        return None
    if trial.state == optuna.trial.TrialState.COMPLETE and _finite(trial.value) is not None:
        return "ok"
    return "unrecorded"


def is_repeat(trial: optuna.trial.FrozenTrial) -> bool:
    """A configuration already evaluated in the study: its result was copied, not measured again."""
    return "repeat_of" in trial.user_attrs


def measured_trials(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """The trials that each evaluated a configuration (repeats left out), by trial number."""
    return sorted((t for t in study.get_trials(deepcopy=False) if not is_repeat(t)), key=lambda t: t.number)


def split_study_name(name: str) -> tuple[str, int]:
    """("<shape key>", n) of a study name "<shape key>~n"; n = 1 without a suffix.

    The search continues a shape in "<key>~2", "~3", ... when the kernel fingerprint or the search
    space changed; the highest suffix is the current study of that shape.
    """
    base, sep, suffix = name.rpartition("~")
    if sep and suffix.isdigit() and base:
        return base, int(suffix)
    return name, 1


def current_and_superseded(studies: Sequence[optuna.Study]) -> tuple[list[optuna.Study], list[optuna.Study]]:
    latest: dict[str, tuple[int, optuna.Study]] = {}
    for s in studies:
        base, n = split_study_name(s.study_name)
        if base not in latest or n > latest[base][0]:
            latest[base] = (n, s)
    current = [s for _, s in latest.values()]
    return current, [s for s in studies if all(s is not c for c in current)]


def trial_us(trial: optuna.trial.FrozenTrial) -> float | None:
    """Kernel time of a successful trial, in µs (user_attrs["us"], else the objective value)."""
    if trial_outcome(trial) != "ok":
        return None
    us = _finite(trial.user_attrs.get("us"))
    return us if us is not None else _finite(trial.value)


def ok_study(study: optuna.Study) -> optuna.Study:
    """An in-memory copy holding only the successful, timed trials of `study`, valued in µs.

    Optuna's plots and importance evaluators read trial values; a failure recorded as COMPLETE with a
    penalty value would otherwise bend every axis.
    """
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # not "a new study created" per study
    try:
        copy = optuna.create_study(study_name=study.study_name, direction="minimize")
    finally:
        optuna.logging.set_verbosity(verbosity)
    keep = []
    for t in measured_trials(study):
        us = trial_us(t)
        if us is None:
            continue
        keep.append(optuna.trial.create_trial(
            state=optuna.trial.TrialState.COMPLETE, value=us, params=t.params,
            distributions=t.distributions, user_attrs=t.user_attrs))
    copy.add_trials(keep)
    return copy


@dataclass
class StudyInfo:
    name: str
    arch: str
    problem: dict
    label: str
    device: dict
    versions: dict
    timing: dict
    kernel_fingerprint: str | None
    fingerprint_state: str
    peers: dict                      # peer -> {"us", "tflops"} or {"error"}
    default_us: float | None
    knob_names: list[str]            # knobs searched (params seen), in declaration order
    n_trials: int                    # configurations evaluated (repeats of one left out)
    outcomes: dict[str, int]         # outcome -> count, finished trials only, repeats left out
    best: dict | None                # {"number", "us", "tflops", "params"}
    history: list[tuple[int, float, float]]  # (trial number, µs, best µs so far), ok trials
    importance: dict[str, float] | None
    importance_note: str
    ok_study: optuna.Study | None = field(default=None, repr=False, compare=False)


def _knob_order(arch: str, names: Iterable[str]) -> list[str]:
    names = set(names)
    try:
        from fa4.kernels import knobs_for
        declared = [k.name for k in knobs_for(arch)]
    except ValueError:
        declared = []
    return [n for n in declared if n in names] + sorted(names - set(declared))


def knob_importance(study: optuna.Study, knob_names: Sequence[str],
                    min_trials: int = 8) -> tuple[dict[str, float] | None, str]:
    """PED-ANOVA importance of each knob for kernel time, over successful trials only.

    Knobs that took a single value in the study cannot matter to it and are left out. Returns
    (importances or None, a note saying what was done or why not).
    """
    trials = study.get_trials(deepcopy=False)
    if len(trials) < min_trials:
        return None, f"{len(trials)} successful trials; importance needs at least {min_trials}"
    varied = [n for n in knob_names if len({repr(t.params.get(n)) for t in trials if n in t.params}) > 1]
    if not varied:
        return None, "no knob took more than one value"
    evaluator = optuna.importance.PedAnovaImportanceEvaluator()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            raw = optuna.importance.get_param_importances(study, evaluator=evaluator, params=varied,
                                                           normalize=True)
    except Exception as exc:  # optuna refuses some degenerate studies; say so in the report
        return None, f"PED-ANOVA failed: {exc}"
    return ({n: float(raw.get(n, 0.0)) for n in varied},
            f"PED-ANOVA over {len(trials)} successful trials, {len(varied)} varied knobs")


def summarize_study(study: optuna.Study, fingerprints: Mapping[str, str | None] | None = None,
                    min_importance_trials: int = 8) -> StudyInfo:
    """What the report shows of one study; ValueError (see `MALFORMED`) when its attributes are not what
    the search writes (`fa4tune.searches.study`)."""
    attrs = study.user_attrs
    arch = str(attrs.get("arch") or "unknown")
    problem = checked_problem(attrs["problem"]) if attrs.get("problem") is not None else {}
    device, versions, timing, peers = (_mapping_attr(attrs, n) for n in ("device", "versions", "timing", "peers"))
    trials = measured_trials(study)
    outcomes: dict[str, int] = {}
    for t in trials:
        outcome = trial_outcome(t)
        if outcome is not None:
            outcomes[outcome] = outcomes.get(outcome, 0) + 1

    history: list[tuple[int, float, float]] = []
    best = None
    best_us = math.inf
    default_trial_us = None
    for t in trials:
        us = trial_us(t)
        if us is None:
            continue
        if t.user_attrs.get("is_default") and default_trial_us is None:
            default_trial_us = us
        if us < best_us:
            best_us = us
            best = {"number": t.number, "us": us,
                    "tflops": _finite(t.user_attrs.get("tflops")) or tflops_of(problem, us),
                    "params": dict(t.params)}
        history.append((t.number, us, best_us))

    knob_names = _knob_order(arch, {n for t in trials for n in t.params})
    good = ok_study(study)
    importance, note = knob_importance(good, knob_names, min_importance_trials)
    recorded_fp = attrs.get("kernel_fingerprint")
    current_fp = (fingerprints or {}).get(arch)
    default_us = _finite(attrs.get("default_us"))
    return StudyInfo(
        name=study.study_name, arch=arch, problem=problem,
        label=problem_label(problem) if problem else study.study_name,
        device=device, versions=versions, timing=timing,
        kernel_fingerprint=recorded_fp if isinstance(recorded_fp, str) else None,
        fingerprint_state=fingerprint_state(recorded_fp if isinstance(recorded_fp, str) else None, current_fp),
        peers=peers,
        default_us=default_us if default_us is not None else default_trial_us,
        knob_names=knob_names, n_trials=len(trials), outcomes=outcomes, best=best, history=history,
        importance=importance, importance_note=note, ok_study=good if len(good.trials) else None)


# --------------------------------------------------------------------------------------------------
# per-shape comparison (bench first, studies for shapes the bench did not cover)
# --------------------------------------------------------------------------------------------------

@dataclass
class ShapeRow:
    arch: str
    device: str
    problem: dict
    label: str
    source: str                                  # "bench" or "study"
    impls: dict[str, dict]                       # impl -> {"us", "tflops"} or {"error"}
    speedup: dict[str, float] = field(default_factory=dict)  # impl -> its µs / tuned µs (not tuned's)

    def compute_speedups(self) -> None:
        tuned = _finite(self.impls.get("tuned", {}).get("us"))
        self.speedup = {}
        if tuned is None:
            return
        for impl in impls()[1:]:
            us = _finite(self.impls.get(impl, {}).get("us"))
            if us is not None:
                self.speedup[impl] = us / tuned


def _impl_entry(us: Any, tflops: Any, problem: Mapping, error: Any = None) -> dict:
    us = _finite(us)
    if us is None:
        return {"error": str(error or "no time recorded")}
    return {"us": us, "tflops": _finite(tflops) or tflops_of(problem, us)}


def _backends(value: Any) -> dict[str, str]:
    """{mode: implementation} of a dispatched row ("backend"), or of the run's "dispatch" choices
    ({mode: {"backend", ...}}); what is malformed is left out."""
    if not isinstance(value, Mapping):
        return {}
    out = {}
    for mode in DISPATCH_MODES:
        name = value.get(mode)
        name = name.get("backend") if isinstance(name, Mapping) else name
        if isinstance(name, str) and name:
            out[mode] = name
    return out


def _dispatched_extras(rec: Mapping, run: Mapping) -> dict:
    """What a "dispatched" bench row adds to its time: which backend ran in each mode, and which one
    this run's own times pick (the bench's top-level "dispatch")."""
    extras: dict[str, Any] = {}
    extras["backend"] = _backends(rec.get("backend"))
    picks = run.get("dispatch")
    extras["picked"] = _backends(picks.get(rec.get("shape")) if isinstance(picks, Mapping) else None)
    return extras


def rows_from_bench(records: Sequence[Mapping], run: Mapping | None = None,
                    notes: list[str] | None = None) -> list[ShapeRow]:
    """Group bench records (one per problem x implementation) into one row per (arch, device, problem).
    A record whose problem is malformed is skipped, with a line in `notes`.

    A record names its implementation "variant" (fa4tune bench) or "impl", its result "outcome" or
    "status"; arch and device come from the record or else from the run (`run`: the file's top level).
    """
    run = run or {}
    rows: dict[tuple, ShapeRow] = {}
    for rec in records:
        impl = str(_first(rec, "variant", "impl", default=""))
        if not rec.get("problem") or not impl:
            continue
        try:
            problem = checked_problem(rec["problem"])
        except ValueError as exc:
            if notes is not None:
                notes.append(f"bench row {rec.get('shape', '?')} {impl}: skipped ({exc})")
            continue
        arch = str(_first(rec, "arch", default=run.get("arch")) or "unknown")
        dev = device_name(_first(rec, "device", default=run.get("device")))
        key = (arch, dev, problem_key(problem))
        row = rows.setdefault(key, ShapeRow(arch, dev, problem, problem_label(problem), "bench", {}))
        status = str(_first(rec, "outcome", "status", default="ok"))
        error = None
        if status != "ok":  # name the failure class unless it is the generic "error"
            detail = rec.get("error")
            error = (str(detail) if status == "error" else f"{status}: {detail}") if detail else status
        entry = _impl_entry(rec.get("us") if not error else None, rec.get("tflops"), problem, error)
        if rec.get("kv_expanded") and "us" in entry:
            entry["kv_expanded"] = True  # timed on K and V expanded to the query heads: not what runs
        eager = _finite(rec.get("eager_us"))
        if eager is not None and "us" in entry:
            entry["eager_us"] = eager  # wall time per back-to-back eager call (fa4tune.benchmark.runner)
        if impl == DISPATCHED and "us" in entry:
            entry.update(_dispatched_extras(rec, run))
        row.impls[impl] = entry
    for row in rows.values():
        row.compute_speedups()
    return list(rows.values())


def rows_from_studies(studies: Sequence[StudyInfo]) -> list[ShapeRow]:
    """What the searches themselves measured: best trial, default, and the peers timed alongside."""
    rows = []
    for s in studies:
        if not s.problem:
            continue
        impls: dict[str, dict] = {}
        impls["tuned"] = (_impl_entry(s.best["us"], s.best["tflops"], s.problem) if s.best
                          else {"error": "no successful trial"})
        if s.default_us is not None:
            impls["default"] = _impl_entry(s.default_us, None, s.problem)
        for peer, result in s.peers.items():
            result = result if isinstance(result, Mapping) else {}
            impls[peer] = _impl_entry(result.get("us"), result.get("tflops"), s.problem,
                                      result.get("error"))
        row = ShapeRow(s.arch, device_name(s.device), s.problem, s.label, "study", impls)
        row.compute_speedups()
        rows.append(row)
    return rows


def merge_rows(bench_rows: Sequence[ShapeRow], study_rows: Sequence[ShapeRow]) -> list[ShapeRow]:
    """Bench rows win (a dedicated same-run comparison) where they measured anything; study rows fill
    the shapes the bench lacks or where every bench variant failed."""
    measured = [r for r in bench_rows if any("us" in e for e in r.impls.values())]
    seen = {(r.arch, r.device, problem_key(r.problem)) for r in measured}
    fill = [r for r in study_rows if (r.arch, r.device, problem_key(r.problem)) not in seen]
    filled = {(r.arch, r.device, problem_key(r.problem)) for r in fill}
    failed = [r for r in bench_rows if r not in measured
              and (r.arch, r.device, problem_key(r.problem)) not in filled]
    rows = measured + fill + failed
    return sorted(rows, key=_row_sort_key)


def _row_sort_key(row: ShapeRow) -> tuple:
    p = row.problem
    return (row.arch, row.device, str(p.get("dtype")), p.get("head_dim") or 0,
            (p.get("heads_q") or 0) // max(1, p.get("heads_kv") or 1), p.get("heads_q") or 0,
            bool(p.get("causal")), p.get("batch") or 0, p.get("seqlen_q") or 0, p.get("seqlen_k") or 0)


def speedup_summary(rows: Sequence[ShapeRow]) -> dict[str, dict[str, float]]:
    """Per baseline over the shapes that have it: count, geometric mean, min and max of the speedup,
    and how many shapes the tuned kernel wins (speedup > 1)."""
    out = {}
    for baseline in baselines():
        values = [r.speedup[baseline] for r in rows if baseline in r.speedup]
        if values:
            out[baseline] = {"n": len(values), "geomean": geometric_mean(values),
                             "min": min(values), "max": max(values), "wins": sum(v > 1.0 for v in values)}
    return out


@dataclass
class DispatchRow:
    """One shape's dispatched row beside the fastest implementation of the same run, in both of issue
    12's modes: GPU time by CUDA-graph replay ("graph") and wall time per back-to-back eager call."""

    label: str
    arch: str
    device: str
    us: float                    # fa4.attention's GPU time (CUDA-graph replay, graph mode)
    eager_us: float | None       # its wall time per back-to-back eager call
    ran: dict[str, str]          # mode -> the implementation fa4.attention ran (its database's times)
    picked: dict[str, str]       # mode -> what this run's own times pick (the bench's "dispatch")
    fastest: str | None          # the fastest implementation timed in the run (what the runtime can run)
    fastest_us: float | None
    ratio: float | None          # us / fastest_us (1.0: as fast as the fastest)
    eager_fastest: str | None    # the same, by eager wall time per call
    eager_fastest_us: float | None
    eager_ratio: float | None    # eager_us / eager_fastest_us

    @property
    def graph_within_tolerance(self) -> bool | None:
        return _within(self.ratio)

    @property
    def eager_within_tolerance(self) -> bool | None:
        return _within(self.eager_ratio)

    @property
    def within_tolerance(self) -> bool | None:
        """The dispatch bar in every mode measured: False if either ratio misses it, None if none is known."""
        verdicts = [v for v in (self.graph_within_tolerance, self.eager_within_tolerance) if v is not None]
        return all(verdicts) if verdicts else None


def _within(ratio: float | None) -> bool | None:
    return None if ratio is None else ratio <= 1 + DISPATCH_TOLERANCE


def _fastest_of(times: Mapping[str, float]) -> tuple[str | None, float | None]:
    if not times:
        return None, None
    name = min(times, key=times.get)
    return name, times[name]


def dispatch_rows(rows: Sequence[ShapeRow]) -> list[DispatchRow]:
    """Every shape whose dispatched row was timed, beside the fastest implementation of the same run:
    ours as fa4.attention would run it (tuned, else the default) and every peer, leaving out a SDPA row
    timed on K and V expanded to the query heads (the runtime never expands them per call). The same
    comparison by eager wall time per call, among those of them whose eager time was measured."""
    out = []
    for r in rows:
        d = r.impls.get(DISPATCHED, {})
        if "us" not in d:
            continue
        ours = "tuned" if "us" in r.impls.get("tuned", {}) else "default"
        runnable = {impl: e for impl, e in r.impls.items()
                    if impl in (ours,) + backends.peer_names() and "us" in e and not e.get("kv_expanded")}
        fastest, fastest_us = _fastest_of({impl: e["us"] for impl, e in runnable.items()})
        eager_fastest, eager_fastest_us = _fastest_of(
            {impl: e["eager_us"] for impl, e in runnable.items() if e.get("eager_us") is not None})
        eager_us = d.get("eager_us")
        out.append(DispatchRow(r.label, r.arch, r.device, d["us"], eager_us, d.get("backend", {}),
                               d.get("picked", {}), fastest, fastest_us,
                               d["us"] / fastest_us if fastest_us else None,
                               eager_fastest, eager_fastest_us,
                               eager_us / eager_fastest_us if eager_us is not None and eager_fastest_us else None))
    return out


@dataclass
class TrainingRow:
    """One implementation's training pass on one shape (`fa4tune bench --backward`): "fa4" is
    fa4.attention (its forward and the backward `fa4.backward` chose), the others are peers through
    autograd. A ratio is this row's time ÷ the fastest peer's in the same pass and shape (below 1:
    faster than every peer), None where either time is missing."""

    arch: str
    device: str
    problem: dict
    label: str
    implementation: str
    outcome: str
    fwdbwd_us: float | None          # forward + backward, GPU time by CUDA-graph replay
    bwd_us: float | None             # the backward alone, the lowest over rounds
    bwd_us_rounds: list
    peak_extra_mib: float | None     # the most one backward call allocated beyond what was live
    validated: bool | None           # gradients checked against fp32 autograd (False: an older file's)
    backward: str | None             # fa4 only: the backward implementation that ran
    kv_expanded: bool                # a peer that refuses GQA, run on K and V expanded inside the timed call
    error: str | None
    fastest_peer: dict[str, str] = field(default_factory=dict)  # pass ("fwdbwd", "bwd") -> the fastest peer
    fwdbwd_ratio: float | None = None
    bwd_ratio: float | None = None


def training_order(name: str) -> int:
    """Where an implementation's training row stands: fa4.attention first, then the peers as registered."""
    order = (TRAINING_FA4,) + backends.peer_names()
    return order.index(name) if name in order else len(order)


def training_rows(data: Any, notes: list[str] | None = None) -> list[TrainingRow]:
    """The training rows of a bench document, one per shape x implementation, with each row's ratio to
    the fastest peer of its shape in each pass. A document without "training_rows" (a bench run without
    --backward, or an older file) gives none; a malformed record is skipped with a line in `notes`.

    Peers timed on expanded K and V count among the peers: the expansion is inside their timed call,
    so their time is what a caller of that peer pays (the forward bench, which times them on K and V
    expanded beforehand, leaves them out instead)."""
    records = data.get("training_rows") if isinstance(data, Mapping) else None
    if not isinstance(records, list):
        return []
    rows: list[TrainingRow] = []
    for index, rec in enumerate(records):
        try:
            if not isinstance(rec, Mapping):
                raise ValueError(f"a {type(rec).__name__}, not a mapping")
            problem = checked_problem(rec.get("problem"))
            name = str(rec["implementation"])
            error = rec.get("error")
            rounds = rec.get("bwd_us_rounds")
            rows.append(TrainingRow(
                arch=str(_first(rec, "arch", default=data.get("arch")) or "unknown"),
                device=device_name(_first(rec, "device", default=data.get("device"))),
                problem=problem, label=problem_label(problem), implementation=name,
                outcome=str(rec.get("outcome") or "ok"),
                fwdbwd_us=_finite(rec.get("fwdbwd_us")), bwd_us=_finite(rec.get("bwd_us")),
                bwd_us_rounds=[_finite(x) for x in rounds] if isinstance(rounds, list) else [],
                peak_extra_mib=(float(rec["bwd_peak_extra_mib"])
                                if isinstance(rec.get("bwd_peak_extra_mib"), (int, float)) else None),
                validated=rec["validated"] if isinstance(rec.get("validated"), bool) else None,
                backward=str(rec["backward"]) if rec.get("backward") else None,
                kv_expanded=bool(rec.get("kv_expanded")), error=str(error) if error else None))
        except MALFORMED as exc:
            if notes is not None:
                shape = rec.get("shape", index) if isinstance(rec, Mapping) else index
                notes.append(f"bench training row {shape}: skipped ({type(exc).__name__}: {exc})")
    shapes: dict[tuple, list[TrainingRow]] = {}
    for row in rows:
        shapes.setdefault((row.arch, row.device, problem_key(row.problem)), []).append(row)
    for group in shapes.values():
        peers = [r for r in group if r.implementation != TRAINING_FA4 and r.outcome == "ok"]
        fastest = {}
        for pass_ in ("fwdbwd", "bwd"):
            times = {r.implementation: getattr(r, f"{pass_}_us") for r in peers
                     if getattr(r, f"{pass_}_us") is not None}
            fastest[pass_] = _fastest_of(times)
        for r in group:
            r.fastest_peer = {p: name for p, (name, _) in fastest.items() if name}
            for pass_, (_, us) in fastest.items():
                mine = getattr(r, f"{pass_}_us")
                setattr(r, f"{pass_}_ratio", mine / us if mine is not None and us else None)
    key = {id(r): _row_sort_key(ShapeRow(r.arch, r.device, r.problem, "", "", {})) for r in rows}
    return sorted(rows, key=lambda r: (key[id(r)], training_order(r.implementation), r.implementation))


@dataclass
class Heatmap:
    baseline: str
    x: list[str]                 # sequence lengths and batch
    y: list[str]                 # shape family: arch, dtype, head dim, heads, mask
    z: list[list[float | None]]  # speedup of tuned over the baseline (>1: tuned is faster)


def _family_label(row: ShapeRow, with_device: bool = False) -> str:
    p = row.problem
    mask = "causal" if p.get("causal") else "full"
    label = f"{row.arch} {p.get('dtype')} D{p.get('head_dim')} H{p.get('heads_q')}/{p.get('heads_kv')} {mask}"
    label += " +lse" if p.get("return_lse") else ""
    return f"{row.device}: {label}" if with_device else label


def _length_label(row: ShapeRow) -> str:
    p = row.problem
    sq, sk = p.get("seqlen_q"), p.get("seqlen_k")
    seq = f"S{sq}" if sq == sk else f"Sq{sq} Sk{sk}"
    return f"B{p.get('batch')} {seq}"


def speedup_heatmaps(rows: Sequence[ShapeRow]) -> list[Heatmap]:
    """One grid per baseline that has any data: rows are shape families, columns batch x lengths."""
    rows = sorted(rows, key=_row_sort_key)
    many_devices = len({r.device for r in rows}) > 1

    def family(r: ShapeRow) -> str:
        return _family_label(r, many_devices)

    ys: list[str] = []
    x_order: dict[str, tuple] = {}
    for r in rows:
        if family(r) not in ys:
            ys.append(family(r))
        x = _length_label(r)
        x_order.setdefault(x, (r.problem.get("seqlen_q") or 0, r.problem.get("seqlen_k") or 0,
                               r.problem.get("batch") or 0))
    xs = sorted(x_order, key=lambda x: x_order[x])
    maps = []
    for baseline in baselines():
        z: list[list[float | None]] = [[None] * len(xs) for _ in ys]
        any_value = False
        for r in rows:
            value = r.speedup.get(baseline)
            if value is None:
                continue
            z[ys.index(family(r))][xs.index(_length_label(r))] = value
            any_value = True
        if any_value:
            maps.append(Heatmap(baseline, xs, ys, z))
    return maps


# --------------------------------------------------------------------------------------------------
# best-config database and bench file
# --------------------------------------------------------------------------------------------------

def _first(entry: Mapping, *names: str, default: Any = None) -> Any:
    for name in names:
        if name in entry and entry[name] is not None:
            return entry[name]
    return default


@dataclass
class BestConfigRow:
    arch: str
    device: str
    shape: str          # the bucket description
    tuned_on: str       # the exact problem the tuning ran on, when recorded
    config: dict
    us: float | None
    tflops: float | None
    speedup: dict[str, float]
    max_err: float | None
    kernel_fingerprint: str | None
    fingerprint_state: str
    versions: dict
    date: str
    study: str
    trial: Any


def _bucket_label(entry: Mapping) -> str:
    parts = [str(_first(entry, "dtype", default="?")), f"D{_first(entry, 'head_dim', default='?')}",
             f"GQA{_first(entry, 'gqa_ratio', default='?')}",
             "causal" if _first(entry, "causal", default=False) else "full"]
    for name, tag in (("seqlen_q_bucket", "Sq"), ("seqlen_k_bucket", "Sk"), ("work_bucket", "work")):
        value = entry.get(name)
        if value is not None:
            parts.append(f"{tag} {value}")
    return " ".join(parts)


def best_config_rows(db: Any, fingerprints: Mapping[str, str | None],
                     notes: list[str] | None = None) -> list[BestConfigRow]:
    """Rows of the best-config database, read tolerantly (a list, or {"entries": [...]}); an entry that
    is malformed (its config not a mapping, ...) is skipped, with a line in `notes`."""
    entries = db.get("entries", []) if isinstance(db, Mapping) else db
    if not isinstance(entries, list):
        raise ValueError("the database holds no list of entries")
    rows = []
    for index, e in enumerate(entries):
        try:
            row = _best_config_row(e, fingerprints)
        except MALFORMED as exc:
            if notes is not None:
                key = e.get("key") if isinstance(e, Mapping) else None
                notes.append(f"best-config entry {key or index}: skipped ({type(exc).__name__}: {exc})")
            continue
        rows.append(row)
    return sorted(rows, key=lambda r: (r.arch, r.device, r.shape))


def _best_config_row(e: Any, fingerprints: Mapping[str, str | None]) -> BestConfigRow:
    if not isinstance(e, Mapping):
        raise ValueError(f"an entry is a {type(e).__name__}, not a mapping")
    config = _first(e, "config", "knobs", default={})
    if not isinstance(config, Mapping):
        raise ValueError(f"its config is a {type(config).__name__}, not a mapping of knob values")
    arch = str(_first(e, "arch", default="unknown"))
    fp = _first(e, "kernel_fingerprint", "fingerprint")
    speedup = _first(e, "speedup", "speedups", default={})
    return BestConfigRow(
        arch=arch, device=device_name(_first(e, "device")), shape=_bucket_label(e),
        tuned_on=problem_label(e["problem"]) if isinstance(e.get("problem"), Mapping) else "",
        config=dict(config), us=_finite(_first(e, "us", "time_us")),
        tflops=_finite(e.get("tflops")),
        speedup={str(k): float(v) for k, v in (speedup.items() if isinstance(speedup, Mapping) else [])
                 if _finite(v) is not None},
        max_err=(float(e["max_err"]) if isinstance(e.get("max_err"), (int, float)) else None),
        kernel_fingerprint=fp, fingerprint_state=fingerprint_state(fp, fingerprints.get(arch)),
        versions=dict(_first(e, "versions", default={})), date=str(_first(e, "date", default="")),
        study=str(_first(e, "study", default="")), trial=_first(e, "trial", default=""))


def bench_records(data: Any) -> list[Mapping]:
    """Bench records from bench.json: a list, or {"rows"|"results"|"records": [...]}."""
    if isinstance(data, list):
        return [r for r in data if isinstance(r, Mapping)]
    if isinstance(data, Mapping):
        for name in ("rows", "results", "records", "entries"):
            if isinstance(data.get(name), list):
                return [r for r in data[name] if isinstance(r, Mapping)]
    raise ValueError("bench file holds no list of rows")


def bench_timing(data: Any) -> dict:
    """The timing description a bench file carries at top level, if any."""
    if isinstance(data, Mapping) and isinstance(data.get("timing"), Mapping):
        return dict(data["timing"])
    return {}


# --------------------------------------------------------------------------------------------------
# everything together
# --------------------------------------------------------------------------------------------------

@dataclass
class ReportData:
    generated: str
    sources: dict[str, str]           # input -> what was read (path, or why nothing)
    missing: list[str]                # one line per input that is absent or unreadable
    studies: list[StudyInfo]          # the current study of each shape
    superseded: list[str]             # older studies of a shape ("<key>" when "<key>~2" exists)
    shape_rows: list[ShapeRow]
    heatmaps: list[Heatmap]
    dispatch: list[DispatchRow]       # fa4.attention's own row per shape, beside the run's fastest
    training: list[TrainingRow]       # the bench's training pass (--backward), per shape x implementation
    best_configs: list[BestConfigRow]
    timing: list[str]                 # distinct timing descriptions (method, L2 state, ...)
    devices: list[str]
    versions: list[str]               # distinct version sets
    warnings: list[str]               # sm100 not run on hardware, stale tunings, mixed timing
    fingerprints: dict[str, str | None]

    def to_dict(self) -> dict:
        """Everything computed, as JSON-ready plain data (the optuna study copies left out)."""
        out = _plain(self)
        out["speedup_summary"] = self.speedups
        return out

    @property
    def speedups(self) -> dict[str, dict[str, float]]:
        return speedup_summary(self.shape_rows)

    @property
    def failure_table(self) -> tuple[list[str], list[str], list[list[int]]]:
        """(study names, outcome classes, counts[outcome][study]): the failures-by-class figure."""
        names = [s.name for s in self.studies]
        seen = {o for s in self.studies for o in s.outcomes}
        classes = [o for o in OUTCOMES if o in seen] + sorted(seen - set(OUTCOMES))
        return names, classes, [[s.outcomes.get(o, 0) for s in self.studies] for o in classes]

    @property
    def importance_table(self) -> tuple[list[str], list[str], list[list[float | None]]]:
        """(study names, knob names, importance[study][knob]) for studies where it was computed."""
        studies = [s for s in self.studies if s.importance]
        knobs: list[str] = []
        for s in studies:
            knobs += [k for k in s.knob_names if k in s.importance and k not in knobs]
        return ([s.name for s in studies], knobs,
                [[s.importance.get(k) for k in knobs] for s in studies])


TIMING_METHODS = {"cuda_graph": "CUDA-graph replay"}


def _plain(value: Any) -> Any:
    from dataclasses import fields, is_dataclass

    if is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value) if f.name != "ok_study"}
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def describe_timing(timing: Mapping[str, Any]) -> str:
    if not timing:
        return "not recorded"
    method = timing.get("method", "unknown method")
    method = TIMING_METHODS.get(method, method)
    parts = [str(method)]
    if timing.get("launches_per_graph") is not None:
        parts.append(f"{timing['launches_per_graph']} launches per graph")
    if timing.get("replays") is not None:
        parts.append(f"median of {timing['replays']} replays")
    l2 = timing.get("l2")
    parts.append(f"L2 {l2}" if l2 is not None else "L2 state not recorded")
    if timing.get("rounds") is not None:  # a bench: each row's lowest median of its interleaved rounds
        parts.append(f"lowest of {timing['rounds']} rounds")
    extra = sorted(set(timing) - {"method", "launches_per_graph", "replays", "l2", "rounds"})
    parts += [f"{k}={timing[k]}" for k in extra]
    return ", ".join(parts)


def _describe_versions(versions: Mapping[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(versions.items())) if versions else "not recorded"


def _read_json(path: Path) -> Any:
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def collect(results_dir: str | Path = "results", storage: str | None = None,
            database: str | Path | None = None, bench: str | Path | None = None,
            min_importance_trials: int = 8) -> ReportData:
    """Read every input that exists and compute what the report shows.

    `storage`: an optuna storage URL or file; by default every SQLite or journal file directly in
    `results_dir`. `database`, `bench`: default `results_dir/best_configs.json`, `results_dir/bench.json`.
    """
    results_dir = Path(results_dir)
    sources: dict[str, str] = {}
    missing: list[str] = []

    # optuna storage(s)
    specs = [storage] if storage else [str(p) for p in find_storages(results_dir)]
    raw_studies: list[optuna.Study] = []
    if not specs:
        missing.append(f"optuna storage: none found in {shown(results_dir)}/ (give --storage); "
                       "no per-study history, parallel coordinates, importance or failure counts")
    for spec in specs:
        try:
            found = load_studies(open_for_reading(spec))
        except Exception as exc:  # an unreadable storage is reported, the rest of the report still builds
            missing.append(f"optuna storage {shown(spec)}: could not be read ({type(exc).__name__}: {exc})")
            continue
        sources[f"optuna storage {shown(spec)}"] = f"{len(found)} studies"
        raw_studies += found
    raw_studies, superseded = current_and_superseded(raw_studies)
    archs = {str(s.user_attrs.get("arch")) for s in raw_studies if s.user_attrs.get("arch")}

    # database
    db_path = Path(database) if database else results_dir / DEFAULT_DATABASE
    db = None
    if db_path.is_file():
        try:
            db = _read_json(db_path)
            entries = db.get("entries", []) if isinstance(db, Mapping) else db
            archs |= {str(e.get("arch")) for e in entries if isinstance(e, Mapping) and e.get("arch")}
        except (OSError, ValueError, AttributeError, TypeError) as exc:
            missing.append(f"best-config database {shown(db_path)}: could not be read ({exc})")
            db = None
    else:
        missing.append(f"best-config database {shown(db_path)}: not found; no table of best configurations")

    # bench
    bench_path = Path(bench) if bench else results_dir / DEFAULT_BENCH
    records: list[Mapping] = []
    bench_data = None
    if bench_path.is_file():
        try:
            bench_data = _read_json(bench_path)
            records = bench_records(bench_data)
            sources[f"bench {shown(bench_path)}"] = f"{len(records)} rows" + (
                f", {len(bench_data['training_rows'])} training rows"
                if isinstance(bench_data, Mapping) and isinstance(bench_data.get("training_rows"), list) else "") + (
                f", run {bench_data['date']}" if isinstance(bench_data, Mapping) and bench_data.get("date")
                else "")
        except (OSError, ValueError) as exc:
            missing.append(f"bench results {shown(bench_path)}: could not be read ({exc})")
    else:
        missing.append(f"bench results {shown(bench_path)}: not found; the per-shape comparison uses the "
                       "times measured during the searches")
    archs |= {str(r.get("arch")) for r in records if r.get("arch")}
    if isinstance(bench_data, Mapping) and bench_data.get("arch"):
        archs.add(str(bench_data["arch"]))

    fingerprints = current_fingerprints(a for a in archs if a != "unknown")
    summaries = []
    for raw in raw_studies:
        try:
            summaries.append(summarize_study(raw, fingerprints, min_importance_trials))
        except MALFORMED as exc:  # one malformed study must not take the report down
            missing.append(f"study {raw.study_name}: skipped ({type(exc).__name__}: {exc})")
    studies = sorted(summaries,
                     key=lambda s: _row_sort_key(ShapeRow(s.arch, device_name(s.device), s.problem, "", "",
                                                          {})) + (s.name,))
    best_rows: list[BestConfigRow] = []
    if db is not None:
        try:
            best_rows = best_config_rows(db, fingerprints, notes=missing)
            sources[f"best-config database {shown(db_path)}"] = f"{len(best_rows)} entries"
        except ValueError as exc:
            missing.append(f"best-config database {shown(db_path)}: {exc}")

    run = bench_data if isinstance(bench_data, Mapping) else {}
    shape_rows = merge_rows(rows_from_bench(records, run, notes=missing), rows_from_studies(studies))
    training = training_rows(run, notes=missing)

    timing_set = {describe_timing(s.timing) for s in studies}
    if bench_data is not None:
        bench_t = bench_timing(bench_data) or next(
            (dict(r["timing"]) for r in records if isinstance(r.get("timing"), Mapping)), {})
        timing_set.add(describe_timing(bench_t) + " (bench)" if bench_t else
                       "bench: timing method not recorded in bench.json")
    devices = sorted({device_name(s.device) for s in studies} | {r.device for r in shape_rows}
                     | {r.device for r in best_rows})
    version_set = {_describe_versions(s.versions) for s in studies} | {
        _describe_versions(r.versions) for r in best_rows}
    if isinstance(bench_data, Mapping) and isinstance(bench_data.get("versions"), Mapping):
        version_set.add(_describe_versions(bench_data["versions"]) + " (bench)")
    version_set = sorted(version_set)

    notes: list[str] = []
    all_archs = archs | {s.arch for s in studies} | {r.arch for r in shape_rows} | {r.arch for r in best_rows}
    if "sm100" in all_archs:
        notes.append("sm100 (Blackwell) data appears below: our sm100 kernel has never run on hardware "
                     "(no Blackwell GPU was available). Any sm100 entry is compile-checked only; treat its "
                     "numbers as untested.")
    if isinstance(bench_data, Mapping) and bench_data.get("kernel_fingerprint") and bench_data.get("arch"):
        bench_fp = fingerprint_state(bench_data["kernel_fingerprint"], fingerprints.get(str(bench_data["arch"])))
        if bench_fp == "stale":
            notes.append("the bench results were measured with kernel sources that differ from the current "
                         "ones (re-run fa4tune bench).")
    stale = [s.name for s in studies if s.fingerprint_state == "stale"]
    stale_db = [r for r in best_rows if r.fingerprint_state == "stale"]
    if stale or stale_db:
        notes.append(f"{len(stale)} studies and {len(stale_db)} best-config entries were measured with kernel "
                     "sources that differ from the current ones (stale: re-tune before trusting them).")
    study_timings = {describe_timing(s.timing) for s in studies}
    if len(study_timings) > 1:
        notes.append("the searches used different timing methods or L2 states; compare within one only.")

    data = ReportData(
        generated=_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        sources=sources, missing=missing, studies=studies,
        superseded=sorted(s.study_name for s in superseded), shape_rows=shape_rows,
        heatmaps=speedup_heatmaps(shape_rows), dispatch=dispatch_rows(shape_rows), training=training,
        best_configs=best_rows, timing=sorted(timing_set),
        devices=devices, versions=version_set, warnings=notes, fingerprints=fingerprints)
    _portable_notes(data, results_dir)
    return data


def _portable_notes(data: ReportData, results_dir: Path) -> None:
    """Every note of the report without an absolute path (`fa4tune.workers.outcomes.portable_note`; paths
    below `results_dir` become `<results>/...`): the missing inputs, the warnings, each failed
    implementation's error (forward and training pass), each study's peer errors and importance note."""
    def note(text: Any) -> str:
        return portable_note(str(text), results_dir)

    def entry(value: Any) -> Any:
        return {**value, "error": note(value["error"])} if isinstance(value, Mapping) and "error" in value else value

    data.missing = [note(line) for line in data.missing]
    data.warnings = [note(line) for line in data.warnings]
    for row in data.shape_rows:
        row.impls = {impl: entry(e) for impl, e in row.impls.items()}
    for row in data.training:
        row.error = note(row.error) if row.error else None
    for study in data.studies:
        study.peers = {peer: entry(result) for peer, result in study.peers.items()}
        study.importance_note = note(study.importance_note)
