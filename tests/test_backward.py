"""`fa4.attention` in a training step, on CPU: gradients through the op's registered backward
(`fa4.ops`, `fa4.backward`: the blockwise PyTorch backward here) against fp32 autograd with flash-attn's
rule, over the held-out style of cases; a gradient through LSE; torch.compile without a graph break.
The GPU implementations (flash-attn-4's backward; ours when it exists) are tested in tests/gpu."""

from __future__ import annotations

import warnings

import pytest
import torch

import fa4
from fa4 import backward
from fa4.kernels import Config
from fa4.reference import check_grads, plain_attention, softmax_scale

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}

CASES = [  # (B, Sq, Sk, Hq, Hkv, D, causal)
    (2, 77, 77, 4, 1, 64, True),       # MQA, odd length
    (1, 130, 200, 8, 2, 64, True),     # Sq < Sk, GQA 4
    (1, 200, 130, 5, 1, 64, True),     # Sq > Sk: rows that see no key; GQA 5
    (1, 96, 161, 8, 1, 128, False),    # full mask, GQA 8
    (2, 129, 129, 4, 4, 128, False),   # MHA
    (1, 100, 60, 8, 1, 128, False),    # Sq > Sk full: every row sees a key
]


@pytest.fixture(autouse=True)
def _quiet_fallback():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*fallback='sdpa'")
        yield


def _inputs(batch, sq, sk, hq, hkv, d, dtype, seed=0, strided=False):
    gen = torch.Generator().manual_seed(seed)
    if strided:  # q, k, v as views into one packed projection (B, S, Hq + 2 Hkv, D), as models make them
        assert sq == sk
        packed = torch.randn(batch, sq, hq + 2 * hkv, d, generator=gen).to(dtype)
        q, k, v = packed.split([hq, hkv, hkv], dim=2)
    else:
        q = torch.randn(batch, sq, hq, d, generator=gen).to(dtype)
        k = torch.randn(batch, sk, hkv, d, generator=gen).to(dtype)
        v = torch.randn(batch, sk, hkv, d, generator=gen).to(dtype)
    dout = torch.randn(batch, sq, hq, d, generator=gen).to(dtype)
    return q, k, v, dout


def _fa4_grads(q, k, v, dout, causal, **kwargs):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = fa4.attention(*leaves, causal=causal, fallback="sdpa", **kwargs)
    out.backward(dout)
    return [t.grad for t in leaves]


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}-sq{}-sk{}-hq{}-hkv{}-d{}-{}".format(
    *c[:6], "causal" if c[6] else "full"))
def test_gradients_match_fp32_autograd(case, dtype):
    *shape, causal = case
    q, k, v, dout = _inputs(*shape, DTYPES[dtype], seed=sum(shape))
    grads = _fa4_grads(q, k, v, dout, causal)
    failures = check_grads(grads, q, k, v, dout, causal)
    assert not failures, failures


def test_strided_views_and_a_scale():
    q, k, v, dout = _inputs(2, 96, 96, 8, 2, 64, torch.bfloat16, strided=True)
    assert not q.is_contiguous()
    grads = _fa4_grads(q, k, v, dout, True, softmax_scale=0.2)
    assert not check_grads(grads, q, k, v, dout, True, scale=0.2)


def test_rows_that_see_no_key_get_zero_gradient():
    q, k, v, dout = _inputs(1, 40, 24, 2, 1, 64, torch.float16)
    dq, dk, dv = _fa4_grads(q, k, v, dout, True)
    assert (dq[:, :16] == 0).all() and all(torch.isfinite(g).all() for g in (dq, dk, dv))


def test_gradient_through_the_returned_lse():
    q, k, v, dout = _inputs(1, 70, 90, 4, 2, 64, torch.bfloat16)
    dlse = torch.randn(1, 4, 70, generator=torch.Generator().manual_seed(3))
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out, lse = fa4.attention(*leaves, causal=True, fallback="sdpa", return_lse=True)
    ((out * dout).sum() + (lse * dlse).sum()).backward()
    failures = check_grads([t.grad for t in leaves], q, k, v, dout, True, dlse=dlse)
    assert not failures, failures


