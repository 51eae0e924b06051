"""Progress on stderr for the search, bench and compile runs: a rich bar on a terminal, plain lines
elsewhere.

`quiet` silences it (`fa4tune -q`), `verbose` adds a line per item (`fa4tune -v`); data never goes here
(it goes to stdout, `--format table|json`).

A search over a shape set (`start_set`) says which study of how many runs, and estimates the time left:
in the study from its rate so far (configurations evaluated by this run per second, capped by its
`--timeout`), in the set from the mean wall time of the studies this run already tuned (`time_left`).

Several studies may run at once, one per thread (`fa4tune.searches.runner` on several GPUs, `lanes` in
`start_set`): each thread's current study is its own (`_StudyLine`, thread-local), a lock serialises
every method, and the set's estimate shares the studies not yet started among the lanes. On a terminal
the studies running at once are rows of one rich bar (rich allows one live display at a time).
"""

from __future__ import annotations

import math
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional


def study_left_s(elapsed_s: float, done_this_run: int, remaining: int,
                 timeout_s: Optional[float]) -> Optional[float]:
    """Seconds a study still needs: its remaining configurations at this run's rate so far, at most
    what its time budget leaves; None while there is nothing to go by."""
    budget_left = None if timeout_s is None else max(0.0, timeout_s - elapsed_s)
    if remaining <= 0:
        return 0.0
    if done_this_run <= 0:
        return budget_left
    estimate = remaining * elapsed_s / done_this_run
    return estimate if budget_left is None else min(estimate, budget_left)


def set_left_s(current_left: Optional[float], current_elapsed_s: float, finished_walls: list[float],
               studies_after: int) -> Optional[float]:
    """Seconds the rest of a shape set needs: the current study's estimate plus, for each study after it,
    the mean wall time of the studies this run tuned (else the current study's projected total)."""
    if studies_after <= 0:
        return current_left
    if finished_walls:
        per_study = sum(finished_walls) / len(finished_walls)
    elif current_left is not None:
        per_study = current_elapsed_s + current_left
    else:
        return None
    return (current_left or 0.0) + studies_after * per_study


def format_duration(seconds: Optional[float]) -> str:
    if seconds is None:
        return "?"
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


@dataclass
class _StudyLine:
    """The study a thread is running: its label, where it started, and its row of the bar."""

    name: str = ""
    started: float = field(default_factory=time.monotonic)
    done0: int = 0
    timeout_s: Optional[float] = None
    task: object = None        # its rich task, on a terminal
    last: float = 0.0          # when its last plain line was printed


