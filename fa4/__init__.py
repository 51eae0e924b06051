"""fa4: the runtime. `fa4.attention(q, k, v, causal=...)` looks up the tuned configuration and runs it.

    out = fa4.attention(q, k, v, causal=True)        # q (B, Sq, Hq, D), k/v (B, Sk, Hkv, D), fp16/bf16
    out, lse = fa4.attention(q, k, v, return_lse=True)
    print(fa4.explain(q, k, v, causal=True))         # which implementation and configuration, and why
    fa4.warmup([(q, k, v)], causal=True)             # compile ahead (before a CUDA-graph capture)
    fa4.autotune("quick")                            # tune unseen shapes on first use (or FA4_AUTOTUNE=quick)
    out = fa4.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k)   # packed sequences
    print(fa4.explain_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k))    # ... what runs, and why
"""

from fa4 import ops as _ops  # registers the custom op fa4::attention  # noqa: F401
from fa4.checks import Fa4Error, InvalidInputError, UnsupportedInputError
from fa4.explanation import Explanation
from fa4.runtime import KernelCompileError, NotWarmedUpError, attention, explain
from fa4.state import Fa4Warning, cache_info, reset_caches, use_config_db
from fa4.compile_ahead import warmup
from fa4.autotuning import autotune
from fa4.varlen import attention_varlen, explain_varlen

__all__ = [
    "attention", "attention_varlen", "explain", "explain_varlen", "warmup", "autotune", "Explanation", "use_config_db", "cache_info", "reset_caches",
    "Fa4Error", "InvalidInputError", "UnsupportedInputError", "KernelCompileError", "NotWarmedUpError",
    "Fa4Warning",
]
