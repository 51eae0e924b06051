"""Variable-length batches: `fa4.attention_varlen`, in flash-attn's packed layout and semantics.

    out = fa4.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=True)

q (total_q, Hq, D), k and v (total_k, Hkv, D): the batch's sequences one after another; sequence b is
rows cu_seqlens_q[b]:cu_seqlens_q[b+1] of q and cu_seqlens_k[b]:cu_seqlens_k[b+1] of k and v (int32
offsets, batch + 1 of them, starting at 0). Each sequence is its own attention problem: causal masks
are bottom-right aligned per sequence, GQA as in `fa4.attention`, a sequence may be empty, and a query
row that sees no key (its sequence has no keys, or a causal sequence with more queries than keys) gets
O = 0 and LSE = -inf; so do rows after the last sequence. LSE is (Hq, total_q) fp32, flash-attn's
varlen layout. `window_size` and `softcap` as in `fa4.attention` (flash-attn's conventions), per
sequence.

Implementations (`backend=`):
- "ours": our sm90 kernel compiled for varlen (one launch for the whole batch: per tile the sequence's
  offsets are read from cu_seqlens on the GPU; docs/design.md, section 3). H100/H200, fp16/bf16, head
  dims 64, 96, 128, 192 (also with v at 128) and 256; forward only (a call that needs gradients runs another implementation). Its
  configuration is the one `fa4tune search --varlen` recorded for the batch's bucket (max lengths,
  sequences x KV heads, total query tokens: `fa4.varlen_batch`), else the nearest tuned bucket's, else
  the heuristic default (`fa4.varlen_dispatch`).
- a peer's varlen kernel (`fa4.backends`: a peer with a `varlen` method; today "flash_attn_4", the
  `peer` extra; one launch for the whole batch).
- "per_sequence": `fa4.attention` on each sequence in turn (our tuned dense kernel per sequence, or its
  fallback): one launch per non-empty sequence, so it suits a few long sequences, not many short ones.
  It reads the offsets on the host (a device-to-host copy when they are on the GPU; inside a CUDA-graph
  capture the offsets must be CPU tensors).
- "auto" (the default): ours where the database measured it (or predicts it, from the nearest measured
  batches) at least as fast as the first peer whose kernel runs here (inside a capture with the offsets
  on the GPU, that peer's kernel plus its pass over O, below), else that peer, else ours, else
  per_sequence (`fa4.varlen_dispatch`). `fa4.explain_varlen` says which runs, in which configuration,
  and why, computing and running nothing.

The offsets are checked on every call outside a capture (one copy of batch + 1 integers): a wrong
offset or a max_seqlen below a sequence's length raises instead of reading out of bounds. Inside a
capture, offsets on the GPU cannot be read; the kernels then run them unchecked.
"""

from __future__ import annotations

from typing import Optional

import torch

from fa4 import backends
from fa4.checks import InvalidInputError, UnsupportedInputError
from fa4.kernels.problem import UNBOUNDED, AttentionProblem, resolve_mask, softcap_value, window_pair
from fa4.reference import attention_fp32, softmax_scale as default_scale

OURS = "ours"
PER_SEQUENCE = "per_sequence"


def varlen_peers() -> tuple:
    """The registered peers with a varlen kernel (a `varlen` method), in registry order."""
    return tuple(peer for peer in backends.peers() if hasattr(peer, "varlen"))


def implementations() -> tuple[str, ...]:
    return (OURS,) + tuple(peer.name for peer in varlen_peers()) + (PER_SEQUENCE,)


def unsupported(name: str, q: torch.Tensor, k: Optional[torch.Tensor] = None,
                v: Optional[torch.Tensor] = None) -> Optional[str]:
    """Why implementation `name` cannot take these inputs (None: it can)."""
    if name == OURS:
        return ours_unsupported(q, k, v)
    peer = next((p for p in varlen_peers() if p.name == name), None)
    return None if peer is None else peer.varlen_unsupported(q)


