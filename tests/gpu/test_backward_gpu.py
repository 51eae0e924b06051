"""`fa4.attention` in training on the H200: gradients of our forward with the chosen backward
(flash-attn-4's kernels where installed, else the blockwise PyTorch one) against fp32 autograd with
flash-attn's rule; both backward implementations forced; CUDA-graph capture of a training step; and a
100-step training run of a small transformer that tracks the same run with SDPA.

    python -m pytest -m gpu -q tests/gpu/test_backward_gpu.py
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fa4
from fa4 import backward
from fa4.reference import check_grads

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("empty_database")]

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
CASES = [  # (B, Sq, Sk, Hq, Hkv, D, causal): the held-out style
    (2, 777, 777, 16, 4, 128, True),     # odd length, GQA 4
    (1, 300, 1000, 10, 2, 64, True),     # Sq < Sk, GQA 5
    (1, 1000, 300, 8, 1, 128, True),     # Sq > Sk: rows that see no key; MQA
    (2, 513, 513, 16, 2, 64, False),     # GQA 8, full
    (1, 1024, 1024, 8, 8, 128, False),   # MHA
]


def _inputs(batch, sq, sk, hq, hkv, d, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shapes = ((batch, sq, hq, d), (batch, sk, hkv, d), (batch, sk, hkv, d), (batch, sq, hq, d))
    return [torch.randn(*s, device="cuda", dtype=dtype, generator=gen) for s in shapes]


def _grads(q, k, v, dout, causal):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    fa4.attention(*leaves, causal=causal).backward(dout)
    return [t.grad for t in leaves]


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}-sq{}-sk{}-hq{}-hkv{}-d{}-{}".format(
    *c[:6], "causal" if c[6] else "full"))
def test_gradients_match_fp32_autograd(case, dtype):
    *shape, causal = case
    q, k, v, dout = _inputs(*shape, DTYPES[dtype], seed=sum(shape))
    failures = check_grads(_grads(q, k, v, dout, causal), q, k, v, dout, causal)
    assert not failures, failures


@pytest.mark.parametrize("implementation", backward.implementations())
def test_each_backward_implementation(implementation, monkeypatch):
    probe = torch.empty(1, 1, 1, 128, device="cuda", dtype=torch.bfloat16)
    if implementation == backward.OURS:
        why_not = backward.ours_unsupported(probe)
    elif implementation != backward.BLOCKWISE:
        why_not = next(p for p in backward.peers_with_backward() if p.name == implementation).backward_unsupported(probe)
    else:
        why_not = None
    if why_not:
        pytest.skip(why_not)
    monkeypatch.setattr(backward, "choose", lambda q, *_, **__: (implementation, "forced by the test"))
    q, k, v, dout = _inputs(1, 400, 600, 8, 2, 128, torch.bfloat16, seed=5)
    failures = check_grads(_grads(q, k, v, dout, True), q, k, v, dout, True)
    assert not failures, failures


def test_strided_views_from_one_projection():
    gen = torch.Generator(device="cuda").manual_seed(1)
    packed = torch.randn(2, 256, 12, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
    q, k, v = packed.split([8, 2, 2], dim=2)
    dout = torch.randn(2, 256, 8, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
    failures = check_grads(_grads(q, k, v, dout, True), q, k, v, dout, True)
    assert not failures, failures


def test_a_training_step_captures_in_a_cuda_graph():
    q, k, v, dout = _inputs(1, 512, 512, 8, 2, 128, torch.bfloat16, seed=2)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def step():
        for t in leaves:
            t.grad = None
        fa4.attention(*leaves, causal=True).backward(dout)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):   # warm-up: decisions and compiles happen outside the capture
            step()
    torch.cuda.current_stream().wait_stream(stream)
    eager = [t.grad.clone() for t in leaves]
    graph = torch.cuda.CUDAGraph()
    for t in leaves:
        t.grad = None
    with torch.cuda.graph(graph):
        fa4.attention(*leaves, causal=True).backward(dout)
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip((t.grad for t in leaves), eager):
        torch.testing.assert_close(got, want)


class _Block(torch.nn.Module):
    def __init__(self, width, heads, kv_heads, attend):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.attend = heads, kv_heads, width // heads, attend
        self.norm1, self.norm2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.qkv = torch.nn.Linear(width, (heads + 2 * kv_heads) * self.head_dim, bias=False)
        self.proj = torch.nn.Linear(width, width, bias=False)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                       torch.nn.Linear(4 * width, width))

    def forward(self, x):
        batch, seqlen, _ = x.shape
        qkv = self.qkv(self.norm1(x)).view(batch, seqlen, self.heads + 2 * self.kv_heads, self.head_dim)
        q, k, v = qkv.to(torch.bfloat16).split([self.heads, self.kv_heads, self.kv_heads], dim=2)
        attended = self.attend(q, k, v).reshape(batch, seqlen, -1).float()
        x = x + self.proj(attended)
        return x + self.mlp(self.norm2(x))


def _fa4_attend(q, k, v):
    return fa4.attention(q, k, v, causal=True)


def _sdpa_attend(q, k, v):
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=True, enable_gqa=True)
    return out.transpose(1, 2)


class _Model(torch.nn.Module):
    def __init__(self, vocab, width, seqlen, attend):
        super().__init__()
        self.tokens, self.positions = torch.nn.Embedding(vocab, width), torch.nn.Embedding(seqlen, width)
        self.blocks = torch.nn.Sequential(*(_Block(width, 8, 2, attend) for _ in range(3)))
        self.head = torch.nn.Sequential(torch.nn.LayerNorm(width), torch.nn.Linear(width, vocab))

    def forward(self, x):
        positions = torch.arange(x.shape[1], device=x.device)
        return self.head(self.blocks(self.tokens(x) + self.positions(positions)))


def _train(attend, steps=150, seed=0):
    torch.manual_seed(seed)
    vocab, width, seqlen = 512, 512, 512
    model = _Model(vocab, width, seqlen, attend).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    # eight fixed random sequences, memorised: a loss that falls 100x in 150 steps. (A fresh random
    # copy task per step, the first version, needs in-context copying, which this model does not learn
    # in 150 steps: on the H200 both fa4 and SDPA went 6.40 -> 6.28.)
    tokens = torch.randint(0, vocab, (8, seqlen), device="cuda", generator=gen)
    losses = []
    for _ in range(steps):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


# the two runs differ only in bf16 rounding inside attention (and the order of the backward's sums);
# chosen before the first run on the H200 (which measured a worst gap of 3.7e-4 over 150 steps,
# losses 6.41 -> 0.00068 both)
LOSS_TOLERANCE = 0.02   # relative, per step


def test_a_training_run_tracks_sdpa():
    ours, sdpa = _train(_fa4_attend), _train(_sdpa_attend)
    assert ours[-1] < 0.01 * ours[0], ("the model did not learn", ours[::15])
    worst = max(abs(a - b) / b for a, b in zip(ours, sdpa))
    print(f"losses ours {ours[0]:.3f} -> {ours[-1]:.4f}, SDPA {sdpa[0]:.3f} -> {sdpa[-1]:.4f}, "
          f"worst relative gap {worst:.4f}")
    assert worst <= LOSS_TOLERANCE, (worst, ours[::10], sdpa[::10])


def test_the_bench_times_the_training_pass():
    """`fa4tune bench --backward`'s measurement (`fa4tune.workers.training`) on one small shape."""
    from fa4.kernels import AttentionProblem
    from fa4tune.workers.evaluator import KernelEvaluator
    from fa4tune.workers.timing import TimingSettings
    from fa4tune.workers.training import FA4

    problem = AttentionProblem(batch=1, seqlen_q=512, seqlen_k=512, heads_q=8, heads_kv=2, head_dim=128,
                               dtype="bf16", causal=True)
    evaluator = KernelEvaluator("gpu")
    evaluator.setup()
    got = evaluator.time_training(problem, TimingSettings(), [FA4, "sdpa_cudnn"])
    ours = got[FA4]
    assert "error" not in ours, ours
    assert ours["validated"] and 0 < ours["bwd_us"] < ours["fwdbwd_us"] and ours["bwd_peak_extra_mib"] > 0
    print(got)
