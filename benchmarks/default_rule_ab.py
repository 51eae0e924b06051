"""A/B of the sm90 default rules on the H200: today's `kernels/sm90/defaults.py` against a baseline copy of
it (an older revision, e.g. `git show REV:kernels/sm90/defaults.py > baseline.py`), shape by shape, with
the peers timed beside them:

    python benchmarks/default_rule_ab.py --baseline baseline.py \\
        --shapes "b4-s900-hq24-hkv8-d64-bf16-causal b4-s2000-hq16-hkv16-d64-bf16-causal" --out FILE

Judge a rule change on shapes it flips that neither the train nor the held-out set holds. Both
defaults are validated and timed alternately (`--rounds` rounds of CUDA-graph replay, the lowest of
each); a shape where both rule sets pick the same configuration is timed once.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys

from fa4.backends import peer_names
from fa4tune.api import DEFAULT_PROBLEM
from fa4tune.inputs.shapes import parse_shape


def load_baseline(path: str):
    """The baseline rules' module, loaded as a sibling of kernels/sm90/defaults.py (its relative
    imports resolve there)."""
    spec = importlib.util.spec_from_file_location("fa4.kernels.sm90._baseline_defaults", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", required=True, help="a copy of kernels/sm90/defaults.py to compare with")
    ap.add_argument("--shapes", required=True)
    ap.add_argument("--peers", default=",".join(peer_names()), help="comma-separated peer names")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import fa4.kernels.sm90.defaults as current
    from fa4.kernels import compiling
    from fa4tune.workers.evaluator import KernelEvaluator
    from fa4tune.workers.timing import TimingSettings

    baseline = load_baseline(args.baseline)
    evaluator = KernelEvaluator("gpu")
    device = evaluator.setup()
    timing = TimingSettings()
    rows = []
    for text in args.shapes.replace(",", " ").split():
        _, problem = parse_shape(text, DEFAULT_PROBLEM)
        configs = {"baseline": baseline.default_config(problem), "current": current.default_config(problem)}
        if configs["baseline"] == configs["current"]:
            del configs["baseline"]
        row = {"shape": text, **{f"{name}_config": c.label() for name, c in configs.items()}}
        try:
            kernels = {name: compiling.compile_attention(c, problem) for name, c in configs.items()}
            for _ in range(args.rounds):
                for name, config in configs.items():
                    result = evaluator.run_trial(kernels[name], config, problem, timing, validate=True,
                                                 perturb=False)
                    if result.get("outcome") != "ok":
                        raise RuntimeError(f"{name}: {result}")
                    row[f"{name}_us"] = min(row.get(f"{name}_us", float("inf")), result["us"])
            for name, res in evaluator.time_peers(problem, timing, [p for p in args.peers.split(",") if p]).items():
                row[f"{name}_us"] = res.get("us")
        except Exception as exc:  # a shape that cannot run is a row with its reason
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": device, "timing": timing.describe(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
