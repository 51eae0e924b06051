"""fa4.attention_varlen on the GPU: every implementation (our varlen kernel, flash-attn-4's varlen kernel,
our kernel per sequence) against the fp32 reference, gradients with flash-attn's rule per sequence (ours
has no backward: it says so), CUDA-graph captures, and our varlen kernel under the knobs that change its
walk over tiles (every scheduler, one and two Q buffers, overlap off, P through shared memory).

    python -m pytest -m gpu -q tests/gpu/test_varlen_gpu.py
"""

from __future__ import annotations

import pytest
import torch

import fa4
from fa4 import varlen
from fa4.reference import check_grads

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("empty_database")]


def _skip_unless_runs(implementation, q):
    why = varlen.unsupported(implementation, q)
    if why:
        pytest.skip(why)

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# (lengths_q, lengths_k, Hq, Hkv, D): empty sequences, length 1, Sq != Sk both ways, no keys, long and short
CASES = [
    ([0, 1, 300, 1025, 77], [5, 1, 300, 700, 0], 16, 4, 128),
    ([513, 2048, 3], [513, 1000, 3000], 10, 2, 64),
    ([128] * 12, [128] * 12, 8, 8, 128),
    ([3000] + [1, 130, 64] * 5, [3000] + [1, 130, 200] * 5, 8, 2, 64),   # one long among short
    ([77, 0, 400, 260], [300, 5, 0, 260], 4, 1, 256),                     # head dim 256, MQA
    ([0, 1, 190, 333], [1, 0, 190, 500], 12, 4, 96),                      # head dim 96
    ([1, 257, 64, 0], [9, 257, 64, 3], 8, 8, 192),                        # head dim 192
]


def _packed(lengths_q, lengths_k, heads_q, heads_kv, head_dim, dtype, tail=5, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    total_q, total_k = sum(lengths_q) + tail, sum(lengths_k)
    q = torch.randn(total_q, heads_q, head_dim, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(total_k, heads_kv, head_dim, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(total_k, heads_kv, head_dim, device="cuda", dtype=dtype, generator=gen)

    def offsets(lengths):
        return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")

    return q, k, v, offsets(lengths_q), offsets(lengths_k), max(lengths_q), max(lengths_k)


@pytest.mark.parametrize("implementation", varlen.implementations())
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_matches_the_reference(case, causal, dtype, implementation):
    q, k, v, cu_q, cu_k, max_q, max_k = _packed(*CASES[case], DTYPES[dtype])
    _skip_unless_runs(implementation, q)
    out, lse = fa4.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, return_lse=True,
                                    backend=implementation)
    want_out, want_lse = varlen.reference_varlen(q, k, v, cu_q, cu_k, causal)
    torch.testing.assert_close(out.float(), want_out, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse, want_lse, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("implementation", varlen.implementations())
# the last: a window wider than every sequence (the mask's, no key block skipped) with a softcap
@pytest.mark.parametrize("window, softcap, causal", [((128, 0), None, True), ((200, 64), 30.0, False),
                                                     (None, 30.0, True), ((-1, 16), None, False),
                                                     ((4096, 4096), 20.0, True)])
@pytest.mark.parametrize("case", [0, 5])
def test_windows_and_softcaps_match_the_reference(case, window, softcap, causal, implementation):
    q, k, v, cu_q, cu_k, max_q, max_k = _packed(*CASES[case], torch.bfloat16)
    _skip_unless_runs(implementation, q)
    out, lse = fa4.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, return_lse=True,
                                    backend=implementation, window_size=window, softcap=softcap)
    want_out, want_lse = varlen.reference_varlen(q, k, v, cu_q, cu_k, causal, window_size=window, softcap=softcap)
    torch.testing.assert_close(out.float(), want_out, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse, want_lse, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("implementation", varlen.implementations())
def test_gradients_follow_flash_attns_rule_per_sequence(implementation):
    lengths_q, lengths_k, heads_q, heads_kv, head_dim = CASES[0]
    q, k, v, cu_q, cu_k, max_q, max_k = _packed(lengths_q, lengths_k, heads_q, heads_kv, head_dim,
                                                torch.bfloat16, tail=0)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    _skip_unless_runs(implementation, q)
    if implementation == varlen.OURS:   # no backward: forced, it says why; auto runs another
        with pytest.raises(fa4.UnsupportedInputError, match="no backward"):
            fa4.attention_varlen(*leaves, cu_q, cu_k, max_q, max_k, causal=True, backend=implementation)
        assert varlen.choose(q, "auto", *leaves[1:]) != varlen.OURS
        return
    dout = torch.randn_like(q)
    out = fa4.attention_varlen(*leaves, cu_q, cu_k, max_q, max_k, causal=True, backend=implementation)
    grads = torch.autograd.grad(out, leaves, dout)
    starts_q, starts_k = cu_q.tolist(), cu_k.tolist()
    for b in range(len(lengths_q)):
        q0, q1, k0, k1 = starts_q[b], starts_q[b + 1], starts_k[b], starts_k[b + 1]
        if q1 == q0 or k1 == k0:
            assert torch.all(grads[0][q0:q1] == 0)
            continue
        piece = [g[None, a:z] for g, (a, z) in zip(grads, [(q0, q1), (k0, k1), (k0, k1)])]
        failures = check_grads(piece, q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], dout[None, q0:q1], True)
        assert not failures, (b, failures)


@pytest.mark.parametrize("implementation", [name for name in varlen.implementations() if name != varlen.PER_SEQUENCE])
def test_device_offsets_capture_in_a_cuda_graph(implementation):
    q, k, v, cu_q, cu_k, max_q, max_k = _packed(*CASES[1], torch.bfloat16)
    _skip_unless_runs(implementation, q)
    eager = fa4.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, backend=implementation)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fa4.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, backend=implementation)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured, eager)


