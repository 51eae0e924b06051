"""The sm100 kernel's tile scheduler: `fa4.kernels.scheduling.TileScheduler` (the protocol the sm90
family's scheduler implements too). NOT RUN ON HARDWARE, like the kernel (`kernel.py`).

A task is (m_block, head, batch) of `q_stages` x 128 rows; head is the KV head when GQA is packed.
- single: one CTA per task on a 1-D grid, m-fastest order.
- static: persistent, grid = min(SM count, tasks); CTA c runs tasks c, c + grid, ... m-fastest.
- lpt: persistent like static, longest first: heads in groups whose K and V stay in L2 together
  (`lpt_l2_bytes`), inside a group the last m_blocks (the longest under causal) first.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

from ..scheduling import SchedulerBase

KINDS = ("single", "static", "lpt")


class TileScheduler(SchedulerBase):
    """`TileScheduler(kind, num_m_blocks, task_heads, num_tasks, lpt_group, num_sms)`: `kind` and
    `num_sms` are compile-time constants; the counts are runtime values (the kernel's arguments)."""

    KINDS = KINDS
    RUNTIME = ("num_m_blocks", "task_heads", "num_tasks", "lpt_group")

    # ---- host / launch ----------------------------------------------------------------------
    @staticmethod
    def create(kind: str, num_m_blocks, task_heads, batch, seqlen_k, head_dim: int, num_sms: int,
               lpt_l2_bytes: int) -> "TileScheduler":
        """The scheduler of a launch, from the problem's runtime counts."""
        num_tasks = num_m_blocks * task_heads * batch
        # LPT: heads are taken in groups whose K and V (16-bit) fit the L2 budget together
        kv_bytes_per_head = seqlen_k * (4 * head_dim)
        lpt_group = cutlass.max(Int32(1), Int32(lpt_l2_bytes)
                                // cutlass.max(kv_bytes_per_head, Int32(1)))
        lpt_group = cutlass.min(lpt_group, num_tasks // cutlass.max(num_m_blocks, Int32(1)))
        lpt_group = cutlass.max(lpt_group, Int32(1))
        return TileScheduler(kind, num_m_blocks, task_heads, num_tasks, lpt_group, num_sms)

    def grid_shape(self):
        if const_expr(self.kind == "single"):
            grid_x = self.num_tasks
        else:
            grid_x = cutlass.min(self.num_tasks, Int32(self.num_sms))
        return [grid_x, 1, 1]

    # ---- device -----------------------------------------------------------------------------
    @cute.jit
    def initial_work(self):
        bidx, _, _ = cute.arch.block_idx()
        task = Int32(bidx)
        return task, task < self.num_tasks

    @cute.jit
    def _task_stride(self):
        if const_expr(self.kind == "single"):
            return Int32(1 << 30)  # one task per CTA
        else:
            gdim, _, _ = cute.arch.grid_dim()
            return Int32(gdim)

    @cute.jit
    def next_work(self, task: Int32):
        task += self._task_stride()
        return task, task < self.num_tasks

    @cute.jit
    def decode(self, task: Int32):
        """task index -> (m_block, head, batch) under the configured order."""
        num_m_blocks, task_heads, num_tasks = self.num_m_blocks, self.task_heads, self.num_tasks
        m_block = Int32(0)
        head = Int32(0)
        batch = Int32(0)
        if const_expr(self.kind != "lpt"):
            m_block = task % num_m_blocks
            hb = task // num_m_blocks
            head = hb % task_heads
            batch = hb // task_heads
        else:
            # Longest first: for causal the late m_blocks see the most keys. Heads are taken in
            # groups sized so the group's K and V stay resident in L2 while all its m_blocks run.
            # (the group size is computed once at launch: see `create`)
            group = self.lpt_group
            num_hb = num_tasks // num_m_blocks
            per_group = group * num_m_blocks
            g = task // per_group
            within = task - g * per_group
            this_group = cutlass.min(group, num_hb - g * group)
            m_rev = within // this_group
            hb = g * group + within % this_group
            m_block = num_m_blocks - 1 - m_rev
            head = hb % task_heads
            batch = hb // task_heads
        return m_block, head, batch
