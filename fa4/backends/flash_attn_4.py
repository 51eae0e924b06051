"""flash-attn-4 (`flash_attn.cute.flash_attn_func`, the `peer` extra) as a peer.

It gives our semantics natively: bottom-right causal masks, GQA, and LSE in our layout. Its first call
of a shape JIT-compiles (seconds), and its host time per eager call (~80-90 us on an H200) is more
than its kernel's at S=1024, which is why eager calls are judged by host time too (`fa4.dispatch`).
"""

from __future__ import annotations

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
        return None  # every call we take, LSE included

    def runner(self, causal: bool):
        from flash_attn.cute import flash_attn_func

        def run(q, k, v, scale, return_lse):
            result = flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, return_lse=return_lse)
            out, lse = result if isinstance(result, tuple) else (result, None)
            return out, (lse if return_lse else None)

        return run

    def direct_call(self, q, k, v, causal: bool):
        from flash_attn.cute import flash_attn_func

        return (lambda: flash_attn_func(q, k, v, causal=causal)), ""


register(FlashAttn4())
