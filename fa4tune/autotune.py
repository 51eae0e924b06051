"""The harness's tuner for autotune on first use (`fa4.autotune`), registered under the entry point group
`fa4.tuners`: `tune(request)` measures a short list of configurations in the search's worker processes
and returns what it measured by the request's deadline.

Where it runs: in a child process (`python -m fa4tune.autotune`, its own session) that starts the
search's worker pool (`fa4tune.workers.pool`: compile, validate against the fp32 reference and SDPA
with the search's tolerance, time by CUDA-graph replay, a fault or hang killing a worker, never the
caller). Not the caller's process: the pool's spawned workers would re-run a user's script as their
main module, and at the deadline one signal to the child's process group stops everything at once.
The child prints each result as one JSON line as it arrives, so what finished before the deadline
counts.

The candidates (`candidates`), in order, cut to `request.max_configs`, each judged feasible on the GPU
by the kernel family first:
1. the heuristic default (a tune is never worse than the untuned call);
2. the best configurations of the nearest tuned entries of the same architecture, dtype and head dim
   (the search's warm start, `fa4tune.searches.warm_start`, over the database layers the runtime reads);
3. single-knob moves away from the default through the search space (`search_spaces/<arch>.toml`),
   round-robin over the knobs (each knob's first other value, then each knob's second, ...), so a
   short list varies every knob once rather than one knob many times.
The runtime records the fastest (`fa4.autotune.tune_and_record`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from typing import Iterator, Optional

from fa4.autotuning import Measured, TuneRequest, TuneResult
from fa4.kernels import AttentionProblem, Config, DeviceDescription
from fa4tune.workers.pool import DEFAULT_EVALUATOR

def candidates(arch: str, problem: AttentionProblem, device: DeviceDescription, limit: int) -> list[tuple[Config, str]]:
    """[(configuration, where it came from)], at most `limit`, feasible on `device` (module docstring)."""
    from fa4 import database, kernels
    from fa4tune.inputs.space import load_space
    from fa4tune.searches.warm_start import warm_start_configs

    default = kernels.default_config(arch, problem, device)
    space = load_space(arch)
    chosen: list[tuple[Config, str]] = [(default, "default")]
    seen = {default}

    def take(config: Config, source: str) -> None:
        if len(chosen) < limit and config not in seen and not kernels.feasible(config, problem, device):
            seen.add(config)
            chosen.append((config, source))

    try:
        db = database.BestConfigDB.load_layers()
        fingerprint = kernels.kernel_fingerprint(arch)
        choices = {name: list(values) + ([getattr(default, name)] if getattr(default, name) not in values else [])
                   for name, values in space.choices}
        for values, key in warm_start_configs(db, arch, device.name, problem, fingerprint, choices,
                                              default.to_dict()):
            take(Config.from_dict(arch, values), f"neighbour {key}")
    except Exception:  # no readable database: the moves below still make a list
        pass
    for name, value in _moves(space, default):
        take(default.replace(**{name: value}), f"default with {name}={value}")
    return chosen


def _moves(space, default: Config) -> Iterator[tuple[str, object]]:
    others = [(name, [v for v in values if v != getattr(default, name)]) for name, values in space.choices]
    for rank in range(max((len(v) for _, v in others), default=0)):
        for name, values in others:
            if rank < len(values):
                yield name, values[rank]


def tune(request: TuneRequest, evaluator: str = DEFAULT_EVALUATOR) -> TuneResult:
    """Measure the candidates of `request` in a child process until they are done or the deadline
    passes (then the child's whole process group is killed); what finished is returned."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpu = visible.split(",")[request.gpu_index].strip() if visible else str(request.gpu_index)
    job = {"arch": request.arch, "problem": request.problem.to_dict(),
           "device": dataclasses.asdict(request.device), "gpu": gpu, "max_configs": request.max_configs,
           "seconds": max(0.0, request.deadline - time.monotonic()), "evaluator": evaluator}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    child = subprocess.Popen([sys.executable, "-m", "fa4tune.autotune"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True,
                             start_new_session=True)
    result = TuneResult()
    lines: queue.Queue = queue.Queue()
    # a thread reads the child's lines, so the wait for them can stop at the deadline
    reader = threading.Thread(target=lambda: [lines.put(line) for line in child.stdout] + [lines.put(None)],
                              daemon=True)
    try:
        child.stdin.write(json.dumps(job))
        child.stdin.close()
        reader.start()
        while True:
            try:
                line = lines.get(timeout=max(0.0, request.deadline - time.monotonic()))
            except queue.Empty:
                result.notes.append(f"the budget ended with {result.tried - len(result.measured)} of "
                                    f"{result.tried} configurations unmeasured or failed")
                break
            if line is None:
                break
            _take(result, json.loads(line))
    finally:
        _kill_group(child)
    return result


def _take(result: TuneResult, message: dict) -> None:
    if "tried" in message:
        result.tried, result.versions = message["tried"], message["versions"]
    elif message.get("outcome") == "ok":
        result.measured.append(Measured(config=message["config"], us=message["us"],
                                        max_err=message.get("max_err"), is_default=message["is_default"]))
    elif "outcome" in message:
        result.notes.append(f"{message['label']}: {message['outcome']}")
    elif "error" in message:
        result.notes.append(message["error"])


def _kill_group(child: subprocess.Popen) -> None:
    if child.poll() is None:
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    child.wait()


# ------------------------------------------------------------------------------------------------
# the child process

def _child(job: dict, out) -> None:
    from fa4tune.environment import versions
    from fa4tune.workers.pool import WorkerPool
    from fa4tune.workers.timing import TimingSettings

    deadline = time.monotonic() + job["seconds"]
    arch, problem = job["arch"], AttentionProblem(**job["problem"])
    fields = dict(job["device"], capability=tuple(job["device"]["capability"]))
    device = DeviceDescription(**fields)
    chosen = candidates(arch, problem, device, job["max_configs"])

    def say(message: dict) -> None:
        out.write(json.dumps(message) + "\n")
        out.flush()

    say({"tried": len(chosen), "versions": versions()})
    processes = min(len(chosen), max(1, (os.cpu_count() or 2) // 2), 8)
    limit = max(1.0, job["seconds"])
    pool = WorkerPool(processes, [job["gpu"]], evaluator=job["evaluator"], mode="gpu", arch=arch,
                      compile_timeout_s=limit, trial_timeout_s=limit, startup_timeout_s=limit)
    timing = TimingSettings().to_dict()
    try:
        pool.start(wait_ready=False)
        tasks = {}
        for config, source in chosen:
            payload = {"arch": arch, "config": config.to_dict(), "problem": problem.to_dict(), "timing": timing}
            tasks[pool.submit("trial", payload, compile_key=None)] = (config, source)
        while tasks and time.monotonic() < deadline:
            for task_id, measured in pool.poll(min(1.0, max(0.0, deadline - time.monotonic()))):
                config, source = tasks.pop(task_id)
                say({"config": config.to_dict(), "label": config.label(), "source": source,
                     "is_default": source == "default", "outcome": measured.get("outcome"),
                     "us": measured.get("us"), "max_err": measured.get("max_err")})
    finally:
        pool.kill()


if __name__ == "__main__":
    try:
        _child(json.loads(sys.stdin.read()), sys.stdout)
    except Exception as exc:  # the caller runs untuned and says why
        from fa4tune.workers.outcomes import portable_error

        print(json.dumps({"error": portable_error(exc)}), flush=True)
