"""How a variable-length batch's CTAs find their tasks (kernels/sm90/scheduler.py, `packed_varlen`;
`FlashAttentionSm90.first_task`), on the CPU: the kernel's steps over 32 lanes emulated with plain
integers (a lane per sequence, the shuffle scan, the ballot's count), then held to what the grid must
do. Every task of every non-empty sequence runs exactly once, CTAs past the last task find none, the
grid bound (`varlen_grid_tasks`) is never short, and each kind keeps its order. The GPU suite
(tests/gpu/test_varlen_gpu.py) checks the compiled code's outputs; test_sm90_varlen_compile.py that
it compiles (with the scan's shuffles and ballot in its PTX)."""

from __future__ import annotations

import random

import pytest

from fa4.kernels.sm90.scheduler import varlen_grid_tasks

LANES = 32


def first_task(cta: int, lengths: list[int], heads: int, tile_m: int, kind: str, l2_bytes: int = 1 << 25,
               head_dim: int = 128):
    """(sequence, head, m_block) of CTA `cta`, or None: `first_task`'s loop step by step, the lanes as
    lists (shuffle up: a lane adds the lane `offset` below it; ballot + popc: the lanes at or below).
    Queries and keys have the same lengths here; single_lpt's head groups hold K and V of `l2_bytes`."""
    rest, first = cta, 0
    while first < len(lengths):
        seqs = [first + lane for lane in range(LANES)]
        blocks = [-(-lengths[s] // tile_m) if s < len(lengths) else 0 for s in seqs]
        keys = [lengths[s] if s < len(lengths) else 0 for s in seqs]
        tasks = [b * heads for b in blocks]
        through = list(tasks)
        for step in range(5):
            offset = 1 << step
            through = [t + (through[lane - offset] if lane >= offset else 0) for lane, t in enumerate(through)]
        passed = sum(t <= rest for t in through)
        if passed < LANES:
            local = rest - (through[passed] - tasks[passed])
            seq_blocks = blocks[passed]
            if kind == "single_lpt":
                group_heads = max(l2_bytes // (max(keys[passed], 1) * head_dim * 4), 1)
                group, within = divmod(local, group_heads * seq_blocks)
                size = min(group_heads, heads - group * group_heads)
                return first + passed, group * group_heads + within % size, seq_blocks - 1 - within // size
            return first + passed, local // seq_blocks, local % seq_blocks
        rest -= through[LANES - 1]
        first += LANES
    return None


def _batches():
    rng = random.Random(3)
    yield [0]                                       # one empty sequence
    yield [1]
    yield [16384] + [rng.randint(1, 200) for _ in range(31)]   # one long among short ones
    yield [0, 5, 0, 0, 300, 0]                      # empty sequences between
    yield [rng.randint(0, 700) for _ in range(33)]  # a second group of 32
    yield [rng.randint(0, 5000) for _ in range(100)]


@pytest.mark.parametrize("kind, l2_bytes", [("single", None), ("single_lpt", 1 << 25), ("single_lpt", 1 << 21)])
@pytest.mark.parametrize("tile_m", [64, 128, 192])
@pytest.mark.parametrize("heads", [1, 3, 32])
def test_every_task_runs_once_and_the_grid_is_never_short(kind, l2_bytes, tile_m, heads):
    for lengths in _batches():
        grid = varlen_grid_tasks(sum(lengths), len(lengths), tile_m, heads)
        found = [first_task(cta, lengths, heads, tile_m, kind, l2_bytes or 1) for cta in range(grid)]
        tasks = [t for t in found if t is not None]
        expected = {(s, h, m) for s, n in enumerate(lengths) for h in range(heads) for m in range(-(-n // tile_m))}
        assert len(tasks) == len(set(tasks)) and set(tasks) == expected, lengths
        # the CTAs with a task come first; past the last one every CTA finds none
        assert all(t is not None for t in found[:len(tasks)]) and all(t is None for t in found[len(tasks):])
        # the bound: each sequence wastes less than a tile of rows, so at most one CTA a sequence and head
        assert grid - len(tasks) <= len(lengths) * heads


@pytest.mark.parametrize("kind", ["single", "single_lpt"])
def test_each_kind_keeps_its_order(kind):
    lengths, heads, tile_m = [700, 0, 260, 1000], 2, 128
    order = [first_task(cta, lengths, heads, tile_m, kind)
             for cta in range(varlen_grid_tasks(sum(lengths), len(lengths), tile_m, heads))]
    order = [t for t in order if t is not None]
    assert [s for s, _, _ in order] == sorted(s for s, _, _ in order)   # sequences in batch order
    first_seq = [t for t in order if t[0] == 0]
    if kind == "single":   # a head's m-blocks ascending, then the next head
        assert first_seq == [(0, h, m) for h in range(heads) for m in range(6)]
    else:                  # the last m-block first (the longest under a causal mask), heads fastest
        assert first_seq == [(0, h, m) for m in reversed(range(6)) for h in range(heads)]


def test_single_lpt_keeps_a_head_groups_keys_in_l2():
    # one sequence of 4096 keys at head dim 128: 2 MiB of K and V a head, so an 8 MiB budget takes 4
    # heads a group; in each group the last m-block first, the group's heads fastest, as the dense order
    lengths, heads, tile_m = [4096], 10, 128
    order = [first_task(cta, lengths, heads, tile_m, "single_lpt", 8 << 20) for cta in range(32 * heads)]
    assert order[:8] == [(0, h, 31) for h in range(4)] + [(0, h, 30) for h in range(4)]
    assert order[32 * 4: 32 * 4 + 4] == [(0, h, 31) for h in range(4, 8)]
    assert order[32 * 8: 32 * 8 + 3] == [(0, 8, 31), (0, 9, 31), (0, 8, 30)]   # the last group: 2 heads


@pytest.mark.parametrize("kind", ["single", "single_lpt"])
def test_the_kernels_decode_reads_a_found_task_back(kind, monkeypatch):
    """`first_task` returns static's index ((sequence x heads + head) x m_blocks + m_block);
    `TileScheduler.decode` must read it back for every packed kind, never the block index (the grid is
    one-dimensional: read as (m_block, head, batch) it would run sequence 0's head 0 only)."""
    import types

    from fa4.kernels.sm90 import scheduler

    def no_block_index():
        raise AssertionError("a packed varlen task was decoded from the block index")

    fake_cute = types.SimpleNamespace(arch=types.SimpleNamespace(block_idx=no_block_index))
    fake_cutlass = types.SimpleNamespace(max=max, min=min)
    monkeypatch.setattr(scheduler, "_device", lambda: (fake_cutlass, fake_cute, int))
    lengths, heads, tile_m = [700, 0, 260, 1000], 3, 128
    m_blocks = -(-max(lengths) // tile_m)   # the launch's max_seqlen_q's m-blocks
    sched = scheduler.TileScheduler(kind, m_blocks, heads, len(lengths), 1, 132)
    sched.packed_varlen = True
    for cta in range(varlen_grid_tasks(sum(lengths), len(lengths), tile_m, heads)):
        found = first_task(cta, lengths, heads, tile_m, kind)
        if found is None:
            continue
        seq, head, m_block = found
        assert sched.decode((seq * heads + head) * m_blocks + m_block) == (m_block, head, seq)