class Progress:
    """Progress on stderr: a rich bar on a terminal, a plain line every few seconds elsewhere.
    Safe to share between threads that each run one study at a time."""

    def __init__(self, stream=None, quiet: bool = False, every_s: float = 5.0, verbose: bool = False):
        self.stream = stream or sys.stderr
        self.quiet = quiet
        self.verbose = verbose and not quiet
        self.every_s = every_s
        self._lock = threading.RLock()
        self._bar = None
        self._bar_rows = 0           # studies with a row on the bar that did not end yet
        self._last = 0.0
        self._count_started: dict[str, tuple[float, int]] = {}  # what -> (first call's time, done)
        self._local = threading.local()
        # the shape set, for the estimates of time left
        self._set_size = 1
        self._lanes = 1              # studies running at once
        self._started_count = 0      # studies of the set started so far
        self._finished_walls: list[float] = []

    @property
    def _line(self) -> _StudyLine:
        line = getattr(self._local, "line", None)
        if line is None:
            line = self._local.line = _StudyLine()
        return line

    def message(self, text: str) -> None:
        if not self.quiet:
            with self._lock:
                print(text, file=self.stream, flush=True)

    def detail(self, text: str) -> None:
        """A line per item (each compiled configuration, each bench row): shown with -v only."""
        if self.verbose:
            with self._lock:
                print(text, file=self.stream, flush=True)

    def count(self, done: int, total: int, what: str) -> None:
        """"what: done/total, ~ETA left", at most every few seconds (always the last one); the ETA
        from the rate since this count's first call."""
        with self._lock:
            now = time.monotonic()
            started, done_then = self._count_started.setdefault(what, (now, done))
            if done == total or now - self._last >= self.every_s:
                self._last = now
                eta = ""
                if done_then < done < total and now > started:
                    left = (now - started) / (done - done_then) * (total - done)
                    eta = f", ~{format_duration(left)} left"
                self.message(f"{what}: {done}/{total}{eta}")

    def start_set(self, names: list[str], lanes: int = 1) -> None:
        """A search of several studies begins, `lanes` of them at a time: name them."""
        with self._lock:
            self._set_size, self._lanes = len(names), max(1, lanes)
            self._started_count, self._finished_walls = 0, []
            if len(names) > 1:
                at_once = f", {self._lanes} at a time" if self._lanes > 1 else ""
                self.message(f"shape set: {len(names)} studies{at_once}: " + ", ".join(names))

    def study_finished(self, wall_s: float, evaluated_this_run: int) -> None:
        """A study ended; a study resumed with nothing left to do says nothing about the rest."""
        with self._lock:
            if evaluated_this_run > 0:
                self._finished_walls.append(wall_s)

    def time_left(self, done: int, total: int) -> str:
        with self._lock:
            line = self._line
            elapsed = time.monotonic() - line.started
            left = study_left_s(elapsed, done - line.done0, total - done, line.timeout_s)
            text = f"~{format_duration(left)} left"
            if self._set_size > 1:
                # the studies not started yet, shared among the lanes, follow this one
                after = math.ceil(max(0, self._set_size - self._started_count) / self._lanes)
                text += f", ~{format_duration(set_left_s(left, elapsed, self._finished_walls, after))} for the set"
            return text

    def start(self, name: str, total: int, done: int, timeout_s: Optional[float] = None) -> None:
        with self._lock:
            if self._set_size > 1:
                name = f"{name} ({self._started_count + 1}/{self._set_size})"
                self._started_count += 1
            line = self._local.line = _StudyLine(name=name, started=time.monotonic(), done0=done,
                                                 timeout_s=timeout_s)
            if self.quiet:
                return
            if getattr(self.stream, "isatty", lambda: False)():
                if self._bar is None:
                    from rich.console import Console
                    from rich.progress import (BarColumn, MofNCompleteColumn, Progress as RichProgress,
                                               TextColumn, TimeElapsedColumn)

                    self._bar = RichProgress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                             TimeElapsedColumn(), console=Console(file=self.stream))
                    self._bar.start()
                line.task = self._bar.add_task(name, total=total, completed=done)
                self._bar_rows += 1
            else:
                self.message(f"[{name}] starting: {done}/{total} configurations done")

    def update(self, done: int, total: int, counts: Counter, best_us, default_us, final=False) -> None:
        fails = " ".join(f"{k}={v}" for k, v in sorted(counts.items()) if k != "ok" and v)
        best = f"best {best_us:.2f} us" if best_us is not None else "best -"
        dflt = f" (default {default_us:.2f} us)" if default_us is not None else ""
        text = f"{done}/{total} ok={counts.get('ok', 0)} {fails} | {best}{dflt}".replace("  ", " ")
        if not final:
            text += f" | {self.time_left(done, total)}"
        if self.quiet:
            return
        with self._lock:
            line = self._line
            if self._bar is not None and line.task is not None:
                self._bar.update(line.task, completed=done, description=f"{line.name} {text}")
                if final:
                    line.task = None
                    self._bar_rows -= 1
                    if self._bar_rows <= 0:   # the last study running at once ended
                        self._bar.stop()
                        self._bar = None
                return
            now = time.monotonic()
            if final or now - line.last >= self.every_s:
                line.last = now
                self.message(f"[{line.name}] {text}")
