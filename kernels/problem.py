"""The attention problem a kernel is asked to solve: shapes, dtype and flags, nothing about tiles."""

from __future__ import annotations

from dataclasses import asdict, dataclass

DTYPES = ("fp16", "bf16")


@dataclass(frozen=True)
class AttentionProblem:
    """O = softmax(Q K^T * scale) V with Q (B, Sq, Hq, D), K and V (B, Sk, Hkv, D).

    Causal masks key j > query i + (Sk - Sq): bottom-right aligned, as flash-attn.
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

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {DTYPES}")
        for name in ("batch", "seqlen_q", "seqlen_k", "heads_q", "heads_kv", "head_dim"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.heads_kv <= 0 or self.heads_q % self.heads_kv:
            raise ValueError(
                f"heads_q ({self.heads_q}) must be a positive multiple of heads_kv ({self.heads_kv})")

    @property
    def gqa_ratio(self) -> int:
        return self.heads_q // self.heads_kv

    def visible_pairs_per_head(self) -> int:
        """(query, key) pairs not masked out, for one batch and head."""
        if not self.causal:
            return self.seqlen_q * self.seqlen_k
        if self.seqlen_q == self.seqlen_k:  # the field's convention: exactly half
            return self.seqlen_q * self.seqlen_k // 2
        offset = self.seqlen_k - self.seqlen_q
        return sum(max(0, min(self.seqlen_k, i + offset + 1)) for i in range(self.seqlen_q))

    def flops(self) -> int:
        """4 * B * Hq * (visible pairs) * D: the TFLOP/s convention of the field."""
        return 4 * self.batch * self.heads_q * self.visible_pairs_per_head() * self.head_dim

    def to_dict(self) -> dict:
        return asdict(self)

    def label(self) -> str:
        mask = "causal" if self.causal else "full"
        return (f"B{self.batch} Sq{self.seqlen_q} Sk{self.seqlen_k} H{self.heads_q}/{self.heads_kv} "
                f"D{self.head_dim} {self.dtype} {mask}")
