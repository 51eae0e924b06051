"""Every sm90 knob value on a smaller set (S = 1000 and 1024, GQA 4, both dtypes and causal modes),
the softmax scale argument, LSE, and extreme logits (inputs x30): no NaN/inf and a match."""

from __future__ import annotations

import itertools

import pytest

from fa4.kernels import AttentionProblem, Config, feasible, knobs_for

from sm90_cases import run_and_check, shard

# one knob moved away from a base per entry (plus what that value needs to be feasible)
BASE = dict(tile_m=128, tile_n=128, kv_stages=2, q_stages=1, rescale_threshold=8.0,
            softmax_overlap=True, pv_operand="rs", scheduler="single", pack_gqa=True,
            exp2_poly_columns=0)
VARIANTS = [
    dict(),
    dict(tile_m=64),
    dict(tile_m=192, tile_n=64, softmax_overlap=False, pv_operand="ss"),
    dict(tile_m=192, tile_n=80),
    dict(tile_n=64, kv_stages=4),
    dict(tile_n=80, kv_stages=3),
    dict(tile_n=96),
    dict(tile_n=112),
    dict(tile_n=144),
    dict(tile_n=160),
    dict(tile_n=176),
    dict(tile_n=192),
    dict(q_stages=2, scheduler="static"),
    dict(q_stages=2, scheduler="lpt"),
    dict(scheduler="static"),
    dict(scheduler="lpt"),
    dict(scheduler="single_lpt"),
    dict(rescale_threshold=0.0),
    dict(rescale_threshold=4.0),
    dict(rescale_threshold=12.0),
    dict(softmax_overlap=False, pv_operand="ss"),
    dict(pv_operand="ss"),
    dict(pv_operand="ss", softmax_overlap=False, tile_n=96),
    dict(pack_gqa=False),
    dict(exp2_poly_columns=2),
    dict(exp2_poly_columns=4, tile_n=80),
    dict(exp2_poly_columns=4, rescale_threshold=12.0),
]
# head dim 64 (below): flash-attn-4's 192 x 128 tile, which the register model admits there
VARIANTS_D64 = [dict(tile_m=192), dict(tile_m=192, scheduler="single_lpt"),
                dict(tile_m=192, q_stages=2, scheduler="static"),
                dict(tile_m=192, exp2_poly_columns=2), dict(tile_m=192, exp2_poly_columns=4)]


def _config(variant):
    return Config.make("sm90", **{**BASE, **variant})


def test_variants_cover_every_knob_value():
    seen = {k.name: set() for k in knobs_for("sm90")}
    for v in VARIANTS:
        for name, value in _config(v).items:
            seen[name].add(value)
    for k in knobs_for("sm90"):
        assert set(k.choices) <= seen[k.name], k.name


CASES = shard([
    pytest.param(i, dtype, causal, s, id=f"{_config(v).label().replace(' ', ',')}-{dtype}-{'causal' if causal else 'full'}-s{s}")
    for (i, v), dtype, causal, s in itertools.product(
        enumerate(VARIANTS), ("fp16", "bf16"), (False, True), (1000, 1024))
])


@pytest.mark.gpu
@pytest.mark.parametrize("variant,dtype,causal,s", CASES)
def test_knob_value(variant, dtype, causal, s):
    cfg = _config(VARIANTS[variant])
    prob = AttentionProblem(2, s, s, 8, 2, 128, dtype, causal=causal, return_lse=(s == 1000))
    assert feasible(cfg, prob) == [], cfg.label()
    failures = run_and_check(cfg, prob)
    assert not failures, f"{prob.label()} {cfg.label()}: {failures}"


CASES_D64 = shard([
    pytest.param(i, dtype, causal, id=f"{_config(v).label().replace(' ', ',')}-d64-{dtype}-{'causal' if causal else 'full'}")
    for (i, v), dtype, causal in itertools.product(enumerate(VARIANTS_D64), ("fp16", "bf16"), (False, True))
])


@pytest.mark.gpu
@pytest.mark.parametrize("variant,dtype,causal", CASES_D64)
def test_knob_value_head_dim_64(variant, dtype, causal):
    cfg = _config(VARIANTS_D64[variant])
    prob = AttentionProblem(2, 1000, 1000, 8, 2, 64, dtype, causal=causal, return_lse=True)
    assert feasible(cfg, prob) == [], cfg.label()
    failures = run_and_check(cfg, prob)
    assert not failures, f"{prob.label()} {cfg.label()}: {failures}"


# head dims 96, 192 and 256: the tiles the register and shared-memory models admit there, one knob
# away from the default's tile each (P operand, overlap, stages, schedulers, packing)
VARIANTS_NEW_HEAD_DIMS = {
    96: [dict(tile_m=192, pv_operand="ss"), dict(tile_m=192, pv_operand="ss", softmax_overlap=False),
         dict(tile_m=192, tile_n=80), dict(), dict(tile_m=64, tile_n=192),
         dict(q_stages=2, scheduler="lpt"), dict(pack_gqa=False, exp2_poly_columns=4)],
    192: [dict(tile_n=112), dict(tile_n=80, pv_operand="ss"), dict(tile_n=64, kv_stages=3),
          dict(tile_m=64, tile_n=128), dict(tile_n=80, q_stages=2, scheduler="static"),
          dict(tile_n=112, scheduler="single_lpt", exp2_poly_columns=2)],
    256: [dict(tile_n=80), dict(tile_n=64, pv_operand="ss", softmax_overlap=False), dict(tile_n=64),
          dict(tile_m=64, tile_n=96), dict(tile_m=64, tile_n=64, q_stages=2, scheduler="lpt"),
          dict(tile_n=80, pack_gqa=False, rescale_threshold=0.0)],
}
CASES_NEW_HEAD_DIMS = shard([
    pytest.param(d, i, dtype, causal, id=f"{_config(v).label().replace(' ', ',')}-d{d}-{dtype}-{'causal' if causal else 'full'}")
    for d, variants in VARIANTS_NEW_HEAD_DIMS.items()
    for (i, v), dtype, causal in itertools.product(enumerate(variants), ("fp16", "bf16"), (False, True))
])


@pytest.mark.gpu
@pytest.mark.parametrize("d,variant,dtype,causal", CASES_NEW_HEAD_DIMS)
def test_knob_value_new_head_dims(d, variant, dtype, causal):
    cfg = _config(VARIANTS_NEW_HEAD_DIMS[d][variant])
    prob = AttentionProblem(2, 1000, 1000, 8, 2, d, dtype, causal=causal, return_lse=True)
    assert feasible(cfg, prob) == [], cfg.label()
    failures = run_and_check(cfg, prob)
    assert not failures, f"{prob.label()} {cfg.label()}: {failures}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("threshold", [0.0, 8.0, 12.0])
@pytest.mark.parametrize("poly", [0, 4])
def test_extreme_logits(dtype, causal, threshold, poly):
    prob = AttentionProblem(1, 1000, 1000, 8, 2, 128, dtype, causal=causal, return_lse=True)
    cfg = _config(dict(rescale_threshold=threshold, exp2_poly_columns=poly))
    failures = run_and_check(cfg, prob, logit_scale=30.0)
    assert not failures, failures


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_softmax_scale_argument(causal):
    prob = AttentionProblem(1, 1000, 1024, 8, 2, 64, "bf16", causal=causal, return_lse=True)
    failures = run_and_check(_config(dict()), prob, softmax_scale=0.3)
    assert not failures, failures
