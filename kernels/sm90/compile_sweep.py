"""Compile the whole sm90 search space for one problem, in parallel processes, and print a table.

    python -m fa4.kernels.sm90.compile_sweep --jobs 16 [--seqlen 1024 --heads 32/8 --head-dim 128
        --dtype fp16 --causal --lse] [--space search_spaces/sm90.toml] [--json out.json]

Every configuration is either rejected by `fa4.kernels.feasible` (with its reasons) or compiled for
sm_90a without a GPU; the table shows registers, spills, the wgmma-serialisation warning, shared
memory from the kernel's SharedStorage next to the model's, and compile seconds. Exit status 1 when a
feasible configuration fails to compile, spills, or disagrees with the shared-memory model.
On 2 cores this takes long (1-5 s per configuration); run it where there are many cores.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tomllib
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

SPACE = Path(__file__).resolve().parents[2] / "search_spaces" / "sm90.toml"


def _configs(space_path: Path):
    from fa4.kernels import Config, knobs_for
    data = tomllib.loads(space_path.read_text())
    knobs = data.get("knobs", {})
    names = [k.name for k in knobs_for("sm90")]
    choices = [knobs.get(n, list(k.choices)) for n, k in zip(names, knobs_for("sm90"))]
    choices = [c if isinstance(c, list) else [c] for c in choices]
    for values in itertools.product(*choices):
        yield Config.make("sm90", **dict(zip(names, values)))


def _compile_one(args):
    config_dict, problem_dict = args
    from fa4.kernels import AttentionProblem, Config, sm90
    cfg = Config.from_dict("sm90", config_dict)
    prob = AttentionProblem(**problem_dict)
    report = sm90.compile_report(cfg, prob)
    report.pop("remarks_excerpt", None)
    report["model_smem_bytes"] = sm90.resources(cfg, prob)["smem_bytes"]
    return config_dict, report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--seqlen", type=int, default=1024)
    ap.add_argument("--heads", default="32/8")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="fp16")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--lse", action="store_true")
    ap.add_argument("--space", type=Path, default=SPACE)
    ap.add_argument("--limit", type=int, default=0, help="compile at most this many (0: all)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    from fa4.kernels import AttentionProblem, feasible
    hq, hkv = (int(x) for x in args.heads.split("/"))
    prob = AttentionProblem(1, args.seqlen, args.seqlen, hq, hkv, args.head_dim, args.dtype,
                            causal=args.causal, return_lse=args.lse)
    rows, todo = [], []
    for cfg in _configs(args.space):
        reasons = feasible(cfg, prob)
        if reasons:
            rows.append((cfg.to_dict(), {"ok": False, "infeasible": reasons}))
        else:
            todo.append((cfg.to_dict(), prob.to_dict()))
    if args.limit:
        todo = todo[:args.limit]
    print(f"{prob.label()}: {len(rows)} infeasible, compiling {len(todo)} with {args.jobs} "
          f"processes", file=sys.stderr)
    bad = 0
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for cfg_dict, rep in pool.map(_compile_one, todo):
            rows.append((cfg_dict, rep))
            if (not rep.get("ok") or rep.get("spill_stores") or rep.get("spill_loads")
                    or rep.get("wgmma_serialized") or rep.get("smem_bytes") != rep.get("model_smem_bytes")):
                bad += 1
            label = " ".join(f"{k}={v}" for k, v in cfg_dict.items())
            print(f"{label:100s} regs={rep.get('registers')} spills={rep.get('spill_stores')}/"
                  f"{rep.get('spill_loads')} serialized={rep.get('wgmma_serialized')} "
                  f"smem={rep.get('smem_bytes')} model={rep.get('model_smem_bytes')} "
                  f"s={rep.get('compile_seconds')} {rep.get('error', '')[:120]}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"problem": prob.to_dict(), "rows": rows}, f, indent=1, sort_keys=True)
    print(f"{len(todo)} compiled, {bad} failed/spilled/mismatched", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
