"""`fa4tune bench`: the tuned configuration, the default configuration and every peer, side by side.

Every number comes from the same worker processes and the same timing method (`fa4tune.workers.timing`) in
one run, and every configuration of ours is validated before it is timed. This is how performance is
reported everywhere (README, docs/measurements.md, report).

Rounds: every row is timed `rounds` times (`--rounds`, default 2), in interleaved rounds: round r+1 is
submitted once every task of round r has started, odd rounds in reverse order, so a transient (GPU clocks, power,
a compile on the host) hits one round of a row, not all of them, and no row always follows the same
neighbour (in a held-out run with one order, the dispatched row, timed right after the peers, was 2-4 %
slower than the default row on two shapes where both ran the same configuration); a repeat reuses the worker's compiled
kernel (`fa4tune.workers.pool` routes a compile key to the worker that holds it). A row's `us` is the lowest of
its rounds' medians: a transient only ever slows a measurement down, so the lowest is the best
estimate of the kernel's time (the estimator of the search's re-time step, `fa4tune.searches.retime`). In a
single-round run on an H200 (a compile running on the host), one kernel was timed 442.2 and 521.7 us
as two rows of a shape.

Parts (`--shapes-per-part N`): the shapes N at a time, each part's rounds interleaved within it, the
file written after each part, so a run cut short (a 10-minute device call) keeps the shapes it
finished; `--resume` keeps the shapes a file of the same settings holds (`resumable`: architecture,
GPU model, rounds, pass, L2 state, kernel fingerprint) and times the rest, and the document then
lists the earlier runs' dates in "resumed".

Output file (JSON, default `bench.json` in the results directory, `fa4tune.paths`; `--csv` writes the
rows as CSV too):

    {"schema": 1, "date", "arch", "device" {"name", "sm_count", "driver", "cc"}, "versions",
     "kernel_fingerprint", "timing" {"method", "launches_per_graph", "replays", "l2", "rounds"},
     "rows": [ {row}, ... ]}

One row per (shape, variant):
    shape       the shape key (`fa4tune.inputs.shapes.shape_key`), problem: AttentionProblem fields
    variant     "tuned" | "default" | a peer (`fa4.backends.peer_names()`) | "dispatched": `fa4.attention`
                itself, called in a worker with the database the bench reads (fastest-backend dispatch
                included); its `us` is GPU time by CUDA-graph replay like every row's (graph mode), and
                it adds `backend` ({"eager", "graph"}: what ran, as fa4.explain says)
    outcome     "ok" or the failure class (`fa4tune.workers.outcomes`; "missing" for a tuned row with no
                usable database entry, its error saying why: stale, unusable, too far, another GPU)
    us, tflops  GPU time and rate (null unless ok): the round with the lowest median
    us_rounds   every round's us, in round order (null for a round that failed; the whole field null on
                a row never timed: missing, infeasible). A row that failed in any round keeps the
                failure (outcome and error of the first failing round): another round's success never
                hides it
    eager_us    wall time per back-to-back eager call (`fa4tune.workers.timing.time_eager`: the larger of host
                and GPU time per call), the eager counterpart of `us`, so the dispatch bar can be checked
                in both modes from one run. On a "dispatched" row: fa4.attention as a user calls it. On
                a peer row: the peer called as the runtime calls it (the call its `us` times). On ours:
                only the row fa4.attention runs (the tuned row, else the default: `report_data`'s
                rule), timed as fa4.attention forced to our kernel (backend="ours"), so it includes the
                runtime's host work as the dispatched row's does; the other row of ours has none.
                null where not measured. The lowest over rounds, every round's in `eager_us_rounds`
    speedup_of_tuned   this row's us / the tuned row's us (how much faster tuned is; null if either
                is missing)
    kv_expanded true on a SDPA row timed on K and V expanded to the query heads (the backend refused
                GQA); left out of the times `fa4tune db import-bench` records for dispatch
    max_err     the largest over rounds (every round validates)
    config      knob values (ours only), lookup: "exact" | "nearest" | "default" (tuned row: how the
                database answered), db_key (the entry used), max_err, error (why a row failed; a bench
                file is committed and shared, so no absolute path: `fa4tune.workers.outcomes.portable_note`)

    training_rows  with `backward=True` (`fa4tune bench --backward`): per shape and implementation
                ("fa4": fa4.attention, its forward and the backward `fa4.backward` chooses, and every
                peer through autograd), {"shape", "problem", "implementation", "outcome", "fwdbwd_us",
                "bwd_us" (GPU time by CUDA-graph replay, the lowest over rounds; every round's in
                "bwd_us_rounds"), "bwd_peak_extra_mib", "validated", "backward" (fa4: which
                backward ran), "kv_expanded", "error"} (`fa4tune.workers.training`)
    dispatch    {shape: {"eager" | "graph": {"backend", "ratio", "reason"}}}: the implementation
                fastest-backend dispatch picks from this run's times (`dispatched`); the "dispatched"
                rows show what fa4.attention ran, which follows the database's times
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from fa4 import backends
from fa4.config_text import display_label
from fa4.files import atomic_write
from fa4.kernels import AttentionProblem, Config
from fa4tune.environment import kernel_api, kernel_fingerprint, utc_now, versions
from fa4tune.progress import Progress
from fa4tune.inputs.shapes import shape_key
from fa4tune.workers.outcomes import MISSING, portable_note
from fa4tune.workers.timing import TimingSettings
from fa4tune.workers.pool import DEFAULT_EVALUATOR, WorkerPool
from fa4tune.workers.training import FA4 as TRAINING_FA4

BENCH_SCHEMA = 1
CSV_FIELDS = ("shape", "variant", "outcome", "us", "eager_us", "backend", "tflops", "speedup_of_tuned",
              "lookup", "db_key", "max_err", "config", "error", "us_rounds")
DISPATCHED = "dispatched"
POLL_S = 1.0
ROUNDS = 2  # rounds per row (`--rounds`)


@dataclass(frozen=True)
class _Task:
    """One task of a round: what `WorkerPool.submit` gets, and the row its result fills."""
    kind: str
    payload: dict
    row: dict
    compile_key: object = None


def run_bench(arch: str, problems: list[AttentionProblem], *, db_path: Optional[str] = None,
              timing: TimingSettings = TimingSettings(), peers: Optional[tuple] = None,
              gpus=(0,), processes: int = 4, evaluator: str = DEFAULT_EVALUATOR, api: str = "fa4.kernels",
              trial_timeout_s: float = 60.0, compile_timeout_s: float = 300.0,
              progress: Optional[Progress] = None, time_dispatched: bool = True, rounds: int = ROUNDS,
              backward: bool = False, shapes_per_part: int = 0, partial: Optional[Callable[[dict], None]] = None,
              previous: Optional[dict] = None) -> dict:
    """Measure every variant of every problem `rounds` times; returns the document described above.
    `peers`: the peers to time (None: every one, `fa4.backends.peer_names()`).

    `shapes_per_part` > 0 runs the problems that many at a time (each part's rounds interleaved within
    it) and hands `partial` the document so far after each part, so a run cut short keeps the shapes it
    finished. `previous`: such a document of this run's settings (`resumable`); its shapes are kept as
    they are and not timed again."""
    from fa4.database import BestConfigDB

    if rounds < 1:
        raise ValueError(f"a bench needs at least one round, not {rounds}")
    peers = backends.peer_names() if peers is None else tuple(peers)
    progress = progress or Progress()
    kernels = kernel_api(api)
    fingerprint = kernel_fingerprint(arch, api)
    # what fa4.attention reads: the layers (or the one file --db names), with its lookup rules
    db = BestConfigDB.load(db_path) if db_path is not None else BestConfigDB.load_layers()
    for layer, path, error in db.errors:
        progress.message(f"bench: the {layer} database {path} cannot be read ({error}); its entries are left out")
    unusable = db.unusable_entries(kernels.feasible)
    for (layer, key), reasons in unusable.items():
        progress.message(f"bench: entry {key}{f' ({layer})' if layer else ''} cannot be used: {'; '.join(reasons)}")
    keys = [shape_key(arch, p) for p in problems]
    rows: list[dict] = []
    training_rows: list[dict] = []
    kept = set()
    if previous is not None:
        kept = {r["shape"] for r in previous["rows"]} & set(keys)
        rows += [r for r in previous["rows"] if r["shape"] in kept]
        training_rows += [r for r in previous.get("training_rows", []) if r["shape"] in kept]
        progress.message(f"bench: {len(kept)} of {len(keys)} shape(s) kept from the run resumed")
    todo = [p for p, key in zip(problems, keys) if key not in kept]
    step = shapes_per_part if shapes_per_part > 0 else max(len(todo), 1)
    ours_eager: dict[str, list[Optional[float]]] = {}  # shape -> ours' eager us per round, from its dispatched task

    def document(device: dict) -> dict:
        order = {"tuned": 0, "default": 1, **{p: 2 + i for i, p in enumerate(peers)}, DISPATCHED: 2 + len(peers)}
        rows.sort(key=lambda r: (keys.index(r["shape"]), order.get(r["variant"], 99)))
        training_rows.sort(key=lambda r: keys.index(r["shape"]))
        _ours_eager(rows, ours_eager)
        _speedups(rows)
        for r in rows:   # whoever made the note: a worker, a peer's import, the database's reasons
            if r["error"]:
                r["error"] = portable_note(r["error"])
        return {"schema": BENCH_SCHEMA, "date": utc_now(), "arch": arch, "device": device,
                "versions": versions(), "kernel_fingerprint": fingerprint,
                "timing": {**timing.describe(), "rounds": rounds}, "rows": [dict(r) for r in rows],
                "dispatch": dispatched(rows, device.get("name", "")),
                **({"training_rows": [dict(r) for r in training_rows]} if backward else {}),
                **({"resumed": [*previous.get("resumed", []), previous["date"]]} if previous is not None else {})}

    with WorkerPool(processes, list(gpus), evaluator=evaluator, mode="gpu", arch=arch,
                    trial_timeout_s=trial_timeout_s, compile_timeout_s=compile_timeout_s) as pool:
        device = pool.device
        context = _BenchContext(arch, db, device, fingerprint, unusable, kernels, timing, peers, backward,
                                time_dispatched, db_path)
        for start in range(0, len(todo), step):
            specs: list[_Task] = []  # one round's tasks, in submission order
            for problem in todo[start:start + step]:
                rows += _shape_tasks(context, problem, specs)
            results = _run_rounds(pool, specs, rounds, progress)
            for spec, outs in zip(specs, results):
                row = spec.row
                if spec.kind == "training":
                    training_rows.extend(_training_row(row, name, outs) for name in [TRAINING_FA4, *peers])
                    continue
                if spec.kind == "peers":
                    rows.extend(_lowest([_peer_row(row, name, result) for result in outs]) for name in peers)
                    continue
                rows.append(_lowest([_task_row(row, result) for result in outs]))
                if spec.kind == DISPATCHED:
                    ours_eager[row["shape"]] = [result.get("ours_eager_us") for result in outs]
                    failed = next((result["ours_eager_error"] for result in outs if result.get("ours_eager_error")),
                                  None)
                    if failed:
                        progress.message(f"bench {row['shape']}: fa4.attention forced to our kernel "
                                         f"could not be timed eagerly ({failed})")
            if partial is not None and start + step < len(todo):
                partial(document(device))
    return document(device)


def resumable(previous: dict, arch: str, device_name: str, rounds: int, backward: bool, l2: str) -> list[str]:
    """Why a bench document cannot be resumed by a run of these settings (empty: it can): another
    architecture, GPU model, round count, pass or L2 state, or kernel sources (`kernel_fingerprint`)."""
    why = []
    found = {"arch": previous.get("arch"), "GPU": (previous.get("device") or {}).get("name"),
             "rounds": (previous.get("timing") or {}).get("rounds"), "backward": "training_rows" in previous,
             "L2": (previous.get("timing") or {}).get("l2"), "kernels": previous.get("kernel_fingerprint")}
    wanted = {"arch": arch, "GPU": device_name, "rounds": rounds, "backward": backward, "L2": l2,
              "kernels": kernel_fingerprint(arch)}
    for name, value in wanted.items():
        if found[name] != value:
            why.append(f"{name} {found[name]!r}, this run's {value!r}")
    return why


@dataclass(frozen=True)
class _BenchContext:
    """What every shape's tasks of one bench run share (`run_bench`'s settings, the database it reads,
    the workers' GPU)."""
    arch: str
    db: object                  # fa4.database.BestConfigDB
    device: dict
    fingerprint: str
    unusable: dict              # (layer, key) -> why the entry cannot be used
    kernels: object             # the kernel API (`kernel_api`)
    timing: TimingSettings
    peers: tuple
    backward: bool
    time_dispatched: bool
    db_path: Optional[str]


