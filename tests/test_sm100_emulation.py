"""The CPU emulation of the sm100 FA4 tile algorithm against SDPA and an fp32 reference.

Criteria (design `fa4-sm100.md`, Validation): rtol = atol = 1e-2 against SDPA (explicit bottom-right
mask) and against fp32; the error against fp32 within a small multiple of a same-precision SDPA's; LSE
against torch.logsumexp; every rescale_threshold of the sm100 space within a small multiple of threshold
0's error; P never above 2^threshold. The falsification tests swap in the seed's wrong rescale rule and
a plan without masks, and show the same checks then fail.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from fa4.kernels import Config, knob
from fa4.kernels.sm100 import emulation as emu
from fa4.kernels.sm100.emulation import BasisUpdate, RescaleStats, emulate_fa4_forward
from fa4.reference import attention_fp32, check, sdpa_same_precision, visible_keys
from fa4tune.sm100 import rescale_stats

THRESHOLDS = knob("sm100", "rescale_threshold").choices
TILE_NS = knob("sm100", "tile_n").choices
SMALL_N, LARGE_N = min(TILE_NS), max(TILE_NS)
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# the error of threshold t may be this many times threshold 0's (P's top value is rounded once t > 0)
THRESHOLD_ERROR_FACTOR = 3.0
# and ours this many times a same-precision SDPA's, both against fp32
SDPA_ERROR_FACTOR = 3.0


def _inputs(batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype, seed=0, logit_gain=1.0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seqlen_q, heads_q, head_dim, generator=gen) * logit_gain
    k = torch.randn(batch, seqlen_k, heads_kv, head_dim, generator=gen) * logit_gain
    v = torch.randn(batch, seqlen_k, heads_kv, head_dim, generator=gen)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _references(q, k, v, causal):
    # the one fp32 reference and same-precision SDPA (`fa4.reference`); compared in fp64 so the
    # comparison adds no rounding of its own
    ref, ref_lse = (t.double() for t in attention_fp32(q, k, v, causal))
    return ref, ref_lse, sdpa_same_precision(q, k, v, causal)


def _check(out, lse, q, k, v, causal, refs=None):
    """Every criterion against the references; returns our max error against fp32."""
    ref, ref_lse, sdpa = refs or _references(q, k, v, causal)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    assert torch.isfinite(out).all(), "O holds NaN or inf"
    seen = torch.isfinite(ref_lse)                      # (B, Hq, Sq)
    seen_rows = seen.permute(0, 2, 1)[..., None]         # (B, Sq, Hq, 1)
    # rows that see no key: O = 0, LSE = -inf
    assert (out.float() * ~seen_rows).abs().max() == 0 if (~seen).any() else True
    assert torch.equal(torch.isfinite(lse), seen) and (lse[~seen] == -math.inf).all()
    torch.testing.assert_close(lse[seen].double(), ref_lse[seen], rtol=1e-5, atol=1e-4)
    ours = out.double() * seen_rows
    torch.testing.assert_close(ours, ref * seen_rows, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(ours, sdpa.double() * seen_rows, rtol=1e-2, atol=1e-2)
    err = float((ours - ref).abs().max())
    sdpa_err = float((sdpa.double() * seen_rows - ref).abs().max())
    assert err <= SDPA_ERROR_FACTOR * sdpa_err + 1e-6, f"error {err:.2e} vs SDPA's {sdpa_err:.2e}"
    return err


# (batch, Sq, Sk, Hq, Hkv, D) and the config overrides each case runs with: every tile_n, both q_stages,
# both pack_gqa values and every threshold appear; tails, Sq != Sk (both ways) and GQA 1/2/4/7/8 too.
GRID = [
    ((1, 1024, 1024, 32, 8, 128), {}),                                   # the design's base case
    ((2, 300, 300, 8, 2, 64), dict(tile_n=SMALL_N, q_stages=1, exp2_poly_columns=8)),  # tails, ratio 4
    ((1, 200, 333, 4, 4, 128), dict(tile_n=LARGE_N, rescale_threshold=0.0,
                                    exp2_poly_columns=0)),               # Sq < Sk, ratio 1
    ((1, 333, 150, 8, 1, 64), dict(tile_n=LARGE_N, rescale_threshold=12.0)),  # Sq > Sk: empty rows
    ((1, 190, 257, 7, 1, 64), dict(pack_gqa=False, rescale_threshold=4.0)),  # ratio 7, unpacked
    ((1, 129, 129, 16, 2, 128), dict(tile_n=SMALL_N, q_stages=1, pack_gqa=False)),  # ratio 8
    ((1, 257, 511, 4, 2, 64), dict(q_stages=1, tile_n=LARGE_N)),         # ratio 2
]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("shape,overrides", GRID, ids=[f"{s}-{o}" for s, o in GRID])
def test_matches_sdpa_and_fp32(shape, overrides, dtype, causal):
    q, k, v = _inputs(*shape, DTYPES[dtype], seed=sum(shape))
    stats = RescaleStats()
    out, lse = emulate_fa4_forward(q, k, v, Config.make("sm100", **overrides), causal=causal,
                                   return_lse=True, stats=stats)
    _check(out, lse, q, k, v, causal)
    assert stats.max_p_16bit <= 2.0 ** Config.make("sm100", **overrides).rescale_threshold


# The cluster-pair mode (two_cta, non-causal only): a task is both CTAs' Q stages (2 * q_stages tiles)
# on one KV loop; tails, Sq != Sk, GQA packed and not, both tile_n, both q_stages.
TWO_CTA_GRID = [
    ((1, 1024, 1024, 32, 8, 128), dict(two_cta=True)),
    ((2, 300, 300, 8, 2, 64), dict(two_cta=True, tile_n=SMALL_N, q_stages=1, exp2_poly_columns=8)),
    ((1, 200, 333, 4, 4, 128), dict(two_cta=True, rescale_threshold=0.0, pack_gqa=False)),
    ((1, 700, 150, 8, 1, 64), dict(two_cta=True, rescale_threshold=12.0)),
]


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("shape,overrides", TWO_CTA_GRID, ids=[f"{s}-{o}" for s, o in TWO_CTA_GRID])
def test_two_cta_matches_sdpa_and_fp32(shape, overrides, dtype):
    q, k, v = _inputs(*shape, DTYPES[dtype], seed=sum(shape) + 1)
    config = Config.make("sm100", **overrides)
    out, lse = emulate_fa4_forward(q, k, v, config, return_lse=True)
    _check(out, lse, q, k, v, False)
    # non-causal: the pair changes which CTA owns a row, not what the row computes
    single = emulate_fa4_forward(q, k, v, config.replace(two_cta=False), return_lse=True)
    assert torch.equal(out, single[0]) and torch.equal(lse, single[1])


def test_two_cta_is_non_causal_only():
    q, k, v = _inputs(1, 64, 64, 4, 2, 64, torch.float16)
    with pytest.raises(ValueError, match="non-causal"):
        emulate_fa4_forward(q, k, v, Config.make("sm100", two_cta=True), causal=True)


def test_keep_mask_is_the_column_limit():
    """The kernel's 32-bit keep words (`_mask_row`, replayed by `keep_mask`) keep exactly the
    columns below the limit, for limits below, inside and beyond the block and at word edges."""
    limits = torch.tensor([-300, -1, 0, 1, 31, 32, 33, 63, 64, 65, 96, 127, 128, 129, 4000])
    for n_cols in (64, 128):
        expected = torch.arange(n_cols)[None, :] < limits[:, None]
        assert torch.equal(emu.keep_mask(limits, n_cols), expected)


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_extreme_logits(dtype, causal):
    """Inputs x30 (logits in the thousands): no NaN/inf and still within tolerance, every threshold."""
    q, k, v = _inputs(2, 300, 333, 8, 2, 64, DTYPES[dtype], seed=3, logit_gain=30.0)
    refs = _references(q, k, v, causal)
    for threshold in THRESHOLDS:
        out, lse = emulate_fa4_forward(q, k, v, Config.make("sm100", rescale_threshold=threshold),
                                       causal=causal, return_lse=True)
        _check(out, lse, q, k, v, causal, refs)


def test_polynomial_exp2_accuracy_and_masked_zero():
    """The kernel's FMA exp2: relative error below half an fp16 ulp over the range P sees, exactly 0
    for a masked (-inf) score, and only on the columns the knob names."""
    x = torch.linspace(-125.0, 12.0, 100_001)
    rel = (emu.exp2_polynomial(x).double() / torch.exp2(x.double()) - 1).abs().max()
    assert rel < 1e-4, rel
    assert float(emu.exp2_polynomial(torch.tensor([-math.inf, -127.0, -500.0])).abs().max()) == 0.0
    scores = torch.full((3, 64), 0.5)
    out = emu.kernel_exp2(scores, 8)
    poly_cols = (torch.arange(64) % 32) >= 24
    assert torch.equal(out[:, ~poly_cols], torch.exp2(scores[:, ~poly_cols]))
    assert not torch.equal(out[:, poly_cols], torch.exp2(scores[:, poly_cols]))  # the fit's own error
    assert torch.equal(emu.kernel_exp2(scores, 0), torch.exp2(scores))


def test_explicit_softmax_scale():
    """A caller's scale is folded into scale_log2 like the default 1/sqrt(D)."""
    q, k, v = _inputs(1, 200, 260, 4, 2, 64, torch.bfloat16, seed=11)
    scale = 0.37
    out, lse = emulate_fa4_forward(q, k, v, Config.make("sm100"), causal=True, softmax_scale=scale,
                                   return_lse=True)
    ref, ref_lse = attention_fp32(q, k, v, True, scale)
    assert check(out, lse, q, k, v, True, scale) == []
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-4)


