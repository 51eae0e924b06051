"""Warm start: a new study begins with the best configurations of its tuned neighbours.

A study with no trials yet is seeded, after the heuristic default, with the configurations of the
nearest entries of the best-config database that share its architecture, dtype and head dim: up to
`PER_MASK` of its own causal mode, then up to `PER_MASK` of the other mode (the same tiles often win
both), nearest first: entries of the same device first, then by GQA ratio, then by the log2 distance
of the sequence-length and work buckets (as the runtime's nearest lookup, `fa4.database`). Stale
entries (another kernel fingerprint) are not used, nor configurations outside the study's space; but the
stale entry of the study's own bucket goes first: after a kernel change, a re-tune starts from the
configuration that won before (re-timed like any seed, never trusted).
A variable-length batch (`fa4.varlen_batch.VarlenProblem`) is seeded from varlen entries only and a
dense problem from dense ones (a kind's configurations are judged at its own shapes; a dense winner
packing GQA rows could not run a varlen batch at all); the tokens bucket joins the distance.
Each seeded trial carries user_attr `warm_start`: the key of the entry it came from. Seeds are
evaluated like any trial (screened, counted in `--trials`); with none to be found, a study starts cold.
"""

from __future__ import annotations

import math
from typing import Optional

from fa4.kernels import AttentionProblem

PER_MASK = 2


def _distance(entry, problem: AttentionProblem) -> float:
    from fa4.database import bucket

    work = problem.batch * problem.heads_kv
    tokens = getattr(problem, "tokens_q", None)
    return (abs(math.log2(entry.seqlen_q_bucket) - math.log2(bucket(problem.seqlen_q)))
            + abs(math.log2(entry.seqlen_k_bucket) - math.log2(bucket(problem.seqlen_k)))
            + abs(math.log2(entry.work_bucket) - math.log2(bucket(work)))
            + (0.0 if tokens is None or entry.tokens_bucket is None
               else abs(math.log2(entry.tokens_bucket) - math.log2(bucket(tokens)))))


def warm_start_configs(db, arch: str, device: Optional[str], problem: AttentionProblem, fingerprint: str,
                       choices: dict[str, list], default: dict) -> list[tuple[dict, str]]:
    """[(knob values, database entry key)] to seed a new study with, nearest first (module docstring).
    `choices` is the study's space ({knob: values}); `default` the configuration seeded anyway."""
    from fa4.database import entry_key

    chosen: list[tuple[dict, str]] = []
    seen = {tuple(sorted(default.items()))}

    def take(entry) -> bool:
        """Seed the entry's configuration unless it lies outside this study's space (a narrowed
        --space, or knobs since changed) or is already seeded; whether it was."""
        config = {k: entry.config.get(k) for k in choices}
        key = tuple(sorted(config.items()))
        if any(config[k] not in values for k, values in choices.items()) or key in seen:
            return False
        seen.add(key)
        chosen.append((config, entry.key))
        return True

    own = db.get(entry_key(arch, device, problem)) if device else None
    if own is not None and own.is_stale(fingerprint):
        take(own)
    for causal in (problem.causal, not problem.causal):
        candidates = [e for e in db.entries
                      if e.arch == arch and e.dtype == problem.dtype and e.head_dim == problem.head_dim
                      and e.causal == causal and not e.is_stale(fingerprint)
                      and bool(e.problem.get("varlen")) == problem.varlen]
        candidates.sort(key=lambda e: (e.device != device, abs(math.log2(e.gqa_ratio) - math.log2(problem.gqa_ratio)),
                                       _distance(e, problem), e.key))
        taken = 0
        for entry in candidates:
            taken += take(entry)
            if taken == PER_MASK:
                break
    return chosen
