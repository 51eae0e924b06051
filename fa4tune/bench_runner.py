"""`fa4tune bench`: the tuned configuration, the default configuration and every peer, side by side.

Every number comes from the same worker processes and the same timing method (`fa4tune.timing`) in
one run, and every configuration of ours is validated before it is timed. This is how performance is
reported everywhere (README, report).

Output file (JSON, default `bench.json` in the results directory, `fa4tune.paths`; `--csv` writes the
rows as CSV too):

    {"schema": 1, "date", "arch", "device" {"name", "sm_count", "driver", "cc"}, "versions",
     "kernel_fingerprint", "timing" {"method", "launches_per_graph", "replays", "l2"},
     "rows": [ {row}, ... ]}

One row per (shape, variant):
    shape       the shape key (`fa4tune.shapes.shape_key`), problem: AttentionProblem fields
    variant     "tuned" | "default" | a peer (`fa4tune.peers.PEER_NAMES`)
    outcome     "ok" or the failure class (`fa4tune.outcomes`; "missing" for a tuned row with no
                usable database entry)
    us, tflops  GPU time and rate (null unless ok)
    speedup_of_tuned   this row's us / the tuned row's us (how much faster tuned is; null if either
                is missing)
    config      knob values (ours only), lookup: "exact" | "nearest" | "default" (tuned row: how the
                database answered), db_key (the entry used), max_err, error
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Optional

from fa4.files import atomic_write
from fa4.kernels import AttentionProblem, Config
from fa4tune.environment import kernel_api, kernel_fingerprint, utc_now, versions
from fa4tune.progress import Progress
from fa4tune.shapes import shape_key
from fa4tune.outcomes import MISSING
from fa4tune.peers import PEER_NAMES
from fa4tune.timing import TimingSettings
from fa4tune.pool import DEFAULT_EVALUATOR, WorkerPool

BENCH_SCHEMA = 1
CSV_FIELDS = ("shape", "variant", "outcome", "us", "tflops", "speedup_of_tuned", "lookup", "db_key",
              "max_err", "config", "error")


def run_bench(arch: str, problems: list[AttentionProblem], *, db_path: Optional[str] = None,
              timing: TimingSettings = TimingSettings(), peers=PEER_NAMES,
              gpus=(0,), processes: int = 4, evaluator: str = DEFAULT_EVALUATOR, api: str = "fa4.kernels",
              trial_timeout_s: float = 60.0, compile_timeout_s: float = 300.0,
              progress: Optional[Progress] = None) -> dict:
    """Measure every variant of every problem; returns the document described above."""
    from fa4.database import BestConfigDB

    progress = progress or Progress()
    kernels = kernel_api(api)
    fingerprint = kernel_fingerprint(arch, api)
    db = BestConfigDB.load(db_path)
    rows: list[dict] = []
    tasks: dict[int, dict] = {}
    with WorkerPool(processes, list(gpus), evaluator=evaluator, mode="gpu", arch=arch,
                    trial_timeout_s=trial_timeout_s, compile_timeout_s=compile_timeout_s) as pool:
        device = pool.device
        for problem in problems:
            key = shape_key(arch, problem)
            base = {"shape": key, "problem": problem.to_dict()}
            lookup = db.lookup(arch, device.get("name", ""), problem, fingerprint)
            variants = []
            if lookup.entry is not None:
                variants.append(("tuned", Config.from_dict(arch, lookup.entry.config),
                                 {"lookup": lookup.kind, "db_key": lookup.entry.key}))
            else:
                rows.append({**base, "variant": "tuned", "outcome": MISSING, "lookup": lookup.kind,
                             "error": "no usable database entry"
                                      + (f" ({len(lookup.stale)} stale)" if lookup.stale else "")})
            variants.append(("default", kernels.default_config(arch, problem), {}))
            for variant, config, extra in variants:
                reasons = kernels.feasible(config, problem)
                row = {**base, "variant": variant, "config": config.to_dict(), **extra}
                if reasons:
                    rows.append({**row, "outcome": "infeasible", "error": "; ".join(reasons)})
                    continue
                payload = {"arch": arch, "config": config.to_dict(), "problem": problem.to_dict(),
                           "timing": timing.to_dict(), "validate": True}
                tasks[pool.submit("trial", payload, compile_key=kernels.compile_key(config, problem))] = row
            if peers:
                tasks[pool.submit("peers", {"problem": problem.to_dict(), "timing": timing.to_dict(),
                                            "names": list(peers)})] = {**base, "variant": "peers"}
        while tasks:
            for task_id, result in pool.poll(timeout=1.0):
                row = tasks.pop(task_id)
                if row["variant"] == "peers":
                    for name in peers:
                        data = (result.get("peers") or {}).get(name) or {"error": result.get("error", "failed")}
                        ok = "us" in data
                        rows.append({"shape": row["shape"], "problem": row["problem"], "variant": name,
                                     "outcome": "ok" if ok else "launch_error", "us": data.get("us"),
                                     "tflops": data.get("tflops"), "max_err": data.get("max_err"),
                                     "error": data.get("error")})
                else:
                    rows.append({**row, "outcome": result["outcome"], "us": result.get("us"),
                                 "tflops": result.get("tflops"), "max_err": result.get("max_err"),
                                 "error": result.get("error")})
                progress.detail(f"bench {row['shape']} {row['variant']}: {result.get('outcome')}")
    order = {"tuned": 0, "default": 1, **{p: 2 + i for i, p in enumerate(peers)}}
    rows.sort(key=lambda r: ([shape_key(arch, p) for p in problems].index(r["shape"]), order.get(r["variant"], 99)))
    _speedups(rows)
    return {"schema": BENCH_SCHEMA, "date": utc_now(), "arch": arch, "device": device,
            "versions": versions(), "kernel_fingerprint": fingerprint, "timing": timing.describe(),
            "rows": rows}


def _speedups(rows: list[dict]) -> None:
    tuned = {r["shape"]: r.get("us") for r in rows if r["variant"] == "tuned" and r.get("outcome") == "ok"}
    for r in rows:
        t = tuned.get(r["shape"])
        r["speedup_of_tuned"] = round(r["us"] / t, 3) if t and r.get("us") else None
        for key in ("us", "tflops", "max_err", "error", "config", "lookup", "db_key"):
            r.setdefault(key, None)


def write_bench(doc: dict, path: str | Path, csv_path: str | Path | None = None) -> None:
    """The document as JSON (sorted keys), and its rows as CSV when asked; both written atomically."""
    atomic_write(path, json.dumps(doc, indent=2, sort_keys=True) + "\n")
    if csv_path is not None:
        text = io.StringIO(newline="")
        writer = csv.DictWriter(text, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for row in doc["rows"]:
            out = {k: row.get(k) for k in CSV_FIELDS}
            out["config"] = Config.from_dict(doc["arch"], row["config"]).label() if row.get("config") else ""
            writer.writerow(out)
        atomic_write(csv_path, text.getvalue())
