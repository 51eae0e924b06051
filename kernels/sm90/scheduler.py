"""The sm90 kernel's tile scheduler: `fa4.kernels.scheduling.TileScheduler` (the protocol the sm100
family's scheduler implements too).

A task ("tile") is (m_block, head, batch), where head is a query head, or a KV head when GQA packing
folds a KV head's query heads into the tile rows.

Host side: `TileScheduler.create(...)` from the problem's runtime counts, `grid_shape()` (the launch
grid). Device side: `initial_work()` and `next_work(task)`; `decode(task)` gives (m_block, head, batch).

- single: one CTA per task, grid (m_blocks, heads, batch), m_block ascending; nothing persists.
- single_lpt: one CTA per task on a 1-D grid in longest-processing-time order (late m_blocks first,
  the longest under causal masking), inside groups of heads sized so that a group's K and V stay in
  L2 (the compiled-in `l2_bytes_for_kv`: `L2_BYTES_FOR_KV_ON_H200` scaled to the device's L2). The hardware hands CTAs to SMs as they free up, so this is a greedy
  longest-first schedule: the heavy causal tiles start first and the light ones fill the tail.
- static: persistent, grid = min(SM count, tasks); CTA c runs tasks c, c + grid, c + 2*grid, ...
  in m-fastest order.
- lpt: persistent like static, over the single_lpt order (dealt round-robin, not greedily).

Variable-length batches (`packed_varlen`, the one-CTA-per-task kinds): a grid over the longest
sequence's m-blocks for every sequence would be mostly CTAs with no rows (B32 with one 16k sequence
among 31 short ones: 96 % of 88k CTAs), each paying a launch, its barriers' setup and a read of
cu_seqlens. So the grid is `varlen_grid_tasks` (a bound of the sequences' own tasks, at most a few
beyond them) and each CTA finds its task by a prefix sum over the sequences' m-blocks
(the kernel's `first_task`): single takes each sequence's heads, m-blocks ascending, in batch order;
single_lpt each sequence's heads in groups whose K and V (that sequence's keys) fit the L2 budget, in
a group the last m-block first and the heads fastest (the dense order, one sequence at a time). The
persistent kinds keep the full grid's order (a persistent CTA passes an empty task in a few
instructions).
"""

from __future__ import annotations

from ..scheduling import PERSISTENT_SCHEDULERS, SchedulerBase

KINDS = ("single", "single_lpt", "static", "lpt")
# one CTA per task: under varlen their grid is the sequences' own tasks (`packed_varlen`)
ONE_CTA_PER_TASK = tuple(kind for kind in KINDS if kind not in PERSISTENT_SCHEDULERS)
# K+V bytes of a head group the longest-first orders keep in L2: chosen on the H200; another device
# gets it scaled to its L2 (the family's `device_key`)
L2_BYTES_FOR_KV_ON_H200 = 32 * 1024 * 1024


def _device():
    # imported lazily so that importing this module never needs the DSL
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int32
    return cutlass, cute, Int32


