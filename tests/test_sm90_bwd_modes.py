"""Two modes of the sm90 backward beside its knobs, on a CPU.

Deterministic gradients (`compile_backward(..., deterministic=True)`): each sum in global memory (dQ's
per query block, a split group's dK and dV per key block) is added by its writers in a fixed order,
each waiting on a counter for its turn (`kernel.FlashAttentionBackwardSm90.wait_turn`). The order
cannot deadlock under any scheduler (a simulation of the grid with few resident CTAs, the waits as the
kernel makes them), and every dQ path and split compiles with the waits and without spills.

The programmatic launch (`FA4_BWD_PROGRAMMATIC_LAUNCH=1`, `plan.PROGRAMMATIC_LAUNCH`): compiles with
its waits. On the GPU: tests/gpu/test_sm90_bwd_deterministic_gpu.py, test_sm90_bwd_programmatic_gpu.py."""

from __future__ import annotations

import itertools
import random

import pytest

from fa4.kernels import AttentionProblem, Config, sm90_bwd
from fa4.kernels.sm90_bwd.defaults import key_block_steps
from fa4.kernels.sm90_bwd.feasibility import heads_per_part
from fa4.kernels.sm90_bwd.plan import launch_order, section_groups


def _programs(config: Config, problem: AttentionProblem, descending: bool = False):
    """Each CTA's ordered adds in launch order: [(tile, [(sum, turn), ...])], the sums named as the
    kernel's counters index them: ("dq", batch, query head, query block) with the key block as the
    turn (`descending`: the key blocks after it that see the query block, `dq_turn`); ("dkv", batch,
    KV head, key block) with the part as the turn (split groups only). A CTA walks its query heads,
    per head the unmasked query blocks, then the masked ones (`block_of`)."""
    steps = key_block_steps(config, problem)
    m_max = -(-max(problem.seqlen_q, 1) // config.tile_m)
    ratio, split = problem.gqa_ratio, config.group_split
    per_part = heads_per_part(config, problem)
    section = section_groups(per_part * max(problem.seqlen_q, 1), problem.head_dim)
    programs = []
    offset = problem.seqlen_k - problem.seqlen_q

    def turn(n_block, m):   # the kernel's dq_turn
        if not descending:
            return n_block
        last = len(steps) - 1
        if problem.causal:
            last = min(((m + 1) * config.tile_m - 1 + offset) // config.tile_n, last)
        return last - n_block

    for n_block, slot, batch in launch_order(config.scheduler, len(steps), problem.heads_kv * split,
                                             problem.batch, section, descending):
        head_kv, part = divmod(slot, split)
        heads = range(part * per_part, min(ratio, (part + 1) * per_part))
        m_min = m_max - steps[n_block]
        adds = [(("dq", batch, head_kv * ratio + h, m), turn(n_block, m))
                for h in heads for m in range(m_min, m_max)]   # the order within a CTA does not matter
        if split > 1:
            adds.append((("dkv", batch, head_kv, n_block), part))
        programs.append(((n_block, slot, batch), adds))
    return programs


def _simulate(programs, resident: int, rng: random.Random) -> dict:
    """Run the CTAs `resident` at a time, handed out in launch order as CTAs finish, a random ready
    CTA stepping each time; each add waits until its sum's counter equals its turn. Returns each sum's
    writers in the order they added; raises on a deadlock (no resident CTA can step)."""
    queue = [list(adds) for _, adds in programs]
    tiles = [tile for tile, _ in programs]
    counters, order = {}, {}
    running, launched = [], 0
    while running or launched < len(queue):
        while len(running) < resident and launched < len(queue):
            running.append(launched)
            launched += 1
        ready = [cta for cta in running
                 if not queue[cta] or counters.get(queue[cta][0][0], 0) == queue[cta][0][1]]
        if not ready:
            waiting = {tiles[cta]: queue[cta][0] for cta in running}
            raise AssertionError(f"deadlock: every resident CTA waits for a turn: {waiting}")
        cta = rng.choice(ready)
        if not queue[cta]:
            running.remove(cta)
            continue
        total, turn = queue[cta].pop(0)
        counters[total] = turn + 1
        order.setdefault(total, []).append(tiles[cta])
    return order


CASES = [  # (batch, Sq, Sk, Hq, Hkv, causal): odd lengths, Sq != Sk both ways, GQA, MHA
    (2, 300, 300, 8, 2, True), (1, 177, 301, 8, 1, True), (1, 301, 177, 6, 2, True),
    (2, 200, 333, 4, 4, False), (1, 640, 640, 16, 2, True),
]


@pytest.mark.parametrize("scheduler, group_split, case, descending", [
    (s, g, c, d) for s, g, c, d in itertools.product(("single", "single_lpt", "sectioned_lpt"), (1, 2, 4),
                                                     CASES, (False, True))
    if g <= c[3] // c[4]])
def test_the_ordered_adds_cannot_deadlock_and_add_in_turn_order(scheduler, group_split, case, descending):
    batch, seqlen_q, seqlen_k, heads_q, heads_kv, causal = case
    problem = AttentionProblem(batch, seqlen_q, seqlen_k, heads_q, heads_kv, 128, "bf16", causal)
    config = Config.make("sm90_bwd", tile_m=64, tile_n=64, scheduler=scheduler, group_split=group_split)
    programs = _programs(config, problem, descending)
    rng = random.Random(0)
    # one resident CTA (the strictest: launch order alone must let every wait through), a few, all
    for resident in (1, 3, 7, len(programs)):
        for _ in range(3):
            order = _simulate(programs, resident, rng)
            for total, writers in order.items():
                # dQ: key blocks 0, 1, 2, ... (every key block up to the last that sees the query
                # block), descending: that last one first, down to 0; dK/dV: parts 0 .. split - 1
                turns = [w[0] if total[0] == "dq" else w[1] % group_split for w in writers]
                want = list(range(len(turns)))
                if descending and total[0] == "dq":
                    want = want[::-1]
                assert turns == want, (total, writers)
            if group_split > 1:
                assert sum(1 for t in order if t[0] == "dkv") == batch * heads_kv * len(key_block_steps(config, problem))


def test_a_wait_that_a_later_cta_must_satisfy_is_caught():
    """The simulation finds a deadlock where one exists: a turn order against the launch order."""
    programs = [((0, 0, 0), [(("dq", 0, 0, 0), 1)]), ((1, 0, 0), [(("dq", 0, 0, 0), 0)])]
    with pytest.raises(AssertionError, match="deadlock"):
        _simulate(programs, 1, random.Random(0))
    assert _simulate(programs, 2, random.Random(0)) == {("dq", 0, 0, 0): [(1, 0, 0), (0, 0, 0)]}


def _problem(head_dim, dtype, causal):
    return AttentionProblem(2, 177, 301, 8, 2, head_dim, dtype, causal)


# one configuration of each dQ path and dK/dV path, under each scheduler (the waits sit in the dQ
# warp, the MMA warpgroups or the epilogue's reduce warp)
DETERMINISTIC_CONFIGS = [
    (128, "bf16", True, dict()),                                                         # atomic
    (128, "bf16", True, dict(dq_accum="bulk", scheduler="single_lpt")),
    (128, "fp16", False, dict(dq_accum="fragment", group_split=2)),
    (64, "bf16", False, dict(dq_accum="bulk", group_split=2, sdp_swap=True, tile_m=64)),
    (128, "bf16", True, dict(tile_m=80, sdp_swap=True, dq_accum="fragment", group_split=2,
                             scheduler="sectioned_lpt")),
    (64, "fp16", True, dict(group_split=2, scheduler="single_lpt")),                     # atomic, split
    (128, "bf16", True, dict(tile_m=80, sdp_swap=True, dq_accum="fragment_atomic")),      # vector reds
]


@pytest.mark.parametrize("head_dim, dtype, causal, knobs", DETERMINISTIC_CONFIGS,
                         ids=lambda v: v if not isinstance(v, dict) else "-".join(f"{k}={x}" for k, x in v.items()))
def test_deterministic_compiles_with_its_waits_and_without_spills(head_dim, dtype, causal, knobs):
    config, problem = Config.make("sm90_bwd", **knobs), _problem(head_dim, dtype, causal)
    assert sm90_bwd.reasons(config, problem) == []
    ordered = sm90_bwd.compile_report(config, problem, only=("main",), deterministic=True)["main"]
    assert ordered["ptx_markers"]["turns"], ordered["ptx_markers"]   # (the plain kernel's SASS is unchanged:
    # benchmarks/sass_hashes.py, docs/backward.md)
    assert not (ordered["spill_stores"] or ordered["spill_loads"] or ordered["wgmma_serialized"]), ordered
    # the counters live in global memory: the shared-memory model holds as it is
    assert ordered["smem_bytes"] == sm90_bwd.smem_bytes(config, problem)
    assert (sm90_bwd.compile_key(config, problem, deterministic=True)
            != sm90_bwd.compile_key(config, problem))


@pytest.mark.parametrize("knobs", [dict(), dict(dq_accum="bulk", group_split=2, sdp_swap=True, tile_m=64),
                                   dict(dq_accum="fragment", group_split=2, sdp_swap=True, tile_m=64)],
                         ids=["default", "bulk-split-swap", "fragment-split-swap"])
def test_programmatic_launch_compiles_with_its_waits(knobs, monkeypatch):
    """FA4_BWD_PROGRAMMATIC_LAUNCH=1 (`plan.PROGRAMMATIC_LAUNCH`, off until timed): the preprocess lets
    its dependent start, the main kernel waits for it and lets the postprocess start, which waits for
    it, without spills; the compile key tells the two launches apart, so no cache serves one for the
    other."""
    config, problem = Config.make("sm90_bwd", **knobs), _problem(64, "bf16", True)
    plain_key = sm90_bwd.compile_key(config, problem)
    monkeypatch.setenv("FA4_BWD_PROGRAMMATIC_LAUNCH", "1")
    assert sm90_bwd.compile_key(config, problem) != plain_key
    reports = sm90_bwd.compile_report(config, problem)
    for name, report in reports.items():
        assert report["ptx_markers"]["griddepcontrol"], name
        assert not (report["spill_stores"] or report["spill_loads"]), (name, report)
    assert reports["main"]["smem_bytes"] == sm90_bwd.smem_bytes(config, problem)
    monkeypatch.setenv("FA4_BWD_PROGRAMMATIC_LAUNCH", "yes")
    with pytest.raises(ValueError, match="0 or 1"):
        sm90_bwd.programmatic_launch()


@pytest.mark.parametrize("head_dim, dtype, causal, knobs", [DETERMINISTIC_CONFIGS[i] for i in (0, 1, 4)],
                         ids=["atomic", "bulk-single_lpt", "fragment-tile_m80-split-sectioned"])
def test_descending_turns_compile_without_spills(head_dim, dtype, causal, knobs, monkeypatch):
    """FA4_BWD_DETERMINISTIC_ORDER=descending (`plan.DESCENDING_TURNS`, off until timed): the key blocks
    launched from the last, each walking its masked query blocks first, the turns from the last key
    block; compiles with its waits and without spills, and the compile key tells the orders apart."""
    config, problem = Config.make("sm90_bwd", **knobs), _problem(head_dim, dtype, causal)
    ascending = sm90_bwd.compile_key(config, problem, deterministic=True)
    monkeypatch.setenv("FA4_BWD_DETERMINISTIC_ORDER", "descending")
    assert sm90_bwd.compile_key(config, problem, deterministic=True) != ascending
    assert sm90_bwd.compile_key(config, problem) == sm90_bwd.compile_key(config, problem, deterministic=False)
    ordered = sm90_bwd.compile_report(config, problem, only=("main",), deterministic=True)["main"]
    assert ordered["ptx_markers"]["turns"], ordered["ptx_markers"]
    assert not (ordered["spill_stores"] or ordered["spill_loads"] or ordered["wgmma_serialized"]), ordered
    monkeypatch.setenv("FA4_BWD_DETERMINISTIC_ORDER", "sideways")
    with pytest.raises(ValueError, match="ascending or descending"):
        sm90_bwd.descending_turns()
