"""The default sm90 configuration against SDPA and an fp32 reference (explicit bottom-right mask)
over dtypes, causal modes, sequence lengths (tails, Sq != Sk, empty causal rows), GQA ratios, MQA and
head dims, with LSE. Run on the H200; timing is `fa4tune bench`."""

from __future__ import annotations

import itertools

import pytest

from fa4.kernels import AttentionProblem, default_config, feasible

from sm90_cases import run_and_check, shard

SEQLENS = [(s, s) for s in (1, 17, 128, 1000, 1024, 2048, 4099)] + [
    (1, 4099), (128, 2048), (1000, 17), (2048, 1024)]
HEADS = {"gqa1": (2, 2), "gqa2": (4, 2), "gqa4": (8, 2), "gqa7": (14, 2), "gqa8": (16, 2),
         "mqa": (16, 1)}

CASES = shard([
    pytest.param(dtype, causal, sq, sk, hq, hkv, d, id=f"{dtype}-{'causal' if causal else 'full'}-{sq}x{sk}-{name}-d{d}")
    for dtype, causal, (sq, sk), (name, (hq, hkv)), d in itertools.product(
        ("fp16", "bf16"), (False, True), SEQLENS, HEADS.items(), (64, 128))
])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,causal,sq,sk,hq,hkv,d", CASES)
def test_default_config(dtype, causal, sq, sk, hq, hkv, d):
    batch = 2 if max(sq, sk) <= 1024 else 1
    prob = AttentionProblem(batch, sq, sk, hq, hkv, d, dtype, causal=causal, return_lse=True)
    cfg = default_config("sm90", prob)
    assert feasible(cfg, prob) == []
    failures = run_and_check(cfg, prob)
    assert not failures, f"{prob.label()} {cfg.label()}: {failures}"
