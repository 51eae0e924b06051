"""The parent side of the worker processes: a fixed pool spread over GPUs that runs tasks ("trial",
"peers", "training", "report") and turns deaths, hangs and faults into results.

Tasks are dicts in, result dicts (at least "outcome") out: `submit`, then `poll`. A task whose compile
key a worker already holds goes to that worker, so identical compile keys compile once. A worker that
died, faulted or overran its phase's time limit (compile, GPU, peers) is killed if need be and replaced;
`events` counts what happened.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import wait as mp_wait
from typing import Any, Optional

from fa4tune.workers.worker import worker_main

DEFAULT_EVALUATOR = "fa4tune.workers.evaluator:KernelEvaluator"


class PoolError(RuntimeError):
    """The pool cannot run (no worker starts, e.g. no GPU, or the evaluator cannot be imported)."""


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

    def kill(self) -> None:
        """Stop every worker now (SIGKILL), whatever it is doing: a caller's deadline has passed."""
        for w in self._workers:
            self._kill(w)
            if w.conn is not None:
                with contextlib.suppress(Exception):
                    w.conn.close()
            w.proc, w.task = None, None

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
        # reaped first: its pipe closes before the process is gone, and an unreaped one has no exit code
        # (under load the fault's signal was lost: "exit status unknown")
        if w.proc is not None:
            w.proc.join(timeout=1)
        code = w.proc.exitcode if w.proc is not None else None
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
            gpu_limit = self.peers_timeout_s if task.kind in ("peers", "training") else self.trial_timeout_s
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
