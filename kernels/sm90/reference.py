"""fp32 PyTorch reference of the forward contract (explicit bottom-right causal mask), for tests and
benchmarks. Imports torch lazily; nothing here touches the DSL."""

from __future__ import annotations

import os

import math


def attention_reference(q, k, v, causal: bool, softmax_scale=None):
    """O (B, Sq, Hq, D) and LSE (B, Hq, Sq) in fp32. A row that sees no key: O = 0, LSE = -inf."""
    import torch
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    ratio = hq // hkv
    qf = q.float().transpose(1, 2)                                    # (B, Hq, Sq, D)
    kf = k.float().transpose(1, 2).repeat_interleave(ratio, dim=1)   # (B, Hq, Sk, D)
    vf = v.float().transpose(1, 2).repeat_interleave(ratio, dim=1)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    if causal:
        i = torch.arange(sq, device=q.device).view(-1, 1)
        j = torch.arange(sk, device=q.device).view(1, -1)
        s = s.masked_fill(j > i + (sk - sq), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)                                  # -inf for empty rows
    p = torch.exp(s - lse.unsqueeze(-1).masked_fill(torch.isinf(lse).unsqueeze(-1), 0.0))
    p = torch.nan_to_num(p, nan=0.0)
    o = torch.matmul(p, vf).transpose(1, 2)                          # (B, Sq, Hq, D)
    return o, lse


def sdpa_reference(q, k, v, causal: bool, softmax_scale=None):
    """torch SDPA in the inputs' dtype, with an explicit bottom-right mask (SDPA's is_causal is
    top-left). Rows that see no key come back as NaN from SDPA; they are set to 0 here."""
    import torch
    import torch.nn.functional as F
    sq, sk = q.shape[1], k.shape[1]
    ratio = q.shape[2] // k.shape[2]
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    kt = kt.repeat_interleave(ratio, dim=1)
    vt = vt.repeat_interleave(ratio, dim=1)
    mask = None
    if causal:
        i = torch.arange(sq, device=q.device).view(-1, 1)
        j = torch.arange(sk, device=q.device).view(1, -1)
        mask = j <= i + (sk - sq)
    o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=softmax_scale)
    return torch.nan_to_num(o.transpose(1, 2), nan=0.0)


def check_against_references(out, lse, q, k, v, causal: bool, softmax_scale=None, tol=1e-2):
    """Failures (list of strings) of our output against the fp32 reference and SDPA at rtol = atol =
    tol. SDPA is compared only on rows that see at least one key (it has no defined output for the
    others); those rows must be exactly O = 0 and LSE = -inf."""
    import torch
    failures = []
    o_ref, lse_ref = attention_reference(q, k, v, causal, softmax_scale)
    o_sdpa = sdpa_reference(q, k, v, causal, softmax_scale).float()
    o = out.float()
    if not torch.isfinite(o).all():
        failures.append("output has NaN/inf")
    if not torch.allclose(o, o_ref, rtol=tol, atol=tol):
        failures.append(f"vs fp32 reference: max abs err {float((o - o_ref).abs().max()):.4g}")
    sq, sk = q.shape[1], k.shape[1]
    seen = torch.ones(sq, dtype=torch.bool, device=q.device)
    if causal:
        seen = torch.arange(sq, device=q.device) + (sk - sq) >= 0
    if seen.any() and not torch.allclose(o[:, seen], o_sdpa[:, seen], rtol=tol, atol=tol):
        failures.append(f"vs SDPA: max abs err {float((o[:, seen] - o_sdpa[:, seen]).abs().max()):.4g}")
    if (~seen).any() and bool((o[:, ~seen] != 0).any()):
        failures.append("rows that see no key are not 0")
    if lse is not None:
        if (~seen).any() and not bool(torch.isneginf(lse[:, :, ~seen]).all()):
            failures.append("LSE of rows that see no key is not -inf")
        if seen.any():
            a, b = lse[:, :, seen], lse_ref[:, :, seen]
            if not torch.allclose(a, b, rtol=tol, atol=tol):
                failures.append(f"LSE: max abs err {float((a - b).abs().max()):.4g}")
    return failures


def make_inputs(problem, seed=0, logit_scale=1.0):
    """Random Q, K, V (B, S, H, D) on the GPU in the problem's dtype; Q and K scaled by logit_scale."""
    import torch
    dt = {"fp16": torch.float16, "bf16": torch.bfloat16}[problem.dtype]
    g = torch.Generator(device="cuda").manual_seed(seed)
    b, sq, sk, hq, hkv, d = (problem.batch, problem.seqlen_q, problem.seqlen_k, problem.heads_q,
                             problem.heads_kv, problem.head_dim)
    q = (torch.randn(b, sq, hq, d, device="cuda", generator=g) * logit_scale).to(dt)
    k = (torch.randn(b, sk, hkv, d, device="cuda", generator=g) * logit_scale).to(dt)
    v = torch.randn(b, sk, hkv, d, device="cuda", generator=g).to(dt)
    return q, k, v


# ---- helpers of the GPU test suites (tests/gpu/test_sm90_*.py) -------------------------------------
# FA4_SM90_SHARD="i/n" keeps the i-th of n contiguous chunks of a suite's cases, so one device run can
# test a suite in n parallel processes; suites list cases with the compile key outermost, so a chunk
# compiles only its own keys.

def shard(cases):
    spec = os.environ.get("FA4_SM90_SHARD")
    if not spec:
        return cases
    i, n = (int(x) for x in spec.split("/"))
    size = -(-len(cases) // n)
    return cases[i * size:(i + 1) * size]


def run_and_check(config, problem, logit_scale=1.0, softmax_scale=None):
    import torch
    from fa4.kernels import compile_attention
    from fa4.kernels.sm90.reference import check_against_references, make_inputs
    q, k, v = make_inputs(problem, logit_scale=logit_scale)
    out = torch.full_like(q, float("nan"))  # every element must be written
    lse = None
    if problem.return_lse:
        lse = torch.full((problem.batch, problem.heads_q, problem.seqlen_q), float("nan"),
                         device="cuda", dtype=torch.float32)
    compile_attention(config, problem).run(q, k, v, out, lse, softmax_scale)
    torch.cuda.synchronize()
    return check_against_references(out, lse, q, k, v, problem.causal, softmax_scale)
