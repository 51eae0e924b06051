"""Worker processes: compile, validate and time configurations where a crash cannot end the search.

Why processes: a GPU fault (illegal address, device-side assert) poisons the CUDA context of the
process it happens in, and a hung kernel never returns. So every trial runs in a worker process; the
parent (`WorkerPool`, used by `fa4tune.search`) classifies what happened and replaces a worker that
died, faulted or hung.

How compiled kernels reach the GPU: compilation happens inside the pool. Each worker process is bound
to one GPU (`CUDA_VISIBLE_DEVICES`) and compiles on its own CPU core; the GPU part of a trial
(validation, timing) runs under an exclusive per-GPU file lock (`fcntl.flock`, released by the kernel
when a holder dies), so while one worker times, the others compile the next trials. No kernel object
crosses a process boundary. Identical compile keys are compiled once: a worker caches its compiled
kernels by `fa4.kernels.compile_key`, and the pool sends a task whose key a worker already holds to
that worker.

Outcomes of a trial: `fa4tune.outcomes` (a worker reports ok or one of its WORKER_FAILURES; the
parent decides "infeasible" before any worker sees a trial).

Test-only fault injection (read here, in the worker, and nowhere else): the environment variable
`FA4TUNE_INJECT_FAULT` holds rules separated by ";", each `<outcome>@<knob>=<value>[,<knob>=<value>]`
or `<outcome>@*`, e.g. `fault@tile_n=80;timeout@kv_stages=4`. A trial whose configuration matches a
rule behaves as that outcome: compile_error raises in compilation, launch_error raises at launch,
fault triggers a real device-side assert on a GPU (on CPU the worker kills itself with SIGSEGV),
timeout sleeps forever holding the GPU lock, mismatch perturbs the output before validation.

The evaluator (what compiles and measures) is named by "module:attribute" so tests can inject a CPU
one; the default is `fa4tune.worker:KernelEvaluator`.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import multiprocessing as mp
import os
import signal
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import wait as mp_wait
from typing import Any, Optional

from fa4tune.outcomes import WORKER_FAILURES

INJECT_ENV = "FA4TUNE_INJECT_FAULT"
DEFAULT_EVALUATOR = "fa4tune.worker:KernelEvaluator"
_INJECTABLE = WORKER_FAILURES


class InjectedFault(RuntimeError):
    """Raised by the test-only fault injection."""


class PoolError(RuntimeError):
    """The pool cannot run (no worker starts, e.g. no GPU, or the evaluator cannot be imported)."""


def short_error(exc: BaseException | str, limit: int = 400) -> str:
    text = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
    lines = [ln for ln in str(text).strip().splitlines() if ln.strip()]
    if not lines:
        return str(text)[:limit]
    # DSL and CUDA errors put the useful line last, Python puts it first: keep both ends
    joined = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"
    return joined[:limit]


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
# evaluators: what a worker runs

class KernelEvaluator:
    """Compiles with `fa4.kernels`, validates against SDPA and fp32, times with `fa4tune.timing`."""

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
        from fa4.kernels import compile_attention

        return compile_attention(config, problem)

    def compile_report(self, config, problem) -> dict:
        from fa4.kernels import compile_report

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
            expected = Expected.of(q, k, v, problem.causal, scale)
            torch.cuda.synchronize()
            self._inputs[key] = (q, k, v, expected, scale)
        return self._inputs[key]

    def run_trial(self, kernel, config, problem, timing, validate: bool, perturb: bool) -> dict:
        import torch

        from fa4tune.timing import time_cuda, tflops

        from fa4.reference import compare

        q, k, v, expected, scale = self._cached_inputs(problem)
        out = torch.full_like(q, float("nan"))  # a kernel that writes nothing cannot pass
        lse = (torch.full((problem.batch, problem.heads_q, problem.seqlen_q), float("nan"),
                          device=q.device, dtype=torch.float32) if problem.return_lse else None)
        kernel.run(q, k, v, out, lse, scale)
        torch.cuda.synchronize()
        if perturb:
            out.add_(1.0)
        result: dict = {}
        if validate:
            check = compare(out, lse, expected)
            result.update({k: v for k, v in check.items() if k not in ("passed", "failures")})
            if not check["passed"]:
                result["outcome"] = "mismatch"
                return result
        measured = time_cuda(lambda: kernel.run(q, k, v, out, lse, scale), timing)
        result.update(outcome="ok", us=round(measured.us, 3),
                      tflops=round(tflops(problem.flops(), measured.us), 2),
                      replay_spread=round(measured.spread, 4))
        return result

    def time_peers(self, problem, timing, names) -> dict:
        import torch

        from fa4tune.peers import peer_available, peer_call
        from fa4tune.timing import time_cuda, tflops

        q, k, v, expected, scale = self._cached_inputs(problem)
        out: dict = {}
        for name in names:
            why_not = peer_available(name)
            if why_not:
                out[name] = {"error": why_not}
                continue
            try:
                call, notes = peer_call(name, q, k, v, problem.causal, scale)
                got = call()
                torch.cuda.synchronize()
                max_err = float((got.float() - expected.out_fp32).abs().max())
                measured = time_cuda(call, timing)
                out[name] = {"us": round(measured.us, 3),
                             "tflops": round(tflops(problem.flops(), measured.us), 2),
                             "max_err": round(max_err, 6), **notes}
            except Exception as exc:  # a peer that cannot run this shape is a result, not a crash
                out[name] = {"error": short_error(exc)}
                if not self.healthy():
                    raise
        return out

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


def device_info() -> dict:
    import torch

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {"name": props.name, "sm_count": props.multi_processor_count,
            "cc": f"{props.major}.{props.minor}", "driver": _driver_version()}


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


# ------------------------------------------------------------------------------------------------
# the worker process

@contextlib.contextmanager
def gpu_lock(path: Optional[str]):
    if path is None:
        yield
        return
    with open(path, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


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
        conn.send(("setup_error", short_error(exc), traceback.format_exc(limit=5)))
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
        elif kind == "report":
            result, retire = _run_report(evaluator, payload), False
        else:
            result, retire = {"outcome": "launch_error", "error": f"unknown task {kind!r}"}, False
        conn.send(("done", task_id, result))
        if retire:
            conn.close()
            os._exit(3)  # the CUDA context is poisoned: the pool starts a fresh worker


def _problem_and_config(payload):
    from fa4.kernels import AttentionProblem, Config

    problem = AttentionProblem(**payload["problem"])
    config = Config.from_dict(payload["arch"], payload["config"])
    return problem, config


def _run_trial(conn, evaluator, rules, compiled, lock_path, task_id, payload):
    from fa4tune.timing import TimingSettings

    problem, config = _problem_and_config(payload)
    inject = injected_outcome(rules, config.to_dict())
    result: dict = {}
    t0 = time.perf_counter()
    try:
        key = evaluator.compile_key(config, problem)
    except Exception as exc:
        return {"outcome": "compile_error", "error": short_error(exc)}, False
    kernel = compiled.get(key)
    if kernel is None:
        try:
            if inject == "compile_error":
                raise InjectedFault("injected compile error")
            kernel = evaluator.compile(config, problem)
        except Exception as exc:
            kernel = _CompileFailure(short_error(exc))
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
            result.update(outcome="fault" if retire else "launch_error", error=short_error(exc))
        result["gpu_s"] = round(time.perf_counter() - t_gpu, 3)
    result.pop("passed", None)
    return result, retire


def _run_peers(conn, evaluator, lock_path, task_id, payload):
    from fa4.kernels import AttentionProblem
    from fa4tune.timing import TimingSettings

    problem = AttentionProblem(**payload["problem"])
    with gpu_lock(lock_path):
        conn.send(("phase", task_id, "gpu", {}))
        try:
            peers = evaluator.time_peers(problem, TimingSettings.from_dict(payload["timing"]),
                                         payload["names"])
            return {"outcome": "ok", "peers": peers}, False
        except Exception as exc:
            retire = not evaluator.healthy()
            return {"outcome": "fault" if retire else "launch_error", "error": short_error(exc)}, retire


def _run_report(evaluator, payload):
    problem, config = _problem_and_config(payload)
    t0 = time.perf_counter()
    try:
        report = evaluator.compile_report(config, problem)
        result = {"outcome": "ok", "report": report, "compile_s": round(time.perf_counter() - t0, 3)}
        if isinstance(report, dict):
            if report.get("ok") is False:  # a family may report a failed compile instead of raising
                result.update(outcome="compile_error", error=short_error(str(report.get("error", "failed"))))
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
        return {"outcome": "compile_error", "error": short_error(exc),
                "compile_s": round(time.perf_counter() - t0, 3)}


# ------------------------------------------------------------------------------------------------
# the parent side

@dataclass
class _Task:
    task_id: int
    kind: str
    payload: dict
    compile_key: Any = None
    phase: str = "queued"        # queued -> compiling -> compiled -> gpu
    phase_since: float = 0.0
    compile_s: Optional[float] = None


@dataclass
class _Worker:
    wid: int
    gpu_index: Optional[int]
    proc: Any = None
    conn: Any = None
    ready: bool = False
    started: float = 0.0
    task: Optional[_Task] = None
    retiring: bool = False
    queue: deque = field(default_factory=deque)
    keys: set = field(default_factory=set)


class WorkerPool:
    """A fixed number of worker processes spread over GPUs; `submit` tasks, `poll` for results.

    Results are dicts with at least "outcome". Deaths, hangs and faults become results; a dead or
    retired worker is replaced. `events` counts what happened (for the report and the tests).
    """

    def __init__(self, processes: int, gpus: list, *, evaluator: str = DEFAULT_EVALUATOR,
                 mode: str = "gpu", arch: Optional[str] = None, lock_dir: Optional[str] = None,
                 compile_timeout_s: float = 300.0, trial_timeout_s: float = 60.0,
                 startup_timeout_s: float = 600.0, peers_timeout_s: float = 600.0):
        if processes < 1:
            raise ValueError("a pool needs at least one process")
        self.mode = mode
        self.evaluator = evaluator
        self.arch = arch
        self.compile_timeout_s = compile_timeout_s
        self.trial_timeout_s = trial_timeout_s
        self.startup_timeout_s = startup_timeout_s
        # a peers task JIT-compiles flash-attn-4 under the GPU lock: it gets its own, longer limit
        self.peers_timeout_s = peers_timeout_s
        self.lock_dir = lock_dir or os.environ.get("TMPDIR", "/tmp")
        self.gpus = list(gpus) or [None]
        self._ctx = mp.get_context("spawn")
        self._workers = [_Worker(i, self.gpus[i % len(self.gpus)]) for i in range(processes)]
        self._pending: deque[_Task] = deque()
        self._results: list = []
        self._next_id = 0
        self._setup_failures = 0
        self._last_setup_error = ""
        self.device: dict = {}
        self.events = {"spawned": 0, "replaced": 0, "killed_hung": 0, "died": 0}

    # -- lifecycle --
    def __enter__(self) -> "WorkerPool":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self, wait_ready: bool = True) -> None:
        for w in self._workers:
            self._spawn(w)
        if wait_ready:
            deadline = time.monotonic() + self.startup_timeout_s
            while not any(w.ready for w in self._workers):
                if time.monotonic() > deadline:
                    raise PoolError(f"no worker became ready within {self.startup_timeout_s:.0f} s")
                self._pump(1.0)

    def close(self) -> None:
        for w in self._workers:
            if w.proc is not None and w.proc.is_alive():
                with contextlib.suppress(Exception):
                    w.conn.send(("stop", -1, None))
        for w in self._workers:
            if w.proc is not None:
                w.proc.join(timeout=5)
                if w.proc.is_alive():
                    w.proc.kill()
                    w.proc.join(timeout=5)
                with contextlib.suppress(Exception):
                    w.conn.close()
            w.proc = None

    def _spawn(self, w: _Worker) -> None:
        parent_conn, child_conn = self._ctx.Pipe()
        lock_path = None
        if self.mode == "gpu":
            lock_path = os.path.join(self.lock_dir, f"fa4tune-gpu{w.gpu_index if w.gpu_index is not None else 0}.lock")
        spec = {"evaluator": self.evaluator, "mode": self.mode, "gpu_index": w.gpu_index,
                "lock_path": lock_path, "arch": self.arch}
        proc = self._ctx.Process(target=worker_main, args=(child_conn, spec), daemon=True,
                                 name=f"fa4tune-worker-{w.wid}")
        proc.start()
        child_conn.close()
        w.proc, w.conn, w.ready, w.started, w.retiring, w.keys = proc, parent_conn, False, time.monotonic(), False, set()
        self.events["spawned"] += 1

    # -- submitting --
    @property
    def size(self) -> int:
        return len(self._workers)

    def submit(self, kind: str, payload: dict, compile_key: Any = None) -> int:
        task = _Task(self._next_id, kind, payload, compile_key)
        self._next_id += 1
        owner = next((w for w in self._workers if compile_key is not None and compile_key in w.keys
                      and w.proc is not None and not w.retiring), None)
        if owner is not None:
            owner.queue.append(task)
        else:
            self._pending.append(task)
        self._dispatch()
        return task.task_id

    def outstanding(self) -> int:
        return (len(self._pending) + sum(len(w.queue) for w in self._workers)
                + sum(1 for w in self._workers if w.task is not None))

    def idle_capacity(self) -> int:
        """How many more tasks would start at once (ready or starting workers without work)."""
        free = sum(1 for w in self._workers if w.task is None and not w.queue and not w.retiring)
        return max(0, free - len(self._pending))

    def busy_tasks(self) -> list[tuple[int, str, float]]:
        return [(w.task.task_id, w.task.phase, w.task.phase_since) for w in self._workers if w.task]

    def _dispatch(self) -> None:
        for w in self._workers:
            if not w.ready or w.task is not None or w.retiring or w.proc is None:
                continue
            task = w.queue.popleft() if w.queue else (self._pending.popleft() if self._pending else None)
            if task is None:
                continue
            try:
                w.conn.send((task.kind, task.task_id, task.payload))
            except (OSError, BrokenPipeError):
                self._pending.appendleft(task)
                continue
            task.phase = "compiling" if task.kind in ("trial", "report") else "waiting"
            task.phase_since = time.monotonic()
            w.task = task
            if task.compile_key is not None:
                w.keys.add(task.compile_key)

    # -- receiving --
    def poll(self, timeout: float) -> list[tuple[int, dict]]:
        """Results finished since the last poll (waits up to `timeout` seconds for the first)."""
        deadline = time.monotonic() + timeout
        while not self._results:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            self._pump(min(remaining, 0.5))
        out, self._results = self._results, []
        return out

    def _pump(self, timeout: float) -> None:
        live = [w for w in self._workers if w.proc is not None]
        handles = [w.conn for w in live] + [w.proc.sentinel for w in live]
        if handles:
            ready = mp_wait(handles, timeout=timeout)
        else:
            time.sleep(timeout)
            ready = []
        for w in live:
            if w.conn in ready:
                self._receive(w)
        for w in live:
            if w.proc is not None and not w.proc.is_alive() and not w.conn.poll():
                self._on_death(w)
        self._check_deadlines()
        self._dispatch()

    def _receive(self, w: _Worker) -> None:
        while w.proc is not None:
            try:
                if not w.conn.poll():
                    return
                message = w.conn.recv()
            except (EOFError, OSError, Exception):
                self._on_death(w)
                return
            kind = message[0]
            if kind == "ready":
                w.ready = True
                self._setup_failures = 0
                if not self.device and message[1]:
                    self.device = dict(message[1])
            elif kind == "setup_error":
                self._setup_failures += 1
                self._last_setup_error = message[1]
                w.retiring = True
            elif kind == "phase" and w.task is not None and w.task.task_id == message[1]:
                w.task.phase = message[2]
                w.task.phase_since = time.monotonic()
                if message[2] == "compiled":
                    w.task.compile_s = message[3].get("compile_s")
            elif kind == "done" and w.task is not None and w.task.task_id == message[1]:
                result = dict(message[2])
                if result.get("outcome") == "fault":
                    w.retiring = True
                self._results.append((w.task.task_id, result))
                w.task = None

    def _on_death(self, w: _Worker) -> None:
        code = w.proc.exitcode if w.proc is not None else None
        if w.proc is not None:
            w.proc.join(timeout=1)
        if w.task is not None:
            how = f"worker died ({_exit_text(code)})"
            in_compile = w.task.phase == "compiling"
            outcome = "compile_error" if in_compile else "fault"
            result = {"outcome": outcome, "error": f"{how} during {'compilation' if in_compile else 'the GPU phase'}"}
            if w.task.compile_s is not None:
                result["compile_s"] = w.task.compile_s
            self._results.append((w.task.task_id, result))
            self.events["died"] += 1
            w.task = None
        self._replace(w)

    def _replace(self, w: _Worker) -> None:
        stranded = list(w.queue)
        w.queue.clear()
        self._pending.extendleft(reversed(stranded))
        with contextlib.suppress(Exception):
            w.conn.close()
        w.proc = None
        if self._setup_failures >= max(3, len(self._workers)):
            raise PoolError(f"workers fail to start: {self._last_setup_error}")
        self._spawn(w)
        self.events["replaced"] += 1

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        for w in self._workers:
            if w.proc is None:
                continue
            if not w.ready and now - w.started > self.startup_timeout_s:
                self._kill(w)
                self._replace(w)
                continue
            task = w.task
            if task is None:
                continue
            gpu_limit = self.peers_timeout_s if task.kind == "peers" else self.trial_timeout_s
            limit = {"compiling": self.compile_timeout_s, "gpu": gpu_limit}.get(task.phase)
            if limit is None or now - task.phase_since <= limit:
                continue
            result = {"outcome": "timeout",
                      "error": f"{'compilation' if task.phase == 'compiling' else 'GPU phase'} "
                               f"exceeded {limit:g} s; worker killed"}
            if task.compile_s is not None:
                result["compile_s"] = task.compile_s
            self._results.append((task.task_id, result))
            w.task = None
            self.events["killed_hung"] += 1
            self._kill(w)
            self._replace(w)

    def _kill(self, w: _Worker) -> None:
        if w.proc is not None and w.proc.is_alive():
            w.proc.kill()
            w.proc.join(timeout=10)


def _exit_text(code: Optional[int]) -> str:
    if code is None:
        return "exit status unknown"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-code).name}"
        return f"signal {-code}"
    return f"exit code {code}"
