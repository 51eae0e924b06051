"""What "correct" means for our forward: the one fp32 reference and the one comparison rule.

Everything that decides whether an output is right imports this module: the search's workers
(`fa4tune.workers.worker`), the peers' error figures (`fa4tune.workers.peers`), the SDPA fallback's LSE
(`fa4.fallback`), the GPU suites and the CPU tests. Two references that disagree would make two
definitions of "correct"; there is one.

The contract (`docs/design.md`)
-------------------------------
- Layout (B, S, H, D); GQA: query head h reads KV head h // (Hq / Hkv).
- Causal masks are bottom-right aligned: key j is hidden from query i when j > i + Sk - Sq (query i's
  diagonal key). A sliding window (left, right) shows query i the keys diag - left .. diag + right (-1:
  that side unbounded; causal makes the right side 0), as flash-attn.
- A softcap c replaces each scaled score s by c * tanh(s / c) before the softmax (flash-attn-4 caps
  the score after the softmax scale, `flash_attn/cute/utils.py` `create_softcap_scoremod`).
- A query row that sees no key (the first Sq - Sk - right rows: causal with Sq > Sk, or a window whose
  right side ends before key 0) has O = 0 exactly and LSE = -inf. SDPA has no defined answer there
  (it gives NaN), so SDPA is compared on the other rows only; the fp32 reference follows the rule and
  is compared everywhere.
- The output must be finite and within rtol = atol = 1e-2 of both the fp32 reference and
  `scaled_dot_product_attention` in the inputs' precision; the LSE within the same tolerance of the
  fp32 LSE on rows that see a key.

Imports torch lazily, so the harness can import it without torch at hand.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

RTOL = ATOL = 1e-2
# fp32 scores materialised at once: the reference walks the query rows in chunks of at most this
_CHUNK_BYTES = 256 << 20


def softmax_scale(head_dim: int) -> float:
    """The default softmax scale, 1 / sqrt(head_dim)."""
    return 1.0 / math.sqrt(head_dim)


def key_bounds(causal: bool, window=None) -> tuple[Optional[int], Optional[int]]:
    """(left, right): how many keys left and right of its diagonal key a query sees, None for
    unbounded; `window` (left, right) with -1 (or None) unbounded, the right side 0 under causal."""
    left, right = (None, None) if window is None else (
        None if window[0] is None or window[0] < 0 else int(window[0]),
        None if window[1] is None or window[1] < 0 else int(window[1]))
    return left, (0 if causal else right)


def visible_keys(seqlen_q: int, seqlen_k: int, device=None, window=(-1, 0), first_row: int = 0,
                 rows: Optional[int] = None):
    """(rows, Sk) bool, True where query i sees key j: diag - left <= j <= diag + right with diag =
    i + Sk - Sq, for `window` (left, right) (-1: unbounded); the default is the causal mask. The rows
    are the queries first_row .. first_row + rows of the Sq (all of them by default)."""
    import torch

    left, right = key_bounds(False, window)
    count = seqlen_q - first_row if rows is None else rows
    queries = torch.arange(first_row, first_row + count, device=device).unsqueeze(1)
    cols = torch.arange(seqlen_k, device=device).unsqueeze(0)
    diag = queries + (seqlen_k - seqlen_q)
    visible = torch.ones((count, seqlen_k), dtype=torch.bool, device=device)
    if right is not None:
        visible = visible & (cols <= diag + right)
    if left is not None:
        visible = visible & (cols >= diag - left)
    return visible


def _mask_window(causal: bool, window) -> Optional[tuple[int, int]]:
    """The `visible_keys` window of a call, or None when every key is visible."""
    left, right = key_bounds(causal, window)
    if left is None and right is None:
        return None
    return (-1 if left is None else left, -1 if right is None else right)


def rows_without_keys(seqlen_q: int, seqlen_k: int, causal: bool, window=None) -> int:
    """How many query rows see no key; they are always the first ones (O = 0, LSE = -inf there): row i
    sees none exactly when its diagonal key plus the right side is left of key 0."""
    if seqlen_k == 0:
        return seqlen_q
    right = key_bounds(causal, window)[1]
    return 0 if right is None else min(seqlen_q, max(0, seqlen_q - seqlen_k - right))


def rows_with_keys(seqlen_q: int, seqlen_k: int, causal: bool, device=None, window=None):
    """(Sq,) bool, True for the query rows that see at least one key."""
    import torch

    return torch.arange(seqlen_q, device=device) >= rows_without_keys(seqlen_q, seqlen_k, causal, window)


def capped(scores, softcap: Optional[float]):
    """Scaled scores through the softcap: c * tanh(s / c) (unchanged without one)."""
    import torch

    return scores if softcap is None else torch.tanh(scores / softcap) * softcap


def _expand_kv(x, heads_q: int):
    """(B, Sk, Hkv, D) -> (B, Hq, Sk, D) fp32, each KV head repeated for its query heads."""
    return x.float().transpose(1, 2).repeat_interleave(heads_q // x.shape[2], dim=1)


def _rows_per_chunk(q, k, chunk_bytes: int) -> int:
    """How many query rows a chunk takes: at most `chunk_bytes` of their (B, Hq, rows, Sk) fp32 scores,
    at least one row."""
    batch, _, heads_q, _ = q.shape
    return max(1, chunk_bytes // max(1, 4 * batch * heads_q * k.shape[1]))


def _score_chunks(q, k, causal: bool, scale: float, chunk_bytes: int, window=None, softcap=None):
    """(start, stop, scores) over query-row chunks; scores (B, Hq, rows, Sk) fp32, scaled and capped,
    hidden keys -inf (each chunk's rows of the mask, so no (Sq, Sk) buffer)."""
    import torch

    seqlen_q, heads_q, seqlen_k = q.shape[1], q.shape[2], k.shape[1]
    kf = _expand_kv(k, heads_q)
    rows = _rows_per_chunk(q, k, chunk_bytes)
    mask_window = _mask_window(causal, window)
    for start in range(0, seqlen_q, rows):
        stop = min(seqlen_q, start + rows)
        scores = capped(torch.matmul(q[:, start:stop].float().transpose(1, 2), kf.transpose(-1, -2)) * scale,
                        softcap)
        if mask_window:
            visible = visible_keys(seqlen_q, seqlen_k, q.device, mask_window, start, stop - start)
            scores = scores.masked_fill(~visible, -math.inf)
        yield start, stop, scores


def lse_fp32(q, k, causal: bool, scale: Optional[float] = None, chunk_bytes: int = _CHUNK_BYTES, *,
             window=None, softcap: Optional[float] = None):
    """log sum_j exp(score_ij) over the visible keys (score: scale * q_i . k_j, capped): (B, Hq, Sq)
    fp32, -inf where none is."""
    import torch

    batch, seqlen_q, heads_q, head_dim = q.shape
    scale = softmax_scale(head_dim) if scale is None else float(scale)
    lse = torch.full((batch, heads_q, seqlen_q), -math.inf, dtype=torch.float32, device=q.device)
    if k.shape[1] == 0 or q.numel() == 0:
        return lse
    for start, stop, scores in _score_chunks(q, k, causal, scale, chunk_bytes, window, softcap):
        lse[:, :, start:stop] = torch.logsumexp(scores, dim=-1)
    return lse


def attention_fp32(q, k, v, causal: bool, scale: Optional[float] = None, chunk_bytes: int = _CHUNK_BYTES, *,
                   window=None, softcap: Optional[float] = None):
    """The fp32 reference: (O (B, Sq, Hq, D) fp32, LSE (B, Hq, Sq) fp32), rows without a key O = 0,
    LSE = -inf. `window` (left, right) and `softcap` as the module docstring says."""
    return _chunked_attention(q, k, v, causal, scale, chunk_bytes, window, softcap, None)


def _chunked_attention(q, k, v, causal, scale, chunk_bytes, window, softcap, dtype):
    """(O, LSE) a query chunk at a time. `dtype` None: all fp32. Otherwise a flash kernel's precision:
    scores, cap and softmax in fp32, P and V in `dtype` for the value product, O rounded to `dtype`
    (scores rounded to bf16 before a cap and a softmax would be a worse answer than any kernel's, and
    the rule would then fail correct outputs)."""
    import torch

    batch, seqlen_q, heads_q, head_dim = q.shape
    scale = softmax_scale(head_dim) if scale is None else float(scale)
    dtype = dtype or torch.float32
    out = torch.zeros((batch, heads_q, seqlen_q, v.shape[3]), dtype=dtype, device=q.device)
    lse = torch.full((batch, heads_q, seqlen_q), -math.inf, dtype=torch.float32, device=q.device)
    if k.shape[1] == 0 or q.numel() == 0:
        return out.transpose(1, 2).contiguous(), lse
    vf = _expand_kv(v, heads_q).to(dtype)
    for start, stop, scores in _score_chunks(q, k, causal, scale, chunk_bytes, window, softcap):
        chunk_lse = torch.logsumexp(scores, dim=-1)
        empty = torch.isneginf(chunk_lse)
        p = torch.exp(scores - chunk_lse.masked_fill(empty, 0.0).unsqueeze(-1)).to(dtype)
        out[:, :, start:stop] = torch.matmul(p, vf).masked_fill(empty.unsqueeze(-1), 0.0)
        lse[:, :, start:stop] = chunk_lse.float()
    return out.transpose(1, 2).contiguous(), lse


def sdpa_same_precision(q, k, v, causal: bool, scale: Optional[float] = None, *, window=None,
                        softcap: Optional[float] = None):
    """`scaled_dot_product_attention` in the inputs' dtype (whatever backend torch picks) with an explicit
    bottom-right mask (the window's, if any), in our layout; rows without a key set to 0 (SDPA leaves
    them NaN). SDPA has no softcap: with one, the same math written out at a flash kernel's precision
    (`_chunked_attention`), a chunk of query rows at a time."""
    import torch.nn.functional as F

    if softcap is not None:
        return _chunked_attention(q, k, v, causal, scale, _CHUNK_BYTES, window, softcap, q.dtype)[0]
    heads_q = q.shape[2]
    qt = q.transpose(1, 2)
    kt = k.repeat_interleave(heads_q // k.shape[2], dim=2).transpose(1, 2)
    vt = v.repeat_interleave(heads_q // v.shape[2], dim=2).transpose(1, 2)
    mask_window = _mask_window(causal, window)
    mask = visible_keys(q.shape[1], k.shape[1], q.device, mask_window) if mask_window else None
    out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale).transpose(1, 2)
    seen = rows_with_keys(q.shape[1], k.shape[1], causal, q.device, window)
    return out.masked_fill(~seen.view(1, -1, 1, 1), 0.0)


@dataclass
class Expected:
    """The answers an output is held to, computed once per set of inputs (the search reuses them)."""

    out_fp32: Any        # (B, Sq, Hq, D) fp32
    lse_fp32: Any        # (B, Hq, Sq) fp32
    out_sdpa: Any        # (B, Sq, Hq, D) fp32 of the same-precision SDPA answer
    seen: Any            # (Sq,) bool: rows that see a key

    @classmethod
    def of(cls, q, k, v, causal: bool, scale: Optional[float] = None, *, window=None,
           softcap: Optional[float] = None) -> "Expected":
        out, lse = attention_fp32(q, k, v, causal, scale, window=window, softcap=softcap)
        sdpa = sdpa_same_precision(q, k, v, causal, scale, window=window, softcap=softcap).float()
        return cls(out, lse, sdpa, rows_with_keys(q.shape[1], k.shape[1], causal, q.device, window))


def _max_abs(x) -> Optional[float]:
    """The largest |x| as a rounded float, None for an empty or non-finite tensor."""
    if x.numel() == 0:
        return None
    value = float(x.abs().max())
    return round(value, 6) if math.isfinite(value) else None


def compare(out, lse, expected: Expected, rtol: float = RTOL, atol: float = ATOL) -> dict:
    """Hold one output (and its LSE, or None) to the rule above.

    Returns {"passed": bool, "failures": [str], "max_err": vs fp32, "max_err_sdpa": vs SDPA on rows that
    see a key, "max_err_lse" (with an LSE)}, and "error" (the failures joined) when it did not pass.
    """
    import torch

    o = out.float()
    seen = expected.seen
    failures = []
    result: dict = {"max_err": _max_abs(o - expected.out_fp32),
                    "max_err_sdpa": _max_abs(o[:, seen] - expected.out_sdpa[:, seen])}
    if not bool(torch.isfinite(o).all()):
        failures.append("output has NaN/Inf (or was not written)")
    else:
        if not torch.allclose(o, expected.out_fp32, rtol=rtol, atol=atol):
            failures.append(f"differs from the fp32 reference: max abs error {result['max_err']:.4g}")
        if bool(seen.any()) and not torch.allclose(o[:, seen], expected.out_sdpa[:, seen], rtol=rtol, atol=atol):
            failures.append(f"differs from SDPA: max abs error {result['max_err_sdpa']:.4g}")
        if bool((~seen).any()) and bool((o[:, ~seen] != 0).any()):
            failures.append("rows that see no key are not 0")
    if lse is not None:
        lse = lse.float()
        got, want = lse[:, :, seen], expected.lse_fp32[:, :, seen]
        result["max_err_lse"] = _max_abs(got - want)
        if bool((~seen).any()) and not bool(torch.isneginf(lse[:, :, ~seen]).all()):
            failures.append("LSE of rows that see no key is not -inf")
        if got.numel() and not torch.allclose(got, want, rtol=rtol, atol=atol):
            failures.append(f"LSE differs from the fp32 reference: max abs error {result['max_err_lse']}")
    result["passed"] = not failures
    result["failures"] = failures
    if failures:
        result["error"] = "; ".join(failures)
    return result


def check(out, lse, q, k, v, causal: bool, scale: Optional[float] = None, *, window=None,
          softcap: Optional[float] = None) -> list[str]:
    """The failures of one output against the references of its inputs (empty: correct)."""
    return compare(out, lse, Expected.of(q, k, v, causal, scale, window=window, softcap=softcap))["failures"]


def random_inputs(problem, device: str = "cuda", seed: int = 0, logit_scale: float = 1.0):
    """Random q, k, v (standard normal; q and k times `logit_scale`) in our layout and the problem's
    dtype (v at its value head dim). Drawn on the CPU, so the same seed gives the same values on every device."""
    import torch

    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[problem.dtype]
    gen = torch.Generator(device="cpu").manual_seed(seed)
    shape_q = (problem.batch, problem.seqlen_q, problem.heads_q, problem.head_dim)
    shape_kv = (problem.batch, problem.seqlen_k, problem.heads_kv, problem.head_dim)
    q = torch.randn(shape_q, generator=gen) * logit_scale
    k = torch.randn(shape_kv, generator=gen) * logit_scale
    v = torch.randn(shape_kv[:3] + (problem.value_head_dim,), generator=gen)
    return tuple(x.to(device=device, dtype=dtype) for x in (q, k, v))


# ------------------------------------------------------------------------------------------------
# gradients: flash-attn's rule

GRAD_ATOL = 1e-3


def plain_attention(q, k, v, causal: bool, scale: float, dtype, return_lse: bool = False, *, window=None,
                    softcap: Optional[float] = None, first_row: int = 0, seqlen_q: Optional[int] = None):
    """Attention written out in `dtype` (autograd-able, (B, H, Sq, Sk) scores: `attention_grads` calls it
    a chunk of query rows at a time); a row that sees no key gives O = 0 (and LSE = -inf). `q` may be the
    rows first_row .. of a problem of `seqlen_q` query rows: the mask is that problem's."""
    import torch

    heads_q = q.shape[2]
    seqlen_q = q.shape[1] if seqlen_q is None else seqlen_q
    q, k, v = (t.to(dtype).transpose(1, 2) for t in (q, k, v))        # (B, H, S, D)
    k, v = (t.repeat_interleave(heads_q // t.shape[1], dim=1) for t in (k, v))
    scores = capped((q @ k.transpose(-1, -2)) * scale, softcap)
    mask_window = _mask_window(causal, window)
    if mask_window:
        visible = visible_keys(seqlen_q, k.shape[2], q.device, mask_window, first_row, q.shape[2])
        scores = scores.masked_fill(~visible, float("-inf"))
    has_key = torch.isfinite(scores).any(-1, keepdim=True)
    filled = scores.masked_fill(~has_key, 0.0)
    out = (torch.softmax(filled, dim=-1).masked_fill(~has_key, 0.0) @ v).transpose(1, 2)
    if not return_lse:
        return out
    lse = torch.logsumexp(filled, dim=-1, keepdim=True).masked_fill(~has_key, float("-inf")).squeeze(-1)
    return out, lse


def attention_grads(q, k, v, dout, causal: bool, scale: float, dtype, dlse=None, *, window=None,
                    softcap: Optional[float] = None, chunk_bytes: int = _CHUNK_BYTES) -> list:
    """[dQ, dK, dV] as fp32 of `plain_attention` in `dtype` by autograd (with `dlse`: the gradient
    reaching the returned LSE too), a chunk of query rows at a time: a row's output and LSE depend on
    its own query alone, so dQ's rows are their chunk's and dK, dV the chunks' sums (added in fp32, or
    `dtype` where wider). At most `chunk_bytes` of fp32 scores a chunk, so a long problem's reference
    fits beside its kernel (a whole (B, H, Sq, Sk) autograd graph took over 80 GB at B2 S16384 H8)."""
    import torch

    seqlen_q = q.shape[1]
    rows = _rows_per_chunk(q, k, chunk_bytes)
    wide = torch.promote_types(dtype, torch.float32)
    dq = torch.zeros(q.shape, dtype=wide, device=q.device)
    dk, dv = (torch.zeros(t.shape, dtype=wide, device=t.device) for t in (k, v))
    keys, values = (t.detach().to(dtype).requires_grad_() for t in (k, v))
    for start in range(0, seqlen_q, rows):
        stop = min(seqlen_q, start + rows)
        queries = q[:, start:stop].detach().to(dtype).requires_grad_()
        out, lse = plain_attention(queries, keys, values, causal, scale, dtype, return_lse=True, window=window,
                                   softcap=softcap, first_row=start, seqlen_q=seqlen_q)
        loss = (out * dout[:, start:stop].to(dtype)).sum()
        if dlse is not None:
            loss = loss + (lse.masked_fill(~lse.isfinite(), 0.0) * dlse[:, :, start:stop].to(dtype)).sum()
        grad_q, grad_k, grad_v = torch.autograd.grad(loss, (queries, keys, values))
        dq[:, start:stop] = grad_q
        dk += grad_k
        dv += grad_v
    return [t.float() for t in (dq, dk, dv)]


def check_grads(grads, q, k, v, dout, causal: bool, scale: Optional[float] = None, dlse=None,
                atol: float = GRAD_ATOL, *, window=None, softcap: Optional[float] = None) -> list[str]:
    """flash-attn's rule for gradients: each of dQ, dK, dV within 2x the error of the same math in the
    inputs' precision (PyTorch, `plain_attention`) plus `atol`, both against fp32; [] when they pass."""
    references = grad_references(q, k, v, dout, causal, scale, dlse, window=window, softcap=softcap)
    return compare_grads(grads, references, q.dtype, atol)[0]


def grad_references(q, k, v, dout, causal: bool, scale: Optional[float] = None, dlse=None, *,
                    window=None, softcap: Optional[float] = None) -> tuple:
    """(fp32 gradients, the inputs' precision's gradients) that `compare_grads` judges against: computed
    once where many gradients of the same inputs are judged (a backward search)."""
    import torch

    scale = softmax_scale(q.shape[-1]) if scale is None else scale
    mask = {"window": window, "softcap": softcap}
    return (attention_grads(q, k, v, dout, causal, scale, torch.float32, dlse, **mask),
            attention_grads(q, k, v, dout, causal, scale, q.dtype, dlse, **mask))


def compare_grads(grads, references, dtype, atol: float = GRAD_ATOL) -> tuple[list[str], dict]:
    """(failures, {"dQ", "dK", "dV": max |error| against fp32}) by `check_grads`' rule."""
    reference, low_precision = references
    failures, errors = [], {}
    for name, got, ref, low in zip(("dQ", "dK", "dV"), grads, reference, low_precision):
        if got.shape != ref.shape or got.dtype != dtype:
            failures.append(f"{name}: {got.dtype} {tuple(got.shape)}, expected {dtype} {tuple(ref.shape)}")
            continue
        err, low_err = (got.float() - ref).abs().max().item(), (low - ref).abs().max().item()
        errors[name] = err
        if not err <= 2 * low_err + atol:
            failures.append(f"{name}: error {err:.3g} > 2 x {low_err:.3g} + {atol}")
    return failures, errors
