"""Where the search's and the training pass's times of one backward part: the same default configuration
timed four ways on one shape in one process, by CUDA-graph replay (L2 warm), so the gap between
`fa4tune search --backward` (`CompiledBackward.run` on saved tensors of a no-grad forward) and
`benchmarks/training_pass.py` (`torch.autograd.grad` through `fa4.attention`) can be pinned on a step.

    FA4_BACKWARD=ours python benchmarks/bwd_path_gap.py --shape 4,2048,64,8 --head-dim 128 --mask causal

Rows: search (the search's inputs and call), op-tensors (the same call on the O and LSE the custom op
saved for autograd), ours_backward (`fa4.backward.ours_backward` on those: adds the configuration lookup,
dO.contiguous and the gradients' allocation), autograd (`torch.autograd.grad`, what the training pass
times). The forward's backend, the configuration and LSE's layout are printed beside them.
"""

from __future__ import annotations

import argparse


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="4,2048,64,8", metavar="B,S,HQ,HKV")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--mask", choices=("full", "causal"), default="causal")
    ap.add_argument("--dtype", choices=("fp16", "bf16"), default="bf16")
    args = ap.parse_args(argv)

    import torch

    import fa4
    from fa4 import backward
    from fa4.kernels import AttentionProblem, sm90_bwd
    from fa4.reference import softmax_scale
    from fa4tune.workers.backward import BackwardInputs, compile_backward
    from fa4tune.workers.timing import TimingSettings, time_cuda

    batch, seqlen, heads_q, heads_kv = (int(x) for x in args.shape.split(","))
    causal = args.mask == "causal"
    problem = AttentionProblem(batch, seqlen, seqlen, heads_q, heads_kv, args.head_dim, args.dtype, causal)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(batch, seqlen, heads_q, args.head_dim, device="cuda", dtype=dtype, generator=gen)
    k, v = (torch.randn(batch, seqlen, heads_kv, args.head_dim, device="cuda", dtype=dtype, generator=gen)
            for _ in range(2))
    scale = softmax_scale(args.head_dim)
    timing = TimingSettings()

    config = sm90_bwd.default_config(problem)
    tuned_config, source, _ = backward.tuned(q, k, causal)
    print(f"default {config.to_dict()}\nours_backward runs ({source}) {tuned_config.to_dict()}")
    kernel = compile_backward(config, problem)
    inputs = BackwardInputs(problem, q, k, v, scale)
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))

    def search_call():
        kernel.run(q, k, v, inputs.out, inputs.dout, inputs.lse, dq, dk, dv, scale)

    rows = {"search": time_cuda(search_call, timing, stream=inputs.stream).us}

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    op_stream = torch.cuda.Stream()
    op_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(op_stream):
        out, lse = fa4.attention(*leaves, causal=causal, return_lse=True)
    torch.cuda.synchronize()
    print("forward:", "\n  ".join(str(fa4.explain(q, k, v, causal=causal)).splitlines()[:4]))
    print(f"search lse {tuple(inputs.lse.shape)} {inputs.lse.stride()} out {inputs.out.stride()}; "
          f"op lse {tuple(lse.shape)} {lse.stride()} out {out.stride()}")
    print(f"max |out_op - out_search| {(out.detach().float() - inputs.out.float()).abs().max().item():.3g}, "
          f"max |lse_op - lse_search| {(lse.detach() - inputs.lse).abs().max().item():.3g}")
    saved_out, saved_lse = out.detach(), lse.detach()

    def op_tensors_call():
        kernel.run(q, k, v, saved_out, inputs.dout, saved_lse, dq, dk, dv, scale)

    rows["op-tensors"] = time_cuda(op_tensors_call, timing, stream=op_stream).us
    rows["ours_backward"] = time_cuda(
        lambda: backward.ours_backward(inputs.dout, q, k, v, saved_out, saved_lse, causal, scale), timing,
        stream=op_stream).us
    rows["autograd"] = time_cuda(
        lambda: torch.autograd.grad(out, leaves, inputs.dout, retain_graph=True), timing, stream=op_stream).us
    for name, us in rows.items():
        print(f"{name:>14} {us:9.1f} us  {us / rows['search']:.3f}")


if __name__ == "__main__":
    main()
