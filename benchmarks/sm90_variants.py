"""Time sm90 kernel variants beside the peers, shape by shape, in one process (a development tool).

    python benchmarks/sm90_variants.py --shapes "s1024-causal b16-s1024-full" \
        --variants '{"lpt": {"scheduler": "lpt"}, "grid-lpt": {"scheduler": "single_lpt"}}' \
        [--ignore-register-model] [--out FILE]

Each variant is the default configuration of the shape with the given knobs replaced. Every variant
is validated against the fp32 reference and SDPA (the search's rule) before it is timed; the peers
(`--peers`, default every one of `fa4.backends`) are timed in the same process by the same CUDA-graph
method. Unlike
`fa4tune bench` this needs no database and compares any number of configurations; unlike a search it
runs in one process, so a faulting variant ends the run (use it on configurations that compiled).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from fa4.backends import peer_names
from fa4.kernels import AttentionProblem, Config, default_config, feasible
from fa4tune.api import DEFAULT_PROBLEM
from fa4tune.workers.evaluator import KernelEvaluator
from fa4tune.inputs.shapes import parse_shape
from fa4tune.workers.timing import TimingSettings


def compile_variant(config: Config, problem: AttentionProblem, ignore_register_model: bool):
    reasons = feasible(config, problem)
    if ignore_register_model:
        reasons = [r for r in reasons if not r.startswith("registers")]
    if reasons:
        raise ValueError("; ".join(reasons))
    from fa4.kernels import compiling  # no feasibility check of its own: the caller's rule applies
    return compiling.compile_attention(config, problem)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", required=True)
    ap.add_argument("--variants", default="{}", help="JSON {name: {knob: value}}; 'default' is always timed")
    ap.add_argument("--peers", default=",".join(peer_names()), help="comma-separated peer names")
    ap.add_argument("--ignore-register-model", action="store_true",
                    help="compile configurations the register model rejects (to calibrate it)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    variants = {"default": {}, **json.loads(args.variants)}
    peers = [p for p in args.peers.split(",") if p]
    evaluator = KernelEvaluator("gpu")
    device = evaluator.setup()
    timing = TimingSettings()
    rows = []
    for text in args.shapes.replace(",", " ").split():
        _, problem = parse_shape(text, DEFAULT_PROBLEM)
        base = default_config("sm90", problem)
        for name, overrides in variants.items():
            row = {"shape": text, "variant": name}
            try:
                config = base.replace(**overrides)
                row["config"] = config.label()
                t0 = time.perf_counter()
                kernel = compile_variant(config, problem, args.ignore_register_model)
                row["compile_s"] = round(time.perf_counter() - t0, 1)
                result = evaluator.run_trial(kernel, config, problem, timing, validate=True, perturb=False)
                row.update({key: result.get(key) for key in ("outcome", "us", "tflops", "max_err")})
            except Exception as exc:  # a variant that cannot run is a row with its reason
                row.update(outcome="error", error=f"{type(exc).__name__}: {exc}"[:300])
            rows.append(row)
            print(json.dumps(row), flush=True)
        for name, res in evaluator.time_peers(problem, timing, peers).items():
            row = {"shape": text, "variant": name, **res}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\nshape                      variant           us        TFLOP/s  outcome", file=sys.stderr)
    for r in rows:
        print(f"{r['shape']:<26} {r['variant']:<16} {r.get('us') or float('nan'):>9.2f} "
              f"{r.get('tflops') or float('nan'):>8.1f}  {r.get('outcome', r.get('error', ''))}",
              file=sys.stderr)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": device, "timing": timing.describe(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
