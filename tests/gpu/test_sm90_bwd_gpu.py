"""Our sm90 attention backward kernels (`fa4.kernels.sm90_bwd`: preprocess, main, postprocess) on the
H200: dQ, dK, dV from O and LSE of the fp32 reference, held to flash-attn's gradient rule
(`fa4.reference.check_grads`) over odd lengths, Sq < Sk, Sq > Sk (rows that see no key), GQA 4/5/8,
MQA, head dims 64/128, fp16/bf16, causal and full; and on strided (packed QKV) views. The default
configuration runs every case in both dtypes; every other value of every backward knob
(`fa4.kernels.knobs`, knob set "sm90_bwd") runs every case of a head dim (and GQA ratio, for
`group_split`) it can run, in bf16, in the configuration nearest the default that admits it
(`_variants`), and so do a few combinations. A split group (`group_split` > 1) meets its parts' dK and
dV in fp32 accumulators: GQA 4, 5 (parts of 3 and 2 heads) and 8 and MQA run it.

    python -m pytest -m gpu -q tests/gpu/test_sm90_bwd_gpu.py
"""

from __future__ import annotations

import functools

import pytest
import torch

from fa4.kernels import Config, knobs_for, sm90_bwd
from fa4.kernels.problem import AttentionProblem
from fa4.reference import attention_fp32, check_grads, softmax_scale
from fa4tune.inputs.space import load_space

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


# the structural combinations the knobs were made for, beside one knob at a time
COMBINATIONS = [dict(dq_accum="bulk", pds_stages=2), dict(sdp_swap=True, dq_accum="bulk"),
                dict(sdp_swap=True, dq_accum="bulk", pds_stages=2),
                # a split group's dV tile through sK/sV after dK's (one 64-row Q/dO stage is too small),
                # and beside 64-key CTAs and dQ atomics
                dict(q_stages=1, group_split=2), dict(tile_n=64, sdp_swap=False, group_split=4),
                dict(dq_accum="atomic", group_split=2),
                # the fragment-ordered dQ with a split group's dK/dV converter beside it, and unswapped
                dict(dq_accum="fragment", group_split=2), dict(tile_m=64, dq_accum="fragment"),
                dict(tile_m=64, sdp_swap=False, dq_accum="fragment"),
                # the fragment-ordered dQ added from registers: with dQ^T (tile_m 80), a split group,
                # unswapped
                dict(sdp_swap=True, tile_m=80, dq_accum="fragment_atomic"),
                dict(dq_accum="fragment_atomic", group_split=2),
                dict(tile_m=64, sdp_swap=False, dq_accum="fragment_atomic")]


def _kind(head_dim: int, dtype: str = "bf16", causal: bool = True) -> AttentionProblem:
    """A compile's problem: what is compiled in (head dim, dtype, causal); GQA 8, where every
    `group_split` fits (lengths, batch and heads are runtime values)."""
    return AttentionProblem(1, 128, 128, 8, 1, head_dim, dtype, causal)


def _problem(case, dtype: str = "bf16") -> AttentionProblem:
    batch, sq, sk, hq, hkv, d, causal = case
    return AttentionProblem(batch, sq, sk, hq, hkv, d, dtype, causal)


def _variants(head_dim: int) -> list[Config]:
    """For every value of every backward knob other than the default's, the configuration of the
    search space nearest the default (fewest knobs changed; the default unsplit) that the model admits
    at this head dim; then the combinations. Feasibility depends on the head dim and (group_split)
    the GQA ratio, not on dtype or mask."""
    problem = _kind(head_dim)
    default = sm90_bwd.default_config(problem).replace(group_split=1)
    space = [c for c in load_space("sm90_bwd").configs() if not sm90_bwd.reasons(c, problem)]
    out = []
    for knob in knobs_for("sm90_bwd"):
        for value in knob.choices:
            fits = [c for c in space if getattr(c, knob.name) == value]
            if value == getattr(default, knob.name) or not fits:
                continue
            out.append(min(fits, key=lambda c: sum(a != b for (_, a), (_, b) in zip(c.items, default.items))))
    out += [c for c in (default.replace(**combo) for combo in COMBINATIONS) if c in space]
    return list(dict.fromkeys(out))


