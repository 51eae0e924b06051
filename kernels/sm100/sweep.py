"""Compile many sm100 configurations for sm_100a in parallel processes and tabulate the results.

No GPU needed (any CPU machine; the H200 machine's 16 cores serve well). The kernel has NOT run on
hardware: this checks that every feasible configuration compiles with no spills and with tcgen05 and
TMA instructions in its PTX, and that the feasibility model's shared memory equals SharedStorage's.

    python -m fa4.kernels.sm100.sweep --jobs 16                 # the whole search space, base problem
    python -m fa4.kernels.sm100.sweep --sample --jobs 2         # the representative CI sample
    python -m fa4.kernels.sm100.sweep --head-dim 64 --causal --json out.json

The team's `fa4tune compile-space --arch sm100` calls `compile_report` per configuration the same way.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import os
import sys
import time
from typing import Iterable, Optional

from ..knobs import Config, knobs_for
from ..problem import AttentionProblem
from . import can_implement, resource_reasons


def space_configs(space_file: Optional[str] = None) -> list[Config]:
    """Every configuration of search_spaces/sm100.toml (or of the declared knobs without it)."""
    try:
        from fa4tune.space import load_space
        return list(load_space("sm100", space_file).configs())
    except ImportError:  # the kernels package alone: the declared choices
        knobs = knobs_for("sm100")
        return [Config("sm100", tuple(zip([k.name for k in knobs], values)))
                for values in itertools.product(*(k.choices for k in knobs))]


SAMPLE_PROBLEMS = {
    "base": AttentionProblem(1, 1024, 1024, 32, 8, 128, "fp16"),
    "d64_causal_lse_bf16": AttentionProblem(1, 1000, 1000, 32, 4, 64, "bf16", causal=True,
                                            return_lse=True),
    "d128_causal_lse_mha": AttentionProblem(1, 1000, 1000, 16, 16, 128, "fp16", causal=True,
                                            return_lse=True),
}


def representative_sample() -> list[tuple[Config, AttentionProblem]]:
    """A small feasible set of (config, problem) in which every value of every sm100 knob appears.

    Three problems (the design's base case; D=64 causal with LSE in bf16 with GQA ratio 8; D=128
    causal with LSE without GQA) so the masking, LSE and bf16 paths are compiled too. The test checks
    the coverage and feasibility: a model change that makes a variant infeasible fails loudly.
    """
    from . import default_config
    base, d64, mha = (SAMPLE_PROBLEMS[k] for k in ("base", "d64_causal_lse_bf16", "d128_causal_lse_mha"))
    start = Config.make("sm100", tile_n=128, kv_stages=2, q_stages=2, tmem_stages=2, rescale_tile=16,
                        rescale_threshold=8.0, scheduler="static", pack_gqa=True, softmax_regs=192)
    variants = [
        (base, dict()),
        (base, dict(tile_n=64, kv_stages=4, tmem_stages=3, rescale_tile=8, rescale_threshold=0.0,
                    scheduler="single", softmax_regs=176)),
        (mha, dict(q_stages=1, tmem_stages=1, kv_stages=3, rescale_tile=32, rescale_threshold=4.0,
                   scheduler="lpt", pack_gqa=False, softmax_regs=184)),
        (d64, dict(tile_n=64, q_stages=1, tmem_stages=3, kv_stages=4, rescale_tile=64,
                   softmax_regs=176, rescale_threshold=12.0)),
        (mha, dict(kv_stages=3, softmax_regs=200, rescale_tile=8, scheduler="single",
                   pack_gqa=False)),
        (d64, dict(tile_n=64, tmem_stages=1, rescale_threshold=12.0, scheduler="lpt",
                   softmax_regs=184)),
    ]
    sample = [(start.replace(**v), p) for p, v in variants]
    sample += [(default_config(p), p) for p in (d64, mha)]
    return sample


def _worker(args):
    config_dict, problem_dict = args
    config = Config.from_dict("sm100", config_dict)
    problem = AttentionProblem(**problem_dict)
    row = {"config": config.to_dict(), "label": config.label(), "problem": problem.label(),
           "status": "ok", "reason": ""}
    reasons = list(can_implement(problem)) + list(resource_reasons(config, problem))
    if reasons:
        row.update(status="infeasible", reason="; ".join(reasons))
        return row
    start = time.perf_counter()
    try:
        from . import compile_report
        rep = compile_report(config, problem)
    except Exception as exc:  # a failing configuration is a result with a reason
        row.update(status="compile_error", reason=f"{type(exc).__name__}: {str(exc)[:300]}",
                   compile_seconds=round(time.perf_counter() - start, 2))
        return row
    row.update({k: rep[k] for k in ("registers", "spill_stores", "spill_loads", "smem_bytes",
                                    "smem_model_bytes", "compile_seconds", "ptx_markers")})
    problems = []
    if rep["spill_stores"] or rep["spill_loads"]:
        problems.append(f"spills {rep['spill_stores']}/{rep['spill_loads']} B")
    if not all(rep["ptx_markers"].values()):
        missing = [k for k, v in rep["ptx_markers"].items() if not v]
        problems.append(f"PTX lacks {', '.join(missing)}")
    if rep["smem_bytes"] != rep["smem_model_bytes"]:
        problems.append(f"SharedStorage {rep['smem_bytes']} B != model {rep['smem_model_bytes']} B")
    if problems:
        row.update(status="bad", reason="; ".join(problems))
    return row


def compile_many(configs: Iterable[Config], problem: Optional[AttentionProblem] = None, jobs: int = 2,
                 progress=None, pairs: Optional[list] = None) -> list[dict]:
    """compile_report for each configuration in `jobs` fresh processes (spawned: the DSL is not
    fork-safe). Either `configs` for one `problem`, or `pairs` of (config, problem)."""
    if pairs is None:
        pairs = [(c, problem) for c in configs]
    configs = [c for c, _ in pairs]
    rows: list[dict] = []
    tasks = []
    for c, p in pairs:  # infeasible ones are answered here, without a process
        reasons = list(can_implement(p)) + list(resource_reasons(c, p))
        if reasons:
            rows.append({"config": c.to_dict(), "label": c.label(), "problem": p.label(),
                         "status": "infeasible", "reason": "; ".join(reasons)})
        else:
            tasks.append((c.to_dict(), p.to_dict()))
    if tasks:
        ctx = mp.get_context("spawn")
        with ctx.Pool(processes=max(1, min(jobs, len(tasks))), maxtasksperchild=8) as pool:
            for row in pool.imap_unordered(_worker, tasks):
                rows.append(row)
                if progress:
                    progress(len(rows), len(configs), row)
    rows.sort(key=lambda r: r["label"])
    return rows


def summarize(rows: list[dict]) -> dict:
    compiled = [r for r in rows if r["status"] in ("ok", "bad")]
    regs = sorted({r["registers"] for r in compiled if r.get("registers") is not None})
    return {
        "configs": len(rows),
        "feasible": sum(r["status"] != "infeasible" for r in rows),
        "compiled_clean": sum(r["status"] == "ok" for r in rows),
        "compiled_with_problems": sum(r["status"] == "bad" for r in rows),
        "compile_errors": sum(r["status"] == "compile_error" for r in rows),
        "registers_seen": regs,
        "max_spill_bytes": max([max(r.get("spill_stores") or 0, r.get("spill_loads") or 0)
                                for r in compiled] or [0]),
        "compile_seconds_total": round(sum(r.get("compile_seconds", 0) for r in compiled), 1),
    }


def format_table(rows: list[dict]) -> str:
    lines = [f"{'status':<13} {'regs':>4} {'spill':>7} {'smem':>7} {'secs':>5}  config / reason"]
    for r in rows:
        spill = "" if r.get("spill_stores") is None else f"{r['spill_stores']}/{r['spill_loads']}"
        lines.append(f"{r['status']:<13} {r.get('registers') or '':>4} {spill:>7} "
                     f"{r.get('smem_bytes') or '':>7} {r.get('compile_seconds', ''):>5}  {r['label']} | {r['problem']}"
                     + (f"\n{'':>40}{r['reason']}" if r["reason"] else ""))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    ap.add_argument("--sample", action="store_true", help="the representative sample, not the space")
    ap.add_argument("--space", default=None, help="search-space TOML (default: search_spaces/sm100.toml)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="fp16")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--lse", action="store_true")
    ap.add_argument("--heads", default="32/8", help="Hq/Hkv (the ratio matters with pack_gqa)")
    ap.add_argument("--limit", type=int, default=0, help="compile at most this many (0: all)")
    ap.add_argument("--json", default=None, help="write rows and summary here")
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args(argv)
    hq, hkv = (int(x) for x in a.heads.split("/"))
    problem = AttentionProblem(1, 1024, 1024, hq, hkv, a.head_dim, a.dtype, a.causal, a.lse)
    if a.sample:
        pairs = representative_sample()
    else:
        pairs = [(c, problem) for c in space_configs(a.space)]
    if a.limit:
        pairs = pairs[:a.limit]

    def progress(done, total, row):
        if not a.quiet:
            print(f"[{done}/{total}] {row['status']:<13} {row.get('registers') or '':>4} "
                  f"{row.get('compile_seconds', '')!s:>6}s {row['label']} | {row['problem']}",
                  file=sys.stderr, flush=True)

    rows = compile_many([], jobs=a.jobs, progress=progress, pairs=pairs)
    summary = summarize(rows)
    print(format_table(rows))
    print(json.dumps(summary, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"problem": None if a.sample else problem.to_dict(), "summary": summary,
                       "rows": rows}, f, indent=1,
                      sort_keys=True)
    return 0 if summary["compiled_with_problems"] == 0 and summary["compile_errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
