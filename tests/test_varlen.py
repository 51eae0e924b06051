"""fa4.attention_varlen on the CPU: the per-sequence path (with the SDPA fallback) against the fp32
reference, the rows-without-keys rule, the offset checks and gradients."""

from __future__ import annotations

import pytest
import torch

import fa4
from fa4 import varlen
from fa4.checks import InvalidInputError, UnsupportedInputError
from fa4.reference import plain_attention, softmax_scale

# (lengths_q, lengths_k): empty sequences, length 1, more queries than keys and fewer, a sequence without keys
CASES = {
    "mixed": ([0, 1, 5, 17, 3], [4, 2, 7, 17, 0]),
    "one": ([33], [33]),
    "sq_gt_sk": ([9, 12], [3, 12]),
}


def _packed(lengths_q, lengths_k, heads_q=4, heads_kv=2, head_dim=64, dtype=torch.bfloat16, tail=0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    total_q, total_k = sum(lengths_q) + tail, sum(lengths_k)
    q = torch.randn(total_q, heads_q, head_dim, generator=gen).to(dtype)
    k = torch.randn(total_k, heads_kv, head_dim, generator=gen).to(dtype)
    v = torch.randn(total_k, heads_kv, head_dim, generator=gen).to(dtype)

    def offsets(lengths):
        return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)

    return q, k, v, offsets(lengths_q), offsets(lengths_k), max(lengths_q), max(lengths_k)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("causal", [False, True])
def test_per_sequence_matches_the_reference(case, causal):
    q, k, v, cu_q, cu_k, max_q, max_k = _packed(*CASES[case], tail=3)
    out, lse = fa4.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, return_lse=True,
                                    fallback="sdpa")
    want_out, want_lse = varlen.reference_varlen(q, k, v, cu_q, cu_k, causal)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (q.shape[1], q.shape[0])
    torch.testing.assert_close(out.float(), want_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, want_lse, atol=1e-2, rtol=1e-2)
    hidden = varlen.rows_without_keys(cu_q, cu_k, q.shape[0], causal)
    assert torch.all(out[hidden] == 0) and torch.all(lse[:, hidden] == -torch.inf)
    assert hidden[-3:].all()   # the rows after the last sequence


@pytest.mark.parametrize("window, softcap", [((4, 0), None), ((3, 2), 5.0), ((-1, 1), None), (None, 2.0)])
@pytest.mark.parametrize("causal", [False, True])
def test_windows_and_softcaps_per_sequence(window, softcap, causal):
    q, k, v, cu_q, cu_k, max_q, max_k = _packed(*CASES["mixed"], tail=2)
    out, lse = fa4.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, return_lse=True,
                                    fallback="sdpa", window_size=window, softcap=softcap)
    want_out, want_lse = varlen.reference_varlen(q, k, v, cu_q, cu_k, causal, window_size=window, softcap=softcap)
    torch.testing.assert_close(out.float(), want_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, want_lse, atol=1e-2, rtol=1e-2)
    right = None if window is None or window[1] == -1 else window[1]
    hidden = varlen.rows_without_keys(cu_q, cu_k, q.shape[0], causal, right)
    assert hidden.tolist() == (want_lse == -torch.inf).all(0).tolist()   # the rule flash-attn-4's rows get


def test_rows_without_keys_rule():
    _, _, _, cu_q, cu_k, _, _ = _packed(*CASES["mixed"])
    got = varlen.rows_without_keys(cu_q, cu_k, int(cu_q[-1]) + 2, causal=True).tolist()
    want = []
    for lq, lk in zip(*CASES["mixed"]):
        want += [lk == 0 or i < lq - lk for i in range(lq)]
    assert got == want + [True, True]
    full = varlen.rows_without_keys(cu_q, cu_k, int(cu_q[-1]), causal=False).tolist()
    assert full == [lk == 0 for lq, lk in zip(*CASES["mixed"]) for _ in range(lq)]


@pytest.mark.parametrize("causal, right", [(True, None), (False, None), (False, 2), (False, 0)])
def test_host_hidden_rows_are_the_device_rule(causal, right):
    # fa4.varlen._peer fixes only these rows where the offsets are on the host
    for case, tail in (("mixed", 3), ("one", 0), ("sq_gt_sk", 1)):
        _, _, _, cu_q, cu_k, _, _ = _packed(*CASES[case], tail=tail)
        total_q = int(cu_q[-1]) + tail
        want = varlen.rows_without_keys(cu_q, cu_k, total_q, causal, right).nonzero().flatten().tolist()
        assert varlen.hidden_rows(cu_q.tolist(), cu_k.tolist(), total_q, causal, right).tolist() == want, case


