"""`fa4.attention` against our kernel called as a trial calls it, on the same configuration (H200):

    python benchmarks/dispatch_vs_trial.py "b1-s4096-hq64-hkv8-bf16-causal b16-s1024-hq28-hkv4-bf16-causal"

Per shape, alternately and twice each, by CUDA-graph replay: the default configuration's kernel with a
preallocated output (a bench's default row), the same with a fresh output per call, `fa4.attention` (the
dispatched row, the packaged database) and `fa4.attention(backend="ours")`. Writes
$OUT/dispatch_vs_trial.json (or /tmp's)."""

from __future__ import annotations

import json
import os
import sys

import torch

import fa4
from fa4.kernels import compiling, default_config
from fa4.reference import random_inputs, softmax_scale
from fa4tune.api import DEFAULT_PROBLEM
from fa4tune.inputs.shapes import parse_shape
from fa4tune.workers.timing import TimingSettings, time_cuda

REPEATS = 2


def compare(text: str) -> dict:
    _, problem = parse_shape(text, DEFAULT_PROBLEM)
    q, k, v = random_inputs(problem)
    scale = softmax_scale(problem.head_dim)
    config = default_config("sm90", problem)
    kernel = compiling.compile_attention(config, problem)
    out = torch.empty_like(q)
    plan = fa4.explain(q, k, v, causal=problem.causal)
    row = {"shape": text, "default": config.label(), "dispatched": plan.config.label() if plan.config else None,
           "runs": dict(plan.runs), "source": plan.source}

    def preallocated():
        kernel.run(q, k, v, out, None, scale)

    def fresh_output():
        fresh = torch.empty_like(q)
        kernel.run(q, k, v, fresh, None, scale)
        return fresh

    calls = {"trial": preallocated, "trial_fresh": fresh_output,
             "dispatched": lambda: fa4.attention(q, k, v, causal=problem.causal),
             "ours": lambda: fa4.attention(q, k, v, causal=problem.causal, backend="ours")}
    with torch.no_grad():
        for call in calls.values():
            call()
        torch.cuda.synchronize()
        row["max_diff"] = (calls["dispatched"]() - out).abs().max().item()
        for _ in range(REPEATS):
            for name, call in calls.items():
                row.setdefault("t_" + name, []).append(round(time_cuda(call, TimingSettings()).us, 2))
    return row


def main() -> None:
    fa4.use_config_db("fa4/data/best_configs.json")
    rows = []
    for text in sys.argv[1].split():
        rows.append(compare(text))
        print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "dispatch_vs_trial.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
