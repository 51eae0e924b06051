"""The attention problem a kernel is asked to solve: shapes, dtype and flags, nothing about tiles."""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass, fields
from typing import Optional

DTYPES = ("fp16", "bf16")
UNBOUNDED = -1  # a side of a sliding window without a bound (flash-attn's convention)


@dataclass(frozen=True, repr=False)
class AttentionProblem:
    """O = softmax(Q K^T * scale) V with Q (B, Sq, Hq, D), K (B, Sk, Hkv, D), V (B, Sk, Hkv, Dv) and
    O (B, Sq, Hq, Dv).

    Query i's diagonal key is i + Sk - Sq (bottom-right aligned, as flash-attn). Causal hides the keys
    right of it. `window` (left, right), a sliding window: query i sees key j when
    diag - left <= j <= diag + right, -1 leaving a side unbounded; under causal its right side is 0.
    `softcap` c: each scaled score s becomes c * tanh(s / c) before the softmax (flash-attn-4 caps the
    score after the softmax scale). Both None: the dense problem (its key, label and dict are those of
    a problem without the fields). One problem has one form: `resolve_mask` turns what a caller gives
    (flash-attn's arguments) into it, and the constructor refuses any other form.

    `varlen`: a variable-length batch in flash-attn's packed layout (`fa4.attention_varlen`): `batch`
    sequences of at most `seqlen_q` queries and `seqlen_k` keys (the call's max_seqlen), each its own
    problem with the masks above. False (a dense batch) leaves it out of the key, label and dict.

    `head_dim_v`: the value (and output) head dim Dv where it differs from `head_dim` (DeepSeek's
    192 / 128); None, or a value equal to `head_dim` (made None), is Dv = D and leaves it out of the
    key, label, repr and dict. Which pairs a kernel runs is its `can_implement`'s.
    """

    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_kv: int
    head_dim: int
    dtype: str = "fp16"
    causal: bool = False
    return_lse: bool = False
    window: Optional[tuple[int, int]] = None
    softcap: Optional[float] = None
    varlen: bool = False
    head_dim_v: Optional[int] = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {DTYPES}")
        for name in ("batch", "seqlen_q", "seqlen_k", "heads_q", "heads_kv", "head_dim"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.heads_kv <= 0 or self.heads_q % self.heads_kv:
            raise ValueError(
                f"heads_q ({self.heads_q}) must be a positive multiple of heads_kv ({self.heads_kv})")
        if self.window is not None:
            # a JSON list (database entries, worker payloads) reads back as the tuple it was
            object.__setattr__(self, "window", window_pair(self.window))
            left, right = self.window
            if left == UNBOUNDED and right == UNBOUNDED:
                raise ValueError("window (-1, -1) bounds no side: give window=None")
            if self.causal and right != 0:
                raise ValueError(f"window {self.window} under causal: its right side is 0 (the causal bound)")
            if self.causal and left == UNBOUNDED:
                raise ValueError("window (-1, 0) under causal is the causal mask: give window=None")
            if not self.causal and right == 0:
                raise ValueError(f"window {self.window} bounds the right side at the diagonal: give causal=True"
                                 + (", window=None" if left == UNBOUNDED else ""))
        if self.softcap is not None:
            object.__setattr__(self, "softcap", softcap_value(self.softcap))
        if self.head_dim_v is not None:
            if isinstance(self.head_dim_v, bool) or not isinstance(self.head_dim_v, numbers.Integral) \
                    or self.head_dim_v < 1:
                raise ValueError(f"head_dim_v must be an integer >= 1 (None: head_dim), got {self.head_dim_v!r}")
            # one form for one problem: Dv = D is the problem without the field
            object.__setattr__(self, "head_dim_v", None if self.head_dim_v == self.head_dim else int(self.head_dim_v))

    def __repr__(self) -> str:
        """The constructor call, a dense problem's without `window` and `softcap` (as before they existed)."""
        shown = (f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)
                 if not (f.name in _LEFT_OUT_WHEN_UNSET and not getattr(self, f.name)))
        return f"AttentionProblem({', '.join(shown)})"

    @property
    def value_head_dim(self) -> int:
        """Dv: the head dim of V and O."""
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    @property
    def gqa_ratio(self) -> int:
        return self.heads_q // self.heads_kv

    @property
    def window_left(self) -> Optional[int]:
        """Keys a query sees left of its diagonal key; None: every one."""
        return None if self.window is None or self.window[0] == UNBOUNDED else self.window[0]

    @property
    def window_right(self) -> Optional[int]:
        """Keys a query sees right of its diagonal key; None: every one (0 under causal)."""
        if self.causal:
            return 0
        return None if self.window is None or self.window[1] == UNBOUNDED else self.window[1]

    def visible_keys(self, row: int) -> tuple[int, int]:
        """[first, last + 1) of the keys query `row` sees (empty when first >= last + 1)."""
        diag = row + self.seqlen_k - self.seqlen_q
        left, right = self.window_left, self.window_right
        first = 0 if left is None else max(0, diag - left)
        stop = self.seqlen_k if right is None else min(self.seqlen_k, max(0, diag + right + 1))
        return first, stop

    def visible_pairs_per_head(self) -> int:
        """(query, key) pairs not masked out, for one batch and head (closed form)."""
        if self.window is None and not self.causal:
            return self.seqlen_q * self.seqlen_k
        if self.window is None and self.seqlen_q == self.seqlen_k:  # the field's convention: exactly half
            return self.seqlen_q * self.seqlen_k // 2
        # row i sees clamp(diag + right + 1, 0, Sk) - clamp(diag - left, 0, Sk) keys
        offset = self.seqlen_k - self.seqlen_q
        left, right = self.window_left, self.window_right
        seen = (self.seqlen_q * self.seqlen_k if right is None
                else _clamped_sum(offset + right + 1, self.seqlen_q, self.seqlen_k))
        hidden = 0 if left is None else _clamped_sum(offset - left, self.seqlen_q, self.seqlen_k)
        return seen - hidden

    def flops(self) -> int:
        """2 * B * Hq * (visible pairs) * (D + Dv): the TFLOP/s convention of the field (4 * ... * D
        when Dv = D)."""
        return 2 * self.batch * self.heads_q * self.visible_pairs_per_head() * (self.head_dim + self.value_head_dim)

    def to_dict(self) -> dict:
        """The fields; a dense problem's leave out `window` and `softcap` (the dicts recorded before
        they existed read the same)."""
        fields = asdict(self)
        for name in _LEFT_OUT_WHEN_UNSET:
            if fields[name] is None or fields[name] is False:
                del fields[name]
        if self.window is not None:
            fields["window"] = list(self.window)
        return fields

    def mask_label(self) -> str:
        """"causal" or "full", then the window and softcap where there are: "causal window (4095, 0)
        softcap 50"."""
        parts = ["causal" if self.causal else "full"]
        if self.window is not None:
            parts.append(f"window ({self.window[0]}, {self.window[1]})")
        if self.softcap is not None:
            parts.append(f"softcap {self.softcap:g}")
        if self.varlen:
            parts.append("varlen")
        return " ".join(parts)

    def label(self) -> str:
        return (f"B{self.batch} Sq{self.seqlen_q} Sk{self.seqlen_k} H{self.heads_q}/{self.heads_kv} "
                f"D{self.head_dim}{'' if self.head_dim_v is None else f' Dv{self.head_dim_v}'} "
                f"{self.dtype} {self.mask_label()}")


