"""The sm90 backward's default configuration (`fa4.kernels.sm90_bwd.defaults`): runnable wherever the
backward runs, and its `group_split` rule splits a KV head's group only where one CTA a group leaves
the GPU idle or one long CTA ends last (its grid model, `split_makespan`, is a model: the H200 times
it, `benchmarks/h200_training.sh bwd-split`)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from fa4.kernels import AttentionProblem, sm90_bwd
from fa4.kernels.device import H200
from fa4.kernels.sm90_bwd.defaults import group_split_for, key_block_steps, split_makespan
from fa4.kernels.sm90_bwd.feasibility import launch_grid


def _problem(batch, seqlen, heads_q, heads_kv, head_dim=128, causal=True):
    return AttentionProblem(batch, seqlen, seqlen, heads_q, heads_kv, head_dim, "bf16", causal)


@pytest.mark.parametrize("batch, seqlen, heads_q, heads_kv, head_dim, causal", [
    (b, s, hq, hkv, d, c) for (b, s), (hq, hkv), d, c in itertools.product(
        [(1, 128), (1, 1000), (2, 4096), (16, 1024)], [(32, 8), (8, 1), (5, 1), (6, 2), (7, 7), (24, 8)],
        (64, 128), (True, False))])
def test_the_default_is_runnable(batch, seqlen, heads_q, heads_kv, head_dim, causal):
    problem = _problem(batch, seqlen, heads_q, heads_kv, head_dim, causal)
    config = sm90_bwd.default_config(problem)
    assert sm90_bwd.reasons(config, problem) == []


def test_a_grid_that_leaves_sms_idle_is_split():
    # B1 S1024 H32/8: 8 key blocks x 8 KV heads = 64 CTAs on 132 SMs, each walking 4 query heads
    for causal in (True, False):
        problem = _problem(1, 1024, 32, 8, causal=causal)
        assert sm90_bwd.default_config(problem).group_split > 1
    # one CTA a group at B1 S128 H8/1: eight query heads in one CTA, 131 SMs idle
    assert sm90_bwd.default_config(_problem(1, 128, 8, 1)).group_split == 8


def test_a_wide_grid_and_mha_are_not_split():
    assert sm90_bwd.default_config(_problem(16, 1024, 32, 8)).group_split == 1   # 1,024 CTAs
    assert sm90_bwd.default_config(_problem(4, 2048, 16, 4)).group_split == 1    # 256 CTAs, balanced
    assert sm90_bwd.default_config(_problem(1, 1024, 16, 16)).group_split == 1   # nothing to split


def test_the_model_counts_the_blocks_the_kernel_visits():
    # causal, Sq = Sk = 1024, 64-row query blocks: key block j (128 keys) starts at row 128 j
    problem = _problem(1, 1024, 32, 8)
    config = sm90_bwd.default_config(problem).replace(group_split=1, tile_m=64)
    assert key_block_steps(config, problem) == [16 - 2 * j for j in range(8)]
    # Sq < Sk: rows 84-99 alone see the last key block; Sq > Sk: rows 0-199 see no key, so the three
    # query blocks before row 192 are skipped
    assert key_block_steps(config, AttentionProblem(1, 100, 400, 4, 1, 128, "bf16", True)) == [2, 2, 2, 1]
    assert key_block_steps(config, AttentionProblem(1, 300, 100, 4, 1, 128, "bf16", True)) == [2]


def test_80_row_blocks_start_where_their_first_visible_row_is():
    # 80-row blocks (13 cover 1024 rows): key block j's first row 128 j lies in block 128 j // 80
    problem = _problem(1, 1024, 32, 8)
    config = sm90_bwd.default_config(problem).replace(group_split=1)
    assert config.tile_m == 80
    assert key_block_steps(config, problem) == [13 - 128 * j // 80 for j in range(8)]


@pytest.mark.parametrize("batch, seqlen, heads_q, heads_kv, head_dim, order", [
    (1, 4096, 32, 8, 128, "sectioned_lpt"),    # GQA: sections of groups, longest first in each
    (16, 1024, 32, 8, 128, "sectioned_lpt"),   # 512 MiB of streamed rows: four sections
    (2, 16384, 8, 1, 128, "sectioned_lpt"),    # MQA is GQA 8
    (16, 2048, 16, 16, 64, "single"),          # MHA, 256 MiB: the plain order's L2 reuse
    (8, 512, 16, 16, 64, "single_lpt"),        # MHA, 32 MiB: longest first
    (1, 4096, 32, 32, 128, "single_lpt"),      # MHA, 128 MiB: still longest first
])
def test_the_order_of_key_blocks(batch, seqlen, heads_q, heads_kv, head_dim, order):
    assert sm90_bwd.default_config(_problem(batch, seqlen, heads_q, heads_kv, head_dim)).scheduler == order
    # without a mask every key block is as long as the next: nothing to put first
    full = sm90_bwd.default_config(_problem(batch, seqlen, heads_q, heads_kv, head_dim, causal=False))
    assert full.scheduler == "single"


@pytest.mark.parametrize("heads_q, heads_kv, floor", [(8, 1, 2), (64, 8, 2), (32, 8, 1), (5, 1, 2), (7, 1, 2),
                                                      (16, 1, 4), (64, 1, 8)])
def test_a_cta_walks_at_most_four_query_heads_where_a_split_allows(heads_q, heads_kv, floor):
    # wide grids, where the grid model alone would not split
    for batch, seqlen, causal in ((16, 4096, True), (16, 4096, False)):
        problem = _problem(batch, seqlen, heads_q, heads_kv, causal=causal)
        assert sm90_bwd.default_config(problem).group_split == floor


def test_the_query_tile_is_80_rows_at_head_dim_128_and_128_at_64():
    for causal in (True, False):
        assert sm90_bwd.default_config(_problem(2, 4096, 32, 8, 128, causal)).tile_m == 80
        assert sm90_bwd.default_config(_problem(2, 4096, 32, 8, 64, causal)).tile_m == 128


def test_more_sms_take_a_larger_split_never_a_smaller_one():
    problem = _problem(1, 2048, 32, 8, head_dim=64)
    wide = dataclasses.replace(H200, sm_count=4 * H200.sm_count)
    assert group_split_for(sm90_bwd.default_config(problem), problem, wide) >= \
        group_split_for(sm90_bwd.default_config(problem), problem, H200)


def test_a_split_costs_its_reduce_where_it_buys_nothing():
    # one CTA per SM already and every CTA alike: a split only adds the reduce and the accumulators
    problem = _problem(1, 2048, 32, 8, head_dim=64, causal=False)   # 16 x 8 = 128 CTAs of 16 steps x 4
    config = sm90_bwd.default_config(problem)
    assert split_makespan(config.replace(group_split=2), problem, 132) > \
        split_makespan(config.replace(group_split=1), problem, 132)
    assert config.group_split == 1


@pytest.mark.parametrize("n_blocks, groups, section", [(8, 10, 3), (5, 7, 7), (4, 6, 1), (3, 5, 2), (1, 1, 1),
                                                       (16, 4, 9)])
def test_a_sectioned_grid_visits_every_tile_once_longest_first_in_each_section(n_blocks, groups, section):
    from fa4.kernels.sm90_bwd.plan import sectioned_tile

    order = [sectioned_tile(i, section, n_blocks, groups) for i in range(n_blocks * groups)]
    assert sorted(order) == [(n, g) for n in range(n_blocks) for g in range(groups)]
    for start in range(0, groups, section):   # a section: its groups' key block 0 first, groups fastest
        size = min(section, groups - start)
        block = order[start * n_blocks:(start + size) * n_blocks]
        assert block == [(n, g) for n in range(n_blocks) for g in range(start, start + size)]
    # one group a section is the plain order; every group in one section is single_lpt's
    if section == 1:
        assert order == [(n, g) for g in range(groups) for n in range(n_blocks)]
    if section >= groups:
        assert order == [(n, g) for n in range(n_blocks) for g in range(groups)]


def test_a_section_holds_the_groups_whose_rows_fit_the_budget():
    from fa4.kernels.sm90_bwd.plan import SECTION_BYTES, section_groups

    # head dim 128: 1 KiB of Q, dO and dQ a row; 4 heads x 1024 rows = 4 MiB a group
    assert section_groups(4 * 1024, 128) == SECTION_BYTES // (4 * 2**20)
    assert section_groups(8 * 16384, 128) == 1 and section_groups(8 * 65536, 128) == 1   # never none
    problem = _problem(16, 1024, 32, 8)
    config = sm90_bwd.default_config(problem).replace(scheduler="sectioned_lpt")
    n_blocks = -(-1024 // config.tile_n)
    assert launch_grid(config, problem) == (n_blocks * 8 * config.group_split * 16, 1, 1)
    # the grid model orders it as the kernel does: as balanced as longest first, here within 2 %
    lpt = split_makespan(config.replace(scheduler="single_lpt"), problem, 132)
    assert split_makespan(config, problem, 132) <= 1.02 * lpt
