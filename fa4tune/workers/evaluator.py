"""What a worker process runs: the evaluator that compiles a configuration, validates its output and
times it, and the device facts recorded with every result.

A worker loads its evaluator by "module:attribute" (`load_evaluator`), so tests inject a CPU one
(tests/test_search_fakes.py); the default is `fa4tune.workers.evaluator:KernelEvaluator`. An evaluator has
`setup() -> device facts`, `compile_key`, `compile`, `compile_report`, `run_trial`, `time_peers`,
`time_dispatched` (fa4.attention itself, for `fa4tune bench`), `trigger_fault` and `healthy`.
A configuration of a backward knob set (`fa4.kernels.BACKWARD_KERNELS`, `fa4tune search --backward`)
compiles our backward kernel and runs as a backward trial (`fa4tune.workers.backward`). A variable-length
batch (`fa4.varlen_batch.VarlenProblem`, `fa4tune search --varlen`) compiles our varlen kernel and runs
as a varlen trial on packed tensors, its peers being `fa4.attention_varlen`'s other implementations
(`fa4tune.workers.varlen`).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
from typing import Any, Optional

from fa4tune.workers.outcomes import portable_note, portable_error


class KernelEvaluator:
    """Compiles with `fa4.kernels`, validates against SDPA and fp32, times with `fa4tune.workers.timing`."""

    def __init__(self, mode: str):
        self.mode = mode  # "gpu": validate and time; "cpu": compile reports only
        self._inputs: dict = {}

    # -- lifecycle --
    def setup(self) -> dict:
        if self.mode != "gpu":
            return {}
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA GPU is visible to this worker")
        torch.cuda.init()
        torch.cuda.set_device(0)
        torch.zeros(1, device="cuda").add_(1).item()
        return device_info()

    # -- compile --
    def compile_key(self, config, problem):
        from fa4.kernels import compile_key

        return compile_key(config, problem)

    def compile(self, config, problem):
        from fa4.kernels import BACKWARD_KERNELS, compile_attention

        if config.arch in BACKWARD_KERNELS:
            from fa4tune.workers.backward import compile_backward

            return compile_backward(config, problem)
        if _is_varlen_batch(problem):
            problem = problem.base()   # the kernel is compiled for the batch's shape, not its lengths
        return compile_attention(config, problem)

    def compile_report(self, config, problem) -> dict:
        from fa4.kernels.dsl_internals import without_source_locations
        from fa4.kernels import compile_report

        # a report needs ptxas's remarks, not where in our Python each op was built (half its time)
        with without_source_locations():
            return plain(compile_report(config, problem))

    # -- GPU --
    def _cached_inputs(self, problem):
        key = problem
        if key not in self._inputs:
            import torch

            from fa4.reference import Expected, random_inputs, softmax_scale

            self._inputs.clear()  # one problem at a time: keep the GPU memory of one set
            scale = softmax_scale(problem.head_dim)
            q, k, v = random_inputs(problem)
            expected = Expected.of(q, k, v, problem.causal, scale, window=problem.window, softcap=problem.softcap)
            torch.cuda.synchronize()
            self._inputs[key] = (q, k, v, expected, scale)
        return self._inputs[key]

    def _varlen_inputs(self, problem):
        """The packed tensors and references of a varlen batch (one problem's kept)."""
        if problem not in self._inputs:
            from fa4tune.workers.varlen import VarlenInputs

            self._inputs.clear()
            self._inputs[problem] = VarlenInputs(problem)
        return self._inputs[problem]

    def _backward_inputs(self, problem):
        """The saved tensors, dO and gradient references of a backward search's problem (one kept)."""
        key = ("backward", problem)
        if key not in self._inputs:
            from fa4tune.workers.backward import BackwardInputs

            q, k, v, _, scale = self._cached_inputs(problem)
            self._inputs[key] = BackwardInputs(problem, q, k, v, scale)
        return self._inputs[key]

    def run_trial(self, kernel, config, problem, timing, validate: bool, perturb: bool) -> dict:
        import torch

        from fa4.kernels import BACKWARD_KERNELS

        if config.arch in BACKWARD_KERNELS:
            from fa4tune.workers.backward import run_backward_trial

            return run_backward_trial(kernel, self._backward_inputs(problem), problem, timing, validate, perturb)
        if _is_varlen_batch(problem):
            from fa4tune.workers.varlen import run_varlen_trial

            return run_varlen_trial(kernel, self._varlen_inputs(problem), problem, timing, validate, perturb)

        from fa4.kernels.compiling import mask_values
        from fa4.reference import compare
        from fa4tune.workers.timing import time_cuda, tflops

        q, k, v, expected, scale = self._cached_inputs(problem)
        # a kernel that writes nothing cannot pass; O has v's head dim
        out = q.new_full(q.shape[:3] + v.shape[3:], float("nan"))
        lse = (torch.full((problem.batch, problem.heads_q, problem.seqlen_q), float("nan"),
                          device=q.device, dtype=torch.float32) if problem.return_lse else None)
        masks = mask_values(problem)
        run = kernel.run if masks is None else (lambda *args: kernel.run(*args, masks=masks))
        run(q, k, v, out, lse, scale)
        torch.cuda.synchronize()
        if perturb:
            out.add_(1.0)
        result: dict = {}
        if validate:
            check = compare(out, lse, expected)
            # what a trial records: the errors and the failure text, not the verdict's own fields
            result.update({name: value for name, value in check.items() if name not in ("passed", "failures")})
            if not check["passed"]:
                result["outcome"] = "mismatch"
                return result
        measured = time_cuda(lambda: run(q, k, v, out, lse, scale), timing)
        result.update(outcome="ok", us=round(measured.us, 3),
                      tflops=round(tflops(problem.flops(), measured.us), 2),
                      replay_spread=round(measured.spread, 4))
        return result

    def time_peers(self, problem, timing, names, eager: bool = False) -> dict:
        """GPU time of each peer by CUDA-graph replay; with `eager`, also its wall time per
        back-to-back eager call (the bench's eager comparison; a search has no use for it). A varlen
        batch's: `fa4.attention_varlen`'s other implementations (`fa4tune.workers.varlen`)."""
        import torch

        if _is_varlen_batch(problem):
            from fa4tune.workers.varlen import time_varlen_peers

            return time_varlen_peers(self._varlen_inputs(problem), problem, timing, names, self.healthy)

        from fa4tune.workers.peers import peer_available, peer_call
        from fa4tune.workers.timing import time_cuda, time_eager, tflops

        q, k, v, expected, scale = self._cached_inputs(problem)
        out: dict = {}
        for name in names:
            why_not = peer_available(name)
            if why_not:
                out[name] = {"error": portable_note(why_not)}
                continue
            try:
                call, notes = peer_call(name, q, k, v, problem.causal, scale, problem.window, problem.softcap)
                got = call()
                torch.cuda.synchronize()
                max_err = float((got.float() - expected.out_fp32).abs().max())
                measured = time_cuda(call, timing)
                out[name] = {"us": round(measured.us, 3),
                             "tflops": round(tflops(problem.flops(), measured.us), 2),
                             "max_err": round(max_err, 6), **notes}
                if eager:  # the same call back to back: what an eager caller of this peer pays per call
                    out[name]["eager_us"] = round(time_eager(call), 3)
            except Exception as exc:  # a peer that cannot run this shape is a result, not a crash
                out[name] = {"error": portable_error(exc)}
                if not self.healthy():
                    raise
        return out

    def time_training(self, problem, timing, names) -> dict:
        """Forward + backward and backward alone of `fa4.attention` ("fa4") and of the peers named
        (`fa4tune.workers.training`)."""
        from fa4tune.workers.training import time_training

        q, k, v, _, _ = self._cached_inputs(problem)
        return time_training(problem, timing, names, (q, k, v), self.healthy)

    def time_dispatched(self, problem, timing, db_path: Optional[str]) -> dict:
        """`fa4.attention` itself on the problem, with the database the bench reads: what it runs per
        mode (`fa4.explain`), its output checked, its GPU time by CUDA-graph replay (graph mode:
        dispatch judges by GPU time there) and its wall time per back-to-back eager call; and, as
        "ours_eager_us", the eager wall time of our kernel through the runtime forced
        (backend="ours"), so the eager comparison has ours beside the peers' eager times. That extra
        time is optional: if it fails, the field is left out ("ours_eager_error" says why) and the
        dispatched row stands. A varlen batch's: `fa4.attention_varlen` on its packed tensors
        (`fa4tune.workers.varlen.time_varlen_dispatched`)."""
        import fa4
        from fa4.reference import compare

        fa4.use_config_db(db_path)  # None: the default layers, as a user's process reads them
        if _is_varlen_batch(problem):   # fa4.attention_varlen, as a user calls it
            from fa4tune.workers.varlen import time_varlen_dispatched

            return time_varlen_dispatched(self._varlen_inputs(problem), problem, timing, self.healthy)
        q, k, v, expected, _ = self._cached_inputs(problem)
        options = dict(causal=problem.causal, return_lse=problem.return_lse, window_size=problem.window,
                       softcap=problem.softcap)

        def describe():
            plan = fa4.explain(q, k, v, **options)
            # the configuration ours runs here, to compare the dispatched row with the default row
            return dict(plan.runs), plan.config.to_dict() if plan.config is not None else None

        return dispatched_row(lambda backend="auto": fa4.attention(q, k, v, backend=backend, **options),
                              lambda out, lse: compare(out, lse, expected), describe, problem, timing,
                              self.healthy)

    def trigger_fault(self) -> None:
        """A real sticky CUDA error (device-side assert from an out-of-bounds index)."""
        import torch

        if self.mode != "gpu" or not torch.cuda.is_available():
            os.kill(os.getpid(), signal.SIGSEGV)
        x = torch.zeros(4, device="cuda")
        index = torch.tensor([1 << 30], device="cuda")
        x[index] = 1.0
        torch.cuda.synchronize()

    def healthy(self) -> bool:
        if self.mode != "gpu":
            return True
        try:
            import torch

            torch.cuda.synchronize()
            return torch.ones(1, device="cuda").add_(1).item() == 2.0
        except Exception:
            return False


def dispatched_row(call, check, describe, problem, timing, healthy) -> dict:
    """The bench's "dispatched" row (`KernelEvaluator.time_dispatched`): `call(backend="auto")` as a
    user makes it, its output held to the one rule (`check(out, lse)`, `fa4.reference.compare`'s
    fields), what it runs (`describe()`: ({mode: implementation}, ours' configuration or None)), its
    GPU time by CUDA-graph replay and its eager wall time per call; "ours_eager_us" with
    `call(backend="ours")`, or "ours_eager_error" where ours cannot run (a broken GPU raises)."""
    import torch

    from fa4tune.workers.timing import time_cuda, time_eager, tflops

    with torch.no_grad():
        first = call()
        torch.cuda.synchronize()
        out, lse = first if problem.return_lse else (first, None)
        checked = check(out, lse)
        result = {name: value for name, value in checked.items() if name not in ("passed", "failures")}
        result["backend"], result["config"] = describe()
        if not checked["passed"]:
            return {**result, "outcome": "mismatch"}
        measured = time_cuda(call, timing)
        eager_us = time_eager(call)
        result.update(outcome="ok", us=round(measured.us, 3), eager_us=round(eager_us, 3),
                      tflops=round(tflops(problem.flops(), measured.us), 2),
                      replay_spread=round(measured.spread, 4))
        try:
            result["ours_eager_us"] = round(time_eager(lambda: call(backend="ours")), 3)
        except Exception as exc:  # ours forced cannot run here: the dispatched row still holds
            if not healthy():
                raise
            result["ours_eager_error"] = portable_error(exc)
    return result


def _is_varlen_batch(problem) -> bool:
    """A `fa4.varlen_batch.VarlenProblem` (a varlen problem with its sequences' lengths)."""
    return getattr(problem, "lengths_q", None) is not None


def device_info() -> dict:
    """The GPU's facts recorded with every result: its name, compute capability and driver, and the
    facts the kernels read of it (`fa4.kernels.DeviceDescription`: SM count, shared memory per block,
    L2), from which the search judges and seeds its configurations (`search_runner.worker_device`)."""
    import torch

    from fa4.kernels import device_from_torch

    described = device_from_torch(torch.cuda.current_device())
    return {"name": described.name, "sm_count": described.sm_count,
            "smem_per_block_bytes": described.smem_per_block_bytes, "l2_bytes": described.l2_bytes,
            "cc": "{}.{}".format(*described.capability), "driver": _driver_version()}


def _driver_version() -> Optional[str]:
    with contextlib.suppress(Exception):
        import pynvml

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    with contextlib.suppress(Exception):
        import subprocess

        text = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20).stdout.strip()
        if text:
            return text.splitlines()[0]
    return None


def plain(obj: Any) -> Any:
    """A compile report as JSON-able data (dict, dataclass, object with to_dict, or its repr)."""
    import dataclasses

    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, dict):
        return {str(k): plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    if dataclasses.is_dataclass(obj):
        return plain(dataclasses.asdict(obj))
    if hasattr(obj, "to_dict"):
        return plain(obj.to_dict())
    return repr(obj)


def load_evaluator(path: str, mode: str):
    module_name, _, attr = path.partition(":")
    if not attr:
        raise ValueError(f"evaluator must be 'module:attribute', got {path!r}")
    return getattr(importlib.import_module(module_name), attr)(mode)
