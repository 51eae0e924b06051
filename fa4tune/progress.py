"""Progress on stderr for the search, bench and compile runs: a rich bar on a terminal, plain lines
elsewhere.

`quiet` silences it (`fa4tune -q`), `verbose` adds a line per item (`fa4tune -v`); data never goes here
(it goes to stdout, `--format table|json`).
"""

from __future__ import annotations

import sys
import time
from collections import Counter


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

    def start(self, name: str, total: int, done: int) -> None:
        self._name = name
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
