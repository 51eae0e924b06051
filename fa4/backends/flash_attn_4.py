"""flash-attn-4 (`flash_attn.cute.flash_attn_func`, the `peer` extra) as a peer.

It gives our semantics natively: bottom-right causal masks, GQA, LSE in our layout, sliding windows
(`window_size`, None for an unbounded side where we write -1) and the softcap (applied, as ours, to
the scaled score: `flash_attn/cute/utils.py` `create_softcap_scoremod`). Its first call
of a shape JIT-compiles (seconds), and its host time per eager call (~80-90 us on an H200) is more
than its kernel's at S=1024, which is why eager calls are judged by host time too (`fa4.dispatch`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from fa4.backends import module_missing, register

MODULE = "flash_attn.cute"


@dataclass(frozen=True)
class FlashAttn4:
    name: str = "flash_attn_4"
    title: str = "flash-attn-4"
    color: str = "#d62728"
    distribution: Optional[str] = "flash-attn-4"
    compiles_on_first_call: bool = True
    expand_kv_if_refused: bool = False  # GQA is native: a refusal is the answer
    direct_row: Optional[str] = "flash-attn-4 flash_attn_func"

    def unavailable(self) -> Optional[str]:
        return module_missing(self.title, MODULE)

    def supports(self, problem) -> Optional[str]:
        return None  # every call we take, LSE included (D/Dv 192/128 too: its `_validate_head_dims`)

    def runner(self, causal: bool, window=None, softcap=None):
        from flash_attn.cute import flash_attn_func

        mask = _mask_arguments(window, softcap)

        def run(q, k, v, scale, return_lse):
            result = flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, return_lse=return_lse, **mask)
            out, lse = result if isinstance(result, tuple) else (result, None)
            return out, (lse if return_lse else None)

        return run

    # its backward reads what our forward saves (O; LSE natural log, (B, Hq, Sq) fp32): `fa4.backward`
    def backward_unsupported(self, q) -> Optional[str]:
        """Why its backward cannot take a gradient of these inputs' kind (None: it can)."""
        import torch

        if q.device.type != "cuda":
            return f"the tensors are on {q.device.type}; {self.title}'s backward runs on CUDA GPUs"
        major = torch.cuda.get_device_capability(q.device)[0]
        if major not in (9, 10):
            return f"{self.title}'s backward does not run on compute capability {major}.x"
        if q.dtype not in (torch.float16, torch.bfloat16) or q.shape[-1] not in (64, 96, 128):
            return f"{self.title}'s backward is not used for {q.dtype} at head dim {q.shape[-1]}"
        return self.unavailable()

    def backward(self, dout, q, k, v, out, lse, causal: bool, scale: float, dlse=None, window=None, softcap=None):
        """(dQ, dK, dV). A row that sees no key has our LSE -inf; its kernels take +inf there (P = 0)."""
        import torch
        from flash_attn.cute.interface import _flash_attn_bwd   # the entry point of its autograd

        if (causal or window is not None) and q.shape[1] > k.shape[1]:
            lse = torch.where(lse == -math.inf, math.inf, lse)
        mask = _mask_arguments(window, softcap)
        left, right = mask.pop("window_size", (None, None))
        if left is not None or right is not None:
            mask.update(window_size_left=left, window_size_right=right)
        dq, dk, dv = _flash_attn_bwd(q, k, v, out, dout.contiguous(), lse, scale, causal, dlse=dlse, **mask)
        return dq, dk, dv

    def varlen_unsupported(self, q) -> Optional[str]:
        """Why its varlen kernel cannot take these inputs (None: it can); `fa4.varlen`."""
        import torch

        if q.device.type != "cuda":
            return f"the tensors are on {q.device.type}; {self.title} runs on CUDA GPUs"
        major = torch.cuda.get_device_capability(q.device)[0]
        if major not in (9, 10):
            return f"{self.title} does not run on compute capability {major}.x"
        return self.unavailable()

    def varlen(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, causal: bool,
               scale, return_lse: bool, window, softcap):
        """(O, LSE or None) of a packed batch (`fa4.varlen`'s layout; offsets on q's device; `window` our
        (left, right) with -1 unbounded, or None). Rows without keys hold what its kernel left there."""
        from flash_attn.cute import flash_attn_varlen_func

        window_size = (None, None) if window is None else tuple(None if side == -1 else side for side in window)
        result = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, softmax_scale=scale,
                                        causal=causal, window_size=window_size, softcap=softcap or 0.0,
                                        return_lse=return_lse)
        out, lse = result if isinstance(result, tuple) else (result, None)
        return out, (lse if return_lse else None)

    def direct_call(self, q, k, v, causal: bool):
        from flash_attn.cute import flash_attn_func

        return (lambda: flash_attn_func(q, k, v, causal=causal)), ""


def _mask_arguments(window, softcap) -> dict:
    """flash-attn-4's keyword arguments for our window and softcap (none for a dense call): its
    `window_size` leaves an unbounded side None, where ours says -1 (its -1 would bound the side)."""
    mask = {}
    if window is not None:
        mask["window_size"] = tuple(None if side < 0 else int(side) for side in window)
    if softcap is not None:
        mask["softcap"] = float(softcap)
    return mask


register(FlashAttn4())
