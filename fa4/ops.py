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
Registered for CompositeExplicitAutograd (every device; SDPA fallback on CPU included) without an
autograd formula: fa4 is forward only, and `fa4.attention` refuses inputs that require grad.
"""

from __future__ import annotations

import torch

from fa4 import runtime

SCHEMA = ("attention(Tensor q, Tensor k, Tensor v, bool causal, float? softmax_scale, bool return_lse, "
          "str? config, str fallback, bool allow_untested_sm100, str backend=\"auto\") -> (Tensor, Tensor)")

_LIB = torch.library.Library("fa4", "DEF")
_LIB.define(SCHEMA)
_LIB.impl("attention", runtime.forward_for_op, "CompositeExplicitAutograd")


@torch.library.register_fake("fa4::attention", lib=_LIB)
def _attention_fake(q, k, v, causal, softmax_scale, return_lse, config, fallback, allow_untested_sm100,
                    backend="auto"):
    batch, seqlen_q, heads_q, head_dim = q.shape
    out = q.new_empty((batch, seqlen_q, heads_q, head_dim))
    lse_shape = (batch, heads_q, seqlen_q) if return_lse else (0,)
    return out, q.new_empty(lse_shape, dtype=torch.float32)
