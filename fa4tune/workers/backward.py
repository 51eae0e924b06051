"""A backward trial in a worker (`fa4tune search --backward`): one configuration of our backward kernel's
knob set (`fa4.kernels.BACKWARD_KERNELS`, "sm90_bwd"), compiled, validated and timed as the backward
alone.

The forward that produces O and LSE is fixed per problem: `fa4.attention` as the runtime dispatches it
(the database the worker's process reads), run once per problem and worker with `return_lse=True` under
no_grad, so every trial of a study differentiates the same saved tensors, the ones a training step hands
our backward. dO is random with a fixed seed (that of `fa4tune.workers.training`).

- validated: dQ, dK, dV by flash-attn's rule against fp32 autograd (`fa4.reference.compare_grads`; the
  references computed once per problem), `max_err` the largest of the three errors;
- timed: GPU time of `CompiledBackward.run` (preprocess, main, postprocess, and the workspaces it
  allocates) by CUDA-graph replay (`time_cuda`), captured on the stream the forward ran on;
- tflops: of the backward's five matrix products, 2.5x the forward's FLOPs.
The peers' backward is timed by `fa4tune.workers.training` (the search's "training" task), through autograd.
"""

from __future__ import annotations

# the backward does five (B, S, S, D) matrix products against the forward's two
BACKWARD_FLOPS_RATIO = 2.5
DOUT_SEED = 7   # fa4tune.workers.training's


def compile_backward(config, problem):
    """The launchable backward (`fa4.kernels.sm90_bwd.compile_backward`) for torch's current GPU."""
    import torch

    from fa4.kernels import backward_kernel, device_from_torch

    return backward_kernel(config.arch).compile_backward(config, problem, device_from_torch(torch.cuda.current_device()))


class BackwardInputs:
    """What every backward trial of one problem reads: the forward's inputs and saved tensors, dO, and
    the gradient references."""

    def __init__(self, problem, q, k, v, scale: float):
        import torch

        import fa4
        from fa4.reference import grad_references

        self.q, self.k, self.v, self.scale = q, k, v, scale
        self.dout = torch.randn(q.shape, dtype=q.dtype, device=q.device,
                                generator=torch.Generator(device=q.device).manual_seed(DOUT_SEED))
        masks = {"window_size": problem.window, "softcap": problem.softcap}
        # the forward's stream: a backward replayed on tensors of another stream breaks the capture
        self.stream = torch.cuda.Stream()
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), torch.cuda.stream(self.stream):
            self.out, self.lse = fa4.attention(q, k, v, causal=problem.causal, return_lse=True, **masks)
        torch.cuda.synchronize()
        self.references = grad_references(q, k, v, self.dout, problem.causal, scale,
                                          window=problem.window, softcap=problem.softcap)


def run_backward_trial(kernel, inputs: BackwardInputs, problem, timing, validate: bool, perturb: bool) -> dict:
    """A trial's result (`fa4tune.workers.evaluator.KernelEvaluator.run_trial`'s fields) for a compiled
    backward on `inputs`."""
    import torch

    from fa4.reference import compare_grads
    from fa4tune.workers.timing import time_cuda, tflops

    q, k, v = inputs.q, inputs.k, inputs.v
    # NaN-filled: a kernel that writes nothing cannot pass
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))

    def run():
        kernel.run(q, k, v, inputs.out, inputs.dout, inputs.lse, dq, dk, dv, inputs.scale)

    # the NaN fill above (and, on a problem's first trial in this worker, the references) are queued on
    # the current stream: without this wait the backward ran beside them on its own stream and the fill
    # landed after it (every worker's first trial of B1 S4096 H32/8 failed with NaN gradients, H200)
    inputs.stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(inputs.stream):
        run()
    torch.cuda.synchronize()
    if perturb:
        dq.add_(1.0)
    result: dict = {}
    if validate:
        failures, errors = compare_grads((dq, dk, dv), inputs.references, q.dtype)
        if errors:
            result["max_err"] = round(max(errors.values()), 6)
        if failures:
            result.update(outcome="mismatch", error="gradients: " + "; ".join(failures))
            return result
    measured = time_cuda(run, timing, stream=inputs.stream)
    result.update(outcome="ok", us=round(measured.us, 3),
                  tflops=round(tflops(BACKWARD_FLOPS_RATIO * problem.flops(), measured.us), 2),
                  replay_spread=round(measured.spread, 4))
    return result