def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool = False,
                     softmax_scale: Optional[float] = None, return_lse: bool = False, backend: str = "auto",
                     fallback: str = "error", *, window_size: Optional[tuple] = None,
                     softcap: Optional[float] = None):
    """O (total_q, Hq, D), and LSE (Hq, total_q) fp32 if `return_lse` (module docstring). `fallback`
    is passed to each per-sequence `fa4.attention` call ("sdpa": PyTorch SDPA where our kernels cannot
    run, e.g. on a CPU)."""
    _check_tensors(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    try:
        window_size = None if window_size is None else window_pair(window_size)
        softcap = None if softcap is None or (not isinstance(softcap, bool) and softcap == 0) else softcap_value(softcap)
    except ValueError as exc:
        raise InvalidInputError(f"fa4.attention_varlen: {exc}") from None
    capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
    offsets = None
    if not (capturing and cu_seqlens_q.is_cuda):
        offsets = _checked_offsets(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k)
    problem = varlen_problem(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k, causal, return_lse, window_size, softcap)
    # offsets is None: inside a capture with the offsets on the GPU, where rows are cleared on the device
    choice = _decide(q, k, v, problem, backend, empty=problem is None, captured=offsets is None)
    implementation = choice.implementation
    if implementation == OURS:
        return _ours(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, return_lse,
                     offsets, problem, choice.config)
    if implementation != PER_SEQUENCE:
        return _peer(implementation, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                     softmax_scale, return_lse, window_size, softcap, offsets)
    if offsets is None:
        raise UnsupportedInputError("fa4.attention_varlen (per_sequence) reads the offsets on the host, which "
                                    "cannot happen during a CUDA-graph capture: pass cu_seqlens_q and "
                                    "cu_seqlens_k as CPU tensors there")
    return _per_sequence(q, k, v, offsets, causal, softmax_scale, return_lse, fallback, window_size, softcap)


def choose(q: torch.Tensor, backend: str = "auto", k: Optional[torch.Tensor] = None,
           v: Optional[torch.Tensor] = None, *, problem: Optional[AttentionProblem] = None) -> str:
    """The implementation a call with `backend` runs (module docstring, `fa4.varlen_dispatch.decide`);
    `k` and `v` (when given) say whether gradients are needed, which ours does not give; `problem`
    (`varlen_problem` of the call) lets "auto" read the database, without it nothing is read."""
    return _decide(q, k, v, problem, backend, empty=False).implementation


def explain_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                   cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool = False,
                   softmax_scale: Optional[float] = None, return_lse: bool = False, backend: str = "auto", *,
                   window_size: Optional[tuple] = None, softcap: Optional[float] = None,
                   captured: bool = False):
    """Which implementation `attention_varlen` runs on these inputs, our kernel's configuration and why
    (the database entry, the times measured there, or the neighbours a prediction used): a
    `fa4.varlen_dispatch.VarlenChoice`, whose `str()` is a short report. Computes and launches nothing,
    and reads no offsets (the total query tokens are q's rows); bad inputs raise as `attention_varlen`
    raises. `captured`: the choice inside a CUDA-graph capture with the offsets on the GPU (where a
    peer's path adds a pass over O: `fa4.varlen_dispatch`)."""
    _check_tensors(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    try:
        window_size = None if window_size is None else window_pair(window_size)
        softcap = None if softcap is None or (not isinstance(softcap, bool) and softcap == 0) else softcap_value(softcap)
    except ValueError as exc:
        raise InvalidInputError(f"fa4.attention_varlen: {exc}") from None
    problem = varlen_problem(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k, causal, return_lse, window_size, softcap)
    return _decide(q, k, v, problem, backend, empty=problem is None, captured=captured)


def _decide(q, k, v, problem, backend, empty: bool, captured: bool = False):
    from fa4.varlen_dispatch import decide

    return decide(q, k, v, problem, backend, empty=empty, captured=captured)


def ours_unsupported(q: torch.Tensor, k: Optional[torch.Tensor] = None,
                     v: Optional[torch.Tensor] = None) -> Optional[str]:
    """Why our varlen kernel cannot take these inputs (None: it can): an sm90 GPU, fp16/bf16, a head
    dim its varlen path has (`VARLEN_HEAD_DIMS`), no gradient needed (it has no backward)."""
    from fa4.arch import arch_of_capability
    from fa4.kernels.sm90.feasibility import VARLEN_HEAD_DIMS

    if q.device.type != "cuda":
        return f"the tensors are on {q.device.type}; our kernel runs on CUDA GPUs"
    capability = torch.cuda.get_device_capability(q.device)
    if arch_of_capability(capability) != "sm90":
        return (f"our varlen kernel is the sm90 family's (H100/H200), not compute capability "
                f"{capability[0]}.{capability[1]}'s")
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"our kernel takes fp16 or bf16, not {q.dtype}"
    if q.shape[-1] not in VARLEN_HEAD_DIMS:
        return (f"head dim {q.shape[-1]}: our varlen kernel takes "
                f"{', '.join(str(d) for d in VARLEN_HEAD_DIMS)}")
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v)):
        return "our varlen kernel has no backward (gradients are needed here)"
    return None


