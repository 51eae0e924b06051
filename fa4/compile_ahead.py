"""`fa4.warmup`: decide and compile ahead, so no call of a warmed shape compiles later.

A first call of a shape plans it (database lookup, fastest backend), compiles our kernel's
configuration (or loads it from the on-disk cache, unless `FA4TUNE_DISK_CACHE=0`, and stores it there
after a compile) and runs flash-attn-4 once where dispatch chose it (it compiles on first use). That
first call costs seconds, and inside a CUDA-graph capture it cannot happen at all
(`fa4.NotWarmedUpError` names the shape). `warmup` makes those first calls now, on tensors of the
shapes given, and returns what each will run (`fa4.explain`'s answer).

Our compiled kernels do not depend on the sequence lengths or the batch (`fa4.kernels.compile_key`),
so one warmed shape covers the lengths of its database bucket that the same configuration runs.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from fa4.checks import KERNEL_DTYPES, InvalidInputError
from fa4.kernels import AttentionProblem

_TORCH_DTYPES = {name: dtype for dtype, name in KERNEL_DTYPES.items()}


def warmup(shapes: Any, *, causal: bool = False, return_lse: bool = False, softmax_scale: float | None = None,
           config: Any = None, fallback: str = "error", backend: str = "auto", device: Any = None,
           allow_untested_sm100: bool = False, window_size: tuple[int, int] | None = None,
           softcap: float | None = None) -> list:
    """Make the first call of every shape now; returns one `fa4.Explanation` per shape.

    shapes: an `fa4.kernels.AttentionProblem` (its own `causal`, `return_lse`, `window` and `softcap`),
    a tuple (q, k, v) of example tensors (their shapes, strides, dtype and device; `causal`,
    `return_lse`, `window_size` and `softcap` below), or a list of these. A problem runs on
    zero-filled contiguous tensors on `device` (default: the current CUDA device). The other
    arguments are `fa4.attention`'s, and must be those of the calls to warm: they are part of what a
    call's plan is cached under.
    """
    from fa4 import runtime

    results = []
    for item in _items(shapes):
        if isinstance(item, AttentionProblem):
            q, k, v = _tensors(item, device)
            mask, lse = item.causal, item.return_lse
            masks = {"window_size": item.window, "softcap": item.softcap}
        else:
            q, k, v = item
            mask, lse = causal, return_lse
            masks = {"window_size": window_size, "softcap": softcap}
        with torch.no_grad():
            runtime.attention(q, k, v, mask, softmax_scale, lse, config, fallback, backend=backend,
                              allow_untested_sm100=allow_untested_sm100, **masks)
        results.append(runtime.explain(q, k, v, mask, softmax_scale, lse, config, fallback, backend=backend,
                                       allow_untested_sm100=allow_untested_sm100, **masks))
    return results


def _items(shapes: Any) -> list:
    if isinstance(shapes, AttentionProblem) or _is_example(shapes):
        return [shapes]
    if isinstance(shapes, Iterable) and not isinstance(shapes, (str, bytes, torch.Tensor)):
        items = list(shapes)
        bad = [item for item in items if not (isinstance(item, AttentionProblem) or _is_example(item))]
        if not bad and items:
            return items
    raise InvalidInputError(
        "fa4.warmup takes an fa4.kernels.AttentionProblem, a tuple (q, k, v) of example tensors, or a "
        f"list of these; got {shapes!r:.200}")


def _is_example(item: Any) -> bool:
    return isinstance(item, tuple) and len(item) == 3 and all(isinstance(t, torch.Tensor) for t in item)


def _tensors(problem: AttentionProblem, device: Any):
    dtype = _TORCH_DTYPES[problem.dtype]  # AttentionProblem admits only the kernels' dtypes
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    shape_q = (problem.batch, problem.seqlen_q, problem.heads_q, problem.head_dim)
    shape_kv = (problem.batch, problem.seqlen_k, problem.heads_kv, problem.head_dim)
    return (torch.zeros(shape_q, dtype=dtype, device=device),
            torch.zeros(shape_kv, dtype=dtype, device=device), torch.zeros(shape_kv, dtype=dtype, device=device))
