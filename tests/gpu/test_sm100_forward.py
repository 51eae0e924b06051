"""The sm100 (Blackwell) kernel on a Blackwell GPU: against an fp32 reference and SDPA.

NEVER RUN: no Blackwell GPU exists in this project, so these tests have only been collected and
skipped. They run where torch reports compute capability 10.0 (`fa4.arch`; tests/conftest.py skips
them elsewhere). Grid of the design contract: B=1 S=1024 Hq=32 Hkv=8 D=128 fp16 as the base, causal and
not, tails (S not a multiple of the tiles), Sq != Sk (bottom-right causal, rows with no key), GQA
ratios 1/2/4/8, head dims 64 and 128, extreme logits; then every knob value.
"""

from __future__ import annotations

import itertools

import pytest

from fa4.kernels import AttentionProblem, Config, compile_attention, default_config, feasible
from fa4.reference import check

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu, pytest.mark.sm100]


def run_case(config: Config, problem: AttentionProblem, logit_scale: float = 1.0, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dt = {"fp16": torch.float16, "bf16": torch.bfloat16}[problem.dtype]
    shape_q = (problem.batch, problem.seqlen_q, problem.heads_q, problem.head_dim)
    shape_k = (problem.batch, problem.seqlen_k, problem.heads_kv, problem.head_dim)
    q = (torch.randn(shape_q, generator=g, device="cuda") * logit_scale).to(dt)
    k = torch.randn(shape_k, generator=g, device="cuda").to(dt)
    v = torch.randn(shape_k, generator=g, device="cuda").to(dt)
    out = torch.empty_like(q)
    lse = torch.empty(problem.batch, problem.heads_q, problem.seqlen_q, device="cuda",
                      dtype=torch.float32) if problem.return_lse else None
    scale = problem.head_dim ** -0.5
    assert feasible(config, problem) == []
    compile_attention(config, problem).run(q, k, v, out, lse, scale)
    torch.cuda.synchronize()
    failures = check(out, lse, q, k, v, problem.causal, scale)
    assert not failures, f"{problem.label()} {config.label()}: {failures}"


SEQLENS = [(1024, 1024), (1, 1), (17, 17), (1000, 1000), (4099, 4099), (128, 2048), (2048, 1024),
           (1000, 17), (1, 4099)]
HEADS = {"gqa1": (8, 8), "gqa2": (16, 8), "gqa4": (32, 8), "gqa8": (64, 8)}


@pytest.mark.parametrize("dtype,causal,seqs,heads,d", [
    pytest.param(dt, c, s, h, d, id=f"{dt}-{'causal' if c else 'full'}-{s[0]}x{s[1]}-{h}-d{d}")
    for dt, c, s, h, d in itertools.product(("fp16", "bf16"), (False, True), SEQLENS, HEADS, (64, 128))
])
def test_default_config_matches_reference(dtype, causal, seqs, heads, d):
    hq, hkv = HEADS[heads]
    problem = AttentionProblem(1, seqs[0], seqs[1], hq, hkv, d, dtype, causal, return_lse=True)
    run_case(default_config("sm100", problem), problem)


@pytest.mark.parametrize("logit_scale", [8.0, 30.0])
@pytest.mark.parametrize("threshold", [0.0, 4.0, 8.0, 12.0])
def test_extreme_logits_every_threshold(logit_scale, threshold):
    problem = AttentionProblem(1, 1024, 1024, 32, 8, 128, "fp16", causal=True, return_lse=True)
    config = default_config("sm100", problem).replace(rescale_threshold=threshold)
    run_case(config, problem, logit_scale=logit_scale)


def _sample_cases():
    # the CPU compile test's sample: every value of every sm100 knob appears at least once
    from sm100_sample import representative_sample  # tests/sm100_sample.py
    return [pytest.param(c, p, id=f"{i}-{p.label()}") for i, (c, p) in enumerate(representative_sample())]


@pytest.mark.parametrize("config,problem", _sample_cases())
def test_every_knob_value(config, problem):
    run_case(config, problem)
    # and a shape with tails in both sequence lengths and Sq != Sk
    tails = AttentionProblem(2, 777, 1531, problem.heads_q, problem.heads_kv, problem.head_dim,
                             problem.dtype, problem.causal, problem.return_lse)
    run_case(config, tails, seed=1)
