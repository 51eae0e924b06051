"""The tile-scheduler protocol both families implement (`kernels/sm90/scheduler.py`,
`kernels/sm100/scheduler.py`).

A task is one (m_block, head, batch) tile, where head is a query head, or a KV head when GQA packing
folds a KV head's query heads into the tile rows. A scheduler decides only the order of the tasks and
which CTA runs which; the kernel does the rest. Its kind (the `scheduler` knob) and the SM count are
compile-time constants; the counts (m-blocks, heads, batch, ...) are the DSL's runtime values.

Host side (the kernel's `__call__`): build the scheduler from the problem's runtime counts and launch
`grid_shape()`; the counts go to the device code as kernel arguments.
Device side (the kernel body rebuilds the scheduler from those arguments; every warp role then runs):

    task, valid = sched.initial_work()
    while valid:
        m_block, head, batch = sched.decode(task)
        ...
        task, valid = sched.next_work(task)

Nothing here imports the DSL at module import time.
"""

from __future__ import annotations

import copy
from typing import Any, Protocol

SCHEDULERS = ("single", "single_lpt", "static", "lpt")  # every kind of any family (knobs.py narrows)
PERSISTENT_SCHEDULERS = ("static", "lpt")  # a CTA runs several tasks; a grid of at most one CTA per SM


class TileScheduler(Protocol):
    kind: str      # compile-time: one of SCHEDULERS
    num_sms: int   # compile-time: the persistent grid's size

    # ---- host ----
    def grid_shape(self) -> tuple:
        """The launch grid (x, y, z), on the DSL's runtime values."""

    # ---- device ----
    def initial_work(self) -> tuple[Any, Any]:
        """(task, valid) of this CTA's first task."""

    def next_work(self, task) -> tuple[Any, Any]:
        """(task, valid) of the task after `task`."""

    def decode(self, task) -> tuple[Any, Any, Any]:
        """(m_block, head, batch) of a task."""


class SchedulerBase:
    """Base of both families' schedulers: `TileScheduler(kind, *counts, num_sms)` with one count per
    name in `RUNTIME` (the DSL's runtime values), `kind` one of `KINDS`. The DSL carries a
    scheduler through the device `while` loops that use it as those runtime values (one Int32 each);
    the rest of the object (kind, SM count) is compile-time and copied."""

    KINDS: tuple[str, ...] = ()
    RUNTIME: tuple[str, ...] = ()

    def __init__(self, kind: str, *counts_and_num_sms):
        if kind not in self.KINDS:
            raise ValueError(f"unknown scheduler {kind!r}; known: {self.KINDS}")
        *counts, num_sms = counts_and_num_sms
        if len(counts) != len(self.RUNTIME):
            raise TypeError(f"{type(self).__name__} takes the counts {self.RUNTIME} and num_sms")
        self.kind = kind
        for name, value in zip(self.RUNTIME, counts):
            setattr(self, name, value)
        self.num_sms = num_sms

    def __extract_mlir_values__(self):
        from cutlass.cutlass_dsl import extract_mlir_values
        values = []
        for name in self.RUNTIME:
            values += extract_mlir_values(getattr(self, name))
        return values

    def __new_from_mlir_values__(self, values):
        from cutlass import Int32
        new = copy.copy(self)
        for name, value in zip(self.RUNTIME, values):
            setattr(new, name, Int32(value))
        return new
