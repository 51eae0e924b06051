"""Sliding windows and softcaps on the H200: our sm90 kernel against the fp32 reference (the one rule,
`fa4.reference.check`) over window kinds (causal with a left side, two-sided, one side only, as wide as
one key, wider than the sequences) x softcap x GQA (packed and not) x Sq != Sk (rows that see no key
included) x fp16/bf16 x head dims 64 and 128 (and Gemma-2's 256), with LSE; the knobs that change the
block loop; large logits under a softcap; `fa4.attention` itself (ours forced, flash-attn-4 forced where
installed, the dispatched one); and gradients through `fa4.attention` with flash-attn's rule.

    python -m pytest -m gpu -q tests/gpu/test_window_softcap_gpu.py
    FA4_SM90_SHARD=i/n ... (tests/gpu/sm90_cases.py) splits the kernel cases over processes
"""

from __future__ import annotations

import itertools

import pytest
import torch

import fa4
from fa4.kernels import AttentionProblem, default_config, feasible
from fa4.reference import check, check_grads, random_inputs

from sm90_cases import run_and_check, shard

SEQLENS = [(1, 1), (17, 17), (128, 128), (1000, 1000), (2048, 2048), (1000, 17), (17, 1000), (2048, 1024),
           (1024, 2048), (4099, 4099)]
# (name, causal, window (left, right), softcap): each kind of window, with and without a softcap
MASKS = [
    ("causal-w0", True, (0, 0), None),            # each query sees its diagonal key only
    ("causal-w100", True, (100, 0), None),
    ("causal-w5000", True, (5000, 0), None),      # wider than every sequence here
    ("full-w64-64", False, (64, 64), None),
    ("full-left300", False, (300, -1), None),
    ("full-right50", False, (-1, 50), None),      # Sq > Sk + 50: leading rows see no key
    ("full-softcap30", False, None, 30.0),
    ("causal-softcap50", True, None, 50.0),
    ("causal-w200-softcap50", True, (200, 0), 50.0),
    ("full-w7-9-softcap5", False, (7, 9), 5.0),
]
HEADS = [("gqa1", (2, 2)), ("gqa4", (8, 2)), ("gqa7", (14, 2)), ("mqa", (16, 1))]


def _cases():
    cases = []
    for (dtype, d), (name, causal, window, softcap) in itertools.product(
            itertools.product(("fp16", "bf16"), (64, 128)), MASKS):
        for i, (sq, sk) in enumerate(SEQLENS):
            heads_name, (hq, hkv) = HEADS[(i + len(name)) % len(HEADS)]  # every GQA kind over the lengths
            cases.append(pytest.param(dtype, d, causal, window, softcap, sq, sk, hq, hkv,
                                      id=f"{dtype}-d{d}-{name}-{sq}x{sk}-{heads_name}"))
    for sq in (1000, 4099, 8192):   # Gemma-2's head dim and cap, its local window
        for window in (None, (4095, 0)):
            cases.append(pytest.param("bf16", 256, True, window, 50.0, sq, sq, 16, 8,
                                      id=f"bf16-d256-gemma-{sq}-{'w4095' if window else 'global'}"))
    return cases


CASES = shard(_cases())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,d,causal,window,softcap,sq,sk,hq,hkv", CASES)
def test_default_config_with_window_and_softcap(dtype, d, causal, window, softcap, sq, sk, hq, hkv):
    batch = 2 if max(sq, sk) <= 1024 else 1
    problem = AttentionProblem(batch, sq, sk, hq, hkv, d, dtype, causal=causal, return_lse=True,
                               window=window, softcap=softcap)
    cfg = default_config("sm90", problem)
    assert feasible(cfg, problem) == []
    failures = run_and_check(cfg, problem)
    assert not failures, f"{problem.label()} {cfg.label()}: {failures}"


KNOBS = {  # the knobs that change the block loop and the tile's rows
    "no-overlap-ss": dict(softmax_overlap=False, pv_operand="ss", tile_m=128, tile_n=128),
    "192x96-poly-threshold0": dict(tile_m=192, tile_n=96, exp2_poly_columns=4, rescale_threshold=0),
    "lpt-2q-unpacked": dict(scheduler="lpt", q_stages=2, pack_gqa=False, tile_m=128, tile_n=128),
    "static-2q-3stages": dict(scheduler="static", q_stages=2, kv_stages=3, tile_m=128, tile_n=64),
    "single-128x80": dict(scheduler="single", tile_m=128, tile_n=80),
}
KNOB_MASKS = [m for m in MASKS if m[0] in ("causal-w100", "full-w64-64", "full-right50", "full-left300",
                                            "causal-w200-softcap50")]


