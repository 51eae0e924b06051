"""A variable-length batch in a worker (`fa4tune search --varlen`, a shapes file's [[varlen]] tables): a
trial of our varlen kernel, and the other implementations of `fa4.attention_varlen` timed on the same
tensors.

The problem is a `fa4.varlen_batch.VarlenProblem`: the compiled problem (batch = sequences, the max
lengths) with the lengths of its sequences, packed exactly (no rows after the last sequence).
- inputs: q (total_q, Hq, D), k and v (total_k, Hkv, D), standard normal with a fixed seed (drawn on the
  CPU, as `fa4.reference.random_inputs`), the offsets on the GPU (and on the CPU for "per_sequence",
  whose capture reads them on the host); kept per problem in the worker;
- validated: O (and LSE) by the one rule, `fa4.reference.compare`, against `fa4.varlen.expected_varlen`
  (the fp32 reference and the same-precision answer per sequence, the packed tensors as batch 1);
- timed: GPU time by CUDA-graph replay (`time_cuda`). A trial times its kernel's launch alone
  (`run_varlen`), which is what `fa4.attention_varlen` launches for ours on an exactly packed batch;
  each varlen peer is timed as its kernel's call (`fa4.backends`' `varlen`, without the runtime's
  clearing of rows that see no key, as dense peers are timed), and "per_sequence" as
  `fa4.attention_varlen(backend="per_sequence")` (one `fa4.attention` per sequence, each as the runtime
  dispatches it). Each other implementation's `max_err` is its distance to the fp32 reference on the
  rows that see a key.
"""

from __future__ import annotations

INPUT_SEED = 0


class VarlenInputs:
    """The packed tensors of one `VarlenProblem` and the answers they are held to."""

    def __init__(self, problem, device: str = "cuda"):
        import torch

        from fa4.reference import softmax_scale
        from fa4.varlen import expected_varlen

        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[problem.dtype]
        gen = torch.Generator(device="cpu").manual_seed(INPUT_SEED)
        q = torch.randn((problem.tokens_q, problem.heads_q, problem.head_dim), generator=gen)
        k = torch.randn((problem.tokens_k, problem.heads_kv, problem.head_dim), generator=gen)
        v = torch.randn((problem.tokens_k, problem.heads_kv, problem.head_dim), generator=gen)
        self.q, self.k, self.v = (t.to(device=device, dtype=dtype) for t in (q, k, v))
        offsets_q, offsets_k = problem.cu_seqlens()
        self.cu_q_host = torch.tensor(offsets_q, dtype=torch.int32)
        self.cu_k_host = torch.tensor(offsets_k, dtype=torch.int32)
        self.cu_q, self.cu_k = self.cu_q_host.to(device), self.cu_k_host.to(device)
        self.scale = softmax_scale(problem.head_dim)
        self.masks = {"window_size": problem.window, "softcap": problem.softcap}
        self.expected = expected_varlen(self.q, self.k, self.v, self.cu_q, self.cu_k, problem.causal, self.scale,
                                        **self.masks)
        if self.q.is_cuda:
            torch.cuda.synchronize()


def run_varlen_trial(kernel, inputs: VarlenInputs, problem, timing, validate: bool, perturb: bool) -> dict:
    """A trial's result (`fa4tune.workers.evaluator.KernelEvaluator.run_trial`'s fields) for a kernel
    compiled for the varlen problem."""
    import torch

    from fa4.kernels.compiling import mask_values
    from fa4.reference import compare
    from fa4tune.workers.timing import time_cuda, tflops

    q, k, v = inputs.q, inputs.k, inputs.v
    out = torch.full_like(q, float("nan"))   # a kernel that writes nothing cannot pass
    lse = (torch.full((problem.heads_q, q.shape[0]), float("nan"), device=q.device, dtype=torch.float32)
           if problem.return_lse else None)
    masks = mask_values(problem)

    def run():
        kernel.run_varlen(q, k, v, out, lse, inputs.scale, masks, inputs.cu_q, inputs.cu_k, problem.seqlen_q,
                          problem.seqlen_k)

    run()
    if q.is_cuda:
        torch.cuda.synchronize()
    if perturb:
        out.add_(1.0)
    result: dict = {}
    if validate:
        check = compare(out[None], None if lse is None else lse[None], inputs.expected)
        result.update({name: value for name, value in check.items() if name not in ("passed", "failures")})
        if not check["passed"]:
            result["outcome"] = "mismatch"
            return result
    measured = time_cuda(run, timing)
    result.update(outcome="ok", us=round(measured.us, 3), tflops=round(tflops(problem.flops(), measured.us), 2),
                  replay_spread=round(measured.spread, 4))
    return result


