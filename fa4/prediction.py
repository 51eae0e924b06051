"""The fastest implementation for a shape the database never measured, predicted from shapes it did.

Every entry the searches wrote carries the GPU time of each implementation at its shape (`backend_us`).
At a shape without an entry, the entries of its region (same arch, GPU model, dtype, head dim and mask)
are ranked by distance in the features that move the ratio between implementations: query length,
key length, parallel work (batch x query heads) and the GQA ratio, each on a log2 scale (a shape twice
as long is one step away, as is one with twice the heads). A variable-length batch (`fa4.varlen`) is
compared with varlen entries only (their mask key says so) and by its total query tokens too, a fifth
log2 feature (`fa4.varlen_batch` says why). `fa4.dispatch.choose` names the winner at each neighbour,
in each mode, among the implementations that can run this call.

The confidence rule: the prediction is confident when the `NEIGHBOURS` nearest entries within
`CONFIDENT_DISTANCE` steps all name the same winner and there are at least two of them, or the only one
is within `CLOSE_DISTANCE` (nearly the same shape). Then that winner runs. Otherwise the region votes:
the implementation that won at the most of its `VOTERS` nearest entries runs, ours on a tie (and with
no entry at all).

Ours at a neighbour was timed with the neighbour's tuned configuration, while the untuned shape runs a
borrowed or default one; the prediction compares implementations, not configurations, and
`fa4.explain` lists the neighbours it used so the guess can be checked (`fa4tune search` the shape to
replace it by a measurement).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional

from fa4 import backends, dispatch
from fa4.database import mask_key

NEIGHBOURS = 3
CONFIDENT_DISTANCE = 2.0
CLOSE_DISTANCE = 0.5
# not confident: the vote is over this many nearest entries of the region (None: the whole region);
# chosen by leave-one-out over the packaged database (benchmarks/prediction_loo.py): graph-mode loss
# geomean 1.0177 with 3 voters, 1.0271 with the whole region, 50 vs 41 of 60 entries fastest
VOTERS: int | None = 3


def features(problem: Mapping[str, Any]) -> tuple[float, ...]:
    """(log2 seqlen_q, log2 seqlen_k, log2 batch x heads_q, log2 GQA ratio) of a problem's fields, and
    log2 of a varlen batch's total query tokens where the fields hold them (`tokens_q`)."""
    found = (math.log2(max(int(problem["seqlen_q"]), 1)), math.log2(max(int(problem["seqlen_k"]), 1)),
             math.log2(max(int(problem["batch"]) * int(problem["heads_q"]), 1)),
             math.log2(max(int(problem["heads_q"]) // max(int(problem["heads_kv"]), 1), 1)))
    return found + ((math.log2(max(int(problem["tokens_q"]), 1)),) if "tokens_q" in problem else ())


def entry_fields(entry: Any) -> dict:
    """An entry's problem fields, with a varlen batch's total query tokens (`tokens_q`)."""
    if getattr(entry, "varlen", None) is None:
        return entry.problem
    return {**entry.problem, "tokens_q": sum(entry.varlen["lengths_q"])}


def work(problem: Mapping[str, Any]) -> float:
    """Score and value MMA work of a problem, in units of B x Hq x Sq x Sk (halved when causal; the
    visible pairs under a sliding window)."""
    if problem.get("window") is not None:
        from fa4.kernels import AttentionProblem

        visible = AttentionProblem(**{k: v for k, v in problem.items() if k != "tokens_q"}).visible_pairs_per_head()
        return int(problem["batch"]) * int(problem["heads_q"]) * visible
    full = int(problem["batch"]) * int(problem["heads_q"]) * int(problem["seqlen_q"]) * int(problem["seqlen_k"])
    return full / 2 if problem.get("causal") else full


def distance(a: Mapping[str, Any], b: Mapping[str, Any]) -> float:
    """Sum of the log2 feature differences (`features`) of two problems."""
    return sum(abs(x - y) for x, y in zip(features(a), features(b)))


@dataclass(frozen=True)
class Neighbour:
    """A measured shape near the call's: its database key, distance, and the winner there (with the
    winner's cost ratio over ours: > 1 means ours is that much slower)."""

    key: str
    distance: float
    winner: str
    ratio: float

    def __str__(self) -> str:
        won = ("ours fastest" if self.winner == dispatch.OURS
               else f"{backends.title(self.winner)} {self.ratio:.3f}x faster than ours")
        return f"{self.key} (distance {self.distance:.2f}): {won}"


@dataclass(frozen=True)
class Prediction:
    """What runs in one mode at an unmeasured shape, whether the neighbours agreed, and the evidence."""

    mode: str
    backend: str
    confident: bool
    neighbours: tuple[Neighbour, ...]
    votes: dict
    reason: str

    def __str__(self) -> str:
        return f"{self.mode}: {backends.title(self.backend)} ({self.reason})"


def region(entries: Iterable[Any], arch: str, device_name: str, problem: Any) -> list[Any]:
    """The entries measured on this GPU model for this kind of problem (same arch, dtype, head dim,
    mask: `fa4.database.mask_key`, the causal flag, a window's bucketed sides, a softcap) that timed
    ours and at least one other implementation."""
    mask = mask_key(problem.to_dict())
    return [e for e in entries
            if e.arch == arch and e.device == device_name and e.dtype == problem.dtype
            and e.head_dim == int(problem.head_dim) and mask_key({**e.problem, "causal": e.causal}) == mask
            and dispatch.OURS in (e.backend_us or {}) and len(e.backend_us) > 1]


def predict(entries: Iterable[Any], problem: Any, mode: str, host: Mapping[str, float],
            usable: Callable[[str], bool], tokens: Optional[int] = None) -> Optional[Prediction]:
    """The predicted implementation for `problem` in `mode` from the `region` entries (`entries`,
    already filtered to the region), among the implementations `usable(name)` accepts; None when the
    region has no entry. A varlen problem's total query tokens: `tokens`, else its own."""
    from fa4.varlen_batch import tokens_of

    target = {k: v for k, v in problem.to_dict().items() if k not in ("lengths_q", "lengths_k")}
    if tokens_of(problem, tokens) is not None:
        target["tokens_q"] = tokens_of(problem, tokens)
    ranked = []
    for entry in entries:
        # GPU times scaled to this shape's work: the ratios between implementations carry over, and an
        # eager call's host time (the same at any shape) is weighed against GPU time of this size
        scale = work(target) / work(entry.problem)
        times = {name: us * scale for name, us in entry.backend_us.items()
                 if name == dispatch.OURS or usable(name)}
        choice = dispatch.choose(times, host, mode)
        if choice is None:
            continue
        ranked.append(Neighbour(entry.key, distance(entry_fields(entry), target), choice.backend, choice.ratio))
    if not ranked:
        return None
    ranked.sort(key=lambda n: (n.distance, n.key))
    near = tuple(n for n in ranked[:NEIGHBOURS] if n.distance <= CONFIDENT_DISTANCE)
    winners = {n.winner for n in near}
    votes = dict(Counter(n.winner for n in ranked[:VOTERS]))
    if len(winners) == 1 and (len(near) >= 2 or near[0].distance <= CLOSE_DISTANCE):
        [backend] = winners
        return Prediction(mode, backend, True, near, votes,
                          f"predicted: the {len(near)} nearest measured shape{'s' if len(near) > 1 else ''} "
                          f"agree ({_summary(near)})")
    top = max(votes.values())
    leaders = sorted(name for name, count in votes.items() if count == top)
    backend = dispatch.OURS if dispatch.OURS in leaders or len(leaders) > 1 else leaders[0]
    shown = near or tuple(ranked[:NEIGHBOURS])
    voters = len(ranked[:VOTERS])
    why = ("the nearest measured shapes disagree" if len(winners) > 1 else
           f"no measured shape within {CONFIDENT_DISTANCE:g} log2 steps" if not near else
           f"one measured shape only, {near[0].distance:.2f} log2 steps away")
    tally = ", ".join(f"{backends.title(name)} {count}" for name, count in sorted(votes.items()))
    return Prediction(mode, backend, False, shown, votes,
                      f"not confident ({why}): fastest most often among the {voters} nearest measured "
                      f"shapes of this kind ({tally}){'; ours on a tie' if len(leaders) > 1 else ''}")


def _summary(neighbours: tuple[Neighbour, ...]) -> str:
    return "; ".join(str(n) for n in neighbours)