KNOB_CASES = shard([  # knobs outermost, then the mask: a shard compiles only its own keys
    pytest.param(knobs, causal, window, softcap, sq, sk, id=f"{knobs}-{name}-{sq}x{sk}")
    for knobs in sorted(KNOBS) for name, causal, window, softcap in KNOB_MASKS
    for sq, sk in ((1000, 1000), (777, 2048), (2048, 777))])


@pytest.mark.gpu
@pytest.mark.parametrize("knobs,causal,window,softcap,sq,sk", KNOB_CASES)
def test_knobs_with_window_and_softcap(knobs, causal, window, softcap, sq, sk):
    problem = AttentionProblem(1, sq, sk, 8, 2, 64, "bf16", causal=causal, return_lse=True, window=window,
                               softcap=softcap)
    cfg = default_config("sm90", problem).replace(**KNOBS[knobs])
    if feasible(cfg, problem):
        pytest.skip(f"{cfg.label()}: {feasible(cfg, problem)}")
    failures = run_and_check(cfg, problem)
    assert not failures, f"{problem.label()} {cfg.label()}: {failures}"


@pytest.mark.gpu
@pytest.mark.parametrize("softcap", shard([1.0, 30.0]))
def test_large_logits_under_a_softcap(softcap):
    """Scores in the hundreds: the cap bounds them, and the softmax must still match."""
    problem = AttentionProblem(1, 1024, 1024, 8, 2, 128, "fp16", causal=True, return_lse=True,
                               window=(255, 0), softcap=softcap)
    failures = run_and_check(default_config("sm90", problem), problem, logit_scale=4.0)
    assert not failures, failures


BACKENDS = ["ours", "flash_attn_4", "auto"]


@pytest.mark.gpu
@pytest.mark.usefixtures("empty_database")
@pytest.mark.parametrize("backend,causal,window,softcap", shard([
    (backend, *mask) for backend in BACKENDS
    for mask in ((True, (255, 255), None), (False, (31, 64), 20.0), (True, None, 50.0), (True, (8191, 0), None))]))
def test_fa4_attention_with_window_and_softcap(backend, causal, window, softcap):
    """Through `fa4.attention`: flash-attn's conventions (causal bounds the right side; a window wider
    than the sequences is none), each implementation forced, and the dispatched one."""
    if backend == "flash_attn_4":
        pytest.importorskip("flash_attn.cute")
    problem = AttentionProblem(2, 1500, 1500, 16, 4, 128, "bf16")
    q, k, v = random_inputs(problem)
    out, lse = fa4.attention(q, k, v, causal=causal, window_size=window, softcap=softcap, return_lse=True,
                             backend=backend)
    torch.cuda.synchronize()
    failures = check(out, lse, q, k, v, causal, window=window, softcap=softcap)
    assert not failures, failures


GRAD_CASES = [  # (B, Sq, Sk, Hq, Hkv, D, causal, window, softcap)
    (2, 777, 777, 16, 4, 128, True, (255, 0), None),
    (1, 300, 1000, 10, 2, 64, False, (64, 64), None),
    (1, 1000, 300, 8, 1, 128, True, None, 30.0),
    (1, 1024, 1024, 8, 8, 64, True, (127, 0), 50.0),
]


@pytest.mark.gpu
@pytest.mark.usefixtures("empty_database")
@pytest.mark.parametrize("case,dtype", shard([
    pytest.param(case, dtype, id=f"{case}-{str(dtype)[6:]}") for case in GRAD_CASES
    for dtype in (torch.float16, torch.bfloat16)]))
def test_gradients_with_window_and_softcap(case, dtype):
    """The backward `fa4.backward` picks (flash-attn-4's with its window and softcap where installed,
    else the blockwise one; never ours, which has neither) against fp32 autograd."""
    b, sq, sk, hq, hkv, d, causal, window, softcap = case
    gen = torch.Generator(device="cuda").manual_seed(sq + sk)
    q, k, v, dout = (torch.randn(*s, device="cuda", dtype=dtype, generator=gen)
                     for s in ((b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, d), (b, sq, hq, d)))
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    fa4.attention(*leaves, causal=causal, window_size=window, softcap=softcap).backward(dout)
    failures = check_grads([t.grad for t in leaves], q, k, v, dout, causal, window=window, softcap=softcap)
    assert not failures, failures
