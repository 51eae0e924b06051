"""A value head dim of its own on the H200 (D=192 for Q and K, Dv=128 for V and O): our sm90 kernel
against the fp32 reference (`fa4.reference.check`, via `sm90_cases.run_and_check`) over both masks,
fp16/bf16, GQA (packed and not), MQA, odd lengths and Sq != Sk (empty causal rows), with LSE; the knob
variants the CPU compile check covers; `fa4.attention` itself (ours, flash-attn-4 forced where
installed), and gradients through it (the blockwise backward).

    python -m pytest -m gpu -q tests/gpu/test_sm90_head_dim_v_gpu.py
"""

from __future__ import annotations

import itertools

import pytest
import torch

import fa4
from fa4.kernels import AttentionProblem, default_config, feasible
from fa4.reference import check, check_grads, random_inputs

from sm90_cases import run_and_check, shard

SEQLENS = [(1, 1), (17, 17), (1000, 1000), (2048, 2048), (4099, 4099), (1, 4099), (1000, 17), (2048, 1024)]
HEADS = {"gqa1": (2, 2), "gqa4": (8, 2), "gqa7": (14, 2), "mqa": (16, 1)}


def _problem(dtype, causal, sq, sk, hq, hkv):
    batch = 2 if max(sq, sk) <= 1024 else 1
    return AttentionProblem(batch, sq, sk, hq, hkv, 192, dtype, causal=causal, return_lse=True, head_dim_v=128)


CASES = shard([pytest.param(dtype, causal, sq, sk, hq, hkv,
                            id=f"{dtype}-{'causal' if causal else 'full'}-{sq}x{sk}-{name}")
               for dtype, causal, (sq, sk), (name, (hq, hkv)) in itertools.product(
                   ("fp16", "bf16"), (False, True), SEQLENS, HEADS.items())])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,causal,sq,sk,hq,hkv", CASES)
def test_default_config(dtype, causal, sq, sk, hq, hkv):
    problem = _problem(dtype, causal, sq, sk, hq, hkv)
    cfg = default_config("sm90", problem)
    assert feasible(cfg, problem) == []
    failures = run_and_check(cfg, problem)
    assert not failures, f"{problem.label()} {cfg.label()}: {failures}"


KNOBS = [{"pv_operand": "ss"}, {"tile_m": 192, "tile_n": 64, "pv_operand": "ss"},
         {"q_stages": 2, "tile_n": 64, "scheduler": "static"}, {"pack_gqa": False}]


@pytest.mark.gpu
@pytest.mark.parametrize("knobs", KNOBS, ids=lambda k: "-".join(f"{n}={v}" for n, v in k.items()))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_knob_variants(knobs, causal):
    problem = _problem("bf16", causal, 2053, 2053, 8, 2)
    cfg = default_config("sm90", problem).replace(**knobs)
    assert feasible(cfg, problem) == [], cfg.label()
    failures = run_and_check(cfg, problem)
    assert not failures, f"{problem.label()} {cfg.label()}: {failures}"


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["ours", "flash_attn_4"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_attention_runs_the_pair(backend, causal):
    if backend == "flash_attn_4":
        pytest.importorskip("flash_attn.cute")
    problem = _problem("bf16", causal, 1000, 1000, 8, 2)
    q, k, v = random_inputs(problem)
    out, lse = fa4.attention(q, k, v, causal=causal, return_lse=True, backend=backend)
    assert out.shape == (2, 1000, 8, 128)
    assert not check(out, lse, q, k, v, causal)


@pytest.mark.gpu
def test_gradients_through_attention():
    problem = _problem("bf16", True, 517, 517, 8, 2)
    q, k, v = (t.requires_grad_() for t in random_inputs(problem))
    out = fa4.attention(q, k, v, causal=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    failures = check_grads([q.grad, k.grad, v.grad], q.detach(), k.detach(), v.detach(), dout, True)
    assert not failures, failures
