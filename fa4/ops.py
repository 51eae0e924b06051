"""`fa4::attention`, a torch.library custom op, so torch.compile (fullgraph) and CUDA graphs see one
opaque node with known output shapes.

The eager `fa4.attention` does not go through it (dispatch would cost several microseconds a call); it
enters the op only while torch.compile traces. The op always returns a pair: O (B, Sq, Hq, D),
contiguous, and LSE (B, Hq, Sq) fp32, or an empty (0,) tensor when return_lse is False (an op output
cannot be None). `config` travels as a string (`fa4.runtime.config_to_str`): the schema has no Config.
"""

from __future__ import annotations

from typing import Optional

import torch

from fa4 import runtime


@torch.library.custom_op("fa4::attention", mutates_args=())
def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                 softmax_scale: Optional[float], return_lse: bool, config: Optional[str],
                 fallback: str, allow_untested_sm100: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return runtime.forward_for_op(q, k, v, causal, softmax_scale, return_lse, config, fallback,
                                  allow_untested_sm100)


@attention_op.register_fake
def _attention_fake(q, k, v, causal, softmax_scale, return_lse, config, fallback, allow_untested_sm100):
    batch, seqlen_q, heads_q, head_dim = q.shape
    out = q.new_empty((batch, seqlen_q, heads_q, head_dim))
    lse_shape = (batch, heads_q, seqlen_q) if return_lse else (0,)
    return out, q.new_empty(lse_shape, dtype=torch.float32)
