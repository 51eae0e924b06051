"""fa4.attention_varlen on the GPU: both implementations (flash-attn-4's varlen kernel, our kernel per
sequence) against the fp32 reference, gradients with flash-attn's rule per sequence, and a CUDA-graph
capture.

    python -m pytest -m gpu -q tests/gpu/test_varlen_gpu.py
"""

from __future__ import annotations

import pytest
import torch

import fa4
from fa4 import varlen
from fa4.reference import check_grads

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("empty_database")]

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# (lengths_q, lengths_k, Hq, Hkv, D): empty sequences, length 1, Sq != Sk both ways, no keys, long and short
CASES = [
    ([0, 1, 300, 1025, 77], [5, 1, 300, 700, 0], 16, 4, 128),
    ([513, 2048, 3], [513, 1000, 3000], 10, 2, 64),
    ([128] * 12, [128] * 12, 8, 8, 128),
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
    if varlen.unsupported(implementation, torch.empty(1, device="cuda")):
        pytest.skip(varlen.unsupported(implementation, torch.empty(1, device="cuda")))
    q, k, v, cu_q, cu_k, max_q, max_k = _packed(*CASES[case], DTYPES[dtype])
    out, lse = fa4.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, return_lse=True,
                                    backend=implementation)
    want_out, want_lse = varlen.reference_varlen(q, k, v, cu_q, cu_k, causal)
    torch.testing.assert_close(out.float(), want_out, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse, want_lse, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("implementation", varlen.implementations())
@pytest.mark.parametrize("window, softcap, causal", [((128, 0), None, True), ((200, 64), 30.0, False),
                                                     (None, 30.0, True), ((-1, 16), None, False)])
def test_windows_and_softcaps_match_the_reference(window, softcap, causal, implementation):
    if varlen.unsupported(implementation, torch.empty(1, device="cuda")):
        pytest.skip(varlen.unsupported(implementation, torch.empty(1, device="cuda")))
    q, k, v, cu_q, cu_k, max_q, max_k = _packed(*CASES[0], torch.bfloat16)
    out, lse = fa4.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, return_lse=True,
                                    backend=implementation, window_size=window, softcap=softcap)
    want_out, want_lse = varlen.reference_varlen(q, k, v, cu_q, cu_k, causal, window_size=window, softcap=softcap)
    torch.testing.assert_close(out.float(), want_out, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse, want_lse, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("implementation", varlen.implementations())
def test_gradients_follow_flash_attns_rule_per_sequence(implementation):
    if varlen.unsupported(implementation, torch.empty(1, device="cuda")):
        pytest.skip(varlen.unsupported(implementation, torch.empty(1, device="cuda")))
    lengths_q, lengths_k, heads_q, heads_kv, head_dim = CASES[0]
    q, k, v, cu_q, cu_k, max_q, max_k = _packed(lengths_q, lengths_k, heads_q, heads_kv, head_dim,
                                                torch.bfloat16, tail=0)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
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


def test_the_automatic_path_captures_in_a_cuda_graph():
    """With device offsets: a peer's varlen kernel where one runs (the per-sequence path needs CPU
    offsets inside a capture and says so)."""
    if varlen.choose(torch.empty(1, device="cuda")) == varlen.PER_SEQUENCE:
        pytest.skip("no peer varlen kernel here")
    q, k, v, cu_q, cu_k, max_q, max_k = _packed(*CASES[1], torch.bfloat16)
    eager = fa4.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fa4.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured, eager)