VARIANTS = [(d, config) for d in sm90_bwd.SUPPORTED_HEAD_DIMS for config in _variants(d)]


@functools.lru_cache(maxsize=None)
def _compiled(head_dim: int, dtype: str, causal: bool, config: Config):
    # one compile per (configuration, head dim, dtype, causal): batch, lengths and heads are runtime values
    return sm90_bwd.compile_backward(config, _kind(head_dim, dtype, causal))


def _inputs(batch, sq, sk, hq, hkv, d, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shapes = ((batch, sq, hq, d), (batch, sk, hkv, d), (batch, sk, hkv, d), (batch, sq, hq, d))
    return [torch.randn(*s, device="cuda", dtype=dtype, generator=gen) for s in shapes]


def _run(q, k, v, dout, causal, dtype_name, config=None):
    """The backward of `config`, else of the default for these inputs' problem (the model admits it)."""
    problem = AttentionProblem(q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[-1],
                               dtype_name, causal)
    config = config or sm90_bwd.default_config(problem)
    assert sm90_bwd.reasons(config, problem) == [], config.label()
    scale = softmax_scale(q.shape[-1])
    out, lse = attention_fp32(q, k, v, causal, scale)
    out = out.to(q.dtype)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    _compiled(q.shape[-1], dtype_name, causal, config).run(q, k, v, out, dout, lse, dq, dk, dv, scale)
    torch.cuda.synchronize()
    return [dq, dk, dv]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_a_gradient_through_the_lse(causal):
    """dLSE enters through D (`CompiledBackward.run(..., dlse)`): held to flash-attn's rule against
    autograd of out and LSE together; rows without a key (Sq > Sk, causal) included."""
    q, k, v, dout = _inputs(1, 700, 500, 8, 2, 128, torch.bfloat16, seed=3)
    dlse = torch.randn(1, 8, 700, device="cuda", generator=torch.Generator(device="cuda").manual_seed(4))
    scale = softmax_scale(128)
    out, lse = attention_fp32(q, k, v, causal, scale)
    grads = [torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)]
    config = sm90_bwd.default_config(AttentionProblem(1, 700, 500, 8, 2, 128, "bf16", causal))
    _compiled(128, "bf16", causal, config).run(q, k, v, out.to(q.dtype), dout, lse, *grads, scale, dlse)
    torch.cuda.synchronize()
    failures = check_grads(grads, q, k, v, dout, causal, dlse=dlse)
    assert not failures, failures


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


