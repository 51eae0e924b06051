"""Worker processes: compile, validate and time configurations where a crash cannot end the search.

Why processes: a GPU fault (illegal address, device-side assert) poisons the CUDA context of the
process it happens in, and a hung kernel never returns. So every trial runs in a worker process; the
parent (`fa4tune.workers.pool.WorkerPool`) classifies what happened and replaces a worker that died, faulted
or hung. This module is the worker's side.

How compiled kernels reach the GPU: compilation happens inside the worker. Each worker process is
bound to one GPU (`CUDA_VISIBLE_DEVICES`) and compiles on its own CPU core; the GPU part of a trial
(validation, timing) runs under an exclusive per-GPU file lock (`filelock`: an `flock`, released by the kernel
when a holder dies), so while one worker times, the others compile the next trials. No kernel object
crosses a process boundary. A worker caches its compiled kernels by `fa4.kernels.compile_key`.

Outcomes of a trial: `fa4tune.workers.outcomes` (a worker reports ok or one of its WORKER_FAILURES; the
parent decides "infeasible" before any worker sees a trial). What compiles and measures is the
evaluator (`fa4tune.workers.evaluator`).

Test-only fault injection (read here, in the worker, and nowhere else): the environment variable
`FA4TUNE_INJECT_FAULT` holds rules separated by ";", each `<outcome>@<knob>=<value>[,<knob>=<value>]`
or `<outcome>@*`, e.g. `fault@tile_n=80;timeout@kv_stages=4`. A trial whose configuration matches a
rule behaves as that outcome: compile_error raises in compilation, launch_error raises at launch,
fault triggers a real device-side assert on a GPU (on CPU the worker kills itself with SIGSEGV),
timeout sleeps forever holding the GPU lock, mismatch perturbs the output before validation.
"""

from __future__ import annotations

import contextlib
import os
import time
import traceback
from typing import Any, Optional

from fa4tune.workers.evaluator import load_evaluator
from fa4tune.workers.outcomes import WORKER_FAILURES, portable_error

INJECT_ENV = "FA4TUNE_INJECT_FAULT"
_INJECTABLE = WORKER_FAILURES


class InjectedFault(RuntimeError):
    """Raised by the test-only fault injection."""


# ------------------------------------------------------------------------------------------------
# fault injection (tests only)

def parse_injections(text: Optional[str]) -> list[tuple[str, dict]]:
    rules = []
    for part in (text or "").split(";"):
        part = part.strip()
        if not part:
            continue
        outcome, _, match = part.partition("@")
        if outcome not in _INJECTABLE:
            raise ValueError(f"{INJECT_ENV}: cannot inject {outcome!r}; one of {_INJECTABLE}")
        conditions: dict[str, str] = {}
        if match.strip() not in ("", "*"):
            for cond in match.split(","):
                name, eq, value = cond.partition("=")
                if not eq:
                    raise ValueError(f"{INJECT_ENV}: expected knob=value, got {cond!r}")
                conditions[name.strip()] = value.strip()
        elif not match.strip():
            raise ValueError(f"{INJECT_ENV}: rule {part!r} needs @<knob>=<value> or @*")
        rules.append((outcome, conditions))
    return rules