def test_a_gradient_through_lse_alone():
    q, k, v, _ = _inputs(1, 33, 33, 2, 1, 64, torch.float16)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    _, lse = fa4.attention(*leaves, fallback="sdpa", return_lse=True)
    lse.sum().backward()
    ref = [t.detach().float().requires_grad_() for t in (q, k, v)]
    plain_attention(*ref, False, softmax_scale(64), torch.float32, return_lse=True)[1].sum().backward()
    for got, want in zip((t.grad for t in leaves[:2]), (t.grad for t in ref[:2])):
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-3)
    assert ref[2].grad is None and (leaves[2].grad == 0).all()   # LSE does not depend on V


def test_only_the_inputs_that_require_grad_get_one():
    q, k, v, dout = _inputs(1, 50, 50, 2, 2, 64, torch.bfloat16)
    k = k.requires_grad_()
    fa4.attention(q, k, v, fallback="sdpa").backward(dout)
    assert k.grad is not None and q.grad is None and v.grad is None


def test_no_grad_mode_builds_no_graph():
    q, k, v, _ = _inputs(1, 20, 20, 2, 2, 64, torch.bfloat16)
    with torch.no_grad():
        out = fa4.attention(q.requires_grad_(), k, v, fallback="sdpa")
    assert out.grad_fn is None


def test_blockwise_blocks_agree_with_one_block():
    """Several query blocks (causal: each trims the keys it cannot see) give one block's answer."""
    q, k, v, dout = _inputs(2, 90, 70, 6, 2, 64, torch.float16)
    out, lse = fa4.attention(q, k, v, causal=True, fallback="sdpa", return_lse=True)
    whole = backward.blockwise_backward(dout, q, k, v, out, lse, True, 0.125)
    row_bytes = 2 * 6 * 70 * 4 * 3
    blocked = backward.blockwise_backward(dout, q, k, v, out, lse, True, 0.125, block_bytes=7 * row_bytes)
    for a, b in zip(whole, blocked):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-3)


def test_choice_on_cpu_is_the_blockwise_backward(monkeypatch):
    monkeypatch.delenv(backward.ENV_VAR, raising=False)
    name, why = backward.choose(torch.empty(1, 8, 2, 64))
    assert name == "blockwise" and "cpu" in why
    with pytest.raises(ValueError, match="unknown backward implementation"):
        backward.attention_backward(*(torch.empty(1, 8, 2, 64),) * 5, torch.empty(1, 2, 8), False, 0.1,
                                    implementation="nonsense")


def test_auto_order_is_a_peer_then_ours_then_blockwise(monkeypatch):
    """Where no peer's backward runs, auto picks ours (it passed its GPU tests), a gradient through
    the LSE included (its dLSE goes to ours); where ours refuses, the blockwise one."""
    monkeypatch.delenv(backward.ENV_VAR, raising=False)
    monkeypatch.setattr(backward, "peers_with_backward", lambda: ())
    monkeypatch.setattr(backward, "ours_unsupported", lambda q, window=None, softcap=None: None)
    # no tuned entry: the default configuration (the database and the GPU's name are test_backward_search's)
    monkeypatch.setattr(backward, "tuned", lambda q, k, causal: (Config.make("sm90_bwd"), "default", None))
    q = torch.empty(1, 8, 2, 64)
    assert backward.choose(q)[0] == "ours"
    assert backward._automatic(q, with_ours=False)[0] == "blockwise"
    ran = []
    monkeypatch.setattr(backward, "ours_backward", lambda *args: ran.append(("ours", args[-1] is not None)))
    monkeypatch.setattr(backward, "blockwise_backward", lambda *args, **kwargs: ran.append(("blockwise",)))
    args = (*(torch.empty(1, 8, 2, 64),) * 5, torch.empty(1, 2, 8), False, 0.1)
    backward.attention_backward(*args)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        backward.attention_backward(*args, dlse=torch.empty(1, 2, 8))
    assert ran == [("ours", False), ("ours", True)]
    monkeypatch.setattr(backward, "ours_unsupported", lambda q, window=None, softcap=None: "not here")
    backward.attention_backward(*args)
    assert ran[-1] == ("blockwise",)