def reference_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal: bool, scale: Optional[float] = None, *,
                     window_size=None, softcap: Optional[float] = None):
    """(O, LSE) in fp32, sequence by sequence with `fa4.reference.attention_fp32`; rows outside every
    sequence get O = 0 and LSE = -inf."""
    scale = default_scale(q.shape[-1]) if scale is None else scale
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), -torch.inf, dtype=torch.float32, device=q.device)
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(starts_q) - 1):
        q0, q1, k0, k1 = starts_q[b], starts_q[b + 1], starts_k[b], starts_k[b + 1]
        if q1 == q0:
            continue
        causal_b, window_b, softcap_b = resolve_mask(causal, window_size, softcap, q1 - q0, k1 - k0)
        o, l = attention_fp32(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], causal_b, scale, window=window_b,
                              softcap=softcap_b)
        out[q0:q1], lse[:, q0:q1] = o[0], l[0]
    return out, lse


def expected_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal: bool, scale: Optional[float] = None, *,
                    window_size=None, softcap: Optional[float] = None):
    """The answers a packed output is held to by the one rule (`fa4.reference.compare`), the packed
    tensors seen as batch 1: the fp32 reference (`reference_varlen`), the same-precision answer
    (`fa4.reference.sdpa_same_precision`) per sequence, and the rows that see a key. Compare an output
    with `compare(out[None], lse[None], expected)`."""
    from fa4.reference import Expected, sdpa_same_precision

    out, lse = reference_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, window_size=window_size,
                                softcap=softcap)
    same_precision = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(starts_q) - 1):
        q0, q1, k0, k1 = starts_q[b], starts_q[b + 1], starts_k[b], starts_k[b + 1]
        if q1 == q0 or k1 == k0:
            continue
        causal_b, window_b, softcap_b = resolve_mask(causal, window_size, softcap, q1 - q0, k1 - k0)
        same_precision[q0:q1] = sdpa_same_precision(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], causal_b,
                                                    scale, window=window_b, softcap=softcap_b)[0].float()
    right = None if window_size is None or causal else window_pair(window_size)[1]
    hidden = rows_without_keys(cu_seqlens_q.to(q.device), cu_seqlens_k.to(q.device), q.shape[0], causal,
                               None if right is None or right == UNBOUNDED else right)
    return Expected(out[None], lse[None], same_precision[None], ~hidden)