@pytest.mark.parametrize("implementation", [name for name in varlen.implementations() if name != varlen.PER_SEQUENCE])
def test_a_capture_clears_a_tail_longer_than_any_sequence(implementation):
    # ours takes the rows after the last sequence as one more sequence without keys inside a capture
    # (fa4.varlen.tail_sequence): here 5000 of them, more than max_seqlen_q's 2048
    q, k, v, cu_q, cu_k, max_q, max_k = _packed(*CASES[1], torch.bfloat16, tail=5000)
    _skip_unless_runs(implementation, q)
    options = dict(causal=True, backend=implementation, return_lse=True)
    eager_out, eager_lse = fa4.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, **options)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = fa4.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, **options)
    out.fill_(float("nan"))   # what the replay does not write stays NaN
    lse.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    rows = int(cu_q[-1])
    assert torch.all(out[rows:] == 0) and torch.all(lse[:, rows:] == -torch.inf)
    torch.testing.assert_close(out, eager_out)
    torch.testing.assert_close(lse, eager_lse)


def test_auto_runs_ours_on_an_h100_or_h200_only_where_measured_or_without_a_peer(empty_database):
    # nothing measured: flash-attn-4's varlen kernel where it runs (ours is not known to be as fast,
    # fa4.varlen_dispatch), else ours; `fa4tune search --varlen` measures a batch
    q = torch.empty(4, 8, 128, device="cuda", dtype=torch.bfloat16)
    _skip_unless_runs(varlen.OURS, q)
    peer_runs = varlen.unsupported("flash_attn_4", q) is None
    assert varlen.choose(q) == ("flash_attn_4" if peer_runs else varlen.OURS)


# knobs over the heuristic default that change how the kernel walks its tiles
KNOBS = {
    "single": dict(scheduler="single", q_stages=1),
    "single_lpt": dict(scheduler="single_lpt", q_stages=1),
    "static-two-q": dict(scheduler="static", q_stages=2),
    "lpt-two-q": dict(scheduler="lpt", q_stages=2),
    "lpt-one-q-three-stages": dict(scheduler="lpt", q_stages=1, kv_stages=3, tile_n=64),
    "no-overlap-ss": dict(scheduler="single_lpt", q_stages=1, softmax_overlap=False, pv_operand="ss"),
    "192-rows": dict(scheduler="single_lpt", q_stages=1, tile_m=192, tile_n=80),
}


@pytest.mark.parametrize("knobs", sorted(KNOBS))
@pytest.mark.parametrize("causal", [False, True])
def test_our_kernel_under_its_knobs(knobs, causal):
    from fa4.kernels import compile_attention, default_config, feasible
    from fa4.kernels.compiling import mask_values

    q, k, v, cu_q, cu_k, max_q, max_k = _packed(*CASES[3], torch.float16)
    _skip_unless_runs(varlen.OURS, q)
    problem = varlen.varlen_problem(q, k, cu_q, max_q, max_k, causal, True, None, None)
    config = default_config("sm90", problem).replace(**{"tile_m": 128, "tile_n": 128, **KNOBS[knobs]})
    assert feasible(config, problem) == [], config.label()
    kernel = compile_attention(config, problem)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((q.shape[1], q.shape[0]), float("nan"), device="cuda")
    kernel.run_varlen(q, k, v, out, lse, None, mask_values(problem), cu_q, cu_k, max_q, max_k)
    torch.cuda.synchronize()
    want_out, want_lse = varlen.reference_varlen(q, k, v, cu_q, cu_k, causal)
    rows = int(cu_q[-1])   # the kernel leaves the rows after the last sequence alone (NaN here)
    assert torch.isnan(out[rows:]).all()
    torch.testing.assert_close(out[:rows].float(), want_out[:rows], atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse[:, :rows], want_lse[:, :rows], atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("scheduler", ["single", "single_lpt", "lpt"])
@pytest.mark.parametrize("causal", [False, True])
def test_more_sequences_than_a_warp_has_lanes(scheduler, causal):
    # the one-CTA-per-task kinds find a CTA's task 32 sequences at a time (kernels/sm90/scheduler.py,
    # `packed_varlen`): 70 sequences, some empty, the long ones in the second and third groups of 32
    from fa4.kernels import compile_attention, default_config
    from fa4.kernels.compiling import mask_values

    lengths_q = [0 if i % 9 == 4 else (i * 53) % 400 + (900 if i in (40, 66) else 0) for i in range(70)]
    lengths_k = [n + (i % 3) * 40 for i, n in enumerate(lengths_q)]
    q, k, v, cu_q, cu_k, max_q, max_k = _packed(lengths_q, lengths_k, 8, 2, 128, torch.bfloat16)
    _skip_unless_runs(varlen.OURS, q)
    problem = varlen.varlen_problem(q, k, cu_q, max_q, max_k, causal, True, None, None)
    kernel = compile_attention(default_config("sm90", problem).replace(scheduler=scheduler), problem)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((q.shape[1], q.shape[0]), float("nan"), device="cuda")
    kernel.run_varlen(q, k, v, out, lse, None, mask_values(problem), cu_q, cu_k, max_q, max_k)
    torch.cuda.synchronize()
    want_out, want_lse = varlen.reference_varlen(q, k, v, cu_q, cu_k, causal)
    rows = int(cu_q[-1])
    torch.testing.assert_close(out[:rows].float(), want_out[:rows], atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse[:, :rows], want_lse[:, :rows], atol=1e-2, rtol=1e-2)