def _shape_tasks(context: _BenchContext, problem: AttentionProblem, specs: list) -> list[dict]:
    """A shape's tasks, appended to `specs` (tuned and default configurations, peers, training pass,
    dispatched), and the rows it gets without a task (no usable entry, infeasible)."""
    from fa4.database import entry_key, max_distance

    arch, db, device, kernels, timing, peers = (context.arch, context.db, context.device, context.kernels,
                                                context.timing, context.peers)
    unusable = context.unusable

    key = shape_key(arch, problem)
    base = {"shape": key, "problem": problem.to_dict()}
    rows = []
    lookup = db.lookup(arch, device.get("name", ""), problem, context.fingerprint, max_distance=max_distance(),
                       broken=frozenset(unusable))
    variants = []
    if lookup.entry is not None:
        variants.append(("tuned", Config.from_dict(arch, lookup.entry.config),
                         {"lookup": lookup.kind, "db_key": lookup.entry.key}))
    else:
        why = [f"{len(lookup.stale)} stale"] if lookup.stale else []
        why += [f"{k} skipped: {'; '.join(r)}" for (_, k), r in unusable.items()
                if k == entry_key(arch, device.get("name", ""), problem)]
        why += list(lookup.passed_over)
        rows.append({**base, "variant": "tuned", "outcome": MISSING, "lookup": lookup.kind,
                     "error": "no usable database entry" + (f" ({'; '.join(why)})" if why else "")})
    variants.append(("default", kernels.default_config(arch, problem), {}))
    for variant, config, extra in variants:
        reasons = kernels.feasible(config, problem)
        row = {**base, "variant": variant, "config": config.to_dict(), **extra}
        if reasons:
            rows.append({**row, "outcome": "infeasible", "error": "; ".join(reasons)})
            continue
        payload = {"arch": arch, "config": config.to_dict(), "problem": problem.to_dict(),
                   "timing": timing.to_dict(), "validate": True}
        specs.append(_Task("trial", payload, row, kernels.compile_key(config, problem)))
    # The shape's runtime tasks compile inside the GPU lock, on first call (a peer's JIT, fa4.attention's
    # forward and backward): routed to one worker, every round after the first finds them compiled
    # there, where another worker would compile them again with the GPU held.
    same_worker = ("runtime", key)
    if peers:
        specs.append(_Task("peers", {"problem": problem.to_dict(), "timing": timing.to_dict(),
                                     "names": list(peers), "eager": True}, {**base, "variant": "peers"},
                           same_worker))
    if context.backward:
        specs.append(_Task("training", {"problem": problem.to_dict(), "timing": timing.to_dict(),
                                        "names": [TRAINING_FA4, *peers]}, {**base, "variant": "training"},
                           same_worker))
    if context.time_dispatched:
        specs.append(_Task(DISPATCHED, {"problem": problem.to_dict(), "timing": timing.to_dict(),
                                        "db_path": context.db_path}, {**base, "variant": DISPATCHED}, same_worker))
    return rows


