"""Warm start against cold start: trials a study needs to come within 1 % of the cold study's best.

    # 1. the cold studies (no seeds from tuned neighbours), and their database
    fa4tune search --shapes-file benchmarks/h200_grid.toml --trials 50 --cold-start --no-peers \
        --storage $OUT/cold.journal --db $OUT/cold.json
    # 2. the same problems warm-started, each seeded from the cold database without its own entry
    python benchmarks/warm_vs_cold.py --shapes-file benchmarks/h200_grid.toml --trials 50 \
        --cold-storage $OUT/cold.journal --seed-db $OUT/cold.json --storage $OUT/warm.journal \
        --workers 2 --out $OUT/warm_vs_cold.json

Each warm study is seeded (`fa4tune.searches.warm_start`) from the cold run's database with the problem's own
entry left out, so its seeds come from the other shapes and the other causal mode, as for a shape
nobody tuned yet. Same sampler, seed and trial budget as the cold run. A trial counts as the search
counts it (feasible, not a repeat), in trial-number order; "trials to 1 %" is the count up to and
including the first trial that reaches the cold study's best: measured within 1 % of its time, or the
very configuration the cold study measured within 1 % (two runs time one configuration up to ~1.5 %
apart on the H200, so a warm study that runs the cold study's best first has found it, whatever its
own timing says). Budget + 1 when no trial does. The rows also give the count by time alone.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import replace
from pathlib import Path

TOLERANCE = 0.01


def counted_trials(study) -> list[tuple[float | None, tuple]]:
    """(GPU µs, knob values) of each counted trial in trial-number order (µs None: feasible but
    not ok)."""
    from optuna.trial import TrialState

    out = []
    for t in sorted(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)),
                    key=lambda t: t.number):
        if "repeat_of" in t.user_attrs or t.user_attrs.get("outcome") == "infeasible":
            continue
        us = t.value if t.user_attrs.get("outcome") == "ok" else None
        out.append((us, tuple(sorted(t.params.items()))))
    return out


def trials_to_reach(trials: list[tuple[float | None, tuple]], target_us: float, budget: int,
                    reached: frozenset = frozenset()) -> int:
    """Counted trials up to and including the first measured at most `target_us` or whose knob
    values are in `reached`; budget + 1 when none is."""
    for i, (us, knobs) in enumerate(trials, start=1):
        if (us is not None and us <= target_us) or knobs in reached:
            return i
    return budget + 1


def reached_configs(trials: list[tuple[float | None, tuple]], target_us: float) -> frozenset:
    return frozenset(knobs for us, knobs in trials if us is not None and us <= target_us)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes-file", required=True)
    ap.add_argument("--cold-storage", required=True)
    ap.add_argument("--seed-db", required=True, help="the cold run's best-config database")
    ap.add_argument("--storage", required=True, help="storage for the warm studies")
    ap.add_argument("--trials", type=int, default=50)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--jobs", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--evaluator", default=None, help="a fake evaluator for a CPU dry run (tests/)")
    ap.add_argument("--kernel-api", default=None, help="with --evaluator: the CPU model of the kernel API")
    args = ap.parse_args()

    import optuna

    from fa4.database import BestConfigDB, entry_key
    from fa4tune.api import detect_gpus, problems_of, resolve_arch
    from fa4tune.workers.pool import WorkerPool
    from fa4tune.progress import Progress
    from fa4tune.searches.runner import SearchSettings, run_search, study_name_of
    from fa4tune.searches.storage import open_storage

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    problems = problems_of(shapes_file=args.shapes_file)
    fake = {"evaluator": args.evaluator, "kernel_api": args.kernel_api} if args.evaluator else {}
    gpus = [{"index": i} for i in range(args.workers)] if fake else detect_gpus()
    arch = "sm90" if fake else resolve_arch("auto", gpus, need_gpu=True)
    base = SearchSettings(trials=args.trials, seed=args.seed, gpus=[g["index"] for g in gpus[:args.workers]],
                          processes=args.jobs, peers=(), storage=args.storage, record_db=False,
                          warm_start=True, retime_rounds=0, **fake)
    progress = Progress()
    pool = WorkerPool(base.process_count(), base.gpus, evaluator=base.evaluator, mode="gpu", arch=arch,
                      compile_timeout_s=base.compile_timeout_s, trial_timeout_s=base.trial_timeout_s)
    pool.start()
    seed_db = BestConfigDB.load(args.seed_db)
    cold_storage = open_storage(args.cold_storage)
    warm_storage = open_storage(args.storage)
    rows = []
    start = time.monotonic()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for problem in problems:
                own = entry_key(arch, pool.device.get("name"), problem)
                leave_one_out = Path(tmp) / "seeds.json"
                BestConfigDB({e.key: e for e in seed_db.entries if e.key != own}).save(leave_one_out)
                name = study_name_of(arch, problem, problems, None)
                settings = replace(base, db_path=str(leave_one_out), study_name=name + "-warm")
                run_search(arch, [problem], settings, progress, pool=pool)
                cold = counted_trials(optuna.load_study(study_name=name, storage=cold_storage))
                warm = counted_trials(optuna.load_study(study_name=name + "-warm", storage=warm_storage))
                cold_best = min(us for us, _ in cold if us is not None)
                target = cold_best * (1 + TOLERANCE)
                row = {"study": name, "cold_best_us": cold_best,
                       "warm_best_us": min((us for us, _ in warm if us is not None), default=None),
                       "cold_trials": len(cold), "warm_trials": len(warm),
                       "cold_to_1pct": trials_to_reach(cold, target, args.trials),
                       "warm_to_1pct": trials_to_reach(warm, target, args.trials, reached_configs(cold, target)),
                       "warm_to_1pct_by_time": trials_to_reach(warm, target, args.trials)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        pool.close()
    cold_total = sum(r["cold_to_1pct"] for r in rows)
    warm_total = sum(r["warm_to_1pct"] for r in rows)
    warm_by_time = sum(r["warm_to_1pct_by_time"] for r in rows)
    summary = {"problems": len(rows), "trials": args.trials, "seed": args.seed, "workers": args.workers,
               "cold_to_1pct_total": cold_total, "warm_to_1pct_total": warm_total,
               "cold_over_warm": round(cold_total / warm_total, 3) if warm_total else None,
               "warm_to_1pct_by_time_total": warm_by_time,
               "warm_wall_s": round(time.monotonic() - start, 1)}
    print(f"\n{'study':<58} {'cold best':>10} {'cold n':>7} {'warm n':>7} {'by time':>8}")
    for r in rows:
        print(f"{r['study']:<58} {r['cold_best_us']:>10.2f} {r['cold_to_1pct']:>7} {r['warm_to_1pct']:>7} {r['warm_to_1pct_by_time']:>8}")
    print(json.dumps(summary))
    if args.out:
        Path(args.out).write_text(json.dumps({"summary": summary, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
