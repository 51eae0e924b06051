"""Our sm90 attention backward kernels (`fa4.kernels.sm90_bwd`: preprocess, main, postprocess) on the
H200: dQ, dK, dV from O and LSE of the fp32 reference, held to flash-attn's gradient rule
(`fa4.reference.check_grads`) over odd lengths, Sq < Sk, Sq > Sk (rows that see no key), GQA 4/5/8,
MQA, head dims 64/128, fp16/bf16, causal and full; and on strided (packed QKV) views.

    python -m pytest -m gpu -q tests/gpu/test_sm90_bwd_gpu.py
"""

from __future__ import annotations

import functools

import pytest
import torch

from fa4.kernels import sm90_bwd
from fa4.kernels.problem import AttentionProblem
from fa4.reference import attention_fp32, check_grads, softmax_scale

pytestmark = pytest.mark.gpu

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
CASES = [  # (B, Sq, Sk, Hq, Hkv, D, causal)
    (2, 777, 777, 16, 4, 128, True),     # odd length, GQA 4
    (1, 300, 1000, 10, 2, 64, True),     # Sq < Sk, GQA 5
    (1, 1000, 300, 8, 1, 128, True),     # Sq > Sk: rows that see no key; MQA
    (1, 1000, 300, 8, 1, 64, False),     # Sq > Sk, full, MQA
    (2, 513, 513, 16, 2, 64, False),     # GQA 8, full
    (1, 1024, 1024, 8, 8, 128, False),   # MHA
    (3, 65, 131, 4, 4, 128, True),       # shorter than one key block in places, odd
    (1, 1, 257, 8, 2, 64, True),         # one query row
]


@functools.lru_cache(maxsize=None)
def _compiled(head_dim: int, dtype: str, causal: bool):
    # one compile per (head dim, dtype, causal): batch, lengths and heads are runtime values
    problem = AttentionProblem(1, 128, 128, 4, 2, head_dim, dtype, causal)
    return sm90_bwd.compile_backward(sm90_bwd.default_config(problem), problem)


def _inputs(batch, sq, sk, hq, hkv, d, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shapes = ((batch, sq, hq, d), (batch, sk, hkv, d), (batch, sk, hkv, d), (batch, sq, hq, d))
    return [torch.randn(*s, device="cuda", dtype=dtype, generator=gen) for s in shapes]


def _run(q, k, v, dout, causal, dtype_name):
    scale = softmax_scale(q.shape[-1])
    out, lse = attention_fp32(q, k, v, causal, scale)
    out = out.to(q.dtype)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    _compiled(q.shape[-1], dtype_name, causal).run(q, k, v, out, dout, lse, dq, dk, dv, scale)
    torch.cuda.synchronize()
    return [dq, dk, dv]


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}-sq{}-sk{}-hq{}-hkv{}-d{}-{}".format(
    *c[:6], "causal" if c[6] else "full"))
def test_gradients_follow_flash_attns_rule(case, dtype):
    *shape, causal = case
    q, k, v, dout = _inputs(*shape, DTYPES[dtype], seed=sum(shape))
    grads = _run(q, k, v, dout, causal, dtype)
    assert all(torch.isfinite(g).all() for g in grads)
    failures = check_grads(grads, q, k, v, dout, causal)
    assert not failures, failures


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_rows_that_see_no_key_get_zero_gradients(causal):
    q, k, v, dout = _inputs(1, 700, 200, 8, 2, 128, torch.bfloat16, seed=7)
    dq, _, _ = _run(q, k, v, dout, causal, "bf16")
    if causal:  # the first Sq - Sk rows see no key under the bottom-right mask
        assert torch.count_nonzero(dq[:, :500]) == 0
    assert torch.count_nonzero(dq[:, 500:]) > 0


def test_strided_views_of_packed_qkv():
    batch, seq, heads, d = 2, 333, 8, 64
    gen = torch.Generator(device="cuda").manual_seed(3)
    qkv = torch.randn(batch, seq, 3, heads, d, device="cuda", dtype=torch.float16, generator=gen)
    q, k, v = qkv.unbind(2)  # (B, S, H, D) views with a row stride of 3 * H * D
    dout = torch.randn(batch, seq, heads, d, device="cuda", dtype=torch.float16, generator=gen)
    grads = _run(q, k, v, dout, True, "fp16")
    failures = check_grads(grads, q, k, v, dout, True)
    assert not failures, failures
