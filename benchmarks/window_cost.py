"""Does a sliding window cost what it shows, or what the sequence is? From one `fa4tune bench` JSON.

Our sm90 kernel skips the key blocks outside a window (only the boundary blocks are masked), so its
time should follow the (query, key) pairs a window leaves visible, not Sq x Sk. This reads the rows of
a bench (`fa4tune bench --shapes-file benchmarks/h200_features.toml --out bench.json`), keeps each
implementation's windowed problems and the causal or full problem of the same shape without one, and
prints per row: the visible pairs (`AttentionProblem.visible_pairs_per_head`, the TFLOP/s convention),
the GPU time, and the time per visible pair relative to the unwindowed problem's (1.0: the window costs
exactly its share; a kernel that masked every block instead of skipping would sit near the unwindowed
time, its per-pair ratio growing as the window narrows).

    python benchmarks/window_cost.py results/h200/features/bench_features.json [--variant tuned]

Rows of the same (implementation, batch, heads, head dim, dtype, mask, softcap) are compared; a window
without its unwindowed problem in the bench is listed with its time per pair alone. Variable-length
batches are left out.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

OURS = ("tuned", "default", "dispatched")   # our rows' variants; any other variant is a peer's
# the problem fields a windowed row and its unwindowed reference share
_SAME = ("batch", "heads_q", "heads_kv", "head_dim", "dtype", "causal", "softcap", "seqlen_q", "seqlen_k")


def _problem(row: dict):
    from fa4.kernels import AttentionProblem

    fields = {k: v for k, v in row["problem"].items() if k in AttentionProblem.__dataclass_fields__}
    if fields.get("window") is not None:
        fields["window"] = tuple(fields["window"])
    return AttentionProblem(**fields)


def _windowed(problem) -> bool:
    return problem.window_left is not None or (not problem.causal and problem.window_right is not None)


def window_rows(bench: dict, variant: str = "tuned") -> list[dict]:
    """One dict per windowed row of `variant` (and per peer row of the same problem): implementation,
    problem label, window, visible pairs (one batch and head), us, us per visible pair and its ratio to
    the unwindowed problem's of the same implementation (None where the bench has none)."""
    # a row's variant is ours ("tuned", "default", "dispatched") or a peer's name
    rows = [r for r in bench["rows"] if r.get("outcome") == "ok" and r.get("us")
            and (r.get("variant") == variant or r.get("variant") not in OURS)
            and not r["problem"].get("varlen")]   # a packed batch's pairs are its sequences', not B x S^2
    by_shape = defaultdict(dict)   # (implementation, shape fields) -> {"windows": [...], "plain": entry}
    out = []
    for row in rows:
        problem = _problem(row)
        impl = row["variant"]
        key = (impl,) + tuple(getattr(problem, f) for f in _SAME)
        pairs = problem.visible_pairs_per_head()
        entry = {"implementation": impl, "problem": problem.label(), "window": problem.window,
                 "visible_pairs": pairs, "us": row["us"], "us_per_mpair": row["us"] / pairs * 1e6}
        if _windowed(problem):
            by_shape[key].setdefault("windows", []).append(entry)
        else:
            by_shape[key]["plain"] = entry
    for key, group in by_shape.items():
        plain = group.get("plain")
        for entry in group.get("windows", []):
            entry["plain_us"] = plain["us"] if plain else None
            entry["per_pair_vs_plain"] = (entry["us_per_mpair"] / plain["us_per_mpair"]) if plain else None
            entry["pairs_vs_plain"] = (entry["visible_pairs"] / plain["visible_pairs"]) if plain else None
            out.append(entry)
    return sorted(out, key=lambda e: (e["implementation"], e["problem"]))


def format_table(entries: list[dict]) -> str:
    lines = ["| implementation | problem | visible pairs (of the unwindowed) | us (unwindowed) | "
             "us per visible pair, ÷ unwindowed |", "|---|---|---|---|---|"]
    for e in entries:
        share = f"{e['pairs_vs_plain']:.3f}" if e["pairs_vs_plain"] is not None else "-"
        plain = f"{e['plain_us']:.1f}" if e["plain_us"] is not None else "-"
        ratio = f"{e['per_pair_vs_plain']:.2f}" if e["per_pair_vs_plain"] is not None else "-"
        lines.append(f"| {e['implementation']} | {e['problem']} | {e['visible_pairs']:,} ({share}) | "
                     f"{e['us']:.1f} ({plain}) | {ratio} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bench", help="a bench JSON (fa4tune bench --out)")
    ap.add_argument("--variant", default="tuned", help="our row to read: tuned, default or dispatched")
    args = ap.parse_args(argv)
    entries = window_rows(json.loads(Path(args.bench).read_text()), args.variant)
    if not entries:
        print("no windowed rows in this bench", file=sys.stderr)
        return 1
    print(format_table(entries))
    return 0


if __name__ == "__main__":
    sys.exit(main())