def test_the_environment_names_the_backward(monkeypatch):
    q = torch.empty(1, 8, 2, 64)
    monkeypatch.setenv(backward.ENV_VAR, "ours")
    assert backward.choose(q) == ("ours", "$FA4_BACKWARD=ours")
    monkeypatch.setenv(backward.ENV_VAR, "fastest")
    with pytest.raises(ValueError, match="FA4_BACKWARD='fastest' names no backward; known: auto, ours"):
        backward.choose(q)


def test_ours_forced_where_it_cannot_run_says_so_and_runs_the_next(monkeypatch):
    """Ours on CPU: a warning names why, and the blockwise backward gives the gradients."""
    monkeypatch.setenv(backward.ENV_VAR, "ours")
    q, k, v, dout = _inputs(1, 40, 40, 4, 2, 64, torch.bfloat16)
    with pytest.warns(UserWarning, match="our backward kernels cannot take this gradient .*run on CUDA GPUs"):
        grads = _fa4_grads(q, k, v, dout, True)
    assert not check_grads(grads, q, k, v, dout, True)


def test_deterministic_reaches_our_kernels_or_runs_the_blockwise_backward(monkeypatch):
    """deterministic=True travels through the op and its backward: on CPU the blockwise backward runs
    (equal gradients on every run, flash-attn's rule); where ours can run it is ours, compiled with the
    ordered sums; a peer named by the environment is not run (a warning says what runs instead)."""
    monkeypatch.delenv(backward.ENV_VAR, raising=False)
    q, k, v, dout = _inputs(1, 70, 90, 4, 2, 64, torch.bfloat16, seed=5)
    first = _fa4_grads(q, k, v, dout, True, deterministic=True)
    again = _fa4_grads(q, k, v, dout, True, deterministic=True)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not check_grads(first, q, k, v, dout, True)
    with pytest.raises(fa4.InvalidInputError, match="deterministic must be True, False or None"):
        fa4.attention(q, k, v, deterministic="yes")

    ran = []
    monkeypatch.setattr(backward, "_ours_unsupported_with_v", lambda q, window, softcap, v: None)
    monkeypatch.setattr(backward, "ours_backward", lambda *args, deterministic=False: ran.append(
        ("ours", deterministic)) or (torch.zeros_like(args[1]), torch.zeros_like(args[2]), torch.zeros_like(args[3])))
    _fa4_grads(q, k, v, dout, True, deterministic=True)
    assert ran == [("ours", True)]
    monkeypatch.setenv(backward.ENV_VAR, "blockwise")
    _fa4_grads(q, k, v, dout, True, deterministic=True)
    assert ran == [("ours", True)]        # the blockwise one is deterministic: it runs as named
    monkeypatch.setattr(backward, "implementations", lambda: ("ours", "some_peer", "blockwise"))
    monkeypatch.setenv(backward.ENV_VAR, "some_peer")
    with pytest.warns(UserWarning, match="deterministic=True: some_peer's backward .*our backward kernels runs"):
        _fa4_grads(q, k, v, dout, True, deterministic=True)
    assert ran[-1] == ("ours", True)
    # what runs is what fa4.explain says
    monkeypatch.delenv(backward.ENV_VAR)
    assert backward.choose(q, k=k, causal=True, deterministic=True)[0] == "ours"


