"""The training pass timed in a worker (`fa4tune bench --backward`): forward + backward and backward
alone, for `fa4.attention` (its dispatched forward and the backward `fa4.backward` chooses) and for each
peer called through autograd as the runtime calls its forward (`fa4.backends.runner`).

Per implementation, on the bench's inputs (dO random, fixed seed):
- fwdbwd_us: GPU time of forward + `torch.autograd.grad` to Q, K, V, by CUDA-graph replay;
- bwd_us: GPU time of the backward alone, replayed on one forward's saved tensors;
- bwd_peak_extra_mib: the most memory one backward call allocated beyond what was live before it
  (its outputs dQ, dK, dV included), eager;
- validated: dQ, dK, dV checked against fp32 autograd with flash-attn's rule
  (`fa4.reference.compare_grads`; a failure is the implementation's error; the references, computed a
  chunk of query rows at a time, once per task);
- backward (fa4 only): the backward implementation that ran.
A peer that refuses GQA runs on K and V expanded to the query heads (the expansion inside the timed
call, since its gradient flows back through it) and says so (`kv_expanded`).
"""

from __future__ import annotations

from typing import Callable

from fa4 import backends
from fa4.reference import compare_grads, grad_references, softmax_scale

FA4 = "fa4"   # the row of fa4.attention itself


def forward_of(name: str, problem) -> tuple[Callable, dict]:
    """(forward(q, k, v) -> O through autograd, notes) for `name` ("fa4" or a peer)."""
    import fa4

    scale = softmax_scale(problem.head_dim)
    if name == FA4:
        return (lambda q, k, v: fa4.attention(q, k, v, causal=problem.causal, window_size=problem.window,
                                              softcap=problem.softcap)), {}
    why = backends.unsupported(name, problem)
    if why:
        raise RuntimeError(why)
    run = backends.runner(name, problem.causal, **({} if problem.window is None and problem.softcap is None
                                                   else {"window": problem.window, "softcap": problem.softcap}))
    if backends.get(name).expand_kv_if_refused and problem.gqa_ratio > 1:
        group = problem.gqa_ratio

        def expanded(q, k, v):
            return run(q, k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2), scale, False)[0]
        return expanded, {"kv_expanded": True}
    return (lambda q, k, v: run(q, k, v, scale, False)[0]), {}


def time_training(problem, timing, names, inputs, healthy: Callable[[], bool]) -> dict:
    """{name: measurements or {"error"}} (module docstring); `inputs`: (q, k, v) of the problem;
    `healthy`: the evaluator's check that the GPU still works after a failure."""
    import torch

    from fa4tune.workers.outcomes import portable_error
    from fa4tune.workers.timing import time_cuda

    q, k, v = (t.detach().requires_grad_() for t in inputs)
    dout = torch.randn(q.shape, dtype=q.dtype, device=q.device,
                       generator=torch.Generator(device=q.device).manual_seed(7))
    references = None
    out: dict = {}
    for name in names:
        try:
            forward, notes = forward_of(name, problem)

            def fwd_bwd():
                return torch.autograd.grad(forward(q, k, v), (q, k, v), dout)

            grads = fwd_bwd()
            torch.cuda.synchronize()
            result = {**notes, "validated": True}
            if references is None:
                references = grad_references(q, k, v, dout, problem.causal, window=problem.window,
                                             softcap=problem.softcap)
            failures = compare_grads(grads, references, q.dtype)[0]
            if failures:
                out[name] = {**result, "error": "gradients: " + "; ".join(failures)}
                continue
            # the backward alone is captured on the stream its forward ran on (`time_cuda`)
            backward_stream = torch.cuda.Stream()
            backward_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(backward_stream):
                saved = forward(q, k, v)
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            torch.autograd.grad(saved, (q, k, v), dout, retain_graph=True)
            torch.cuda.synchronize()
            result["bwd_peak_extra_mib"] = round((torch.cuda.max_memory_allocated() - before) / 2**20, 1)
            result["fwdbwd_us"] = round(time_cuda(fwd_bwd, timing).us, 3)
            result["bwd_us"] = round(time_cuda(
                lambda: torch.autograd.grad(saved, (q, k, v), dout, retain_graph=True), timing,
                stream=backward_stream).us, 3)
            if name == FA4:
                from fa4.backward import choose

                result["backward"] = choose(q, window=problem.window, softcap=problem.softcap, k=k,
                                                causal=problem.causal)[0]
            out[name] = result
            del saved, grads
        except Exception as exc:  # an implementation that cannot train this shape is a result, not a crash
            out[name] = {"error": portable_error(exc)}
            if not healthy():
                raise
    return out

