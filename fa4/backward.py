"""The attention backward: dQ, dK, dV from the forward's saved O and LSE, by the implementation that can run.

`fa4.attention` with inputs that require grad runs its forward through the custom op `fa4::attention`
(its LSE always computed and saved with O) and the op's registered backward (`fa4.ops`) calls
`attention_backward`, which picks an implementation (`choose`):

- a peer's backward (`fa4.backends`: a peer with a `backward` method; today flash-attn's CuTe kernels,
  the `peer` extra, on the GPUs, dtypes and head dims it takes). It reads the same saved tensors our
  forward writes (O, and LSE in natural log, (B, Hq, Sq) fp32), so it follows any forward
  implementation (ours, a peer's, SDPA's).
- "blockwise": this module's PyTorch backward (any device, CPU included): query blocks of all heads
  at once, the keys each block sees, fp32 throughout, no O(S^2) buffer (a block's scores take at
  most `BLOCK_BYTES`). Slower than a kernel; the backward that always runs.
- "ours": our sm90 backward kernels (`fa4.kernels.sm90_bwd`: preprocess, main, postprocess; the
  tile algorithm of `fa4.kernels.backward_emulation`), in the configuration `fa4tune search --backward`
  recorded for the shape (`tuned`: the database's entry of the knob set "sm90_bwd", exact bucket, else
  the nearest within the forward's distance rule, `fa4.database.BestConfigDB.lookup`), else
  `sm90_bwd.default_config`. Untuned, they took 0.90-1.20x flash-attn-4's backward time on seven
  training shapes on the H200 (docs/backward.md), so "auto" picks them over a peer's backward only where that entry
  measured ours faster than the peer (its `backend_us`, timed in one search run), else only where no
  peer's backward runs, ahead of the blockwise one. `FA4_BACKWARD=<name>` forces any name of
  `implementations()`. A gradient through a returned LSE enters every implementation through D.

`deterministic=True` (`fa4.attention(..., deterministic=True)`): gradients equal bit for bit on every
run of the same inputs. Ours adds each sum in a fixed order then (`sm90_bwd`'s module docstring) in
its tuned configuration; where ours cannot run, the blockwise one (PyTorch's products, a fixed
loop). A peer's backward is not taken (its sums' order is not ours to fix); naming one anyway
(`FA4_BACKWARD`) warns once and runs ours or the blockwise one.

The math (P recomputed from the LSE; GQA keys shared by the query heads of a group; bottom-right
causal masks and sliding windows; a row that sees no key has LSE -inf and gets zero gradients):
    D = rowsum(dO * O) - dLSE           (dLSE: the gradient of a returned LSE, else 0)
    P = exp(scale * Q K^T - LSE),  dV = P^T dO,  dP = dO V^T,  dS = P * (dP - D)
    dQ = scale * dS K,  dK = scale * dS^T Q       (dK, dV summed over the query heads of a group)
With a softcap c the score is c * tanh(scale * Q K^T / c) = c * T, P = exp(c * T - LSE), and dS is
multiplied by the derivative of the cap, (1 - T^2).
"""

from __future__ import annotations

from typing import Optional

import torch

from fa4 import backends
from fa4.state import warn_once

BLOCKWISE = "blockwise"
OURS = backends.OURS
ENV_VAR = "FA4_BACKWARD"   # auto (default) or an implementation's name
# scores of one query block (fp32; three such tensors live at once: P, dP, dS)
BLOCK_BYTES = 256 * 2**20


def peers_with_backward() -> tuple:
    """The registered peers (`fa4.backends`) whose backward reads our saved tensors, in registry order."""
    return tuple(peer for peer in backends.peers() if hasattr(peer, "backward"))


def implementations() -> tuple[str, ...]:
    return (OURS,) + tuple(peer.name for peer in peers_with_backward()) + (BLOCKWISE,)


def ours_unsupported(q: torch.Tensor, window=None, softcap: Optional[float] = None) -> Optional[str]:
    """Why our backward kernels cannot take a gradient of these inputs' kind (None: they can; a value
    head dim of its own is `_ours_unsupported_with_v`'s)."""
    if window is not None or softcap is not None:
        return "our backward kernels have no sliding window or softcap"
    if q.device.type != "cuda":
        return f"our backward kernels run on CUDA GPUs, not {q.device.type}"
    major, minor = torch.cuda.get_device_capability(q.device)
    if major != 9:
        return f"our backward kernels are sm90's; this GPU is compute capability {major}.{minor}"
    from fa4.kernels import sm90_bwd

    if q.dtype not in (torch.float16, torch.bfloat16) or q.shape[-1] not in sm90_bwd.SUPPORTED_HEAD_DIMS:
        return f"our backward kernels take fp16/bf16 at head dims {sm90_bwd.SUPPORTED_HEAD_DIMS}"
    return None