def test_deterministic_follows_torchs_setting_unless_given(monkeypatch):
    """deterministic=None (the default) is torch.use_deterministic_algorithms' setting, as PyTorch's own
    ops follow it; True or False given wins."""
    monkeypatch.delenv(backward.ENV_VAR, raising=False)
    ran = []
    monkeypatch.setattr(backward, "_ours_unsupported_with_v", lambda q, window, softcap, v: None)
    monkeypatch.setattr(backward, "peers_with_backward", lambda: ())
    monkeypatch.setattr(backward, "tuned", lambda q, k, causal: (Config.make("sm90_bwd"), "default", None))
    monkeypatch.setattr(backward, "ours_backward", lambda *args, deterministic=False: ran.append(
        deterministic) or (torch.zeros_like(args[1]), torch.zeros_like(args[2]), torch.zeros_like(args[3])))
    q, k, v, dout = _inputs(1, 40, 40, 4, 2, 64, torch.bfloat16, seed=2)
    was = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True, warn_only=True)
        _fa4_grads(q, k, v, dout, True)
        _fa4_grads(q, k, v, dout, True, deterministic=False)
        torch.use_deterministic_algorithms(False)
        _fa4_grads(q, k, v, dout, True)
    finally:
        torch.use_deterministic_algorithms(was)
    assert ran == [True, False, False]


def test_explain_names_the_deterministic_backward():
    q, k, v, _ = _inputs(1, 70, 90, 4, 2, 64, torch.bfloat16)
    name, why = fa4.explain(q, k, v, causal=True, deterministic=True).backward
    assert name == "blockwise" and why.startswith("deterministic=True") and "cpu" in why
    assert "deterministic" not in fa4.explain(q, k, v, causal=True).backward[1]


@pytest.mark.parametrize("deterministic", [False, True])
def test_torch_compile_keeps_the_step_in_one_graph(deterministic):
    q, k, v, dout = _inputs(1, 64, 64, 4, 2, 64, torch.bfloat16)

    def step(q, k, v, dout):
        out = fa4.attention(q, k, v, causal=True, fallback="sdpa", deterministic=deterministic)
        return (out * dout).sum()

    eager = [t.detach().requires_grad_() for t in (q, k, v)]
    step(*eager, dout).backward()
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    compiled(*leaves, dout).backward()
    for got, want in zip(leaves, eager):
        torch.testing.assert_close(got.grad, want.grad)


def test_ours_takes_a_gradient_through_the_lse_in_d():
    """`CompiledBackward.run(..., dlse)` hands the main kernel D = rowsum(dO * O) - dLSE on the real
    rows (padding rows as the preprocess left them), and D alone without one; kernels stood in by
    functions, so this runs on a CPU."""
    from fa4.kernels import AttentionProblem, sm90_bwd

    problem = AttentionProblem(1, 100, 100, 2, 1, 64, "bf16", causal=True)
    config = sm90_bwd.default_config(problem)
    seen = {}

    def preprocess(out, dout, lse, lse2, delta, dq_accum):
        delta.fill_(1.0)

    def main(q, k, v, dout, lse2, delta, dq_accum, dk, dv, scale):
        seen["delta"] = delta.clone()

    compiled = sm90_bwd.CompiledBackward({"preprocess": preprocess, "main": main,
                                          "postprocess": lambda *args: None}, config, problem)
    q, dout = torch.randn(1, 100, 2, 64), torch.randn(1, 100, 2, 64)
    k = v = torch.randn(1, 100, 1, 64)
    lse, dlse = torch.zeros(1, 2, 100), torch.randn(1, 2, 100)
    grads = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    compiled.run(q, k, v, q, dout, lse, *grads, 0.125, dlse)
    assert seen["delta"].shape[-1] == 128   # padded to tile_m rows
    assert torch.equal(seen["delta"][..., :100], 1.0 - dlse) and bool((seen["delta"][..., 100:] == 1.0).all())
    compiled.run(q, k, v, q, dout, lse, *grads, 0.125)
    assert bool((seen["delta"] == 1.0).all())