def _threshold_errors(q, k, v, causal, refs, **overrides):
    errors, stats = {}, {}
    for threshold in THRESHOLDS:
        stats[threshold] = RescaleStats()
        out, lse = emulate_fa4_forward(
            q, k, v, Config.make("sm100", rescale_threshold=threshold, **overrides), causal=causal,
            return_lse=True, stats=stats[threshold])
        errors[threshold] = _check(out, lse, q, k, v, causal, refs)
    return errors, stats


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("kind,causal", [("normal", False), ("peaked", True), ("peaked", False)])
def test_every_threshold_is_exact(kind, causal, dtype):
    """Threshold t keeps the old basis while the max moves by <= t: as exact as threshold 0."""
    q, k, v = rescale_stats.make_inputs(kind, 1, 640, 640, 8, 2, 64, DTYPES[dtype], seed=5)
    refs = _references(q, k, v, causal)
    errors, stats = _threshold_errors(q, k, v, causal, refs, tile_n=SMALL_N)
    for threshold in THRESHOLDS:
        s = stats[threshold]
        assert errors[threshold] <= THRESHOLD_ERROR_FACTOR * errors[0.0], errors
        assert s.max_p_16bit <= 2.0 ** threshold
        assert s.max_p <= 2.0 ** threshold * (1 + 2.0 ** -10)
        if threshold == 0.0:
            assert s.row_rescales_skipped == 0 and s.max_p <= 1.0
            assert s.row_max_moved > 0 and s.tile_rescales > 0
        else:  # not vacuous: some rows really kept an old basis that their max had left
            assert s.row_rescales_skipped > 0
            assert s.tile_rescales <= stats[0.0].tile_rescales
            assert s.warp_rescales <= stats[0.0].warp_rescales


