"""The launch, judged one way for every family: the tile counts a kernel builds its scheduler from
(`tile_counts`, given how many rows a task holds), the grid that scheduler launches (`scheduler_grid`)
and CUDA's limits on it (`grid_reasons`). Each family's `tile_counts`, `launch_grid` and
`launch_reasons` say only what is its own: rows per task, its scheduler class and the device facts it
is compiled with.

Not part of any fingerprint: it judges configurations, it does not change what they compile to.
"""

from __future__ import annotations

from typing import Callable

from .device import DeviceDescription
from .knobs import Config, knob
from .problem import AttentionProblem

# The kernels number their tiles with 32-bit integers (a 1-D grid's block index, the task index of a
# persistent CTA): a launch can address at most this many.
TILE_INDEX_LIMIT = 2**31 - 1
# No scheduler launches more than two CTAs per tile (a cluster pair runs a task of two CTAs' rows):
# while twice the tiles fit the device's smallest grid limit, no grid can exceed one, and the
# scheduler (and with it the DSL) is not consulted.
MAX_CTAS_PER_TILE = 2


def tile_counts(problem: AttentionProblem, rows_per_task: int, pack_gqa: bool) -> tuple[int, int, int]:
    """(m blocks, task heads, batch) of `problem` in tasks of `rows_per_task` rows: the counts a kernel's
    `__call__` builds its tile scheduler from. With GQA packing a KV head's query heads are folded into
    the rows, so heads are KV heads. Empty dimensions count as 1: a bound, never below the real grid."""
    rows, heads = problem.seqlen_q, problem.heads_q
    if pack_gqa:
        rows, heads = problem.seqlen_q * problem.gqa_ratio, problem.heads_kv
    return -(-max(rows, 1) // rows_per_task), max(heads, 1), max(problem.batch, 1)


def scheduler_grid(scheduler, kind: str, tile_counts: tuple[int, int, int], problem: AttentionProblem,
                   *compiled_in) -> tuple[int, int, int]:
    """The grid (x, y, z) a family's tile scheduler class `scheduler` (written in the DSL) launches with:
    its `create(kind, m blocks, heads, batch, seqlen_k, head_dim, *compiled_in)`, then `grid_shape()`,
    on plain integers. `compiled_in`: the family's device facts (and its own extra arguments)."""
    m_blocks, heads, batch = tile_counts
    x, y, z = scheduler.create(kind, m_blocks, heads, batch, max(problem.seqlen_k, 1), problem.head_dim,
                               *compiled_in).grid_shape()
    return int(x), int(y), int(z)


def grid_reasons(config: Config, tile_counts: tuple[int, int, int], device: DeviceDescription,
                 launch_grid: Callable[[], tuple[int, int, int]]) -> list[str]:
    """Why the grid `launch_grid()` (the family's scheduler, on `tile_counts` (m blocks, heads,
    batch)) exceeds `device`'s limits, or its tiles a 32-bit index (empty: it launches)."""
    m_blocks, heads, batch = tile_counts
    tiles = m_blocks * heads * batch
    if tiles * MAX_CTAS_PER_TILE <= min(device.max_grid) and tiles <= TILE_INDEX_LIMIT:
        return []
    x, y, z = launch_grid()
    reasons = []
    one_d = (" (single_lpt runs the same tiles on a 1-D grid)"
             if "single_lpt" in knob(config.arch, "scheduler").choices else "")
    for axis, size, limit in (("y", y, device.max_grid_y), ("z", z, device.max_grid_z)):
        if size > limit:
            reasons.append(f"scheduler={config.scheduler} launches a grid of ({x}, {y}, {z}) blocks for {m_blocks} "
                           f"m blocks x {heads} heads x {batch} batch: its {axis} ({size}) > {limit}, the "
                           f"limit of the grid's {axis} on {device.name}{one_d}")
    if y == z == 1 and tiles > TILE_INDEX_LIMIT:
        reasons.append(f"{tiles} tiles > {TILE_INDEX_LIMIT}, the most one launch can index")
    elif x > device.max_grid_x:  # (a cluster pair launches two CTAs per tile)
        reasons.append(f"scheduler={config.scheduler} launches a grid of ({x}, {y}, {z}) blocks: its x ({x}) > "
                       f"{device.max_grid_x}, the limit of the grid's x on {device.name}")
    return reasons
