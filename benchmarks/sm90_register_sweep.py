"""Compile the sm90 kernel over the register-relevant knobs, ignoring the register model, and record
what ptxas reports (registers, spills, serialised wgmma). The feasibility model's register rule is
fitted to this table (results/sm90_register_table.json) and tests/test_sm90_model.py holds it to it.

    python benchmarks/sm90_register_sweep.py --jobs 15 --out results/sm90_register_table.json

No GPU is needed (the H200 machine's 16 cores make it a two-minute job; 2 cores take ~30 min).
`--head-dims 96 192 256` compiles only those head dims and keeps the other head dims' rows of the
table already at `--out`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import os
import time

from fa4.kernels.sm90.plan import SUPPORTED_HEAD_DIMS  # the DSL-free part of the family

TILE_M = (64, 128, 192)
TILE_N = (64, 80, 96, 112, 128, 144, 160, 176, 192)
OVERLAP = (True, False)
PV_OPERAND = ("rs", "ss")
# the problem variants that change the consumer's registers: the mask code and the LSE write
MASKS = (("full", False, False), ("causal_lse", True, True))


def cases(head_dims):
    for tm, tn, d, ov, pv, (mask, causal, lse) in itertools.product(
            TILE_M, TILE_N, head_dims, OVERLAP, PV_OPERAND, MASKS):
        yield dict(tile_m=tm, tile_n=tn, head_dim=d, softmax_overlap=ov, pv_operand=pv, mask=mask,
                   causal=causal, return_lse=lse)


def problem_and_config(case: dict):
    """The problem and configuration a sweep row was compiled for (the row's fields, the rest fixed:
    kv_stages 2, one Q stage, the persistent LPT loop, packed GQA 32/8). tests/test_sm90_model.py reads
    the committed table through this too."""
    from fa4.kernels import AttentionProblem, Config
    problem = AttentionProblem(batch=1, seqlen_q=1024, seqlen_k=1024, heads_q=32, heads_kv=8,
                               head_dim=case["head_dim"], dtype="fp16", causal=case["causal"],
                               return_lse=case["return_lse"])
    config = Config.make("sm90", tile_m=case["tile_m"], tile_n=case["tile_n"], kv_stages=2, q_stages=1,
                         softmax_overlap=case["softmax_overlap"], pv_operand=case["pv_operand"],
                         scheduler="lpt", pack_gqa=True)
    return problem, config


def compile_case(case: dict) -> dict:
    from fa4.kernels import compiling
    from fa4.kernels.sm90 import REFERENCE_DEVICE, smem_bytes
    problem, config = problem_and_config(case)
    row = dict(case)
    if smem_bytes(config, problem) > REFERENCE_DEVICE.smem_per_block_bytes:
        row["outcome"] = "smem"
        return row
    t0 = time.perf_counter()
    try:
        report = compiling.compile_report(config, problem)
    except Exception as e:  # ptxas refuses some (an instruction needs more registers than the cap)
        report = {"ok": False, "error": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"}
    row.update(outcome="ok" if report.get("ok") else "error", seconds=round(time.perf_counter() - t0, 1),
               registers=report.get("registers"), spill_bytes=(report.get("spill_stores") or 0)
               + (report.get("spill_loads") or 0), wgmma_serialized=report.get("wgmma_serialized"),
               error=report.get("error"))
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=max(1, mp.cpu_count() - 1))
    ap.add_argument("--out", required=True)
    ap.add_argument("--head-dims", type=int, nargs="+", default=list(SUPPORTED_HEAD_DIMS),
                    help="compile only these head dims; the other head dims' rows of --out stay")
    args = ap.parse_args()
    todo = list(cases(args.head_dims))
    kept = []
    if set(args.head_dims) != set(SUPPORTED_HEAD_DIMS) and os.path.exists(args.out):
        with open(args.out) as f:
            kept = [r for r in json.load(f)["rows"] if r["head_dim"] not in args.head_dims]
    with mp.get_context("spawn").Pool(args.jobs) as pool:
        rows = kept + list(pool.imap_unordered(compile_case, todo))
    rows.sort(key=lambda r: (r["tile_m"], r["tile_n"], r["head_dim"], r["mask"], r["pv_operand"],
                             not r["softmax_overlap"]))
    with open(args.out, "w") as f:
        json.dump({"command": "python benchmarks/sm90_register_sweep.py --jobs "
                   f"{args.jobs} --out {args.out} --head-dims {' '.join(map(str, args.head_dims))}",
                   "rows": rows}, f, indent=0, sort_keys=True)
    bad = [r for r in rows if r["outcome"] == "ok" and (r["spill_bytes"] or r["wgmma_serialized"])]
    print(f"{len(rows)} cases: {sum(r['outcome'] == 'ok' for r in rows)} compiled, "
          f"{sum(r['outcome'] == 'smem' for r in rows)} over shared memory, "
          f"{sum(r['outcome'] == 'error' for r in rows)} errors, {len(bad)} spill or serialise")


if __name__ == "__main__":
    main()