@pytest.mark.parametrize("causal, window", [(True, None), (False, None), (False, (3, 2))])
def test_a_peers_rows_without_keys_are_set_alike_with_offsets_on_the_host_or_not(causal, window, monkeypatch):
    """A peer's varlen output (here NaN everywhere, what an unwritten row may hold) gets O = 0 and LSE =
    -inf on exactly the rows without keys: by row index from host offsets (eager) as by the device mask
    over every row (inside a capture); every other row is the peer's, untouched."""
    q, k, v, cu_q, cu_k, max_q, max_k = _packed(*CASES["mixed"], tail=3)

    class NaNPeer:
        def varlen(self, q, *args):
            return torch.full_like(q, float("nan")), torch.full((q.shape[1], q.shape[0]), float("nan"))

    monkeypatch.setattr(varlen.backends, "get", lambda name: NaNPeer())
    args = (q, k, v, cu_q, cu_k, max_q, max_k, causal, None, True, window, None)
    host_out, host_lse = varlen._peer("nan_peer", *args, offsets=(cu_q.tolist(), cu_k.tolist()))
    device_out, device_lse = varlen._peer("nan_peer", *args, offsets=None)
    hidden = varlen.rows_without_keys(cu_q, cu_k, q.shape[0], causal, None if window is None else window[1])
    assert hidden.any() and not hidden.all()
    for out, lse in ((host_out, host_lse), (device_out, device_lse)):
        assert torch.all(out[hidden] == 0) and torch.isnan(out[~hidden]).all()
        assert torch.all(lse[:, hidden] == -torch.inf) and torch.isnan(lse[:, ~hidden]).all()


def test_a_peers_saved_output_survives_the_rows_without_keys_under_a_gradient(monkeypatch):
    """flash-attn-4's varlen autograd keeps its output for the backward: setting the rows without keys
    must not write into it (an H100 run found `index_fill_` did: "modified by an inplace operation"), and
    no gradient reaches the peer through those rows. Without a gradient they are filled in place."""
    q, k, v, cu_q, cu_k, max_q, max_k = _packed(*CASES["mixed"], tail=3)

    class SavesItsOutput(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q):
            out = q * 2
            ctx.save_for_backward(out)
            return out

        @staticmethod
        def backward(ctx, grad):
            ctx.saved_tensors   # raises where the saved output was written in place
            return grad * 2

    class Peer:
        def varlen(self, q, *args):
            return SavesItsOutput.apply(q), torch.zeros(q.shape[1], q.shape[0])

    monkeypatch.setattr(varlen.backends, "get", lambda name: Peer())
    leaf = q.clone().requires_grad_()
    args = (k, v, cu_q, cu_k, max_q, max_k, True, None, False, None, None)
    out = varlen._peer("saving_peer", leaf, *args, offsets=(cu_q.tolist(), cu_k.tolist()))
    hidden = varlen.rows_without_keys(cu_q, cu_k, q.shape[0], True)
    assert hidden.any() and torch.all(out[hidden] == 0)
    (grad,) = torch.autograd.grad(out, leaf, torch.ones_like(out))
    assert torch.all(grad[hidden] == 0) and torch.all(grad[~hidden] == 2)
    plain = q.clone()
    monkeypatch.setattr(Peer, "varlen", lambda self, q, *args: (plain, None))
    with torch.no_grad():
        assert varlen._peer("saving_peer", leaf, *args, offsets=(cu_q.tolist(), cu_k.tolist())) is plain
    assert torch.all(plain[hidden] == 0)


