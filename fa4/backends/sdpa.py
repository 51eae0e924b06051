"""torch's `scaled_dot_product_attention` with one of its backends pinned (`torch.nn.attention.sdpa_kernel`),
one peer per backend.

How SDPA gives our semantics: our (B, S, H, D) tensors reach it transposed to (B, H, S, D) (views, no
copy); GQA as `enable_gqa=True` (some backends refuse it: the harness then times them on K and V
expanded once, and the runtime never dispatches to that time); our bottom-right causal mask as
`is_causal` where Sq == Sk, else as `causal_lower_right` (`is_causal` is top-left aligned). SDPA returns
no LSE, so it supports no call with return_lse; it has no softcap, and a sliding window would be an
explicit mask, which neither cuDNN's nor the flash backend of torch takes, so it supports neither.
torch runs `causal_lower_right` with its own flash or memory-efficient kernel where those take the
inputs, whatever backend is pinned: a pinned backend that is neither would not be the one that runs
(`runs_lower_right_causal`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from fa4.backends import module_missing, register


def _mask(seqlen_q: int, seqlen_k: int, causal: bool) -> dict:
    """SDPA's mask arguments for our bottom-right causal mask (its `is_causal` is top-left aligned)."""
    if causal and seqlen_q == seqlen_k:
        return {"is_causal": True}
    if causal:
        from torch.nn.attention.bias import causal_lower_right

        return {"attn_mask": causal_lower_right(seqlen_q, seqlen_k)}
    return {}


@dataclass(frozen=True)
class PinnedSdpa:
    """SDPA with `torch.nn.attention.SDPBackend.<pinned>` as its only backend; `kernel` names it."""

    name: str
    kernel: str
    pinned: str
    color: str
    runs_lower_right_causal: bool  # torch runs causal_lower_right with this backend itself
    distribution: Optional[str] = None  # torch's own: its version is recorded as "torch"
    compiles_on_first_call: bool = False
    expand_kv_if_refused: bool = True

    @property
    def title(self) -> str:
        return f"SDPA {self.kernel}"

    @property
    def direct_row(self) -> str:
        return f"SDPA {self.kernel} backend"

    def unavailable(self) -> Optional[str]:
        return module_missing(self.title, "torch")

    def supports(self, problem) -> Optional[str]:
        why = []
        if problem.return_lse:
            why.append(f"{self.title} returns no LSE (return_lse=True)")
        if problem.window is not None:
            why.append(f"{self.title} has no sliding window (an explicit mask runs another SDPA backend)")
        if problem.softcap is not None:
            why.append(f"{self.title} has no softcap")
        if problem.head_dim_v is not None:   # not measured with one: torch's flash kernel takes one head dim
            why.append(f"{self.title} is not run with a value head dim of its own ({problem.head_dim}/{problem.head_dim_v})")
        if not self.runs_lower_right_causal and problem.causal and problem.seqlen_q != problem.seqlen_k:
            why.append(f"{self.title} with a bottom-right causal mask and Sq != Sk: torch runs its own flash "
                       f"or memory-efficient kernel for causal_lower_right, not {self.kernel}")
        return "; ".join(why) or None

    def _backend(self):
        from torch.nn.attention import SDPBackend

        return getattr(SDPBackend, self.pinned)

    def runner(self, causal: bool, window=None, softcap=None):
        import torch.nn.functional as F
        from torch.nn.attention import sdpa_kernel

        backend, title = [self._backend()], self.title

        def run(q, k, v, scale, return_lse):
            if return_lse or window is not None or softcap is not None:  # `supports` keeps such calls
                raise ValueError(f"{title} returns no LSE and has no window or softcap")  # away: a guard
            mask_kw = _mask(q.shape[1], k.shape[1], causal)
            gqa = {"enable_gqa": True} if q.shape[2] != k.shape[2] else {}
            with sdpa_kernel(backend):
                out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                     scale=scale, **mask_kw, **gqa)
            return out.transpose(1, 2), None

        return run

    def direct_call(self, q, k, v, causal: bool):
        import torch.nn.functional as F
        from torch.nn.attention import sdpa_kernel

        backend, gqa = self._backend(), q.shape[2] != k.shape[2]
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

        def call():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=gqa).transpose(1, 2)

        return call, "includes the sdpa_kernel context manager"


register(PinnedSdpa("sdpa_cudnn", "cuDNN", "CUDNN_ATTENTION", "#2ca02c", runs_lower_right_causal=False))
register(PinnedSdpa("sdpa_flash", "flash (FA2)", "FLASH_ATTENTION", "#9467bd", runs_lower_right_causal=True))