def _run_rounds(pool: WorkerPool, specs: list[_Task], rounds: int, progress: Progress) -> list[list[dict]]:
    """Run every task `rounds` times on the pool; each task's result per round, in round order.

    Round r+1 is submitted once every task of round r has started (a worker took it), not before: a
    worker runs the tasks routed to it (same compile key) ahead of the common queue, so submitting
    all rounds at once would run a kernel's repeat before other rows' first round. Waiting only for
    the start, not the end, keeps every worker busy across the boundary."""
    results: list[list[Optional[dict]]] = [[None] * rounds for _ in specs]
    tasks: dict[int, tuple[int, int]] = {}  # task id -> (spec index, round)

    def submit(r: int) -> set[int]:
        ids = set()
        order = range(len(specs)) if r % 2 == 0 else reversed(range(len(specs)))
        for index in order:
            spec = specs[index]
            task_id = pool.submit(spec.kind, spec.payload, compile_key=spec.compile_key)
            tasks[task_id] = (index, r)
            ids.add(task_id)
        return ids

    current, submitted = submit(0), 1
    while tasks or submitted < rounds:
        for task_id, result in (pool.poll(timeout=POLL_S) if tasks else []):
            index, r = tasks.pop(task_id)
            results[index][r] = result
            row = specs[index].row
            progress.detail(f"bench {row['shape']} {row['variant']} round {r + 1}/{rounds}: {result.get('outcome')}")
        if submitted < rounds:
            running = {task_id for task_id, _, _ in pool.busy_tasks()}
            if all(task_id in running or task_id not in tasks for task_id in current):
                current, submitted = submit(submitted), submitted + 1
    return results