def test_gradients_match_fp32_autograd_per_sequence():
    q, k, v, cu_q, cu_k, max_q, max_k = _packed([5, 0, 11], [7, 3, 11], dtype=torch.float32)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    dout = torch.randn_like(q)
    out = fa4.attention_varlen(*leaves, cu_q, cu_k, max_q, max_k, causal=True, fallback="sdpa")
    got = torch.autograd.grad(out, leaves, dout)
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    pieces = []
    for b in range(3):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        if q1 > q0:
            pieces.append(plain_attention(*(t[None, a:z] for t, (a, z) in zip(ref_leaves, [(q0, q1), (k0, k1), (k0, k1)])),
                                          True, softmax_scale(q.shape[-1]), torch.float32)[0])
    want = torch.autograd.grad(torch.cat(pieces), ref_leaves, dout)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("change, message", [
    (lambda a: a.update(cu_q=torch.tensor([1, 3, 5], dtype=torch.int32)), "cu_seqlens_q must start at 0"),
    (lambda a: a.update(cu_k=torch.tensor([0, 5, 3], dtype=torch.int32)), "cu_seqlens_k must not decrease"),
    (lambda a: a.update(cu_q=torch.tensor([0, 3, 99], dtype=torch.int32)), "ends at 99, past the 8 tokens"),
    (lambda a: a.update(max_k=2), "more than max_seqlen_k=2"),
    (lambda a: a.update(cu_q=torch.tensor([0, 3, 8], dtype=torch.int64)), "cu_seqlens_q must be a 1-d int32"),
    (lambda a: a.update(cu_k=torch.tensor([0, 8], dtype=torch.int32)), "one batch, one count"),
    (lambda a: a.update(q=torch.zeros(1, 8, 4, 64)), "q must be a 3-d tensor"),
    (lambda a: a.update(max_q=-1), "max_seqlen_q must be a non-negative int"),
    (lambda a: a.update(backend="fastest"), "backend='fastest' is not one of auto"),
    (lambda a: a.update(window=(3,)), "window_size must be a pair"),
    (lambda a: a.update(softcap=-1.0), "softcap must be a finite number > 0"),
])
def test_bad_input_is_named(change, message):
    q, k, v, cu_q, cu_k, max_q, max_k = _packed([3, 5], [4, 4])
    args = dict(q=q, k=k, v=v, cu_q=cu_q, cu_k=cu_k, max_q=max_q, max_k=max_k, backend="auto", window=None,
                softcap=None)
    change(args)
    with pytest.raises(InvalidInputError, match=message):
        fa4.attention_varlen(args["q"], args["k"], args["v"], args["cu_q"], args["cu_k"], args["max_q"],
                             args["max_k"], backend=args["backend"], fallback="sdpa", window_size=args["window"],
                             softcap=args["softcap"])


def test_flash_attn_4_forced_on_cpu_says_why():
    q, k, v, cu_q, cu_k, max_q, max_k = _packed([3, 5], [4, 4])
    with pytest.raises(UnsupportedInputError, match="'flash_attn_4' cannot run here: the tensors are on cpu"):
        fa4.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, backend="flash_attn_4")
    assert varlen.choose(q) == varlen.PER_SEQUENCE


def test_ours_forced_on_cpu_says_why():
    q, k, v, cu_q, cu_k, max_q, max_k = _packed([3, 5], [4, 4])
    with pytest.raises(UnsupportedInputError, match="backend='ours' cannot run here: the tensors are on cpu"):
        fa4.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, backend="ours")
    assert varlen.implementations() == (varlen.OURS, "flash_attn_4", varlen.PER_SEQUENCE)   # from the registry


def test_the_problem_our_kernel_compiles_for_a_batch():
    q, k, _, cu_q, _, _, _ = _packed([3, 5, 0], [4, 4, 2], heads_q=8, heads_kv=2, dtype=torch.float16)
    problem = varlen.varlen_problem(q, k, cu_q, 5, 4, causal=True, return_lse=True, window_size=None,
                                    softcap=None)
    shape = (problem.batch, problem.seqlen_q, problem.seqlen_k, problem.heads_q, problem.heads_kv)
    assert shape == (3, 5, 4, 8, 2)
    assert problem.varlen and problem.causal and problem.return_lse and problem.dtype == "fp16"
    # a window side reaching past every key of the longest sequences bounds no sequence: dropped
    wide = varlen.varlen_problem(q, k, cu_q, 5, 4, False, False, (3, 4), 2.0)
    assert wide.window is None and wide.softcap == 2.0 and not wide.causal
    narrow = varlen.varlen_problem(q, k, cu_q, 5, 4, False, False, (1, 0), None)
    assert narrow.causal and narrow.window == (1, 0)
    # nothing to run: no sequences, or no sequence with a query or a key
    assert varlen.varlen_problem(q, k, cu_q[:1], 0, 0, True, False, None, None) is None
    assert varlen.varlen_problem(q, k, cu_q, 5, 0, True, False, None, None) is None


