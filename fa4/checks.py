"""Input checks of `fa4.attention`: every bad input gets an error that names the problem.

Two kinds of problem, two error classes:
- `InvalidInputError`: the call itself is wrong (wrong rank, shapes that disagree, mixed dtypes, tensors
  on different devices, a sequence longer than 2**31 - 1, a softmax_scale
  that is no positive fp32 number, a window_size that is no pair of integers >= -1, a softcap that is
  no finite number >= 0). Always raised, whatever the fallback.
- `UnsupportedInputError`: a well-formed call our kernels cannot run (CPU tensors, fp32, a GPU without a
  kernel, a head dim no kernel supports, strides or pointers TMA cannot address). Raised by default;
  `fallback="sdpa"` runs PyTorch's SDPA instead.

Everything here except `pointers_misaligned` and `softmax_scale_value` depends only on shapes, strides,
dtypes and devices, so the runtime runs it once per input signature and caches the outcome. Nothing
here touches CUDA: the checks run on CPU and meta tensors, which is how the CPU tests exercise them.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from fa4.kernels import AttentionProblem
from fa4.kernels.problem import resolve_mask, window_pair
from fa4.kernels.sm90.plan import SUPPORTED_HEAD_DIM_PAIRS

# TMA addresses global memory in 16-byte units: base pointers and every stride but the innermost.
TMA_ALIGN_BYTES = 16

KERNEL_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16"}
# Floating dtypes SDPA can run when the user opts into the fallback; any other dtype is an invalid call.
FALLBACK_DTYPES = (torch.float32, torch.float64)

LAYOUT = "q (batch, seqlen_q, heads_q, head_dim), k and v (batch, seqlen_k, heads_kv, head_dim)"
# (q/k head dim, v head dim) pairs with Dv != D that a kernel of ours runs (the sm90 forward's); any
# other pair is an invalid call
VALUE_HEAD_DIM_PAIRS = SUPPORTED_HEAD_DIM_PAIRS
# The longest sequence (queries or keys) of any call, whatever runs it: the kernels' row and key
# indices are 32-bit. Past it the call is invalid, not unsupported: SDPA would need the memory of
# 2**31 rows (an error from torch's allocator, or minutes of work on expanded tensors) to say so.
MAX_SEQLEN = 2**31 - 1


class Fa4Error(Exception):
    """Base class of the errors fa4 raises on purpose."""


class InvalidInputError(Fa4Error, ValueError):
    """The call is wrong: no backend could run it."""


class UnsupportedInputError(Fa4Error, ValueError):
    """A well-formed call our kernels cannot run; `fallback="sdpa"` runs SDPA instead."""


@dataclass(frozen=True)
class InputSpec:
    """What the checks learnt from q, k and v; a function of their signature only."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_kv: int
    head_dim: int
    torch_dtype: torch.dtype
    device: torch.device
    # Why the kernels cannot run these tensors whatever the GPU (dtype, strides; the device is judged
    # separately by `device_reasons`). Empty: nothing against them.
    unsupported: tuple[str, ...]
    # Dimensions of size 1 whose stride TMA could not use; harmless, the runtime re-strides them.
    needs_restride: bool
    # v's (and the output's) head dim where it differs from q's and k's; None: the same
    head_dim_v: int | None = None

    @property
    def value_head_dim(self) -> int:
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    @property
    def dtype(self) -> str | None:
        return KERNEL_DTYPES.get(self.torch_dtype)

    def problem(self, causal: bool, return_lse: bool, window=None, softcap=None) -> AttentionProblem:
        """The problem of these inputs; `causal`, `window` and `softcap` as `mask_arguments` resolved them."""
        if self.dtype is None:
            raise UnsupportedInputError(f"dtype {self.torch_dtype} has no kernel (fp16 or bf16 only)")
        return AttentionProblem(
            batch=self.batch, seqlen_q=self.seqlen_q, seqlen_k=self.seqlen_k, heads_q=self.heads_q,
            heads_kv=self.heads_kv, head_dim=self.head_dim, dtype=self.dtype, causal=bool(causal),
            return_lse=bool(return_lse), window=window, softcap=softcap, head_dim_v=self.head_dim_v)

    @property
    def is_empty(self) -> bool:
        """Nothing to compute: the output has no elements."""
        return self.batch == 0 or self.seqlen_q == 0

    @property
    def has_no_keys(self) -> bool:
        """Every query row sees no key: O = 0 and LSE = -inf, no launch."""
        return self.seqlen_k == 0