def _task_row(row: dict, result: dict) -> dict:
    """The row a trial or dispatched task's result makes (one round)."""
    extra = {}
    if row["variant"] == DISPATCHED:
        extra = {"eager_us": result.get("eager_us"), "backend": result.get("backend"), "config": result.get("config")}
    return {**row, "outcome": result["outcome"], "us": result.get("us"), "tflops": result.get("tflops"),
            "max_err": result.get("max_err"), "error": result.get("error"), **extra}


def _peer_row(row: dict, name: str, result: dict) -> dict:
    """The row of one peer of a peers task's result (one round)."""
    data = (result.get("peers") or {}).get(name) or {"error": result.get("error", "failed")}
    ok = "us" in data
    return {"shape": row["shape"], "problem": row["problem"], "variant": name,
            "outcome": "ok" if ok else "launch_error", "us": data.get("us"), "eager_us": data.get("eager_us"),
            "tflops": data.get("tflops"), "max_err": data.get("max_err"), "error": data.get("error"),
            **({"kv_expanded": True} if data.get("kv_expanded") else {})}


def _training_row(row: dict, name: str, per_round: list[dict]) -> dict:
    """One implementation's training row from a training task's rounds: the round with the lowest
    backward time, every round's in `bwd_us_rounds`; a round that failed wins, as in `_lowest`."""
    rounds = [(r.get("training") or {}).get(name) or {"error": r.get("error", "failed")} for r in per_round]
    failed = next((r for r in rounds if "bwd_us" not in r), None)
    best = failed or min(rounds, key=lambda r: r["bwd_us"])
    return {"shape": row["shape"], "problem": row["problem"], "implementation": name,
            "outcome": "launch_error" if failed else "ok", "bwd_us_rounds": [r.get("bwd_us") for r in rounds],
            **{key: best.get(key) for key in ("bwd_us", "bwd_peak_extra_mib", "validated", "backward",
                                             "kv_expanded", "error")},
            "fwdbwd_us": None if failed else min(r["fwdbwd_us"] for r in rounds)}


