"""Test helpers (not shipped): the representative sample of sm100 configurations (every knob value at
least once) and a parallel compile of (configuration, problem) pairs for sm_100a, used by the CPU
compile tests (tests/test_sm100_compile.py).

No GPU needed. The kernel has NOT run on hardware: this checks that configurations compile with no
spills, with tcgen05 and TMA instructions in their PTX, and that the feasibility model's shared memory
equals SharedStorage's. A whole search space: `fa4tune compile-space --arch sm100 [--shard i/n]`.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Iterable, Optional

from fa4.kernels import AttentionProblem, Config
from fa4.kernels.sm100 import can_implement, resource_reasons


SAMPLE_PROBLEMS = {
    "base": AttentionProblem(1, 1024, 1024, 32, 8, 128, "fp16"),
    "d64_causal_lse_bf16": AttentionProblem(1, 1000, 1000, 32, 4, 64, "bf16", causal=True,
                                            return_lse=True),
    "d128_causal_lse_mha": AttentionProblem(1, 1000, 1000, 16, 16, 128, "fp16", causal=True,
                                            return_lse=True),
    "d64_lse_bf16": AttentionProblem(1, 1000, 1000, 32, 4, 64, "bf16", return_lse=True),
}


def representative_sample() -> list[tuple[Config, AttentionProblem]]:
    """A small feasible set of (config, problem) in which every value of every sm100 knob appears.

    Four problems (the design's base case; D=64 causal with LSE in bf16 with GQA ratio 8; D=128
    causal with LSE without GQA; D=64 non-causal with LSE in bf16, for the pair mode) so the
    masking, LSE, bf16 and cluster-pair paths are compiled too. The test checks
    the coverage and feasibility: a model change that makes a variant infeasible fails loudly.
    """
    from fa4.kernels.sm100 import default_config
    base, d64, mha, d64_full = (SAMPLE_PROBLEMS[k] for k in (
        "base", "d64_causal_lse_bf16", "d128_causal_lse_mha", "d64_lse_bf16"))
    start = Config.make("sm100", tile_n=128, kv_stages=2, q_stages=2, tmem_stages=2, rescale_tile=16,
                        rescale_threshold=8.0, scheduler="static", pack_gqa=True, softmax_regs=192,
                        exp2_poly_columns=4)
    variants = [
        (base, dict()),
        (base, dict(tile_n=64, kv_stages=4, tmem_stages=3, rescale_tile=8, rescale_threshold=0.0,
                    scheduler="single", softmax_regs=176, exp2_poly_columns=0)),
        # a 128-key row at the fewest softmax registers (176), and the 64-column O round trip that
        # needs every register the correction group then gets (112): the register model's corners
        (base, dict(softmax_regs=176, rescale_tile=64, kv_stages=3, exp2_poly_columns=8)),
        # causal + LSE + LPT at the fewest softmax registers the model allows it (184)
        (mha, dict(q_stages=1, tmem_stages=1, kv_stages=3, rescale_tile=32, rescale_threshold=4.0,
                   scheduler="lpt", pack_gqa=False, softmax_regs=184)),
        (d64, dict(tile_n=64, q_stages=1, tmem_stages=3, kv_stages=4, rescale_tile=64,
                   softmax_regs=176, rescale_threshold=12.0)),
        (mha, dict(kv_stages=3, softmax_regs=200, rescale_tile=8, scheduler="single",
                   pack_gqa=False, exp2_poly_columns=8)),
        (d64, dict(tile_n=64, tmem_stages=1, rescale_threshold=12.0, scheduler="lpt",
                   softmax_regs=184)),
        # the cluster pair (non-causal only): with half of every K/V tile per CTA, four K/V
        # stages fit at D=128; and the smallest pair (64-key blocks, one Q stage, unpacked, LSE)
        (base, dict(two_cta=True, kv_stages=4, scheduler="lpt")),
        (d64_full, dict(two_cta=True, tile_n=64, q_stages=1, tmem_stages=3, kv_stages=3,
                        pack_gqa=False, scheduler="single", rescale_tile=32, softmax_regs=184)),
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
        from fa4.kernels.sm100 import compile_report
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