def _value_dim_differs(q: torch.Tensor, v: Optional[torch.Tensor]) -> bool:
    return v is not None and v.shape[-1] != q.shape[-1]


def _one_head_dim(who: str, q: torch.Tensor, v: torch.Tensor) -> str:
    return f"{who}: q, k and v must share one head dim (v's is {v.shape[-1]}, q's {q.shape[-1]})"


def _ours_unsupported_with_v(q: torch.Tensor, window, softcap, v: Optional[torch.Tensor]) -> Optional[str]:
    """`ours_unsupported`, and our kernels' one head dim for q, k and v (the sm90 backward's)."""
    return _one_head_dim("our backward kernels", q, v) if _value_dim_differs(q, v) else ours_unsupported(q, window, softcap)


def choose(q: torch.Tensor, window=None, softcap: Optional[float] = None, *, k: Optional[torch.Tensor] = None,
           causal: Optional[bool] = None, v: Optional[torch.Tensor] = None,
           deterministic: bool = False) -> tuple[str, str]:
    """(implementation, why) for a backward of these inputs' kind: the one `FA4_BACKWARD` names, else
    ours where a tuned entry measured it faster than the first peer's backward that can take it, else
    that peer's, else ours, else the blockwise one. Without `k` and `causal` no entry is read. Where
    ours is chosen, the why names its configuration and where it came from (`tuned`).
    `deterministic`: the module docstring's choice (`_deterministic_choice`)."""
    if deterministic:
        return _deterministic_choice(q, "auto", window, softcap, v)[:2]
    forced = _forced()
    if forced is not None:
        why = f"${ENV_VAR}={forced}"
        if forced == OURS and k is not None and causal is not None and _ours_unsupported_with_v(q, window, softcap, v) is None:
            why += "; " + describe_config(*tuned(q, k, causal))
        return forced, why
    return _automatic(q, window=window, softcap=softcap, k=k, causal=causal, v=v)


def problem_of(q: torch.Tensor, k: torch.Tensor, causal: bool):
    """The `AttentionProblem` of a backward's inputs (B, S, H, D) (fp16/bf16; what our kernels take)."""
    from fa4.kernels import AttentionProblem

    dtype = {torch.float16: "fp16", torch.bfloat16: "bf16"}[q.dtype]
    return AttentionProblem(batch=q.shape[0], seqlen_q=q.shape[1], seqlen_k=k.shape[1], heads_q=q.shape[2],
                            heads_kv=k.shape[2], head_dim=q.shape[-1], dtype=dtype, causal=causal)


def _device_name(q: torch.Tensor) -> str:
    return torch.cuda.get_device_name(q.device)


# tuned(...) per (device, problem) of the database object in use (`fa4.state.database`; another
# object, after `fa4.use_config_db`, starts afresh): a lookup walks the entries, a backward runs per step
_TUNED: dict = {"db": None, "found": {}}


def tuned(q: torch.Tensor, k: torch.Tensor, causal: bool):
    """(config, source, entry) of our backward for these inputs (we can run them: `ours_unsupported`):
    the database's entry of the knob set "sm90_bwd" for this device and shape ("exact" or "nearest"
    within the forward's distance rule, current by the backward's kernel fingerprint, feasible here),
    else the default (`sm90_bwd.default_config`; source "default", entry None)."""
    from fa4 import kernels, planning, state
    from fa4.kernels import Config, backward_kernel

    knob_set = kernels.backward_knob_set("sm90")   # ours runs on sm90 only (`ours_unsupported`)
    problem = problem_of(q, k, causal)
    device_name = _device_name(q)
    db = state.database()
    if _TUNED["db"] is not db:
        _TUNED.update(db=db, found={})
    key = (device_name, problem)
    if key in _TUNED["found"]:
        return _TUNED["found"][key]
    found = None
    if db is not None:
        try:
            found = db.lookup(knob_set, device_name, problem, state.fingerprint(knob_set),
                              max_distance=planning._max_distance(), broken=state.STATE.db_broken)
        except Exception as exc:  # a malformed entry must not break a training step
            warn_once("bwd-db-lookup", f"fa4: backward database lookup failed ({type(exc).__name__}: {exc}); "
                                       "our backward runs its default configuration")
    device = state.device_description(q.device) if q.is_cuda else None   # None: the H200
    result = (backward_kernel(knob_set).default_config(problem, device), "default", None)
    if found is not None and found.entry is not None and found.kind in ("exact", "nearest"):
        try:
            config = Config.from_dict(knob_set, found.entry.config)
            why_not = kernels.feasible(config, problem, device)
        except (ValueError, KeyError, TypeError) as exc:   # knobs renamed since the tuning
            why_not = [str(exc)]
        if not why_not:
            result = (config, found.kind, found.entry)
    _TUNED["found"][key] = result
    return result