def _lowest(per_round: list[dict]) -> dict:
    """One row from a row's rounds: the round with the lowest median (its us, tflops, backend), every
    round's us in `us_rounds`, the lowest eager time over rounds (every round's in `eager_us_rounds`)
    and the largest error. A transient only ever slows a measurement down, so the lowest is the best
    estimate of what the kernel costs (`fa4tune.searches.retime` records the same). A round that failed wins
    over every success: the row keeps the first failing round's outcome and error."""
    failed = next((r for r in per_round if r.get("outcome") != "ok"), None)
    timed = [r for r in per_round if r.get("us") is not None]
    row = dict(failed or (min(timed, key=lambda r: r["us"]) if timed else per_round[0]))
    row["us_rounds"] = [r.get("us") for r in per_round]
    eager = [r.get("eager_us") for r in per_round]
    if any(e is not None for e in eager):
        row["eager_us_rounds"] = eager
        if failed is None:
            row["eager_us"] = min(e for e in eager if e is not None)
    errors = [r["max_err"] for r in per_round if r.get("max_err") is not None]
    if failed is None and errors:
        row["max_err"] = max(errors)
    return row


def dispatched(rows: list[dict], device_name: str) -> dict[str, dict[str, dict]]:
    """{shape: {mode: {"backend", "ratio", "reason"}}}: what fastest-backend dispatch (`fa4.dispatch`)
    picks from this run's times, "ours" being what fa4.attention runs (the tuned row, else the
    default), with the host time per call measured on this GPU model (eager mode)."""
    from fa4 import dispatch

    host = dispatch.host_us(device_name)
    times: dict[str, dict[str, float]] = {}
    for r in rows:
        if r.get("outcome") != "ok" or r.get("us") is None or r.get("kv_expanded"):
            continue
        name = {"tuned": "ours", "default": "default"}.get(r["variant"], r["variant"])
        times.setdefault(r["shape"], {})[name] = float(r["us"])
    out = {}
    for shape, measured in times.items():
        ours = measured.pop("ours", measured.pop("default", None))
        measured.pop("default", None)
        if ours is None:
            continue
        choices = [dispatch.choose({"ours": ours, **measured}, host, mode) for mode in dispatch.MODES]
        out[shape] = {c.mode: {"backend": c.backend, "ratio": round(c.ratio, 3), "reason": c.reason}
                      for c in choices}
    return out


