"""One of our variants over a peer, problem by problem, from `fa4tune bench` JSON files: the speed bar.

Per problem of the bench: our row's GPU time (`--variant`, "tuned" unless told), the peers' (each
`--peer`; unless told the first registered peer, `fa4.backends.peer_names()`; the fastest of them where
several are named) and the ratio. Then the
geometric mean, the worst ratio and how many problems are at most `--bar`. A problem where no named
peer ran (a launch error, a feature it lacks) is listed and left out of the figures; a problem where
our row did not run (no tuned entry, an error) counts as a miss, so a bench that tuned nothing cannot
pass. Exits 0 when every compared problem is at most the bar and the geometric mean at most
`--geomean-bar`, else 1.

    python benchmarks/peer_ratio.py results/h200/features/bench_features.json
    python benchmarks/peer_ratio.py bench.json --variant default --peer sdpa_cudnn --peer sdpa_flash
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys


def ratios(bench_rows: list[dict], variant: str, peers: list[str]) -> list[dict]:
    """One dict per problem, in the bench's order: shape, ours (us or None), peer (us or None), the peer
    that was fastest, ratio (None where either side has no time) and our row's outcome."""
    by_shape: dict[str, dict[str, dict]] = {}
    for row in bench_rows:
        by_shape.setdefault(row["shape"], {})[row["variant"]] = row
    out = []
    for shape, rows in by_shape.items():
        def timed(name):
            row = rows.get(name) or {}
            return row["us"] if row.get("outcome") == "ok" and row.get("us") else None

        ours = timed(variant)
        peer_times = {name: timed(name) for name in peers if timed(name) is not None}
        fastest_peer = min(peer_times, key=peer_times.get) if peer_times else None
        peer = peer_times.get(fastest_peer)
        out.append({"shape": shape, "ours": ours, "peer": peer, "fastest_peer": fastest_peer,
                    "ratio": ours / peer if ours and peer else None,
                    "outcome": (rows.get(variant) or {}).get("outcome", "absent")})
    return out


def summarise(entries: list[dict], bar: float, geomean_bar: float, variant: str) -> tuple[str, bool]:
    """A markdown table and its verdict line, and whether the bar holds."""
    lines = [f"| problem | {variant} us | peer us (which) | {variant} ÷ peer |", "|---|---|---|---|"]
    compared, misses, no_peer = [], [], []
    for e in entries:
        if e["peer"] is None:
            no_peer.append(e["shape"])
            lines.append(f"| {e['shape']} | {_us(e['ours'])} | no peer ran | - |")
            continue
        if e["ratio"] is None:
            misses.append(f"{e['shape']} (ours: {e['outcome']})")
            lines.append(f"| {e['shape']} | {e['outcome']} | {e['peer']:.1f} ({e['fastest_peer']}) | - |")
            continue
        compared.append(e["ratio"])
        if e["ratio"] > bar:
            misses.append(f"{e['shape']} ({e['ratio']:.3f})")
        lines.append(f"| {e['shape']} | {e['ours']:.1f} | {e['peer']:.1f} ({e['fastest_peer']}) | "
                     f"{e['ratio']:.3f} |")
    mean = statistics.geometric_mean(compared) if compared else math.nan
    holds = not misses and bool(compared) and mean <= geomean_bar
    lines.append("")
    lines.append(f"geomean {mean:.3f} over {len(compared)} compared problems, worst "
                 f"{max(compared, default=math.nan):.3f}, at most {bar:.2f} on "
                 f"{sum(r <= bar for r in compared)} of {len(entries) - len(no_peer)}")
    if no_peer:
        lines.append(f"no peer ran on {len(no_peer)}: {', '.join(no_peer)}")
    if misses:
        lines.append(f"past the bar or not run: {', '.join(misses)}")
    lines.append(f"bar (each <= {bar:.2f}, geomean <= {geomean_bar:.2f}): {'holds' if holds else 'does not hold'}")
    return "\n".join(lines), holds


def _us(value: float | None) -> str:
    return f"{value:.1f}" if value else "-"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bench_files", nargs="+")
    parser.add_argument("--variant", default="tuned", help="our row: tuned, default or dispatched")
    parser.add_argument("--peer", action="append",
                        help="a peer's variant name (repeatable; default: the first registered peer)")
    parser.add_argument("--bar", type=float, default=1.00, help="each problem's ratio at most this")
    parser.add_argument("--geomean-bar", type=float, default=0.95)
    args = parser.parse_args(argv)
    rows = [row for path in args.bench_files for row in json.load(open(path))["rows"]]
    from fa4 import backends

    table, holds = summarise(ratios(rows, args.variant, args.peer or backends.peer_names()[:1]), args.bar,
                             args.geomean_bar, args.variant)
    print(table)
    return 0 if holds else 1


if __name__ == "__main__":
    sys.exit(main())