def test_a_varlen_kernel_is_called_with_the_packed_tensors_as_batch_one():
    from fa4.kernels import AttentionProblem, compiling, default_config

    problem = AttentionProblem(3, 5, 4, 8, 2, 64, "fp16", causal=True, return_lse=True, window=(7, 0),
                               varlen=True)
    calls = []
    kernel = compiling.CompiledAttention(lambda *args: calls.append(args), default_config("sm90", problem),
                                         problem, 0, 0.0)
    assert kernel.positionals == 12
    q, k, v = torch.zeros(9, 8, 64), torch.zeros(10, 2, 64), torch.zeros(10, 2, 64)
    out, lse = torch.zeros_like(q), torch.zeros(8, 9)
    cu_q, cu_k = torch.tensor([0, 3, 8, 8], dtype=torch.int32), torch.tensor([0, 4, 8, 10], dtype=torch.int32)
    kernel.run_varlen(q, k, v, out, lse, None, compiling.mask_values(problem), cu_q, cu_k, 5, 4)
    (args,) = calls
    assert [tuple(t.shape) for t in args[:5]] == [(1, 9, 8, 64), (1, 10, 2, 64), (1, 10, 2, 64), (1, 9, 8, 64),
                                                  (1, 8, 9)]
    assert args[5] == pytest.approx(64 ** -0.5)
    assert args[6:9] == (7, None, None)   # the left side; causal's right side is compiled in; no softcap
    assert args[9] is cu_q and args[10] is cu_k and args[11] == 5
    with pytest.raises(ValueError, match="run_varlen"):
        kernel.run(q[None], k[None], v[None], out[None], lse[None])
    with pytest.raises(ValueError, match="lse must be given"):
        kernel.run_varlen(q, k, v, out, None, None, compiling.mask_values(problem), cu_q, cu_k, 5, 4)
    dense = compiling.CompiledAttention(lambda *args: None, default_config("sm90", problem),
                                        AttentionProblem(3, 5, 4, 8, 2, 64, "fp16"), 0, 0.0)
    with pytest.raises(ValueError, match="compiled for a varlen problem"):
        dense.run_varlen(q, k, v, out, None, None, (None, None, None), cu_q, cu_k, 5, 4)


@pytest.mark.parametrize("scheduler, kernel_clears_the_tail", [("single_lpt", True), ("single", True),
                                                                ("static", False), ("lpt", False)])
def test_inside_a_capture_our_kernel_clears_the_tail_as_a_sequence_without_keys(scheduler, kernel_clears_the_tail,
                                                                                 monkeypatch):
    """Inside a capture (no host offsets) the one-CTA-per-task kinds get the rows after the last sequence
    as one more sequence without keys, for which the kernel writes O = 0 and LSE = -inf: no pass over O.
    The persistent kinds keep the device mask. A stand-in kernel writes what ours writes."""
    from fa4.kernels import default_config

    q, k, v, cu_q, cu_k, max_q, max_k = _packed(*CASES["mixed"], tail=3)
    problem = varlen.varlen_problem(q, k, cu_q, max_q, max_k, True, True, None, None)
    config = default_config("sm90", problem).replace(scheduler=scheduler)
    launches = []

    class StandInKernel:
        def run_varlen(self, q, k, v, out, lse, scale, masks, cu_q, cu_k, max_q, max_k):
            launches.append((cu_q.tolist(), cu_k.tolist(), max_q))
            starts_q, starts_k = cu_q.tolist(), cu_k.tolist()
            for b in range(len(starts_q) - 1):   # a sequence's rows: 1 with keys, O = 0 / LSE = -inf without
                rows = slice(starts_q[b], starts_q[b + 1])
                has_keys = starts_k[b + 1] > starts_k[b]
                out[rows] = 1.0 if has_keys else 0.0
                lse[:, rows] = 1.0 if has_keys else -torch.inf

    monkeypatch.setattr("fa4.runtime.compiled_kernel", lambda *args: StandInKernel())
    monkeypatch.setattr("fa4.state.device_description", lambda device: None)
    monkeypatch.setattr("fa4.kernels.feasible", lambda *args: [])
    # what the kernel does not write stays NaN (torch.empty could hold zeros by chance)
    monkeypatch.setattr(torch, "empty", lambda *args, **kw: torch.full(*args, float("nan"), **kw))
    out, lse = varlen._ours(q, k, v, cu_q, cu_k, max_q, max_k, None, True, None, problem, config)
    [(launched_q, launched_k, launched_max_q)] = launches
    total = q.shape[0]
    if kernel_clears_the_tail:
        assert launched_q == cu_q.tolist() + [total] and launched_k == cu_k.tolist() + [int(cu_k[-1])]
        assert launched_max_q == total
    else:
        assert launched_q == cu_q.tolist() and launched_max_q == max_q
    tail = slice(int(cu_q[-1]), total)
    assert torch.all(out[tail] == 0) and torch.all(lse[:, tail] == -torch.inf)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
