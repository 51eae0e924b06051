"""Autotune on first use against an offline search, on one shape nobody tuned (H200, harness installed):

    python benchmarks/autotune_vs_search.py --shape b8-s777-hq24-hkv8-d64-bf16-causal --out DIR

1. A fresh process with FA4_AUTOTUNE=quick and an empty user folder calls `fa4.attention` once; the
   wall time of that first call (tune + compile of the winner) and the configuration it recorded.
2. `fa4tune search --effort default` on the same shape, into its own database (a fresh user folder).
3. Both configurations timed here, alternately (rounds of CUDA-graph replay, the lowest of each), with
   the default beside them: autotuned ÷ searched is the figure (the bar: within 3 %).
Writes DIR/autotune_vs_search.json."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from fa4tune.api import DEFAULT_PROBLEM
from fa4tune.inputs.shapes import parse_shape

FIRST_CALL = """
import json, sys, time, torch, fa4
from fa4 import database
from fa4.kernels import AttentionProblem
from fa4.reference import random_inputs
problem = AttentionProblem(**json.loads(sys.argv[1]))
q, k, v = random_inputs(problem)
torch.cuda.synchronize()
t0 = time.monotonic()
fa4.attention(q, k, v, causal=problem.causal)
torch.cuda.synchronize()
took = time.monotonic() - t0
entries = [e for e in database.BestConfigDB.load(database.user_path()).entries if e.study.startswith("autotune")]
print(json.dumps({"first_call_s": round(took, 1), "entries": [
    {"config": e.config, "us": e.us, "default_us": e.default_us} for e in entries]}))
"""


def search_options(problem) -> list[str]:
    return ["--batch", str(problem.batch), "--heads", str(problem.heads_q), "--heads-kv", str(problem.heads_kv),
            "--head-dim", str(problem.head_dim), "--seqlen", str(problem.seqlen_q),
            "--seqlen-k", str(problem.seqlen_k), "--dtype", problem.dtype,
            "--causal" if problem.causal else "--no-causal"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    _, problem = parse_shape(args.shape, DEFAULT_PROBLEM)
    env = {k: v for k, v in os.environ.items() if k not in ("FA4_CONFIG_DB", "FA4_AUTOTUNE")}
    result: dict = {"shape": args.shape, "problem": problem.to_dict()}

    auto_env = {**env, "FA4TUNE_HOME": os.path.join(args.out, "home_autotune"), "FA4_AUTOTUNE": "quick"}
    done = subprocess.run([sys.executable, "-c", FIRST_CALL, json.dumps(problem.to_dict())], env=auto_env,
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0 or not done.stdout.strip():
        sys.exit(f"the autotuned first call failed:\n{done.stderr[-3000:]}")
    result["autotune"] = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps(result["autotune"]), flush=True)

    search_home = os.path.join(args.out, "home_search")
    db_path = os.path.join(args.out, "search_db.json")
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "fa4tune.cli", "search", *search_options(problem),
                           "--effort", "default", "--db", db_path,
                           "--storage", os.path.join(args.out, "studies.journal")],
                          env={**env, "FA4TUNE_HOME": search_home}, capture_output=True, text=True, timeout=900)
    result["search_wall_s"] = round(time.monotonic() - t0, 1)
    with open(os.path.join(args.out, "search.log"), "w") as f:
        f.write(done.stdout[-20000:] + done.stderr[-20000:])
    if done.returncode != 0:
        sys.exit(f"the search failed (exit {done.returncode}); see search.log")
    from fa4.database import BestConfigDB

    searched = [e for e in BestConfigDB.load(db_path).entries]
    result["search"] = [{"config": e.config, "us": e.us, "default_us": e.default_us} for e in searched]
    print(json.dumps({"search_wall_s": result["search_wall_s"], "search": result["search"]}), flush=True)

    from fa4.kernels import Config, compiling, default_config
    from fa4tune.workers.evaluator import KernelEvaluator
    from fa4tune.workers.timing import TimingSettings

    configs = {"default": default_config("sm90", problem),
               "autotuned": Config.from_dict("sm90", result["autotune"]["entries"][0]["config"]),
               "searched": Config.from_dict("sm90", searched[0].config)}
    evaluator = KernelEvaluator("gpu")
    result["device"] = evaluator.setup()
    kernels = {name: compiling.compile_attention(config, problem) for name, config in configs.items()}
    times: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(args.rounds):
        for name, config in configs.items():
            measured = evaluator.run_trial(kernels[name], config, problem, TimingSettings(), validate=True,
                                           perturb=False)
            if measured.get("outcome") != "ok":
                sys.exit(f"{name} {config.label()}: {measured}")
            times[name].append(measured["us"])
    result["timed"] = {name: {"config": configs[name].label(), "us_rounds": times[name], "us": min(times[name])}
                       for name in configs}
    result["autotuned_over_searched"] = round(min(times["autotuned"]) / min(times["searched"]), 4)
    print(json.dumps({"timed": result["timed"], "autotuned_over_searched": result["autotuned_over_searched"]}),
          flush=True)
    with open(os.path.join(args.out, "autotune_vs_search.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