# fields a problem without them (dense, Dv = D) leaves out of its repr and dict, as before they existed
_LEFT_OUT_WHEN_UNSET = ("window", "softcap", "varlen", "head_dim_v")


def _clamped_sum(start: int, count: int, limit: int) -> int:
    """sum(clamp(start + i, 0, limit) for i in range(count))."""
    def prefix(n: int) -> int:   # sum(clamp(x, 0, limit) for x in range(n)), n >= 0
        if n <= limit + 1:
            return n * (n - 1) // 2
        return limit * (limit + 1) // 2 + (n - limit - 1) * limit
    stop = start + count
    return prefix(max(stop, 0)) - prefix(max(start, 0))


def window_pair(window) -> tuple[int, int]:
    """(left, right) of a window given as two integers, each >= 0 or -1 (unbounded); None for a side
    reads as -1 (flash-attn-4's spelling). ValueError naming what is wrong."""
    if isinstance(window, (str, bytes)) or not hasattr(window, "__len__") or len(window) != 2:
        raise ValueError(f"window_size must be a pair (left, right), got {window!r}")
    sides = []
    for name, side in zip(("left", "right"), window):
        if side is None:
            side = UNBOUNDED
        if isinstance(side, bool) or not isinstance(side, numbers.Integral):
            raise ValueError(f"window_size {name} side must be an integer (-1: unbounded), got {side!r}")
        side = int(side)
        if side < UNBOUNDED:
            raise ValueError(f"window_size {name} side must be >= 0, or -1 for unbounded, got {side}")
        if side > 2**31 - 1:
            raise ValueError(f"window_size {name} side {side} is past 2**31 - 1 (the kernels' indices are 32-bit)")
        sides.append(side)
    return sides[0], sides[1]


def softcap_value(softcap) -> float:
    """A softcap as a float: a finite number > 0. ValueError otherwise."""
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise ValueError(f"softcap must be a number > 0 (None or 0: no softcap), got {softcap!r}")
    value = float(softcap)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"softcap must be a finite number > 0 (None or 0: no softcap), got {softcap!r}")
    return value


def resolve_mask(causal: bool, window_size, softcap, seqlen_q: int, seqlen_k: int
                 ) -> tuple[bool, Optional[tuple[int, int]], Optional[float]]:
    """(causal, window, softcap) of a problem from flash-attn's arguments: `window_size` (left, right)
    with -1 (or None) unbounded, None or (-1, -1) for none; causal sets the right side to 0
    (flash-attn's rule); `softcap` None or 0 for none. A side that reaches past every key of the
    sequences (left >= Sk - 1, right >= Sq - 1) hides nothing and becomes unbounded, so a window at
    least as wide as the sequences is the dense problem (and runs its kernel); a right side of 0 is
    causal ((-1, 0): the causal problem itself)."""
    softcap = None if softcap is None or (not isinstance(softcap, bool) and softcap == 0) else softcap_value(softcap)
    if window_size is None:
        return causal, None, softcap
    left, right = window_pair(window_size)
    if causal:
        right = 0
    if left >= max(seqlen_k - 1, 0):
        left = UNBOUNDED
    if right >= max(seqlen_q - 1, 0) and not causal:
        right = UNBOUNDED
    if right == 0:
        causal = True   # one form for one mask: a right side of 0 is the causal bound
    if left == UNBOUNDED and right in (UNBOUNDED, 0):
        return causal, None, softcap
    return causal, (left, right), softcap
