"""The sm100 kernel's tile scheduler: `fa4.kernels.scheduling.TileScheduler` (the protocol the sm90
family's scheduler implements too). NOT RUN ON HARDWARE, like the kernel (`kernel.py`).

A task is (m_block, head, batch) of `q_stages` x 128 rows; head is the KV head when GQA is packed.
With `cta_group` = 2 (the kernel's cluster pair, knob `two_cta`) a task is run by a pair of
consecutive CTAs (one cluster: CTAs 2p and 2p + 1 run pair p's tasks) and holds both CTAs' rows,
2 x `q_stages` x 128; below, "CTA" then reads "pair", and the grid has `cta_group` CTAs per pair.
- single: one CTA per task on a 1-D grid, m-fastest order.
- static: persistent, grid = min(SM count, tasks); CTA c runs tasks c, c + grid, ... m-fastest
  (a pair: min(SM count / 2, tasks) pairs).
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
    """`TileScheduler(kind, num_m_blocks, task_heads, num_tasks, lpt_group, num_sms, cta_group=1)`:
    `kind`, `num_sms` and `cta_group` (CTAs per task: 2 for a cluster pair) are compile-time
    constants; the counts are runtime values (the kernel's arguments)."""

    KINDS = KINDS
    RUNTIME = ("num_m_blocks", "task_heads", "num_tasks", "lpt_group")

    def __init__(self, kind: str, *counts_and_num_sms, cta_group: int = 1):
        super().__init__(kind, *counts_and_num_sms)
        if cta_group not in (1, 2):
            raise ValueError(f"cta_group must be 1 or 2, got {cta_group!r}")
        self.cta_group = cta_group  # compile-time, carried by the base's copy like kind and num_sms

    # ---- host / launch ----------------------------------------------------------------------
    @staticmethod
    def create(kind: str, num_m_blocks, task_heads, batch, seqlen_k, head_dim: int, num_sms: int,
               lpt_l2_bytes: int, cta_group: int = 1) -> "TileScheduler":
        """The scheduler of a launch, from the problem's runtime counts (`num_m_blocks` counts tasks'
        row blocks: a pair's when `cta_group` is 2)."""
        num_tasks = num_m_blocks * task_heads * batch
        # LPT: heads are taken in groups whose K and V (16-bit) fit the L2 budget together
        kv_bytes_per_head = seqlen_k * (4 * head_dim)
        lpt_group = cutlass.max(Int32(1), Int32(lpt_l2_bytes)
                                // cutlass.max(kv_bytes_per_head, Int32(1)))
        lpt_group = cutlass.min(lpt_group, num_tasks // cutlass.max(num_m_blocks, Int32(1)))
        lpt_group = cutlass.max(lpt_group, Int32(1))
        return TileScheduler(kind, num_m_blocks, task_heads, num_tasks, lpt_group, num_sms,
                             cta_group=cta_group)

    def grid_shape(self):
        # a task runs on one CTA, or on a cluster pair of consecutive CTAs (cta_group = 2)
        if const_expr(self.kind == "single"):
            grid_x = self.num_tasks * self.cta_group
        else:
            grid_x = cutlass.min(self.num_tasks, Int32(self.num_sms // self.cta_group)) * self.cta_group
        return [grid_x, 1, 1]

    # ---- device -----------------------------------------------------------------------------
    @cute.jit
    def initial_work(self):
        bidx, _, _ = cute.arch.block_idx()
        task = Int32(bidx) // self.cta_group  # a pair (consecutive CTAs, one cluster) shares its task
        return task, task < self.num_tasks

    @cute.jit
    def _task_stride(self):
        if const_expr(self.kind == "single"):
            return Int32(1 << 30)  # one task per CTA (per pair)
        else:
            gdim, _, _ = cute.arch.grid_dim()
            return Int32(gdim) // self.cta_group

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
