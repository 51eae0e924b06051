"""Head dims 96, 192 and 256 of the sm90 forward, on the CPU: the default configuration of each (both
dtypes, both masks, a packed GQA case) compiles for sm_90a without spills or a serialised wgmma, within
the shared memory the model counts; the default rules pick the tiles meant for them. The GPU suites
(tests/gpu/test_sm90_default.py, test_sm90_knobs.py) check what these compute."""

from __future__ import annotations

import itertools

import pytest

from fa4.kernels import AttentionProblem, default_config, feasible
from fa4.kernels import sm90

NEW_HEAD_DIMS = (96, 192, 256)
# (heads_q, heads_kv): one query head per KV head, and GQA 4 (packed: 4 divides 128 and 192 rows)
MHA, GQA4 = (16, 16), (32, 8)

CASES = [(d, dtype, causal, MHA) for d, dtype, causal in
         itertools.product(NEW_HEAD_DIMS, ("fp16", "bf16"), (False, True))]
CASES += [(d, "bf16", True, GQA4) for d in NEW_HEAD_DIMS]


def _problem(d, dtype, causal, heads):
    return AttentionProblem(1, 2048, 2048, *heads, d, dtype, causal=causal, return_lse=causal)


@pytest.mark.parametrize("d,dtype,causal,heads", CASES,
                         ids=[f"d{d}-{t}-{'causal' if c else 'full'}-h{h[0]}/{h[1]}" for d, t, c, h in CASES])
def test_default_config_compiles_clean(d, dtype, causal, heads):
    problem = _problem(d, dtype, causal, heads)
    cfg = default_config("sm90", problem)
    assert feasible(cfg, problem) == []
    assert cfg.pack_gqa == (heads == GQA4)
    report = sm90.compile_report(cfg, problem)
    assert report["spill_stores"] == 0 and report["spill_loads"] == 0, report
    assert not report["wgmma_serialized"], report
    assert report["smem_bytes"] == sm90.resources(cfg, problem)["smem_bytes"]
    assert report["smem_bytes"] <= sm90.REFERENCE_DEVICE.smem_per_block_bytes
    assert all(report["ptx_markers"].values()), report["ptx_markers"]


def test_default_tiles_per_head_dim():
    tiles = {d: default_config("sm90", _problem(d, "fp16", False, MHA)) for d in NEW_HEAD_DIMS}
    assert (tiles[96].tile_m, tiles[96].tile_n, tiles[96].pv_operand) == (192, 128, "ss")
    assert (tiles[192].tile_m, tiles[192].tile_n, tiles[192].pv_operand) == (128, 112, "rs")
    assert (tiles[256].tile_m, tiles[256].tile_n, tiles[256].pv_operand) == (128, 80, "rs")
    # head dim 96 keeps 128-row tiles where 192 rows would pad more (as at head dim 64)
    short = default_config("sm90", AttentionProblem(1, 200, 200, 16, 16, 96, "fp16"))
    assert (short.tile_m, short.tile_n, short.pv_operand) == (128, 128, "rs")


@pytest.mark.parametrize("d", NEW_HEAD_DIMS)
def test_short_keys_go_persistent_only_where_two_q_buffers_fit(d):
    """The persistent rule's second Q buffer: at head dim 96 it fits, at 192 and 256 it does not, and
    the rule leaves those one CTA per tile rather than pick an infeasible configuration."""
    problem = AttentionProblem(16, 1024, 1024, 16, 16, d, "bf16")
    cfg = default_config("sm90", problem)
    assert feasible(cfg, problem) == []
    assert (cfg.q_stages == 2) == (d == 96), cfg.label()


@pytest.mark.parametrize("d", NEW_HEAD_DIMS)
def test_three_consumer_warpgroups_are_refused_where_o_does_not_fit(d):
    """192-row tiles hold O (D/2 fp32 registers a thread) beside S in 160 registers only at head dim
    96, and there only with P through shared memory; at 192 and 256 not even the narrowest S fits."""
    problem = _problem(d, "fp16", True, GQA4)
    wide = default_config("sm90", problem).replace(tile_m=192, tile_n=128, pv_operand="rs")
    assert any("registers" in r for r in feasible(wide, problem))
    if d == 96:
        assert feasible(wide.replace(pv_operand="ss"), problem) == []
    else:
        assert any("registers" in r for r in feasible(wide.replace(tile_n=64, pv_operand="ss"), problem))
