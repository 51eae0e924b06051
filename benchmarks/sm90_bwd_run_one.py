"""Runs our sm90 backward once in one configuration on a small problem and checks its gradients by
flash-attn's rule: the process to put under compute-sanitizer when a configuration faults.

    compute-sanitizer --tool memcheck --print-limit 4 \
        python benchmarks/sm90_bwd_run_one.py "tile_m=80" --head-dim 128 --mask full --shape 1,256,2,2

The configuration is the shape's default (`sm90_bwd.default_config`) with the given knob=value pairs
over it (as `benchmarks/sm90_bwd_configs.py` labels them). A fault's PC (`kernel+0x...`) maps to
SASS through the CPU's cubin: `benchmarks/sm90_bwd_sass.py` compiles the same code.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from sm90_bwd_configs import parse_pairs  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pairs", nargs="?", default="", help='knob=value pairs over the default, e.g. "tile_m=80"')
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--mask", choices=("full", "causal"), default="full")
    ap.add_argument("--shape", default="1,256,2,2", metavar="B,S,HQ,HKV")
    ap.add_argument("--dtype", choices=("fp16", "bf16"), default="bf16")
    args = ap.parse_args(argv)

    import torch

    from fa4.kernels import AttentionProblem, sm90_bwd
    from fa4.reference import attention_fp32, check_grads, softmax_scale

    batch, seqlen, heads_q, heads_kv = (int(x) for x in args.shape.split(","))
    causal = args.mask == "causal"
    problem = AttentionProblem(batch, seqlen, seqlen, heads_q, heads_kv, args.head_dim, args.dtype, causal)
    config = sm90_bwd.default_config(problem).replace(**parse_pairs(args.pairs))
    why = sm90_bwd.reasons(config, problem)
    if why:
        sys.exit(f"{config.label()}: {'; '.join(why)}")
    print(config.label(), flush=True)
    kernels = sm90_bwd.compile_backward(config, problem)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(batch, seqlen, heads_q, args.head_dim)] + [(batch, seqlen, heads_kv, args.head_dim)] * 2 + \
        [(batch, seqlen, heads_q, args.head_dim)]
    q, k, v, dout = (torch.randn(*s, device="cuda", dtype=dtype, generator=gen) for s in shapes)
    scale = softmax_scale(args.head_dim)
    out, lse = attention_fp32(q, k, v, causal, scale)
    grads = [torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)]
    kernels.run(q, k, v, out.to(dtype), dout, lse, *grads, scale)
    torch.cuda.synchronize()
    failures = check_grads(grads, q, k, v, dout, causal)
    print("gradients follow flash-attn's rule" if not failures else "; ".join(failures), flush=True)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