def _value_text(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _norm(text: str) -> str:
    text = text.strip().lower()
    try:
        number = float(text)
    except ValueError:
        return text
    return str(int(number)) if number.is_integer() else str(number)


def injected_outcome(rules, config: dict) -> Optional[str]:
    for outcome, conditions in rules:
        if all(name in config and _norm(_value_text(config[name])) == _norm(value)
               for name, value in conditions.items()):
            return outcome
    return None


# ------------------------------------------------------------------------------------------------
# the worker process

@contextlib.contextmanager
def gpu_lock(path: Optional[str]):
    """The GPU phase of a trial holds its GPU's lock (None: no GPU, no lock)."""
    if path is None:
        yield
        return
    from filelock import FileLock  # an flock on a lock file, which the kernel drops when a holder dies

    with FileLock(path):
        yield


class _CompileFailure:
    def __init__(self, error: str):
        self.error = error


def worker_main(conn, spec: dict) -> None:
    """Entry point of a worker process (spawned; imports nothing heavy before the GPU is chosen)."""
    if spec.get("gpu_index") is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(spec["gpu_index"])
    from fa4.arch import DSL_TARGET  # after the GPU is chosen: it imports torch

    if spec["mode"] == "cpu" and spec.get("arch") in DSL_TARGET:
        os.environ.setdefault("CUTE_DSL_ARCH", DSL_TARGET[spec["arch"]])
    try:
        rules = parse_injections(os.environ.get(INJECT_ENV))
        evaluator = load_evaluator(spec["evaluator"], spec["mode"])
        info = evaluator.setup()
    except Exception as exc:
        conn.send(("setup_error", portable_error(exc), traceback.format_exc(limit=5)))
        return
    conn.send(("ready", info))
    compiled: dict = {}
    lock_path = spec.get("lock_path")
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        kind, task_id, payload = message
        if kind == "stop":
            return
        if kind == "trial":
            result, retire = _run_trial(conn, evaluator, rules, compiled, lock_path, task_id, payload)
        elif kind == "peers":
            result, retire = _run_peers(conn, evaluator, lock_path, task_id, payload)
        elif kind == "dispatched":
            result, retire = _run_dispatched(conn, evaluator, lock_path, task_id, payload)
        elif kind == "training":
            result, retire = _run_training(conn, evaluator, lock_path, task_id, payload)
        elif kind == "report":
            result, retire = _run_report(evaluator, payload), False
        else:
            result, retire = {"outcome": "launch_error", "error": f"unknown task {kind!r}"}, False
        conn.send(("done", task_id, result))
        if retire:
            conn.close()
            os._exit(3)  # the CUDA context is poisoned: the pool starts a fresh worker


def _problem_and_config(payload):
    from fa4.kernels import Config
    from fa4.varlen_batch import problem_from_dict

    problem = problem_from_dict(payload["problem"])
    config = Config.from_dict(payload["arch"], payload["config"])
    return problem, config


def _run_trial(conn, evaluator, rules, compiled, lock_path, task_id, payload):
    from fa4tune.workers.timing import TimingSettings

    problem, config = _problem_and_config(payload)
    inject = injected_outcome(rules, config.to_dict())
    result: dict = {}
    t0 = time.perf_counter()
    try:
        key = evaluator.compile_key(config, problem)
    except Exception as exc:
        return {"outcome": "compile_error", "error": portable_error(exc)}, False
    kernel = compiled.get(key)
    if kernel is None:
        try:
            if inject == "compile_error":
                raise InjectedFault("injected compile error")
            kernel = evaluator.compile(config, problem)
        except Exception as exc:
            kernel = _CompileFailure(portable_error(exc))
        compiled[key] = kernel
        result["compile_s"] = round(time.perf_counter() - t0, 3)
        result["compile_cached"] = False
    else:
        result["compile_s"] = 0.0
        result["compile_cached"] = True
    if isinstance(kernel, _CompileFailure):
        result.update(outcome="compile_error", error=kernel.error)
        return result, False
    conn.send(("phase", task_id, "compiled", {"compile_s": result["compile_s"]}))
    with gpu_lock(lock_path):
        conn.send(("phase", task_id, "gpu", {}))
        t_gpu = time.perf_counter()
        try:
            if inject == "timeout":
                while True:
                    time.sleep(3600)
            if inject == "fault":
                evaluator.trigger_fault()
            if inject == "launch_error":
                raise InjectedFault("injected launch error")
            measured = evaluator.run_trial(kernel, config, problem,
                                           TimingSettings.from_dict(payload["timing"]),
                                           payload.get("validate", True), perturb=inject == "mismatch")
            result.update(measured)
            retire = False
        except Exception as exc:
            retire = not evaluator.healthy()
            result.update(outcome="fault" if retire else "launch_error", error=portable_error(exc))
        result["gpu_s"] = round(time.perf_counter() - t_gpu, 3)
    result.pop("passed", None)
    return result, retire


def _run_gpu_task(conn, lock_path, task_id, payload, evaluator, measure):
    """A task whose whole work is on the GPU, under the GPU lock: `measure(problem, timing)` gives the
    result; an exception is a launch error, or a fault (the worker retires) when the GPU is no longer
    healthy."""
    from fa4.varlen_batch import problem_from_dict
    from fa4tune.workers.timing import TimingSettings

    problem = problem_from_dict(payload["problem"])
    with gpu_lock(lock_path):
        conn.send(("phase", task_id, "gpu", {}))
        try:
            return measure(problem, TimingSettings.from_dict(payload["timing"])), False
        except Exception as exc:
            retire = not evaluator.healthy()
            return {"outcome": "fault" if retire else "launch_error", "error": portable_error(exc)}, retire


def _run_peers(conn, evaluator, lock_path, task_id, payload):
    return _run_gpu_task(conn, lock_path, task_id, payload, evaluator, lambda problem, timing: {
        "outcome": "ok", "peers": evaluator.time_peers(problem, timing, payload["names"],
                                                       eager=payload.get("eager", False))})


def _run_training(conn, evaluator, lock_path, task_id, payload):
    return _run_gpu_task(conn, lock_path, task_id, payload, evaluator, lambda problem, timing: {
        "outcome": "ok", "training": evaluator.time_training(problem, timing, payload["names"])})


def _run_dispatched(conn, evaluator, lock_path, task_id, payload):
    return _run_gpu_task(conn, lock_path, task_id, payload, evaluator, lambda problem, timing:
                         evaluator.time_dispatched(problem, timing, payload.get("db_path")))


def _run_report(evaluator, payload):
    problem, config = _problem_and_config(payload)
    t0 = time.perf_counter()
    try:
        report = evaluator.compile_report(config, problem)
        result = {"outcome": "ok", "report": report, "compile_s": round(time.perf_counter() - t0, 3)}
        if isinstance(report, dict):
            if report.get("ok") is False:  # a family may report a failed compile instead of raising
                result.update(outcome="compile_error", error=portable_error(str(report.get("error", "failed"))))
            # what the feasibility model should have rejected: the compiler's own verdict
            warnings = []
            if report.get("spill_stores") or report.get("spill_loads") or report.get("spills"):
                warnings.append("register spills")
            if report.get("wgmma_serialized"):
                warnings.append("wgmma serialized for lack of registers")
            if warnings:
                result["warnings"] = warnings
        return result
    except Exception as exc:
        return {"outcome": "compile_error", "error": portable_error(exc),
                "compile_s": round(time.perf_counter() - t0, 3)}
