"""The held-out verdict from `fa4tune bench` files: how `fa4.attention` does on shapes nobody tuned.

Per shape: the dispatched row (what `fa4.attention` ran: a borrowed or default configuration of ours,
or the implementation predicted fastest) and our default row, each over the fastest peer (every
registered backend, `fa4.backends.peer_names()`: a bar at least as strict as the two fastest peers');
the dispatched row over the fastest row measured at that shape (any implementation, any of our
configurations); and, where the tuned row found a nearest-bucket entry, that configuration too.
Then the geometric means and the shapes past the bars (`--bar`, `--dispatch-bar`).

    python benchmarks/heldout_summary.py results/h200/wide/heldout_1.json results/h200/wide/heldout_2.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from fa4 import backends



def geomean(values: list[float]) -> float:
    return math.exp(sum(map(math.log, values)) / len(values)) if values else math.nan


def _same_configuration(rows: dict[str, dict], fastest: str) -> str | None:
    """The fastest row's variant when it is ours and ran the configuration the dispatched row ran."""
    ran, other = rows["dispatched"].get("config"), rows.get(fastest, {}).get("config")
    return fastest if fastest != "dispatched" and ran and ran == other else None


def summarise(paths: list[str], bar: float, dispatch_bar: float, markdown: bool) -> int:
    shapes: dict[str, dict[str, dict]] = {}
    for path in paths:
        for row in json.load(open(path))["rows"]:
            shapes.setdefault(row["shape"], {})[row["variant"]] = row
    dispatched_ratios, default_ratios, misses = [], [], []
    peers = backends.peer_names()
    header = ("| shape | dispatched us (ran) | default us | " + " | ".join(backends.title(p) for p in peers)
              + " | dispatched ÷ best peer | default ÷ best peer | dispatched ÷ fastest |")
    print(header if markdown else header.replace("|", " "))
    if markdown:
        print("|" + " --- |" * (6 + len(peers)))
    for shape, rows in shapes.items():
        us = {name: row["us"] for name, row in rows.items() if row.get("outcome") == "ok" and row.get("us")}
        peer = min((us[name] for name in backends.peer_names() if name in us), default=None)
        if peer is None or "dispatched" not in us:
            print(f"{shape}: no dispatched row or no peer to compare with ({sorted(us)})")
            misses.append(shape)
            continue
        fastest = min(us.values())
        ran = rows["dispatched"].get("backend") or {}
        d_ratio, f_ratio = us["dispatched"] / peer, us["dispatched"] / fastest
        dispatched_ratios.append(d_ratio)
        default = us.get("default")
        if default:
            default_ratios.append(default / peer)
        flag = " <-- past the bar" if d_ratio > bar or f_ratio > dispatch_bar else ""
        twin = _same_configuration(rows, min(us, key=us.get))
        if flag and f_ratio > dispatch_bar and twin:
            flag += f" (the {twin} row ran the same configuration: the two times' spread, not a choice)"
        if flag:
            misses.append(shape)
        cells = [shape, f"{us['dispatched']:.1f} ({ran.get('graph', '?')})",
                 f"{default:.1f}" if default else "-",
                 *(f"{us.get(p, math.nan):.1f}" for p in peers),
                 f"{d_ratio:.3f}", f"{default / peer:.3f}" if default else "-", f"{f_ratio:.3f}"]
        print(("| " + " | ".join(cells) + " |") if markdown else "  ".join(cells) + flag)
    print(f"\ndispatched ÷ fastest peer: geometric mean {geomean(dispatched_ratios):.4f}, "
          f"worst {max(dispatched_ratios, default=math.nan):.3f} over {len(dispatched_ratios)} shapes "
          f"(bars: each <= {bar}, geometric mean <= 0.97)")
    print(f"default ÷ fastest peer: geometric mean {geomean(default_ratios):.4f}, "
          f"worst {max(default_ratios, default=math.nan):.3f}")
    print(f"{len(misses)} shape(s) past a bar{': ' + ', '.join(misses) if misses else ''}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bench_files", nargs="+")
    parser.add_argument("--bar", type=float, default=1.03, help="dispatched ÷ best peer, per shape")
    parser.add_argument("--dispatch-bar", type=float, default=1.03, help="dispatched ÷ fastest measured")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args(argv)
    return summarise(args.bench_files, args.bar, args.dispatch_bar, args.markdown)


if __name__ == "__main__":
    sys.exit(main())
