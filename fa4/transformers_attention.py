"""`fa4` as an attention implementation of Hugging Face transformers (its `AttentionInterface`):

    import fa4.transformers_attention
    fa4.transformers_attention.register()                      # once per process
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="fa4")

The model's attention layers then call `fa4.attention` (the tuned forward, and its backward when
training), with the layer's scaling and causality. transformers hands attention functions Q (B, Hq, S,
D) and K, V (B, Hkv, S, D); they are passed on as (B, S, H, D) views, no copy.

What `fa4.attention` cannot take yet goes to torch SDPA with the same semantics, said once by a
warning: a batch with padding (transformers gives such layers a (B, Sk) key mask, as it does to
flash-attn: `flash_attention_mask`), inputs our kernels cannot run (`fallback="sdpa"`: CPU tensors,
fp32, other head dims). A softcap, a sliding window narrower than the keys (a wider one hides nothing)
or attention dropout raise instead: the result would differ from the model's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import fa4
from fa4.reference import softmax_scale, visible_keys
from fa4.state import warn_once

NAME = "fa4"


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function protocol: returns (O (B, S, Hq, D), no attention weights)."""
    if kwargs.get("softcap") is not None:
        raise ValueError(f"attn_implementation='{NAME}' does not support softcap yet (got "
                         f"{kwargs['softcap']!r}); use 'sdpa' or 'eager' for this model")
    window = kwargs.get("sliding_window")
    if window is not None and key.shape[2] > window:   # a window at least as wide as the keys hides none
        raise ValueError(f"attn_implementation='{NAME}' does not support a sliding window narrower than the "
                         f"keys yet (window {window}, {key.shape[2]} keys); use 'sdpa' or 'eager' here")
    if dropout and module.training:
        raise ValueError(f"attn_implementation='{NAME}' has no attention dropout (got {dropout}); set the "
                         f"model's attention_dropout to 0")
    causal = getattr(module, "is_causal", True) if is_causal is None else bool(is_causal)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))   # (B, S, H, D) views
    if attention_mask is not None:
        warn_once("transformers-padding", f"fa4: a padded batch (attention_mask with padding) runs on torch "
                                          f"SDPA: attn_implementation='{NAME}' has no variable-length path yet")
        return _padded_sdpa(q, k, v, attention_mask, causal, scaling), None
    return fa4.attention(q, k, v, causal=causal, softmax_scale=scaling, fallback="sdpa"), None


def _padded_sdpa(q, k, v, key_mask, causal: bool, scaling):
    """SDPA with the (B, Sk) key mask (True: a real token) and our bottom-right causal mask, GQA native."""
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    keep = key_mask[:, -seqlen_k:].bool()[:, None, None, :]            # (B, 1, 1, Sk)
    if causal:
        keep = keep & visible_keys(seqlen_q, seqlen_k, q.device)
    scale = softmax_scale(q.shape[-1]) if scaling is None else scaling
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=keep,
                                         scale=scale, enable_gqa=q.shape[2] != k.shape[2])
    # a row whose keys are all padding: SDPA gives NaN, our contract 0
    return torch.nan_to_num(out.transpose(1, 2), nan=0.0)


def register() -> None:
    """Make attn_implementation="fa4" known to transformers (its attention function and its mask: the
    (B, Sk) key mask flash-attn gets, or none without padding)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, flash_attention_mask)