def describe_config(config, source: str, entry) -> str:
    """The configuration ours runs and why, for `fa4.explain`'s backward line."""
    if entry is None:
        return f"configuration {config.label()}: the default (no tuned backward entry for this shape)"
    return f"configuration {config.label()}: tuned, {source} entry {entry.key}, {entry.us:g} us"


def _measured_faster(entry, peer) -> Optional[str]:
    """Why ours runs instead of `peer` (the entry's search timed ours faster), or None."""
    if entry is None:
        return None
    ours_us = entry.backend_us.get(OURS, entry.us)
    peer_us = entry.backend_us.get(peer.name)
    if peer_us is None or not ours_us < peer_us:
        return None
    return f"measured faster than {peer.title}'s backward there, {ours_us:g} us against {peer_us:g} us"


def _forced() -> Optional[str]:
    """The implementation `FA4_BACKWARD` names (None: auto)."""
    import os

    forced = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if forced == "auto":
        return None
    if forced not in implementations():
        raise ValueError(f"${ENV_VAR}={forced!r} names no backward; known: auto, {', '.join(implementations())}")
    return forced


def _automatic(q: torch.Tensor, with_ours: bool = True, window=None, softcap: Optional[float] = None, *,
               k: Optional[torch.Tensor] = None, causal: Optional[bool] = None,
               v: Optional[torch.Tensor] = None) -> tuple[str, str]:
    """`auto`'s choice: ours where its tuned entry measured it faster than the first peer's backward
    that can take these inputs, else that peer's, else ours (unless `with_ours` is False: ours was
    tried and refused), else the blockwise one. A value head dim of its own (v's != q's) only the
    blockwise one takes: the peers' adapters pass one head dim."""
    ours_why_not = _ours_unsupported_with_v(q, window, softcap, v) if with_ours else "ours refused these inputs"
    ours = tuned(q, k, causal) if ours_why_not is None and k is not None and causal is not None else None
    why_not = []
    for peer in peers_with_backward():
        reason = (_one_head_dim(f"{peer.title}'s backward adapter", q, v) if _value_dim_differs(q, v)
                  else peer.backward_unsupported(q))
        if reason is None:
            faster = _measured_faster(ours[2], peer) if ours is not None else None
            if faster:
                return OURS, f"our sm90 backward kernels, {describe_config(*ours)}: {faster}"
            return peer.name, f"{peer.title}'s backward kernels (the fastest measured; ${ENV_VAR} picks another)"
        why_not.append(reason)
    reason = ours_why_not
    if reason is None:
        config = "; " + describe_config(*ours) if ours is not None else ""
        return OURS, "our sm90 backward kernels (" + ("; ".join(why_not) or "no peer backward is registered") + config + ")"
    why_not.append(reason)
    return BLOCKWISE, "; ".join(why_not) or "no peer backward is registered"


def attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float,
                       dlse: Optional[torch.Tensor] = None, implementation: str = "auto", *,
                       window=None, softcap: Optional[float] = None, deterministic: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dQ, dK, dV) in the inputs' dtypes and shapes (B, S, H, D); `window` (left, right) and
    `softcap` those of the forward (`fa4.kernels.AttentionProblem`); `deterministic`: the module
    docstring's."""
    forced = implementation != "auto" or _forced() is not None
    mask = {"window": window, "softcap": softcap}
    if deterministic:
        return _deterministic_backward(dout, q, k, v, out, lse, causal, scale, dlse, implementation, **mask)
    if implementation == "auto":
        implementation, _ = choose(q, **mask, k=k, causal=causal, v=v)
    if implementation == BLOCKWISE:
        return blockwise_backward(dout, q, k, v, out, lse, causal, scale, dlse, **mask)
    if implementation == OURS:
        why = _ours_unsupported_with_v(q, window, softcap, v)
        if why is None:
            return ours_backward(dout, q, k, v, out, lse, causal, scale, dlse)
        implementation, _ = _automatic(q, with_ours=False, v=v)
        if forced:  # auto's own pick of ours needs no warning when the next one takes over
            warn_once(f"bwd-ours:{why}", f"fa4: our backward kernels cannot take this gradient ({why}); "
                                     f"{implementation} runs instead")
        if implementation == BLOCKWISE:
            return blockwise_backward(dout, q, k, v, out, lse, causal, scale, dlse, **mask)
    peer = next((p for p in peers_with_backward() if p.name == implementation), None)
    if peer is None:
        raise ValueError(f"unknown backward implementation {implementation!r}; known: auto, "
                         f"{', '.join(implementations())}")
    if _value_dim_differs(q, v):   # forced: the peer's adapter would refuse or misread it
        why = _one_head_dim(f"{peer.title}'s backward adapter", q, v)
        warn_once(f"bwd-dv:{peer.name}", f"fa4: {why}; the blockwise PyTorch backward runs instead")
        return blockwise_backward(dout, q, k, v, out, lse, causal, scale, dlse, **mask)
    try:
        return peer.backward(dout, q, k, v, out, lse, causal, scale, dlse, **mask)
    except (ImportError, TypeError) as exc:  # its entry point moved: still correct, slower
        warn_once(f"bwd:{peer.name}:{type(exc).__name__}",
                  f"fa4: {peer.title}'s backward could not be called ({type(exc).__name__}: {exc}); "
                  f"the blockwise PyTorch backward runs instead")
        return blockwise_backward(dout, q, k, v, out, lse, causal, scale, dlse, **mask)


def _deterministic_choice(q, implementation: str, window, softcap, v) -> tuple[str, str, Optional[str]]:
    """(implementation, why, warning or None) under `deterministic=True`: ours where it can take the
    gradient, else the blockwise one; the blockwise one where named; a peer named (argument or
    environment) is not run, and the warning says so."""
    name = implementation if implementation != "auto" else (_forced() or "auto")
    ours_why_not = _ours_unsupported_with_v(q, window, softcap, v)
    if name == BLOCKWISE:
        return BLOCKWISE, "deterministic=True, the blockwise PyTorch backward named", None
    if ours_why_not is None:
        choice = (OURS, "deterministic=True: our sm90 backward kernels, each sum added in a fixed order")
    else:
        choice = (BLOCKWISE, f"deterministic=True: the blockwise PyTorch backward ({ours_why_not})")
    warning = None
    if name not in ("auto", OURS):
        warning = (f"fa4: deterministic=True: {name}'s backward does not add its sums in a fixed order; "
                   f"{'our backward kernels' if choice[0] == OURS else 'the blockwise PyTorch backward'} runs instead")
    elif name == OURS and ours_why_not is not None:
        warning = (f"fa4: our backward kernels cannot take this gradient ({ours_why_not}); the blockwise "
                   f"PyTorch backward runs instead")
    return choice + (warning,)


def _deterministic_backward(dout, q, k, v, out, lse, causal, scale, dlse, implementation, *, window, softcap):
    """The module docstring's `deterministic=True` (`_deterministic_choice`)."""
    name, _, warning = _deterministic_choice(q, implementation, window, softcap, v)
    if warning:
        warn_once(f"bwd-deterministic:{warning}", warning)
    if name == OURS:
        return ours_backward(dout, q, k, v, out, lse, causal, scale, dlse, deterministic=True)
    return blockwise_backward(dout, q, k, v, out, lse, causal, scale, dlse, window=window, softcap=softcap)


# compiled backward kernels by (device index, `sm90_bwd.compile_key`): one compile serves every batch,
# length and head count
_COMPILED: dict = {}


def ours_backward(dout, q, k, v, out, lse, causal, scale, dlse=None, deterministic: bool = False):
    """Our sm90 backward kernels on the saved tensors, in the configuration `tuned` picks (compiled on
    first use of a kind); `dlse`: the gradient of a returned LSE, or None; `deterministic`: each sum
    added in a fixed order."""
    from fa4.kernels import device_from_torch, sm90_bwd

    config, _, _ = tuned(q, k, causal)
    problem = problem_of(q, k, causal)
    key = (q.device.index, sm90_bwd.compile_key(config, problem, deterministic))
    compiled = _COMPILED.get(key)
    if compiled is None:
        with torch.cuda.device(q.device):
            compiled = _COMPILED[key] = sm90_bwd.compile_backward(config, problem,
                                                                  device_from_torch(q.device.index),
                                                                  deterministic=deterministic)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    compiled.run(q, k, v, out, dout.contiguous(), lse, dq, dk, dv, scale, dlse)
    return dq, dk, dv