def seed_rule(running_max, block_max, threshold, scale_log2):
    """The lesson seed's reading: skip the O multiply when the factor is "close to 1", yet move the basis
    (and rescale l, which softmax holds). Wrong: O and l end on different bases."""
    right = emu.choose_basis(running_max, block_max, threshold, scale_log2)
    candidate = torch.maximum(running_max, block_max)
    candidate_basis = torch.where(candidate == -math.inf, torch.zeros_like(candidate), candidate)
    log2_factor = (running_max - candidate_basis) * scale_log2
    within = log2_factor >= -threshold
    return BasisUpdate(running_max=candidate, basis=candidate_basis,
                       o_scale=torch.where(within, torch.ones_like(log2_factor), right.o_scale),
                       l_scale=torch.exp2(log2_factor), raised=~within)


def test_seed_rule_is_caught(monkeypatch):
    """The checks above fail when the skip does not keep the basis (threshold 8, the seed's value)."""
    q, k, v = rescale_stats.make_inputs("normal", 1, 640, 640, 8, 2, 64, torch.float16, seed=5)
    refs = _references(q, k, v, False)
    config = Config.make("sm100", rescale_threshold=8.0, tile_n=SMALL_N)
    out, lse = emulate_fa4_forward(q, k, v, config, return_lse=True)
    _check(out, lse, q, k, v, False, refs)
    monkeypatch.setattr(emu, "_basis_rule", seed_rule)
    out, lse = emulate_fa4_forward(q, k, v, config, return_lse=True)
    with pytest.raises(AssertionError):
        _check(out, lse, q, k, v, False, refs)
    # at threshold 0 the seed's rule and ours coincide: the difference is exactly the kept basis
    zero = config.replace(rescale_threshold=0.0)
    wrong_zero = emulate_fa4_forward(q, k, v, zero)
    monkeypatch.setattr(emu, "_basis_rule", emu.choose_basis)
    assert torch.equal(wrong_zero, emulate_fa4_forward(q, k, v, zero))


