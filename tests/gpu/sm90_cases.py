"""Helpers of the sm90 GPU suites (tests/gpu/test_sm90_*.py): run one case and check it by the one rule.

FA4_SM90_SHARD="i/n" keeps the i-th of n contiguous chunks of a suite's cases, so one device run can
test a suite in n parallel processes (`tests/gpu/run_sm90_suites.sh`); the suites list cases with the
compile key outermost, so a chunk compiles only its own keys.
"""

from __future__ import annotations

import os

SHARD_ENV = "FA4_SM90_SHARD"


def shard(cases: list) -> list:
    spec = os.environ.get(SHARD_ENV)
    if not spec:
        return cases
    index, count = (int(x) for x in spec.split("/"))
    size = -(-len(cases) // count)
    return cases[index * size:(index + 1) * size]


def run_and_check(config, problem, logit_scale: float = 1.0, softmax_scale=None) -> list[str]:
    """Compile and run one configuration on random inputs (a window's widths and a softcap's cap as the
    kernel takes them); the failures by `fa4.reference.check`."""
    import torch

    from fa4.kernels import compile_attention
    from fa4.kernels.compiling import mask_values
    from fa4.reference import check, random_inputs

    q, k, v = random_inputs(problem, logit_scale=logit_scale)
    out = q.new_full(q.shape[:3] + v.shape[3:], float("nan"))  # every element must be written (at v's head dim)
    lse = None
    if problem.return_lse:
        lse = torch.full((problem.batch, problem.heads_q, problem.seqlen_q), float("nan"),
                         device="cuda", dtype=torch.float32)
    compile_attention(config, problem).run(q, k, v, out, lse, softmax_scale, masks=mask_values(problem))
    torch.cuda.synchronize()
    return check(out, lse, q, k, v, problem.causal, softmax_scale, window=problem.window, softcap=problem.softcap)