def inspect_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> InputSpec:
    """Check q, k, v; raise `InvalidInputError` for a wrong call, else return what we learnt.

    Reasons the kernels cannot run the tensors (device, dtype, strides) are returned in
    `InputSpec.unsupported`, not raised, so the caller can choose the fallback.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise InvalidInputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        # before anything reads sizes or strides: a nested tensor has neither, a sparse one no strides
        if t.is_nested:
            raise InvalidInputError(
                f"{name} is a nested tensor; fa4.attention takes dense tensors ({LAYOUT}): pad the "
                "sequences to one length (torch.nested.to_padded_tensor) and mask what the padding adds")
        if t.layout != torch.strided:
            raise InvalidInputError(
                f"{name} has layout {t.layout}; fa4.attention takes dense (strided) tensors: call "
                f".to_dense() on {name}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise InvalidInputError(
                f"{name} must be 4-D, got {t.dim()}-D shape {tuple(t.shape)}; expected {LAYOUT}")

    if not (q.device == k.device == v.device):
        raise InvalidInputError(
            f"q, k and v must be on one device, got q on {q.device}, k on {k.device}, v on {v.device}")

    if not (q.dtype == k.dtype == v.dtype):
        raise InvalidInputError(
            f"q, k and v must have one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    dtype = q.dtype
    if dtype not in KERNEL_DTYPES and dtype not in FALLBACK_DTYPES:
        raise InvalidInputError(f"dtype {dtype} is not supported: use torch.float16 or torch.bfloat16")

    batch, seqlen_q, heads_q, head_dim = q.shape
    batch_k, seqlen_k, heads_kv, head_dim_k = k.shape
    batch_v, seqlen_v, heads_v, head_dim_v = v.shape
    if head_dim != head_dim_k:
        raise InvalidInputError(
            f"head dims differ: q {head_dim}, k {head_dim_k} (last dimension); q and k need one head dim")
    if head_dim_v != head_dim and (head_dim, head_dim_v) not in VALUE_HEAD_DIM_PAIRS:
        raise InvalidInputError(
            f"v's head dim {head_dim_v} differs from q's and k's {head_dim} (last dimension); fa4 runs a "
            f"different v head dim only for q/k/v "
            f"{', '.join(f'{d}/{d}/{dv}' for d, dv in VALUE_HEAD_DIM_PAIRS)} (the sm90 kernel)")
    if not (batch == batch_k == batch_v):
        raise InvalidInputError(
            f"batch sizes differ: q {batch}, k {batch_k}, v {batch_v} (first dimension); expected {LAYOUT}")
    if seqlen_k != seqlen_v:
        raise InvalidInputError(
            f"k and v must have the same sequence length, got k {seqlen_k}, v {seqlen_v} (second dimension)")
    if heads_kv != heads_v:
        raise InvalidInputError(
            f"k and v must have the same number of heads, got k {heads_kv}, v {heads_v} (third dimension)")
    if head_dim == 0:
        raise InvalidInputError(
            "head dim is 0 (last dimension): attention needs at least one feature per head; the "
            "default scale 1/sqrt(head_dim) is undefined")
    if heads_q == 0 or heads_kv == 0:
        raise InvalidInputError(f"need at least one head, got heads_q={heads_q}, heads_kv={heads_kv}")
    if heads_q % heads_kv:
        raise InvalidInputError(
            f"heads_q ({heads_q}) must be a multiple of heads_kv ({heads_kv}) for grouped-query attention")
    for name, length in (("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k)):
        if length > MAX_SEQLEN:
            raise InvalidInputError(
                f"{name} is {length}, more than fa4 takes ({MAX_SEQLEN} = 2**31 - 1: the kernels index "
                "rows with 32-bit integers, and no fallback runs what they cannot address)")

    unsupported: list[str] = []
    if dtype not in KERNEL_DTYPES:
        unsupported.append(f"dtype {dtype} has no kernel; use torch.float16 or torch.bfloat16")
    needs_restride = False
    for name, t in (("q", q), ("k", k), ("v", v)):
        reasons, restride = _stride_reasons(name, t)
        unsupported += reasons
        needs_restride |= restride

    return InputSpec(
        batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, heads_q=heads_q, heads_kv=heads_kv,
        head_dim=head_dim, torch_dtype=dtype, device=q.device, unsupported=tuple(unsupported),
        needs_restride=needs_restride, head_dim_v=None if head_dim_v == head_dim else head_dim_v)


# The softmax scales every path takes (the kernels, the peers, the SDPA fallback and `fa4.explain`
# alike), as the kernels take them, in fp32:
# - positive: the kernels' online softmax takes a row's largest raw score as its basis, which is the
#   largest scaled score only for a positive scale. With a negative scale every exponent is >= 0 and
#   grows past fp32, with 0 a masked score (-inf) times the scale is NaN; the kernels' tile algorithm
#   replayed on the CPU (`fa4.kernels.sm100.emulation`) misses the fp32 reference by 0.46 at -0.125
#   and by 3.4 at 0 (causal). SDPA takes any float and flash-attn checks nothing; neither is a reason
#   to return a wrong answer.
# - at least 2**-126, fp32's smallest normal number: the kernels' fast math flushes smaller ones to 0.
# - at most 2**127: the kernels fold log2(e) into the scale, and 2**127 * log2(e) is still finite in
#   fp32 (1e40, finite in Python, is inf in fp32: every output 0 and every LSE +inf).
SOFTMAX_SCALE_MIN = 2.0**-126
SOFTMAX_SCALE_MAX = 2.0**127


def deterministic_value(deterministic) -> bool:
    """`fa4.attention`'s deterministic: True or False, or None for torch's own setting
    (`torch.use_deterministic_algorithms`)."""
    if deterministic is None:
        return torch.are_deterministic_algorithms_enabled()
    if not isinstance(deterministic, bool):
        raise InvalidInputError(f"deterministic must be True, False or None (torch's setting), got {deterministic!r}")
    return deterministic


def softmax_scale_value(softmax_scale) -> float | None:
    """The scale as the kernels take it (a float), None for the default; InvalidInputError for what is
    no real number (a one-element real tensor is one) or lies outside [SOFTMAX_SCALE_MIN,
    SOFTMAX_SCALE_MAX] (see there why)."""
    if softmax_scale is None:
        return None
    if isinstance(softmax_scale, torch.Tensor):
        if softmax_scale.numel() != 1 or softmax_scale.is_complex() or softmax_scale.dtype == torch.bool:
            raise InvalidInputError(f"softmax_scale must be a real number, got a {softmax_scale.dtype} tensor "
                                    f"of shape {tuple(softmax_scale.shape)}")
    elif isinstance(softmax_scale, numbers.Complex) and not isinstance(softmax_scale, numbers.Real):
        raise InvalidInputError(f"softmax_scale must be a real number, got {type(softmax_scale).__name__} "
                                f"{softmax_scale!r}")
    elif not isinstance(softmax_scale, numbers.Real) or isinstance(softmax_scale, bool):
        # a bool is most likely return_lse or causal passed one place too far
        raise InvalidInputError(
            f"softmax_scale must be a number, got {type(softmax_scale).__name__} {softmax_scale!r}")
    scale = float(softmax_scale)
    if not math.isfinite(scale):
        raise InvalidInputError(f"softmax_scale must be finite, got {scale}")
    if not SOFTMAX_SCALE_MIN <= scale <= SOFTMAX_SCALE_MAX:
        raise InvalidInputError(
            f"softmax_scale must be positive, between 2**-126 and 2**127, got {scale!r}: the kernels' "
            "softmax is exact only for a positive scale, and compute in fp32 with log2(e) folded into it")
    return scale


def window_value(window_size) -> tuple[int, int] | None:
    """window_size as a pair (left, right) of integers >= -1 (a None side read as -1), or None;
    InvalidInputError for anything else."""
    if window_size is None:
        return None
    try:
        return window_pair(window_size)
    except ValueError as exc:
        raise InvalidInputError(f"{exc} (flash-attn's convention: keys left and right of a query's "
                                "diagonal key it sees, -1 for no bound)") from None


def mask_arguments(causal: bool, window_size, softcap, spec: InputSpec):
    """(causal, window, softcap) of a call, resolved as `fa4.kernels.problem.resolve_mask` does
    (flash-attn's conventions; a window at least as wide as the sequences is none, a right side 0 is
    causal); InvalidInputError for values no call may pass."""
    window_value(window_size)
    try:
        return resolve_mask(causal, window_size, softcap, spec.seqlen_q, spec.seqlen_k)
    except ValueError as exc:
        raise InvalidInputError(str(exc)) from None


def device_reasons(spec: InputSpec) -> list[str]:
    if spec.device.type != "cuda":
        return [f"the tensors are on {spec.device}; the kernels run on CUDA GPUs only"]
    return []


def _stride_reasons(name: str, t: torch.Tensor) -> tuple[list[str], bool]:
    """Strides TMA cannot use: the head dim must be contiguous, the others multiples of 16 bytes.

    A dimension of size 1 is never stepped over, so its stride does not matter; the runtime gives it an
    aligned one instead of refusing the tensor (returned flag).
    """
    reasons = []
    restride = False
    shape, strides = t.shape, t.stride()
    if shape[3] > 1 and strides[3] != 1:
        reasons.append(
            f"{name} has stride {strides[3]} in its last (head) dimension; the kernels need it contiguous "
            f"(stride 1): call .contiguous() on {name}")
    item = t.element_size()
    for dim, dim_name in ((0, "batch"), (1, "sequence"), (2, "head")):
        if (strides[dim] * item) % TMA_ALIGN_BYTES:
            if shape[dim] <= 1:
                restride = True
            else:
                reasons.append(
                    f"{name} stride {strides[dim]} of its {dim_name} dimension is {strides[dim] * item} bytes, "
                    f"not a multiple of {TMA_ALIGN_BYTES} (TMA needs 16-byte aligned strides): call "
                    f".contiguous() on {name}")
    return reasons, restride


def aligned_strides(t: torch.Tensor) -> tuple[int, ...]:
    """Strides of `t` with those of size-1 dimensions replaced by aligned, equivalent ones."""
    strides = list(t.stride())
    item = t.element_size()
    for dim in range(t.dim()):
        if t.shape[dim] <= 1 and (strides[dim] * item) % TMA_ALIGN_BYTES:
            # never stepped over: any value is the same tensor; use the extent of the inner dimensions
            inner = [t.shape[d] * strides[d] for d in range(dim + 1, t.dim())]
            strides[dim] = max(inner + [1])
            while (strides[dim] * item) % TMA_ALIGN_BYTES:
                strides[dim] += 1
    return tuple(strides)


def pointers_misaligned(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """The per-call check: the reason a base pointer breaks TMA's 16-byte alignment, or None."""
    if (q.data_ptr() | k.data_ptr() | v.data_ptr()) % TMA_ALIGN_BYTES == 0:
        return None
    bad = [f"{n} at 0x{t.data_ptr():x} (storage offset {t.storage_offset()})"
           for n, t in (("q", q), ("k", k), ("v", v)) if t.data_ptr() % TMA_ALIGN_BYTES]
    return (f"data pointers not {TMA_ALIGN_BYTES}-byte aligned (TMA needs them): {', '.join(bad)}; "
            "usually a view that starts mid-row: call .contiguous() on it")


def kernel_reasons(arch: str, spec: InputSpec, causal: bool, return_lse: bool, window=None,
                   softcap=None) -> list[str]:
    """Why the `arch` kernel family cannot run this problem (head dim, GQA ratio, a window or softcap
    it has no code for, ...), empty if it can.

    Asked with at least one row of each sequence and batch, so the answer is about the shape family,
    not about a zero-length call (which never launches).
    """
    from fa4 import kernels

    problem = AttentionProblem(
        batch=max(spec.batch, 1), seqlen_q=max(spec.seqlen_q, 1), seqlen_k=max(spec.seqlen_k, 1),
        heads_q=spec.heads_q, heads_kv=spec.heads_kv, head_dim=spec.head_dim, dtype=spec.dtype,
        causal=bool(causal), return_lse=bool(return_lse), window=window, softcap=softcap,
        head_dim_v=spec.head_dim_v)
    return [f"the {arch} kernel cannot run {problem.label()}: {r}"
            for r in kernels.family(arch).can_implement(problem)]
