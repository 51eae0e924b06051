"""`fa4::attention`, a torch.library operator, so torch.compile (fullgraph) and CUDA graphs see one
opaque node with known output shapes.

The eager `fa4.attention` does not go through it (dispatch costs microseconds a call); it enters the op
only while torch.compile traces. The op runs the runtime in graph mode: fastest-backend dispatch judges
implementations by GPU time there (`fa4.dispatch`), as under CUDA-graph capture. The op always returns a pair: O (B, Sq, Hq, D), contiguous, and LSE
(B, Hq, Sq) fp32, or an empty (0,) tensor when return_lse is False (an op output cannot be None).
`config` travels as a label (`fa4.config_arg.for_op`): the schema has no Config type.

Defined with the low-level `torch.library.Library` rather than `torch.library.custom_op`: the latter
wraps every call in Python layers that cost about 3x more per eager call (measured on CPU: ~17 us of
dispatch against ~5 us), and both give torch.compile the same operator and fake implementation.
Registered for CompositeExplicitAutograd (every device; SDPA fallback on CPU included), with a
registered backward (`torch.library.register_autograd`): the forward saves Q, K, V, O and LSE (so a
call that needs a gradient asks the op for LSE even when the caller does not) and the backward is the
op `fa4::attention_backward` (`fa4.backward`), itself opaque to torch.compile, so a compiled training
step keeps both passes in one graph.
"""

from __future__ import annotations

import torch

from fa4 import backward, runtime
from fa4.kernels.problem import resolve_mask
from fa4.reference import softmax_scale as default_scale

SCHEMA = ("attention(Tensor q, Tensor k, Tensor v, bool causal, float? softmax_scale, bool return_lse, "
          "str? config, str fallback, bool allow_untested_sm100, str backend=\"auto\", int[]? window_size=None, "
          "float? softcap=None, bool deterministic=False) -> (Tensor, Tensor)")

_LIB = torch.library.Library("fa4", "DEF")
_LIB.define(SCHEMA)
_LIB.impl("attention", runtime.forward_for_op, "CompositeExplicitAutograd")


@torch.library.register_fake("fa4::attention", lib=_LIB)
def _attention_fake(q, k, v, causal, softmax_scale, return_lse, config, fallback, allow_untested_sm100,
                    backend="auto", window_size=None, softcap=None, deterministic=False):
    batch, seqlen_q, heads_q, head_dim = q.shape
    out = q.new_empty((batch, seqlen_q, heads_q, v.shape[3]))   # v's head dim (DeepSeek's 192/128)
    lse_shape = (batch, heads_q, seqlen_q) if return_lse else (0,)
    return out, q.new_empty(lse_shape, dtype=torch.float32)


# window: the forward's as resolved (`fa4.kernels.problem.resolve_mask`), -1 for an unbounded side;
# deterministic: the caller's (the forward is deterministic anyway; `fa4.backward` says what it changes)
BACKWARD_SCHEMA = ("attention_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
                   "Tensor? dlse, bool causal, float softmax_scale, int[]? window=None, float? softcap=None, "
                   "bool deterministic=False) -> (Tensor, Tensor, Tensor)")
_LIB.define(BACKWARD_SCHEMA)


def _backward_impl(dout, q, k, v, out, lse, dlse, causal, softmax_scale, window=None, softcap=None,
                   deterministic=False):
    masks = {} if window is None and softcap is None else {
        "window": None if window is None else tuple(window), "softcap": softcap}
    return backward.attention_backward(dout, q, k, v, out, lse, causal, softmax_scale, dlse, **masks,
                                       deterministic=deterministic)


_LIB.impl("attention_backward", _backward_impl, "CompositeExplicitAutograd")


@torch.library.register_fake("fa4::attention_backward", lib=_LIB)
def _attention_backward_fake(dout, q, k, v, out, lse, dlse, causal, softmax_scale, window=None, softcap=None,
                             deterministic=False):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape))


def _setup_context(ctx, inputs, output):
    q, k, v, causal, softmax_scale, return_lse, *rest = inputs
    # after config, fallback, sm100, backend (trailing defaults may be left out of `inputs`)
    window_size, softcap, deterministic = (list(rest[4:7]) + [None, None, False][len(rest[4:7]):])
    out, lse = output
    if lse.numel() != q.shape[0] * q.shape[2] * q.shape[1]:
        raise RuntimeError("fa4::attention was called for a gradient without its LSE (return_lse=False); "
                           "fa4.attention asks for it whenever an input requires grad")
    ctx.save_for_backward(q, k, v, out, lse)
    # the mask the forward ran (flash-attn's conventions resolved for these lengths, as the forward did)
    ctx.causal, window, ctx.softcap = resolve_mask(causal, window_size, softcap, q.shape[1], k.shape[1])
    ctx.window = None if window is None else list(window)
    ctx.softmax_scale = default_scale(q.shape[-1]) if softmax_scale is None else softmax_scale
    ctx.deterministic = bool(deterministic)
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    if dout is None and dlse is None:
        return (None,) * 13
    if dout is None:
        dout = torch.zeros_like(out)
    masks = {} if ctx.window is None and ctx.softcap is None else {"window": ctx.window, "softcap": ctx.softcap}
    if ctx.deterministic:   # a plain call's op call is what it was
        masks["deterministic"] = True
    dq, dk, dv = torch.ops.fa4.attention_backward(dout, q, k, v, out, lse, dlse, ctx.causal, ctx.softmax_scale,
                                                  **masks)
    return (dq, dk, dv) + (None,) * 10


torch.library.register_autograd("fa4::attention", _backward, setup_context=_setup_context, lib=_LIB)
