"""Launch one attention implementation a few times between profiler start/stop, for Nsight Compute.

    ncu --profile-from-start off --section SpeedOfLight ... --csv \
        python benchmarks/ncu_profile.py --shape d64-s2048-full --impl ours [--config '{"tile_n": 96}']

--impl is `ours` (the tuned database's configuration of the shape, or --config's knobs over the
default), or a peer name (flash_attn_4, sdpa_cudnn, sdpa_flash) called as the runtime calls it.
--backward profiles the gradient call instead (`torch.autograd.grad` of one saved forward; `ours` is
fa4.attention's backward: set FA4_BACKWARD=ours to profile our kernel rather than the automatic choice).
The implementation is warmed up outside the profiled range, so the profile holds only --launches
steady-state launches. Nsight locks clocks at base: compare cycles and ratios between rows of one
run, not times with the bench.
"""

from __future__ import annotations

import argparse
import json

import torch

from fa4tune.api import DEFAULT_PROBLEM
from fa4tune.inputs.shapes import parse_shape


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", required=True)
    ap.add_argument("--impl", default="ours")
    ap.add_argument("--config", default=None, help="JSON knob overrides for --impl ours")
    ap.add_argument("--launches", type=int, default=1)
    ap.add_argument("--backward", action="store_true", help="profile the backward pass")
    args = ap.parse_args()
    _, problem = parse_shape(args.shape, DEFAULT_PROBLEM)
    dtype = torch.float16 if problem.dtype == "fp16" else torch.bfloat16
    shape_q = (problem.batch, problem.seqlen_q, problem.heads_q, problem.head_dim)
    shape_kv = (problem.batch, problem.seqlen_k, problem.heads_kv, problem.head_dim)
    q = torch.randn(shape_q, device="cuda", dtype=dtype)
    k = torch.randn(shape_kv, device="cuda", dtype=dtype)
    v = torch.randn(shape_kv, device="cuda", dtype=dtype)
    scale = problem.head_dim ** -0.5
    if args.backward:
        from fa4tune.workers.training import FA4, forward_of

        q, k, v = (t.requires_grad_() for t in (q, k, v))
        forward, notes = forward_of(FA4 if args.impl == "ours" else args.impl, problem)
        saved, dout = forward(q, k, v), torch.randn_like(q)
        print(args.impl, "backward", notes, flush=True)

        def call():
            return torch.autograd.grad(saved, (q, k, v), dout, retain_graph=True)
    elif args.impl == "ours":
        import fa4
        config = json.loads(args.config) if args.config else None

        def call():
            return fa4.attention(q, k, v, causal=problem.causal, config=config, backend="ours")

        print(fa4.explain(q, k, v, causal=problem.causal), flush=True)
    else:
        from fa4tune.workers.peers import peer_call
        call, notes = peer_call(args.impl, q, k, v, problem.causal, scale)
        print(args.impl, notes, flush=True)
    for _ in range(20):
        call()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for _ in range(args.launches):
        call()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