def _ours_eager(rows: list[dict], ours_eager: dict[str, list[Optional[float]]]) -> None:
    """Give the row of ours that fa4.attention runs (the tuned row when it ran, else the default:
    `report_data.dispatch_rows`' rule) the eager time measured with its shape's dispatched task, the
    lowest over rounds; it is known only once every task of the shape finished."""
    tuned_ran = {r["shape"] for r in rows if r["variant"] == "tuned" and r.get("outcome") == "ok"}
    for r in rows:
        ours = "tuned" if r["shape"] in tuned_ran else "default"
        measured = [us for us in ours_eager.get(r["shape"], []) if us is not None]
        if r["variant"] == ours and r.get("outcome") == "ok" and measured:
            r["eager_us"] = min(measured)
            r["eager_us_rounds"] = ours_eager[r["shape"]]


def _speedups(rows: list[dict]) -> None:
    tuned = {r["shape"]: r.get("us") for r in rows if r["variant"] == "tuned" and r.get("outcome") == "ok"}
    for r in rows:
        t = tuned.get(r["shape"])
        r["speedup_of_tuned"] = round(r["us"] / t, 3) if t and r.get("us") else None
        for key in ("us", "eager_us", "tflops", "max_err", "error", "config", "lookup", "db_key", "us_rounds",
                    "eager_us_rounds"):
            r.setdefault(key, None)