def test_missing_causal_mask_is_caught(monkeypatch):
    """A plan that calls every visited block full (no diagonal mask) must fail the same checks."""
    q, k, v = _inputs(1, 300, 300, 4, 2, 64, torch.float16, seed=9)
    real_plan = emu._plan_blocks

    def unmasked_plan(*args):
        plan = real_plan(*args)
        return emu._BlockPlan(plan.n_blocks, plan.block_end, plan.block_end.clone())

    monkeypatch.setattr(emu, "_plan_blocks", unmasked_plan)
    out, lse = emulate_fa4_forward(q, k, v, Config.make("sm100"), causal=True, return_lse=True)
    with pytest.raises(AssertionError):
        _check(out, lse, q, k, v, True)


def _brute_force_regions(config, batch, seqlen_q, seqlen_k, heads_q, heads_kv, causal):
    """Count (task, KV block) pairs by region straight from the visibility matrix."""
    ratio = heads_q // heads_kv
    row_ratio = ratio if config.pack_gqa else 1
    tasks = batch * (heads_kv if config.pack_gqa else heads_q)
    rows = seqlen_q * row_ratio
    rows_per_cta = config.tile_m * config.q_stages * (2 if config.two_cta else 1)
    visible = (visible_keys(seqlen_q, seqlen_k) if causal
               else torch.ones(seqlen_q, seqlen_k, dtype=torch.bool))
    counts = {"skip": 0, "full": 0, "masked": 0}
    for first in range(0, rows, rows_per_cta):
        seqs = torch.arange(first, min(first + rows_per_cta, rows)) // row_ratio
        for key_lo in range(0, seqlen_k, config.tile_n):
            block = visible[seqs, key_lo:key_lo + config.tile_n]
            if not block.any():
                counts["skip"] += tasks
            elif block.all() and key_lo + config.tile_n <= seqlen_k:
                counts["full"] += tasks
            else:
                counts["masked"] += tasks
    return counts


@pytest.mark.parametrize("shape", [(1, 1000, 1000, 4, 2), (1, 333, 150, 8, 1), (1, 150, 700, 6, 3)])
@pytest.mark.parametrize("overrides", [{}, dict(tile_n=SMALL_N, q_stages=1, pack_gqa=False)]
                         + [dict(tile_n=n, q_stages=1) for n in TILE_NS])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_region_counts_match_brute_force(shape, overrides, causal):
    _region_counts(shape, overrides, causal)


@pytest.mark.parametrize("shape", [(1, 1000, 1000, 4, 2), (1, 333, 150, 8, 1), (1, 150, 700, 6, 3)])
@pytest.mark.parametrize("overrides", [dict(two_cta=True), dict(two_cta=True, q_stages=1, tile_n=SMALL_N)])
def test_two_cta_region_counts_match_brute_force(shape, overrides):
    _region_counts(shape, overrides, False)


def _region_counts(shape, overrides, causal):
    config = Config.make("sm100", **overrides)
    batch, seqlen_q, seqlen_k, heads_q, heads_kv = shape
    q, k, v = _inputs(batch, seqlen_q, seqlen_k, heads_q, heads_kv, 64, torch.float16)
    stats = RescaleStats()
    emulate_fa4_forward(q, k, v, config, causal=causal, stats=stats)
    expected = _brute_force_regions(config, *shape, causal)
    got = {"skip": stats.blocks_skipped_causal, "full": stats.blocks_full, "masked": stats.blocks_masked}
    assert got == expected
    visited = stats.blocks_full + stats.blocks_masked
    assert stats.tiles_visited == visited * config.q_stages * (2 if config.two_cta else 1)
    # one decision per visited tile except each task's first block
    assert stats.tile_decisions <= stats.tiles_visited
    assert stats.tile_rescales + stats.tile_skips == stats.tile_decisions
    # four 32-row warps per tile; a tile rescales iff one of its warps does
    assert stats.warp_decisions == 4 * stats.tile_decisions
    assert stats.tile_rescales <= stats.warp_rescales <= 4 * stats.tile_rescales


