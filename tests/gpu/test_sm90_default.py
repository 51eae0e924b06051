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

# head dims 96, 192 and 256 (compiled on the CPU, not yet run before this suite): tails, Sq != Sk,
# empty causal rows, GQA ratios that do and do not divide the tile rows, MQA
SEQLENS_NEW_HEAD_DIMS = [(1, 1), (17, 17), (1000, 1000), (2048, 2048), (1, 4099), (1000, 17), (2048, 1024)]
HEADS_NEW_HEAD_DIMS = {k: HEADS[k] for k in ("gqa1", "gqa4", "gqa7", "mqa")}


def _cases(seqlens, heads, head_dims):
    return [
        pytest.param(dtype, causal, sq, sk, hq, hkv, d, id=f"{dtype}-{'causal' if causal else 'full'}-{sq}x{sk}-{name}-d{d}")
        for dtype, causal, (sq, sk), (name, (hq, hkv)), d in itertools.product(
            ("fp16", "bf16"), (False, True), seqlens, heads.items(), head_dims)
    ]


CASES = shard(_cases(SEQLENS, HEADS, (64, 128))
              + _cases(SEQLENS_NEW_HEAD_DIMS, HEADS_NEW_HEAD_DIMS, (96, 192, 256)))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,causal,sq,sk,hq,hkv,d", CASES)
def test_default_config(dtype, causal, sq, sk, hq, hkv, d):
    batch = 2 if max(sq, sk) <= 1024 else 1
    prob = AttentionProblem(batch, sq, sk, hq, hkv, d, dtype, causal=causal, return_lse=True)
    cfg = default_config("sm90", prob)
    assert feasible(cfg, prob) == []
    failures = run_and_check(cfg, prob)
    assert not failures, f"{prob.label()} {cfg.label()}: {failures}"
