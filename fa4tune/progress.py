"""Progress on stderr for the search, bench and compile runs: a rich bar on a terminal, plain lines
elsewhere.

`quiet` silences it (`fa4tune -q`), `verbose` adds a line per item (`fa4tune -v`); data never goes here
(it goes to stdout, `--format table|json`).

A search over a shape set (`start_set`) says which study of how many runs, and estimates the time left:
in the study from its rate so far (configurations evaluated by this run per second, capped by its
`--timeout`), in the set from the mean wall time of the studies this run already tuned (`time_left`).
"""

from __future__ import annotations

import sys
import time
from collections import Counter
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


class Progress:
    """Progress on stderr: a rich bar on a terminal, a plain line every few seconds elsewhere."""

    def __init__(self, stream=None, quiet: bool = False, every_s: float = 5.0, verbose: bool = False):
        self.stream = stream or sys.stderr
        self.quiet = quiet
        self.verbose = verbose and not quiet
        self.every_s = every_s
        self._bar = None
        self._task = None
        self._last = 0.0
        self._name = ""
        # the shape set and the current study, for the estimates of time left
        self._set_size = 1
        self._study_index = 0
        self._finished_walls: list[float] = []
        self._study_started = time.monotonic()
        self._study_done0 = 0
        self._timeout_s: Optional[float] = None

    def message(self, text: str) -> None:
        if not self.quiet:
            print(text, file=self.stream, flush=True)

    def detail(self, text: str) -> None:
        """A line per item (each compiled configuration, each bench row): shown with -v only."""
        if self.verbose:
            print(text, file=self.stream, flush=True)

    def count(self, done: int, total: int, what: str) -> None:
        """"what: done/total", at most every few seconds (always the last one)."""
        now = time.monotonic()
        if done == total or now - self._last >= self.every_s:
            self._last = now
            self.message(f"{what}: {done}/{total}")

    def start_set(self, names: list[str]) -> None:
        """A search of several studies begins: name them."""
        self._set_size, self._study_index, self._finished_walls = len(names), 0, []
        if len(names) > 1:
            self.message(f"shape set: {len(names)} studies: " + ", ".join(names))

    def study_finished(self, wall_s: float, evaluated_this_run: int) -> None:
        """The current study ended; a study resumed with nothing left to do says nothing about the rest."""
        if evaluated_this_run > 0:
            self._finished_walls.append(wall_s)
        self._study_index += 1

    def time_left(self, done: int, total: int) -> str:
        elapsed = time.monotonic() - self._study_started
        left = study_left_s(elapsed, done - self._study_done0, total - done, self._timeout_s)
        text = f"~{format_duration(left)} left"
        if self._set_size > 1:
            after = self._set_size - self._study_index - 1
            text += f", ~{format_duration(set_left_s(left, elapsed, self._finished_walls, after))} for the set"
        return text

    def start(self, name: str, total: int, done: int, timeout_s: Optional[float] = None) -> None:
        if self._set_size > 1:
            name = f"{name} ({self._study_index + 1}/{self._set_size})"
        self._name = name
        self._study_started, self._study_done0, self._timeout_s = time.monotonic(), done, timeout_s
        if self.quiet:
            return
        if getattr(self.stream, "isatty", lambda: False)():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn, TimeElapsedColumn

            self._bar = RichProgress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                     TimeElapsedColumn(), console=Console(file=self.stream))
            self._bar.start()
            self._task = self._bar.add_task(name, total=total, completed=done)
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
        if self._bar is not None:
            self._bar.update(self._task, completed=done, description=f"{self._name} {text}")
            if final:
                self._bar.stop()
                self._bar = None
            return
        now = time.monotonic()
        if final or now - self._last >= self.every_s:
            self._last = now
            self.message(f"[{self._name}] {text}")