@pytest.mark.parametrize("dq_accum", ["bulk", "fragment", "fragment_atomic"])
@pytest.mark.parametrize("tile_m", [64, 80, 128])
def test_gradients_follow_flash_attns_rule_on_reused_workspace_memory(tile_m, dq_accum):
    """dQ's fp32 accumulator comes from torch.empty and is zeroed by the preprocess: run on memory the
    caching allocator hands back full of NaN (a block of the accumulator's size, freed just before),
    the gradients are still finite and pass the rule (they are NaN if any row is not zeroed)."""
    q, k, v, dout = _inputs(2, 333, 333, 8, 2, 128 if tile_m != 128 else 64, torch.bfloat16, seed=11)
    d = q.shape[-1]
    config = sm90_bwd.default_config(AttentionProblem(2, 333, 333, 8, 2, d, "bf16", False)).replace(
        tile_m=tile_m, dq_accum=dq_accum)
    scale = softmax_scale(d)
    out, lse = attention_fp32(q, k, v, False, scale)
    out = out.to(q.dtype)
    grads = [torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)]
    for _ in range(2):
        # freed just before .run allocates its workspaces: the next block of this size is this one
        # (a fragment-ordered accumulator holds whole query blocks: (B, Hq, Sq padded, D))
        padded = -(-q.shape[1] // tile_m) * tile_m
        shape = (q.shape[0], q.shape[2], padded, d) if dq_accum.startswith("fragment") else q.shape
        poison = torch.full(shape, float("nan"), dtype=torch.float32, device="cuda")
        del poison
        _compiled(d, "bf16", False, config).run(q, k, v, out, dout, lse, *grads, scale)
        torch.cuda.synchronize()
        assert all(torch.isfinite(g).all() for g in grads)
    failures = check_grads(grads, q, k, v, dout, False)
    assert not failures, failures


def test_the_variants_cover_every_knob_value():
    seen = {k.name: set() for k in knobs_for("sm90_bwd")}
    for _, config in VARIANTS:
        for name, value in config.items:
            seen[name].add(value)
    for k in knobs_for("sm90_bwd"):
        assert set(k.choices) <= seen[k.name], f"{k.name}: no variant runs {set(k.choices) - seen[k.name]}"


def _case_id(case) -> str:
    return "b{}-sq{}-sk{}-hq{}-hkv{}-d{}-{}".format(*case[:6], "causal" if case[6] else "full")


VARIANT_CASES = [(config, case) for d, config in VARIANTS for case in CASES
                 if case[5] == d and not sm90_bwd.reasons(config, _problem(case))]


@pytest.mark.parametrize("config, case", VARIANT_CASES,
                         ids=[f"{c.label().replace(' ', ',')}-{_case_id(case)}" for c, case in VARIANT_CASES])
def test_every_knob_value_follows_flash_attns_rule(config, case):
    *shape, causal = case
    q, k, v, dout = _inputs(*shape, torch.bfloat16, seed=sum(shape))
    grads = _run(q, k, v, dout, causal, "bf16", config)
    assert all(torch.isfinite(g).all() for g in grads)
    failures = check_grads(grads, q, k, v, dout, causal)
    assert not failures, (config.label(), failures)


@pytest.mark.parametrize("group_split", [1, 2])
def test_a_grid_of_several_sections_follows_flash_attns_rule(group_split, monkeypatch):
    """scheduler=sectioned_lpt where the sections are many and the last one short: the section budget
    (`plan.SECTION_BYTES`, read when the kernel is traced) shrunk to 3 groups of this problem, so the
    8 (or 16, split) groups go in sections of 3, 3 and 2 (or ... and 1); every (key block, group)
    tile must be visited once for the gradients to pass."""
    from fa4.kernels.sm90_bwd import plan

    batch, seqlen, heads_q, heads_kv, head_dim, causal = 2, 777, 16, 4, 128, True
    rows_per_group = heads_q // heads_kv // group_split * seqlen
    monkeypatch.setattr(plan, "SECTION_BYTES", 3 * rows_per_group * plan.ROW_BYTES_PER_COLUMN * head_dim)
    assert plan.section_groups(rows_per_group, head_dim) == 3
    problem = AttentionProblem(batch, seqlen, seqlen, heads_q, heads_kv, head_dim, "bf16", causal)
    config = sm90_bwd.default_config(problem).replace(scheduler="sectioned_lpt", group_split=group_split)
    assert sm90_bwd.reasons(config, problem) == []
    q, k, v, dout = _inputs(batch, seqlen, seqlen, heads_q, heads_kv, head_dim, torch.bfloat16, seed=21)
    scale = softmax_scale(head_dim)
    out, lse = attention_fp32(q, k, v, causal, scale)
    grads = [torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)]
    # compiled here, not through the cache above: the budget is baked in at trace time
    sm90_bwd.compile_backward(config, _kind(head_dim)).run(q, k, v, out.to(q.dtype), dout, lse, *grads, scale)
    torch.cuda.synchronize()
    failures = check_grads(grads, q, k, v, dout, causal)
    assert not failures, (config.label(), failures)


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