def blockwise_backward(dout, q, k, v, out, lse, causal, scale, dlse=None, block_bytes: int = BLOCK_BYTES, *,
                       window=None, softcap: Optional[float] = None):
    """The module docstring's math in PyTorch, one block of query rows (all batches and heads) at a time."""
    from fa4.reference import key_bounds

    batch, seqlen_q, heads_q, head_dim = q.shape
    _, seqlen_k, heads_kv, _ = k.shape
    ratio = heads_q // heads_kv

    def grouped(t, heads):   # (B, S, H, D) -> (B, Hkv, ratio, S, D) fp32 (ratio 1 for K and V; V, O
        # and dO have the value head dim)
        return t.float().permute(0, 2, 1, 3).reshape(batch, heads_kv, heads // heads_kv, t.shape[1], t.shape[3])

    qf, dof = grouped(q, heads_q), grouped(dout, heads_q)
    kf, vf = grouped(k, heads_kv)[:, :, 0], grouped(v, heads_kv)[:, :, 0]   # (B, Hkv, Sk, D)
    delta = (dout.float() * out.float()).sum(-1).transpose(1, 2)             # (B, Hq, Sq)
    if dlse is not None:
        delta = delta - dlse.float()
    delta = delta.reshape(batch, heads_kv, ratio, seqlen_q)
    lse = lse.float().reshape(batch, heads_kv, ratio, seqlen_q)
    dq = torch.empty_like(qf)
    dk = torch.zeros_like(kf)
    dv = torch.zeros_like(vf)
    per_row = max(1, batch * heads_q * seqlen_k * 4 * 3)
    block = max(1, min(seqlen_q, block_bytes // per_row))
    offset = seqlen_k - seqlen_q   # query i's diagonal key is i + offset (bottom-right)
    left, right = key_bounds(causal, window)
    for i0 in range(0, seqlen_q, block):
        i1 = min(i0 + block, seqlen_q)
        # the keys some row of the block sees: [first, keys)
        keys = seqlen_k if right is None else min(seqlen_k, max(0, i1 + offset + right))
        first = 0 if left is None else min(keys, max(0, i0 + offset - left))
        if keys == first:   # no row of this block sees a key
            dq[:, :, :, i0:i1] = 0
            continue
        qi, doi = qf[:, :, :, i0:i1], dof[:, :, :, i0:i1]
        kj, vj = kf[:, :, first:keys], vf[:, :, first:keys]
        lse_i = lse[:, :, :, i0:i1, None]
        has_key = torch.isfinite(lse_i)
        scores = torch.einsum("bgrid,bgjd->bgrij", qi, kj) * scale
        if softcap is not None:
            capped = torch.tanh(scores / softcap)
            scores = capped * softcap
        p = torch.exp(scores - torch.where(has_key, lse_i, 0.0))
        visible = has_key
        if left is not None or right is not None:
            diag = torch.arange(i0, i1, device=q.device)[:, None] + offset
            cols = torch.arange(first, keys, device=q.device)[None, :]
            if right is not None:
                visible = visible & (cols <= diag + right)
            if left is not None:
                visible = visible & (cols >= diag - left)
        p = torch.where(visible, p, 0.0)
        dv[:, :, first:keys] += torch.einsum("bgrij,bgrid->bgjd", p, doi)
        ds = p * (torch.einsum("bgrid,bgjd->bgrij", doi, vj) - delta[:, :, :, i0:i1, None])
        del p
        if softcap is not None:
            ds = ds * (1 - capped * capped)   # d(c tanh(s / c)) / ds
            del capped
        dq[:, :, :, i0:i1] = torch.einsum("bgrij,bgjd->bgrid", ds, kj) * scale
        dk[:, :, first:keys] += torch.einsum("bgrij,bgrid->bgjd", ds, qi) * scale

    def ungrouped(t, like):   # (B, Hkv, ratio, S, D) or (B, Hkv, S, D) -> (B, S, H, D) in like's dtype
        return t.reshape(batch, -1, t.shape[-2], t.shape[-1]).permute(0, 2, 1, 3).to(like.dtype).contiguous()

    return ungrouped(dq, q), ungrouped(dk, k), ungrouped(dv, v)
