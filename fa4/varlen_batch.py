"""A variable-length batch as the search tunes it and the database keys it: `VarlenProblem`.

Our varlen kernel (`fa4.attention_varlen`, implementation "ours") is compiled for the batch's
`AttentionProblem` with varlen=True: `batch` sequences of at most `seqlen_q` queries and `seqlen_k`
keys (the call's max_seqlen_q and max_seqlen_k). A `VarlenProblem` is that problem together with the
sequences' own lengths, which the kernel reads at run time from cu_seqlens and which decide what a
launch costs. Everything that takes an `AttentionProblem` takes it (the kernels' feasibility, default
and compile key see the compiled problem); the harness measures it on packed tensors of exactly these
lengths.

What decides the best configuration for a batch, and so its database key (`fa4.database.entry_key`:
beside the dense key's device, dtype, head dim, GQA ratio and mask, a `-varlen` mask and a token
bucket), follows from how our kernel launches one. Its grid is max m-blocks x query heads x
sequences, one cell per (m-block, head, sequence): a cell past its sequence's end has no rows and
ends at once, a cell with rows runs its sequence's key blocks (all of them, the causal part, or the
window's).
- max lengths, each bucketed to the next power of two (`sq`, `sk`, as the dense key's lengths): the
  m-blocks per (sequence, head) of the grid and the key blocks of the longest tile, the critical path
  a longest-first scheduler starts first;
- sequences x KV heads, bucketed (`w`, as the dense key's batch x KV heads): how many grid columns
  launch, so with the max length how many CTAs start;
- total query tokens, bucketed (`t`, new): with the heads, the tiles that do work (per head the sum
  over sequences of ceil(L / tile_m)) and so the waves over the SMs. The share of launched cells that
  have rows is about t / (sequences x max_seqlen_q): near 1 the batch launches like a dense one; far
  below 1 (one long sequence among many short ones) most cells are empty, each a launched CTA that
  exits under one CTA per tile (`single`, `single_lpt`) but only a turn of the loop of a persistent
  CTA (`static`, `lpt`), and that trade-off, with the tile shape, is what a search of the batch settles.
Not in the key: the rest of the lengths' histogram (two batches with the same four buckets share an
entry and its configuration) and the exact counts, which change from call to call while the buckets
stay (a serving engine's prefill batches, a packer's rows). The runtime takes the total query tokens
of a call as q.shape[0], which needs no read of the offsets and is the same inside a CUDA-graph
capture.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from fa4.kernels import AttentionProblem
from fa4.kernels.problem import resolve_mask

LENGTH_FIELDS = ("lengths_q", "lengths_k")


@dataclass(frozen=True, repr=False)
class VarlenProblem(AttentionProblem):
    """The varlen `AttentionProblem` our kernel compiles (batch = sequences, seqlen_q / seqlen_k = the
    longest, varlen=True) with the lengths of its sequences (`lengths_q[b]` queries and `lengths_k[b]`
    keys for sequence b; 0 allowed). Build one with `VarlenProblem.of(...)`, which takes flash-attn's
    mask arguments and resolves them against the max lengths as `fa4.attention_varlen` does."""

    lengths_q: tuple = ()
    lengths_k: tuple = ()

    def __post_init__(self) -> None:
        for name in LENGTH_FIELDS:
            lengths = getattr(self, name)
            if isinstance(lengths, (str, bytes)) or not hasattr(lengths, "__iter__"):
                raise ValueError(f"{name} must be a list of sequence lengths, got {lengths!r}")
            lengths = tuple(lengths)
            if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in lengths):
                raise ValueError(f"{name} must hold integers >= 0, got {list(lengths)[:8]}...")
            object.__setattr__(self, name, lengths)
        super().__post_init__()
        reasons = []
        if not self.varlen:
            reasons.append("varlen must be True")
        if not self.lengths_q or len(self.lengths_q) != len(self.lengths_k):
            reasons.append(f"lengths_q ({len(self.lengths_q)}) and lengths_k ({len(self.lengths_k)}) must name "
                           "the same sequences, at least one")
        elif len(self.lengths_q) != self.batch:
            reasons.append(f"batch {self.batch} is not the number of sequences ({len(self.lengths_q)})")
        elif (max(self.lengths_q), max(self.lengths_k)) != (self.seqlen_q, self.seqlen_k):
            reasons.append(f"seqlen_q/seqlen_k {self.seqlen_q}/{self.seqlen_k} are not the longest sequence's "
                           f"({max(self.lengths_q)}/{max(self.lengths_k)})")
        elif self.seqlen_q < 1 or self.seqlen_k < 1:
            reasons.append("no sequence has both queries and keys")
        if reasons:
            raise ValueError("VarlenProblem: " + "; ".join(reasons))

    @classmethod
    def of(cls, lengths_q: Sequence[int], lengths_k: Optional[Sequence[int]] = None, *, heads_q: int,
           heads_kv: int, head_dim: int, dtype: str = "fp16", causal: bool = False, return_lse: bool = False,
           window_size=None, softcap: Optional[float] = None) -> "VarlenProblem":
        """The batch of these lengths (keys as long as the queries unless `lengths_k`), the mask from
        flash-attn's arguments resolved at the max lengths (`fa4.varlen.varlen_problem`'s rule)."""
        lengths_q = tuple(lengths_q)
        lengths_k = lengths_q if lengths_k is None else tuple(lengths_k)
        longest_q = max(lengths_q, default=0)
        longest_k = max(lengths_k, default=0)
        causal, window, softcap = resolve_mask(causal, window_size, softcap, longest_q, longest_k)
        return cls(batch=len(lengths_q), seqlen_q=longest_q, seqlen_k=longest_k, heads_q=heads_q,
                   heads_kv=heads_kv, head_dim=head_dim, dtype=dtype, causal=causal, return_lse=return_lse,
                   window=window, softcap=softcap, varlen=True, lengths_q=lengths_q, lengths_k=lengths_k)

    @property
    def tokens_q(self) -> int:
        """Total query tokens (the packed q's rows)."""
        return sum(self.lengths_q)

    @property
    def tokens_k(self) -> int:
        return sum(self.lengths_k)

    def base(self) -> AttentionProblem:
        """The problem our kernel compiles (this one without the lengths)."""
        return AttentionProblem(**self._compiled_fields())

    def _compiled_fields(self) -> dict:
        fields = AttentionProblem.to_dict(self)
        for name in LENGTH_FIELDS:
            fields.pop(name)
        return fields

    def cu_seqlens(self) -> tuple[list[int], list[int]]:
        """(cu_seqlens_q, cu_seqlens_k) as lists: offsets from 0, one per sequence and one past the end."""
        out = []
        for lengths in (self.lengths_q, self.lengths_k):
            offsets = [0]
            for n in lengths:
                offsets.append(offsets[-1] + n)
            out.append(offsets)
        return out[0], out[1]

    def sequence_problem(self, b: int) -> Optional[AttentionProblem]:
        """Sequence b as a dense problem of batch 1 (its mask resolved at its own lengths), or None
        when it has no query or no key."""
        sq, sk = self.lengths_q[b], self.lengths_k[b]
        if sq == 0 or sk == 0:
            return None
        causal, window, softcap = resolve_mask(self.causal, self.window, self.softcap, sq, sk)
        return AttentionProblem(1, sq, sk, self.heads_q, self.heads_kv, self.head_dim, self.dtype, causal,
                                self.return_lse, window, softcap)

    def flops(self) -> int:
        """The field's convention (`AttentionProblem.flops`) summed over the sequences: the work done,
        not the padded grid's."""
        return sum(p.flops() for b in range(self.batch) if (p := self.sequence_problem(b)) is not None)

    def to_dict(self) -> dict:
        """The compiled problem's fields and the lengths (as lists); `problem_from_dict` reads it back."""
        return {**self._compiled_fields(), "lengths_q": list(self.lengths_q),
                "lengths_k": list(self.lengths_k)}

    def lengths_digest(self) -> str:
        """Six hex digits naming the exact lengths (a study of another batch of one shape is another study)."""
        return hashlib.sha256(repr((self.lengths_q, self.lengths_k)).encode()).hexdigest()[:6]

    def label(self) -> str:
        return f"{AttentionProblem.label(self)} ({self.tokens_q} tokens)"


def problem_from_dict(fields: Mapping[str, Any]) -> AttentionProblem:
    """An `AttentionProblem`, or a `VarlenProblem` when the fields hold lengths (its `to_dict`)."""
    if any(name in fields for name in LENGTH_FIELDS):
        return VarlenProblem(**fields)
    return AttentionProblem(**fields)


def tokens_of(problem: Any, tokens: Optional[int] = None) -> Optional[int]:
    """The total query tokens a varlen problem is keyed by: `tokens` when given (a runtime call: q's
    rows), else the problem's own (`VarlenProblem.tokens_q`); None for a dense problem. ValueError for
    a varlen problem without either."""
    if not getattr(problem, "varlen", False):
        return None
    if tokens is None:
        tokens = getattr(problem, "tokens_q", None)
    if tokens is None:
        raise ValueError(f"the varlen problem {problem.label()} is keyed by its total query tokens: pass tokens=")
    return int(tokens)