def time_varlen_peers(inputs: VarlenInputs, problem, timing, names, healthy) -> dict:
    """{implementation: {"us", "tflops", "max_err"} or {"error"}} for each peer of `names` and for
    "per_sequence" (module docstring); a peer without a varlen kernel says so."""
    import torch

    import fa4
    from fa4 import backends, varlen
    from fa4tune.workers.outcomes import portable_error, portable_note
    from fa4tune.workers.timing import time_cuda, tflops

    seen = inputs.expected.seen
    with_varlen = {peer.name: peer for peer in varlen.varlen_peers()}
    calls = {}
    for name in names:
        if name not in with_varlen:
            calls[name] = f"{backends.title(name) if name in backends.peer_names() else name} has no varlen kernel"
            continue
        peer = with_varlen[name]
        calls[name] = peer.varlen_unsupported(inputs.q) or (
            lambda peer=peer: peer.varlen(inputs.q, inputs.k, inputs.v, inputs.cu_q, inputs.cu_k, problem.seqlen_q,
                                          problem.seqlen_k, problem.causal, inputs.scale, False,
                                          problem.window, problem.softcap)[0])
    calls[varlen.PER_SEQUENCE] = lambda: fa4.attention_varlen(
        inputs.q, inputs.k, inputs.v, inputs.cu_q_host, inputs.cu_k_host, problem.seqlen_q, problem.seqlen_k,
        causal=problem.causal, softmax_scale=inputs.scale, backend=varlen.PER_SEQUENCE, **inputs.masks)
    out: dict = {}
    for name, call in calls.items():
        if isinstance(call, str):
            out[name] = {"error": portable_note(call)}
            continue
        try:
            with torch.no_grad():
                got = call()
                torch.cuda.synchronize()
                max_err = float((got.float() - inputs.expected.out_fp32[0])[seen].abs().max()) if bool(seen.any()) else 0.0
                measured = time_cuda(call, timing)
            out[name] = {"us": round(measured.us, 3), "tflops": round(tflops(problem.flops(), measured.us), 2),
                         "max_err": round(max_err, 6)}
        except Exception as exc:   # an implementation that cannot run this batch is a result
            out[name] = {"error": portable_error(exc)}
            if not healthy():
                raise
    return out


def time_varlen_dispatched(inputs: VarlenInputs, problem, timing, healthy) -> dict:
    """The bench's "dispatched" row of a varlen batch (`fa4tune.workers.evaluator.dispatched_row`):
    `fa4.attention_varlen` as a user calls it (the database the worker's `fa4.use_config_db` names) on
    the packed tensors (offsets on the GPU), what it runs by `fa4.explain_varlen` in each mode (inside
    a capture a peer pays a pass over O, which the choice counts)."""
    import fa4
    from fa4.reference import compare
    from fa4tune.workers.evaluator import dispatched_row

    args = (inputs.q, inputs.k, inputs.v, inputs.cu_q, inputs.cu_k, problem.seqlen_q, problem.seqlen_k)
    options = dict(causal=problem.causal, softmax_scale=inputs.scale, return_lse=problem.return_lse, **inputs.masks)

    def describe():
        eager, graph = (fa4.explain_varlen(*args, **options, captured=captured) for captured in (False, True))
        return ({"eager": eager.implementation, "graph": graph.implementation},
                eager.config.to_dict() if eager.config is not None else None)

    return dispatched_row(lambda backend="auto": fa4.attention_varlen(*args, backend=backend, **options),
                          lambda out, lse: compare(out[None], None if lse is None else lse[None], inputs.expected),
                          describe, problem, timing, healthy)