def test_stats_accumulate_and_threshold_zero_counts():
    q, k, v = _inputs(1, 256, 512, 4, 2, 64, torch.float16, seed=2)
    config = Config.make("sm100", rescale_threshold=0.0, tile_n=SMALL_N)
    once = RescaleStats()
    emulate_fa4_forward(q, k, v, config, stats=once)
    twice = RescaleStats()
    emulate_fa4_forward(q, k, v, config, stats=twice)
    emulate_fa4_forward(q, k, v, config, stats=twice)
    assert twice.tile_decisions == 2 * once.tile_decisions and twice.max_p == once.max_p == 1.0
    # non-causal: one decision per KV block after the first for each of 256 positions x 4 query heads
    assert once.row_decisions == (512 // SMALL_N - 1) * 256 * 4
    assert once.row_rescales == once.row_max_moved and once.row_basis_from_empty == 0


def test_empty_and_degenerate_shapes():
    config = Config.make("sm100")
    q, k, v = _inputs(1, 64, 0, 4, 2, 64, torch.float16)
    out, lse = emulate_fa4_forward(q, k, v, config, return_lse=True)
    assert (out == 0).all() and (lse == -math.inf).all()
    q, k, v = _inputs(1, 0, 64, 4, 2, 64, torch.float16)
    out, lse = emulate_fa4_forward(q, k, v, config, return_lse=True)
    assert out.shape == q.shape and lse.shape == (1, 4, 0)


def test_rejects_what_it_cannot_emulate():
    q, k, v = _inputs(1, 16, 16, 4, 2, 64, torch.float16)
    with pytest.raises(ValueError):
        emulate_fa4_forward(q, k, v, Config.make("sm90"))
    with pytest.raises(ValueError):
        emulate_fa4_forward(q.float(), k.float(), v.float(), Config.make("sm100"))
    with pytest.raises(ValueError):
        emulate_fa4_forward(q[:, :, :3], k, v, Config.make("sm100"))


def test_cli_writes_sorted_json(tmp_path):
    from click.testing import CliRunner

    output = tmp_path / "stats.json"
    result = CliRunner().invoke(rescale_stats.rescale_stats_command, [
        "--seqlen", "256", "--heads", "4", "--heads-kv", "2", "--head-dim", "64",
        "--causal", "--out", str(output)])
    assert result.exit_code == 0, result.output
    text = output.read_text()
    saved = json.loads(text)
    assert text == json.dumps(saved, sort_keys=True, indent=1) + "\n"
    assert saved["command"] == (
        "fa4tune rescale-stats --seqlen 256 "
        + "".join(f"--threshold {t:g} " for t in THRESHOLDS)
        + "--kind normal --kind peaked --causal --heads 4 --heads-kv 2 --head-dim 64 "
        f"--dtype fp16 --out {output}")
    assert sorted({r["threshold"] for r in saved["rows"]}) == sorted(THRESHOLDS)
    assert len(saved["rows"]) == len(THRESHOLDS) * len(rescale_stats.INPUT_KINDS)
    for row in saved["rows"]:
        assert row["max_p_16bit"] <= 2.0 ** row["threshold"]
        assert row["max_abs_err_vs_fp32"] < 1e-2
    help_text = CliRunner().invoke(rescale_stats.rescale_stats_command, ["--help"]).output
    assert "never run" in help_text and "sm100_rescale_stats.json" in help_text
    shown = CliRunner().invoke(rescale_stats.rescale_stats_command, ["--show"]).output
    assert "Saved measurement" in shown or "No saved measurement" in shown


def test_saved_measurement_covers_the_space():
    """The committed table (made by the CLI) covers every threshold and kept P within 2^threshold."""
    path = rescale_stats.committed_stats_path()
    if not path.exists():
        pytest.skip(f"{path} not generated in this checkout")
    saved = json.loads(path.read_text())
    assert {r["threshold"] for r in saved["rows"]} == set(THRESHOLDS)
    for row in saved["rows"]:
        assert row["max_p_16bit"] <= 2.0 ** row["threshold"]
        assert row["max_abs_err_vs_fp32"] < 1e-2
        assert row["tile_rescales"] + row["tile_skips"] == row["tile_decisions"]
