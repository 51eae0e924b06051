"""`fa4` as an attention implementation of Hugging Face transformers (its `AttentionInterface`):

    import fa4.transformers_attention
    fa4.transformers_attention.register()                      # once per process
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="fa4")

The model's attention layers then call `fa4.attention` (the tuned forward, and its backward when
training), with the layer's scaling and causality. transformers hands attention functions Q (B, Hq, S,
D) and K, V (B, Hkv, S, D); they are passed on as (B, S, H, D) views, no copy.

A layer's sliding window (`sliding_window`: a query sees itself and the `sliding_window - 1` keys
before it, as transformers' masks say) and logit softcap (`softcap`, on the scaled scores) go to
`fa4.attention` as flash-attn gets them from transformers (`window_size=(w - 1, w - 1)`, the causal
mask bounding the right side). A batch with padding (transformers gives such layers a (B, Sk) key
mask, as it does to flash-attn: `flash_attention_mask`) goes to `fa4.attention_varlen` with its real
tokens packed, as flash-attn's integration does (padded query rows get O = 0); a mask whose real
tokens are not one run per row, or a call inside a CUDA-graph capture (packing reads the mask on the
host), goes to torch SDPA with the same semantics, said once by a warning. Inputs our kernels cannot
run go to SDPA too (`fallback="sdpa"`: CPU tensors, fp32, other head dims). Attention dropout raises
instead: the result would differ from the model's. Deterministic gradients as transformers asks them of
flash-attn: a `deterministic` argument, else `FLASH_ATTENTION_DETERMINISTIC=1`, else torch's setting.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

import fa4
from fa4.reference import capped, key_bounds, softmax_scale, visible_keys
from fa4.state import warn_once

NAME = "fa4"


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function protocol: returns (O (B, S, Hq, D), no attention weights)."""
    softcap = kwargs.get("softcap")
    window = kwargs.get("sliding_window")
    # transformers' sliding window of w: query i sees keys i - w + 1 .. i (flash-attn's (w - 1, w - 1)
    # under the causal mask); a window at least as wide as the keys hides none
    window_size = (window - 1, window - 1) if window is not None and key.shape[2] > window else None
    if dropout and module.training:
        raise ValueError(f"attn_implementation='{NAME}' has no attention dropout (got {dropout}); set the "
                         f"model's attention_dropout to 0")
    causal = getattr(module, "is_causal", True) if is_causal is None else bool(is_causal)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))   # (B, S, H, D) views
    if attention_mask is not None:
        packed = _padded_varlen(q, k, v, attention_mask, causal, scaling, window_size, softcap)
        if packed is not None:
            return packed, None
        warn_once("transformers-padding", f"fa4: a padded batch whose real tokens are not one run per row (or "
                                          f"one inside a CUDA-graph capture) runs on torch SDPA")
        return _padded_sdpa(q, k, v, attention_mask, causal, scaling, window_size, softcap), None
    deterministic = kwargs.get("deterministic")
    if deterministic is None and os.environ.get("FLASH_ATTENTION_DETERMINISTIC") == "1":
        deterministic = True
    return fa4.attention(q, k, v, causal=causal, softmax_scale=scaling, fallback="sdpa", window_size=window_size,
                         softcap=softcap, deterministic=deterministic), None


def _padded_varlen(q, k, v, key_mask, causal: bool, scaling, window_size=None, softcap=None):
    """O (B, Sq, Hq, D) by `fa4.attention_varlen` on the real tokens, or None where packing does not
    apply. Row b's real keys must be one run (left or right padding); its queries are the last Sq key
    positions (transformers' layout, a cache included), the real ones those over real keys, so the
    bottom-right causal mask of each packed sequence is the padded batch's."""
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k = k.shape[1]
    if seqlen_q > seqlen_k or (q.is_cuda and torch.cuda.is_current_stream_capturing()):
        return None
    keys = key_mask[:, -seqlen_k:].bool()
    queries = keys[:, seqlen_k - seqlen_q:]
    positions = torch.arange(seqlen_k, device=keys.device)
    first = torch.where(keys, positions, seqlen_k).amin(1)
    last = torch.where(keys, positions, -1).amax(1)
    lengths_k, lengths_q = keys.sum(1), queries.sum(1)
    summary = torch.stack([first, last, lengths_k, lengths_q]).tolist()   # the one host sync
    if any(n and z - a + 1 != n for a, z, n in zip(*summary[:3])):
        return None   # real tokens in more than one run: no packed form
    offsets_q, offsets_k = ([0] + torch.tensor(lengths).cumsum(0).tolist() for lengths in summary[3:1:-1])
    query_rows = queries.reshape(-1).nonzero().squeeze(1)
    key_rows = keys.reshape(-1).nonzero().squeeze(1)
    packed_q = q.reshape(batch * seqlen_q, heads_q, head_dim).index_select(0, query_rows)
    packed_k, packed_v = (t.reshape(batch * seqlen_k, *t.shape[2:]).index_select(0, key_rows) for t in (k, v))
    out = fa4.attention_varlen(packed_q, packed_k, packed_v, torch.tensor(offsets_q, dtype=torch.int32),
                               torch.tensor(offsets_k, dtype=torch.int32), max(summary[3]), max(summary[2]),
                               causal=causal, softmax_scale=scaling, fallback="sdpa", window_size=window_size,
                               softcap=softcap)
    padded = out.new_zeros(batch * seqlen_q, heads_q, out.shape[-1]).index_copy(0, query_rows, out)
    return padded.view(batch, seqlen_q, heads_q, out.shape[-1])


def _padded_sdpa(q, k, v, key_mask, causal: bool, scaling, window_size=None, softcap=None):
    """SDPA with the (B, Sk) key mask (True: a real token) and our bottom-right causal mask (and the
    window's), GQA native; with a softcap, the same math written out in fp32 (SDPA has no softcap)."""
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    keep = key_mask[:, -seqlen_k:].bool()[:, None, None, :]            # (B, 1, 1, Sk)
    left, right = key_bounds(causal, window_size)
    if left is not None or right is not None:
        keep = keep & visible_keys(seqlen_q, seqlen_k, q.device, (-1 if left is None else left,
                                                                   -1 if right is None else right))
    scale = softmax_scale(q.shape[-1]) if scaling is None else scaling
    if softcap is not None:
        heads_q = q.shape[2]
        qf = q.float().transpose(1, 2)
        kf, vf = (t.float().transpose(1, 2).repeat_interleave(heads_q // t.shape[2], dim=1) for t in (k, v))
        scores = capped((qf @ kf.transpose(-1, -2)) * scale, softcap).masked_fill(~keep, float("-inf"))
        out = (torch.softmax(scores, dim=-1) @ vf).to(q.dtype)
    else:
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=keep, scale=scale, enable_gqa=q.shape[2] != k.shape[2])
    # a row whose keys are all padding: SDPA gives NaN, our contract 0
    return torch.nan_to_num(out.transpose(1, 2), nan=0.0)


def register() -> None:
    """Make attn_implementation="fa4" known to transformers (its attention function and its mask: the
    (B, Sk) key mask flash-attn gets, or none without padding)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, flash_attention_mask)
