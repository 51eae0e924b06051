"""Leave-one-out check of the dispatch prediction (`fa4.prediction`) on the database's own measurements.

Each entry with measured times is hidden in turn; the prediction from the other entries names an
implementation for its shape, and the cost of that implementation there (the entry's measured times,
`fa4.dispatch.call_cost`) over the cheapest one is the loss. Printed per mode: the geometric mean, the
worst, how often the prediction was confident and how often it named the fastest. Variants of the
prediction's constants are compared with `--voters`, `--confident-distance` and `--neighbours`; the
shipped constants are the ones chosen this way on the packaged database (train shapes and the grid),
never on the held-out shapes.

    python benchmarks/prediction_loo.py --db fa4/data/best_configs.json --voters 0 3 5 7
"""

from __future__ import annotations

import argparse
import math
import sys

from fa4 import backends, dispatch, kernels, prediction
from fa4.database import BestConfigDB
from fa4.kernels import AttentionProblem


def leave_one_out(entries: list, mode: str, host: dict) -> dict:
    losses, ours_losses, confident, hits = [], [], 0, 0
    for i, hidden in enumerate(entries):
        others = [e for j, e in enumerate(entries) if j != i]
        problem = AttentionProblem(**hidden.problem)
        region = prediction.region(others, hidden.arch, hidden.device, problem)
        guess = prediction.predict(region, problem, mode, host, lambda name: True)
        chosen = guess.backend if guess else dispatch.OURS
        cost = {name: dispatch.call_cost(us, host.get(name) if host else None, mode)
                for name, us in hidden.backend_us.items()
                if mode == "graph" or not host or name in host}
        if chosen not in cost:
            continue
        losses.append(cost[chosen] / min(cost.values()))
        ours_losses.append(cost[dispatch.OURS] / min(cost.values()))
        confident += bool(guess and guess.confident)
        hits += cost[chosen] <= min(cost.values()) * (1 + dispatch.TIMING_NOISE)
    geomean = math.exp(sum(map(math.log, losses)) / len(losses)) if losses else math.nan
    ours = math.exp(sum(map(math.log, ours_losses)) / len(ours_losses)) if ours_losses else math.nan
    return {"n": len(losses), "geomean": geomean, "ours": ours, "worst": max(losses, default=math.nan),
            "confident": confident, "within_noise_of_fastest": hits}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", default="fa4/data/best_configs.json")
    parser.add_argument("--voters", type=int, nargs="*", default=[prediction.VOTERS or 0],
                        help="nearest entries that vote when not confident (0: the whole region)")
    parser.add_argument("--confident-distance", type=float, nargs="*", default=[prediction.CONFIDENT_DISTANCE])
    parser.add_argument("--neighbours", type=int, nargs="*", default=[prediction.NEIGHBOURS])
    args = parser.parse_args(argv)
    db = BestConfigDB.load(args.db)
    entries = [e for e in db.current_entries(kernels.kernel_fingerprint("sm90"))
               if dispatch.OURS in e.backend_us and len(e.backend_us) > 1]
    devices = sorted({e.device for e in entries})
    print(f"{len(entries)} entries with measured times ({', '.join(devices)}); loss = cost of the predicted "
          f"implementation / the cheapest, at the hidden entry's shape")
    for voters in args.voters:
        for confident_distance in args.confident_distance:
            for neighbours in args.neighbours:
                prediction.VOTERS = voters or None
                prediction.CONFIDENT_DISTANCE = confident_distance
                prediction.NEIGHBOURS = neighbours
                for mode in dispatch.MODES:
                    rows = [leave_one_out([e for e in entries if e.device == d], mode, dispatch.host_us(d))
                            for d in devices]
                    n = sum(r["n"] for r in rows)
                    geo = math.exp(sum(r["n"] * math.log(r["geomean"]) for r in rows) / n)
                    ours = math.exp(sum(r["n"] * math.log(r["ours"]) for r in rows) / n)
                    print(f"voters {voters or 'region':>6}  confident within {confident_distance:g}  "
                          f"neighbours {neighbours}  {mode:5s}: geomean {geo:.4f}  worst "
                          f"{max(r['worst'] for r in rows):.3f} (always ours: {ours:.4f})  confident {sum(r['confident'] for r in rows)}/{n}  "
                          f"fastest (within {dispatch.TIMING_NOISE:.0%}) {sum(r['within_noise_of_fastest'] for r in rows)}/{n}")
    print(f"implementations: {', '.join(backends.implementations())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