def backend_times(doc: dict) -> dict[str, dict[str, float]]:
    """{database key: {implementation: GPU us}} of a bench document: for every shape whose tuned row
    ran an exact database entry, that row's time as "ours" and every peer that ran, all from the one
    run (`fa4.dispatch` judges the fastest backend from them)."""
    found: dict[str, dict[str, float]] = {}
    tuned = {r["shape"]: r for r in doc["rows"]
             if r["variant"] == "tuned" and r.get("outcome") == "ok" and r.get("lookup") == "exact" and r.get("db_key")}
    for r in doc["rows"]:
        row = tuned.get(r["shape"])
        if row is None or r.get("outcome") != "ok" or r.get("us") is None:
            continue
        if r["variant"] == "tuned":
            found.setdefault(row["db_key"], {})["ours"] = float(r["us"])
        elif r["variant"] in backends.peer_names() and not r.get("kv_expanded"):
            # (a SDPA backend timed on K and V expanded once, outside the timing, is not what the
            # runtime could run: it never expands per call)
            found.setdefault(row["db_key"], {})[r["variant"]] = float(r["us"])
    return found


def import_backend_times(doc: dict, db) -> tuple[list[str], list[str]]:
    """Fold a bench's per-implementation times into the entries it measured (in memory). An entry
    tuned on other kernel sources than the bench ran is left alone, and so is one the bench's values
    would make fail the database's check (a time that is not a finite number > 0). Returns (updated
    keys, skipped keys with why)."""
    import dataclasses

    from fa4.database import field_error

    updated, skipped = [], []
    for key, times in sorted(backend_times(doc).items()):
        entry = db.get(key)
        if entry is None:
            skipped.append(f"{key}: not in the database")
            continue
        if entry.kernel_fingerprint != doc.get("kernel_fingerprint"):
            skipped.append(f"{key}: tuned on kernel {entry.kernel_fingerprint}, the bench ran "
                           f"{doc.get('kernel_fingerprint')}")
            continue
        changed = dataclasses.replace(entry, backend_us=times, backend_source=f"bench {doc['date']}")
        error = field_error(changed.to_dict())
        if error:
            skipped.append(f"{key}: the bench's values fail the database's check ({error})")
            continue
        db.put(changed)
        updated.append(key)
    return updated, skipped


def read_bench(path: str | Path) -> dict:
    """A bench document from `path`; ValueError naming the file when it cannot be read or holds no
    bench output (no rows or date)."""
    try:
        with open(path, encoding="utf-8") as handle:
            doc = json.load(handle)
    except (OSError, ValueError, RecursionError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("rows"), list) or "date" not in doc:
        raise ValueError(f"{path} is not a fa4tune bench output (no rows or date)")
    return doc


def write_bench(doc: dict, path: str | Path, csv_path: str | Path | None = None) -> None:
    """The document as JSON (sorted keys), and its rows as CSV when asked; both written atomically."""
    atomic_write(path, json.dumps(doc, indent=2, sort_keys=True) + "\n")
    if csv_path is not None:
        text = io.StringIO(newline="")
        writer = csv.DictWriter(text, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for row in doc["rows"]:
            out = {k: row.get(k) for k in CSV_FIELDS}
            if row.get("backend"):
                out["backend"] = " / ".join(f"{mode} {name}" for mode, name in sorted(row["backend"].items()))
            out["config"] = display_label(doc["arch"], row["config"]) if row.get("config") else ""
            out["us_rounds"] = " ".join("" if us is None else str(us) for us in row.get("us_rounds") or [])
            writer.writerow(out)
        atomic_write(csv_path, text.getvalue())