def _check_tensors(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> None:
    reasons = []
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            reasons.append(f"{name} must be a 3-d tensor (total tokens, heads, head dim), got "
                           f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if reasons:
        raise InvalidInputError("fa4.attention_varlen: " + "; ".join(reasons))
    if k.shape != v.shape:
        reasons.append(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if q.shape[-1] != k.shape[-1]:
        reasons.append(f"q's head dim {q.shape[-1]} differs from k's {k.shape[-1]}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        reasons.append(f"the query heads ({q.shape[1]}) must be a multiple of the key/value heads ({k.shape[1]})")
    if len({q.dtype, k.dtype, v.dtype}) != 1 or len({q.device, k.device, v.device}) != 1:
        reasons.append("q, k and v must share one dtype and one device")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.dtype != torch.int32 or cu.numel() < 1:
            reasons.append(f"{name} must be a 1-d int32 tensor of batch + 1 offsets")
        elif cu.device.type not in ("cpu", q.device.type) or (cu.is_cuda and cu.device != q.device):
            reasons.append(f"{name} is on {cu.device}; it must be on q's device ({q.device}) or the CPU")
    if not reasons and cu_seqlens_q.numel() != cu_seqlens_k.numel():
        reasons.append(f"cu_seqlens_q has {cu_seqlens_q.numel()} offsets and cu_seqlens_k "
                       f"{cu_seqlens_k.numel()}: one batch, one count (batch + 1)")
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            reasons.append(f"{name} must be a non-negative int, got {value!r}")
    if reasons:
        raise InvalidInputError("fa4.attention_varlen: " + "; ".join(reasons))


def _checked_offsets(cu_seqlens_q, cu_seqlens_k, total_q: int, total_k: int, max_seqlen_q: int,
                     max_seqlen_k: int) -> tuple[list[int], list[int]]:
    """The offsets as host lists, after checking them against the tensors and the max lengths."""
    both = torch.stack([cu_seqlens_q.to("cpu", non_blocking=False), cu_seqlens_k.to("cpu")]).tolist()
    reasons = []
    for name, starts, total, longest in (("cu_seqlens_q", both[0], total_q, max_seqlen_q),
                                         ("cu_seqlens_k", both[1], total_k, max_seqlen_k)):
        lengths = [b - a for a, b in zip(starts, starts[1:])]
        if starts[0] != 0:
            reasons.append(f"{name} must start at 0, got {starts[0]}")
        elif any(n < 0 for n in lengths):
            reasons.append(f"{name} must not decrease (sequence {next(i for i, n in enumerate(lengths) if n < 0)})")
        elif starts[-1] > total:
            reasons.append(f"{name} ends at {starts[-1]}, past the {total} tokens given")
        elif lengths and max(lengths) > longest:
            reasons.append(f"a sequence is {max(lengths)} tokens long, more than "
                           f"max_seqlen_{name[-1]}={longest}")
    if reasons:
        raise InvalidInputError("fa4.attention_varlen: " + "; ".join(reasons))
    return both[0], both[1]


def _per_sequence(q, k, v, offsets, causal, softmax_scale, return_lse, fallback, window_size, softcap):
    import fa4

    starts_q, starts_k = offsets
    outs, lses = [], []
    for b in range(len(starts_q) - 1):
        q0, q1, k0, k1 = starts_q[b], starts_q[b + 1], starts_k[b], starts_k[b + 1]
        if q1 == q0:
            continue
        if k1 == k0:  # no keys: every row sees none
            outs.append(q.new_zeros((q1 - q0,) + tuple(q.shape[1:])))
            lses.append(torch.full((q.shape[1], q1 - q0), -torch.inf, dtype=torch.float32, device=q.device))
            continue
        result = fa4.attention(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], causal=causal,
                               softmax_scale=softmax_scale, return_lse=return_lse, fallback=fallback,
                               window_size=window_size, softcap=softcap)
        out, lse = result if return_lse else (result, None)
        outs.append(out[0])
        if return_lse:
            lses.append(lse[0])
    tail = q.shape[0] - starts_q[-1]   # rows after the last sequence
    if tail:
        outs.append(q.new_zeros((tail,) + tuple(q.shape[1:])))
        lses.append(torch.full((q.shape[1], tail), -torch.inf, dtype=torch.float32, device=q.device))
    out = torch.cat(outs) if outs else q.new_zeros(q.shape)
    if not return_lse:
        return out
    lse = torch.cat(lses, dim=1) if lses else torch.empty((q.shape[1], 0), dtype=torch.float32, device=q.device)
    return out, lse


def varlen_problem(q, k, cu_seqlens_q, max_seqlen_q: int, max_seqlen_k: int, causal: bool, return_lse: bool,
                   window_size, softcap) -> Optional[AttentionProblem]:
    """The `AttentionProblem` our kernel compiles a call for: the batch's sequences at the max lengths,
    the mask resolved against them (a side resolved away reaches past every key of the longest
    sequences, so of every sequence), or None when no sequence has a query and a key (nothing to run)."""
    batch = cu_seqlens_q.numel() - 1
    if batch == 0 or max_seqlen_q == 0 or max_seqlen_k == 0:
        return None
    causal, window, softcap = resolve_mask(causal, window_size, softcap, max_seqlen_q, max_seqlen_k)
    return AttentionProblem(batch=batch, seqlen_q=max_seqlen_q, seqlen_k=max_seqlen_k, heads_q=q.shape[1],
                            heads_kv=k.shape[1], head_dim=q.shape[-1],
                            dtype="fp16" if q.dtype == torch.float16 else "bf16", causal=causal,
                            return_lse=return_lse, window=window, softcap=softcap, varlen=True)


def _ours(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, return_lse, offsets,
          problem, config):
    """Our varlen kernel in `config` (`fa4.varlen_dispatch`: tuned, else the default) on `problem`
    (`varlen_problem`; None: nothing to launch)."""
    from fa4 import kernels
    from fa4.kernels.compiling import mask_values
    from fa4.runtime import compiled_kernel
    from fa4.state import device_description

    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device) if return_lse else None
    if problem is None:   # no sequence has both a query and a key: every row sees none
        out.zero_()
        return (out, lse.fill_(-torch.inf)) if return_lse else out
    device = device_description(q.device)
    reasons = kernels.feasible(config, problem, device)
    if reasons:
        raise UnsupportedInputError(f"fa4.attention_varlen (ours): {config.label()} cannot run "
                                    f"{problem.label()}: {'; '.join(reasons)}")
    kernel = compiled_kernel(config, problem, device)
    cu_q, cu_k = (cu.to(q.device) for cu in (cu_seqlens_q, cu_seqlens_k))
    q, k, v = (_tma_ready(t) for t in (q, k, v))
    # the rows after the last sequence belong to no sequence: a slice clears them where the offsets are
    # on the host; inside a capture the kernel does, where it can take them as one more sequence
    tail_as_sequence = offsets is None and tail_fits_a_sequence(config, q, cu_q.numel() - 1)
    if tail_as_sequence:
        cu_q, cu_k, max_seqlen_q = *tail_sequence(cu_q, cu_k, q.shape[0]), max(max_seqlen_q, q.shape[0])
    kernel.run_varlen(q, k, v, out, lse, softmax_scale, mask_values(problem), cu_q, cu_k, max_seqlen_q,
                      max_seqlen_k)
    if offsets is not None:
        out[offsets[0][-1]:] = 0
        if return_lse:
            lse[:, offsets[0][-1]:] = -torch.inf
    elif not tail_as_sequence:   # device ops over every row (a pass over O)
        tail = torch.arange(q.shape[0], device=q.device) >= cu_q[-1]
        out.masked_fill_(tail[:, None, None], 0)
        if return_lse:
            lse.masked_fill_(tail[None, :], -torch.inf)
    return (out, lse) if return_lse else out


def tail_sequence(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, total_q: int):
    """The offsets with the rows after the last sequence as one more sequence without keys (empty when
    there are none), for which our kernel writes O = 0 and LSE = -inf as for any such sequence. Device
    ops only: a capture can hold them."""
    return (torch.cat([cu_seqlens_q, cu_seqlens_q.new_full((1,), total_q)]),
            torch.cat([cu_seqlens_k, cu_seqlens_k[-1:]]))


def tail_fits_a_sequence(config, q: torch.Tensor, batch: int) -> bool:
    """Whether the launch can take the tail as a sequence: with one CTA per task (its grid is the
    sequences' own tasks, `kernels/sm90/scheduler.py`), not a persistent loop over every sequence's
    max_seqlen_q blocks (which a tail as long as q would stretch), and with the tasks' index, (batch + 1)
    x heads x q's rows / tile_m, in 32 bits."""
    from fa4.kernels.sm90.scheduler import ONE_CTA_PER_TASK

    return (config.scheduler in ONE_CTA_PER_TASK
            and (batch + 1) * q.shape[1] * -(-q.shape[0] // config.tile_m) < 2**31)


def _tma_ready(t: torch.Tensor) -> torch.Tensor:
    """`t` as our kernel's TMA takes it (unit stride in the head dim, the others multiples of 8
    elements): a copy only when it is not."""
    if t.stride(-1) == 1 and all(s % 8 == 0 for s in t.stride()[:-1]) and t.data_ptr() % 16 == 0:
        return t
    return t.contiguous()


def _peer(name, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, return_lse,
          window_size, softcap, offsets=None):
    device_offsets = [cu.to(q.device) for cu in (cu_seqlens_q, cu_seqlens_k)]
    out, lse = backends.get(name).varlen(q, k, v, *device_offsets, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                                         return_lse, window_size, softcap)
    # its rows without keys, and the rows after the last sequence, hold whatever it left there: ours
    # are O = 0 and LSE = -inf
    right = 0 if causal else (None if window_size is None or window_size[1] == UNBOUNDED else window_size[1])
    if offsets is not None:
        # the offsets are on the host: only the rows that see no key are written (none, mostly), not a
        # pass over all of O (about 1.3 us per MB of O on an H100)
        rows = hidden_rows(*offsets, q.shape[0], causal, right)
        if rows.numel() == 0:
            return (out, lse) if return_lse else out
        rows = rows.to(q.device)
        # the peer's autograd keeps its output for the backward (flash-attn-4's does): under a gradient the
        # rows are filled in a copy, else in place (under no_grad its output requires none)
        fill = torch.Tensor.index_fill if out.requires_grad else torch.Tensor.index_fill_
        out = fill(out, 0, rows, 0.0)
        return (out, fill(lse, 1, rows, -torch.inf)) if return_lse else out
    # inside a CUDA-graph capture: device ops only, over every row
    hidden = rows_without_keys(device_offsets[0], device_offsets[1], q.shape[0], causal, right)
    out = torch.where(hidden[:, None, None], 0.0, out)
    if not return_lse:
        return out
    return out, torch.where(hidden[None, :], -torch.inf, lse)


def hidden_rows(starts_q: list[int], starts_k: list[int], total_q: int, causal: bool,
                right: Optional[int] = None) -> torch.Tensor:
    """The rows `rows_without_keys` marks, as a CPU int64 tensor of row indices, from host offsets:
    each sequence without keys whole, with a right bound r (causal: 0) the first Sq - Sk - r rows of a
    sequence, and the rows after the last sequence."""
    right = 0 if causal else right
    pieces = []
    for b in range(len(starts_q) - 1):
        start, length_q, length_k = starts_q[b], starts_q[b + 1] - starts_q[b], starts_k[b + 1] - starts_k[b]
        count = length_q if length_k == 0 else (0 if right is None else min(length_q, max(length_q - length_k - right, 0)))
        if count:
            pieces.append(torch.arange(start, start + count))
    if starts_q[-1] < total_q:
        pieces.append(torch.arange(starts_q[-1], total_q))
    return torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.int64)


def rows_without_keys(cu_seqlens_q, cu_seqlens_k, total_q: int, causal: bool,
                      right: Optional[int] = None) -> torch.Tensor:
    """(total_q,) bool on the offsets' device: the query rows that see no key (their sequence has no
    keys; with a right bound r (causal: 0), the first Sq - Sk - r rows of a sequence, whose window ends
    left of key 0; rows after the last sequence). A left bound never empties a row. No host sync."""
    batch = cu_seqlens_q.numel() - 1
    rows = torch.arange(total_q, device=cu_seqlens_q.device, dtype=torch.int32)
    if batch == 0:
        return torch.ones(total_q, dtype=torch.bool, device=cu_seqlens_q.device)
    sequence = torch.searchsorted(cu_seqlens_q, rows, right=True) - 1   # the last sequence starting at or before
    outside = sequence >= batch
    sequence = sequence.clamp(max=batch - 1)
    length_q = cu_seqlens_q[sequence + 1] - cu_seqlens_q[sequence]
    length_k = cu_seqlens_k[sequence + 1] - cu_seqlens_k[sequence]
    hidden = outside | (length_k == 0)
    right = 0 if causal else right
    if right is not None:
        hidden |= (rows - cu_seqlens_q[sequence]) < (length_q - length_k - right)
    return hidden