class TileScheduler(SchedulerBase):
    """`TileScheduler(kind, num_m_blocks, num_heads, batch, group_heads, num_sms)`: `kind` is a
    compile-time constant; the counts are runtime values, `num_sms` is compiled in (the kernel is
    compiled per SM count of the device)."""

    KINDS = KINDS
    RUNTIME = ("num_m_blocks", "num_heads", "batch", "group_heads")
    # compile-time: the tasks of a variable-length batch, found by the kernel's `first_task` (module
    # docstring); a task then reads as static's (m_block fastest, then head, then batch)
    packed_varlen = False

    @property
    def persistent(self) -> bool:
        return self.kind in PERSISTENT_SCHEDULERS

    def num_tasks(self):
        return self.num_m_blocks * self.num_heads * self.batch

    # ---- host / launch ----------------------------------------------------------------------
    @staticmethod
    def create(kind: str, num_m_blocks, num_heads, batch, seqlen_k, head_dim: int, num_sms: int,
               l2_bytes_for_kv: int):
        """The scheduler of a launch: the longest-first orders take heads in groups whose K and V
        (16-bit, `seqlen_k` rows each) fit `l2_bytes_for_kv` (compiled in) together."""
        group_heads = head_group_size(seqlen_k, head_dim, l2_bytes_for_kv)
        return TileScheduler(kind, num_m_blocks, num_heads, batch, group_heads, num_sms)

    def grid_shape(self):
        cutlass, cute, Int32 = _device()
        if self.kind == "single":
            return (self.num_m_blocks, self.num_heads, self.batch)
        if self.kind == "single_lpt":
            return (cutlass.max(self.num_tasks(), 1), 1, 1)
        return (cutlass.max(cutlass.min(Int32(self.num_sms), self.num_tasks()), 1), 1, 1)

    # ---- device -----------------------------------------------------------------------------
    def initial_work(self):
        """(task index, valid). For `single` the task index is unused: decode reads blockIdx."""
        cutlass, cute, Int32 = _device()
        bx, _, _ = cute.arch.block_idx()
        if self.kind == "single":
            return Int32(bx), cutlass.Boolean(True)
        return Int32(bx), Int32(bx) < self.num_tasks()

    def next_work(self, task):
        cutlass, cute, Int32 = _device()
        if not self.persistent:
            return task, cutlass.Boolean(False)
        gx, _, _ = cute.arch.grid_dim()
        nxt = task + Int32(gx)
        return nxt, nxt < self.num_tasks()

    def decode(self, task):
        """(m_block, head, batch) of a task."""
        cutlass, cute, Int32 = _device()
        # a packed varlen grid is one-dimensional whatever the kind: its task is the kernel's
        # `first_task`, in static's order, never the block index
        if self.kind == "single" and not self.packed_varlen:
            bx, by, bz = cute.arch.block_idx()
            return Int32(bx), Int32(by), Int32(bz)
        if self.kind == "static" or self.packed_varlen:
            m_block = task % self.num_m_blocks
            rest = task // self.num_m_blocks
            return m_block, rest % self.num_heads, rest // self.num_heads
        m_block, unit = longest_first_tile(task, self.num_m_blocks, self.num_heads * self.batch,
                                           self.group_heads)
        return m_block, unit % self.num_heads, unit // self.num_heads


def varlen_grid_tasks(total_rows, batch, tile_m: int, num_heads):
    """CTAs of a variable-length batch's one-CTA-per-task grid: a bound of its tasks, sum over the
    sequences of ceil(rows / tile_m) x heads <= (total_rows + batch (tile_m - 1)) // tile_m x heads
    (each sequence's last block wastes at most tile_m - 1 rows). DSL or plain integers."""
    return (total_rows + batch * (tile_m - 1)) // tile_m * num_heads



def head_group_size(seqlen_k, head_dim: int, l2_bytes_for_kv: int):
    """Heads (or (batch, head) units) a longest-first group holds: as many whose K and V (16-bit,
    `seqlen_k` rows each) fit `l2_bytes_for_kv` together, at least one. On the DSL's values."""
    cutlass, cute, Int32 = _device()
    kv_unit_bytes = cutlass.max(seqlen_k, 1) * (head_dim * 2 * 2)
    return cutlass.max(Int32(l2_bytes_for_kv) // kv_unit_bytes, 1)


def longest_first_tile(index, m_blocks, units, group_heads):
    """(m_block, unit) of the `index`-th task of the longest-first order over `units` (heads, or
    (batch, head) pairs) x `m_blocks`: groups of `group_heads` units, inside a group the m-blocks
    from the last (the longest under causal) to the first, the group's units fastest. On the DSL's
    values: the dense single_lpt and lpt orders, and one varlen sequence's (the kernel's `first_task`)."""
    cutlass, cute, Int32 = _device()
    per_group = group_heads * m_blocks
    group = index // per_group
    within = index - group * per_group
    group_size = cutlass.min(group_heads, units - group * group_heads)
    return m_blocks - 1 - within // group_size, group * group_heads + within % group_size
