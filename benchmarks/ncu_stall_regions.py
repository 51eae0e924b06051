"""Where a kernel's warps stall, by part of the kernel: Nsight Compute's per-instruction warp-stall samples
(`SOURCE=1 bash benchmarks/h200_profile.sh ...`: one `ncu --page source --csv --print-source sass` CSV per
kernel) summed over the loops that issue wgmma (the MMA warps' block loops), the other loops (producer,
dQ writer, waits) and the code outside any loop (prologue, epilogue), then the instructions with the most
samples and their leading stall reasons.

    python benchmarks/ncu_stall_regions.py ncu_source/*.source.csv [--top 25]

A loop is the span from a backward branch's target to the branch. The CSV's columns are found by name
(Nsight versions order and name them a little differently): the address, the SASS text, the
"Warp Stall Sampling (All Samples)" total and any per-reason stall columns.
"""

from __future__ import annotations

import argparse
import csv
import io
import re
import sys
from typing import NamedTuple

_BRANCH = re.compile(r"\bBRA\b[^;]*?(0x[0-9a-f]+)", re.IGNORECASE)


class Instruction(NamedTuple):
    address: int
    text: str
    samples: float
    reasons: dict   # stall reason column -> samples, the non-zero ones


def _number(cell: str) -> float:
    cell = cell.replace(",", "").strip()
    try:
        return float(cell)
    except ValueError:
        return 0.0


def read_source_csv(text: str) -> list[Instruction]:
    """The instructions of one `--page source` CSV, in address order."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if "Source" in line and "Address" in line), None)
    if start is None:
        raise ValueError("no header row with 'Address' and 'Source': not an `ncu --page source --csv` export")
    rows = list(csv.reader(io.StringIO("\n".join(lines[start:]))))
    header = rows[0]
    address_col = next(i for i, h in enumerate(header) if "Address" in h)
    source_col = next(i for i, h in enumerate(header) if h.strip() == "Source")
    samples_col = next(i for i, h in enumerate(header) if h.startswith("Warp Stall Sampling (All"))
    reason_cols = {i: h for i, h in enumerate(header)
                   if "stall" in h.lower() and not h.startswith("Warp Stall Sampling")}
    out = []
    for row in rows[1:]:
        if len(row) <= max(address_col, source_col, samples_col):
            continue
        try:
            address = int(row[address_col].strip(), 16)
        except ValueError:
            continue
        reasons = {h: _number(row[i]) for i, h in reason_cols.items() if _number(row[i])}
        out.append(Instruction(address, row[source_col].strip(), _number(row[samples_col]), reasons))
    return sorted(out, key=lambda i: i.address)


def loops(instructions: list[Instruction]) -> list[tuple[int, int]]:
    """(first, last) address of each backward branch's span, innermost first."""
    spans = []
    for ins in instructions:
        match = _BRANCH.search(ins.text)
        if match and int(match.group(1), 16) <= ins.address:
            spans.append((int(match.group(1), 16), ins.address))
    return sorted(set(spans), key=lambda s: s[1] - s[0])


def regions(instructions: list[Instruction]) -> dict[str, float]:
    """Samples in wgmma loops (each innermost one on its own), in other loops, and outside any loop."""
    spans = loops(instructions)
    mma_spans = [s for s in spans if any("HGMMA" in i.text for i in instructions if s[0] <= i.address <= s[1])]
    # innermost wgmma loops only: a span holding another wgmma span is an outer loop
    inner = [s for s in mma_spans if not any(o != s and s[0] <= o[0] and o[1] <= s[1] for o in mma_spans)]
    out: dict[str, float] = {}
    for ins in instructions:
        where = next((f"wgmma loop {s[0]:#x}-{s[1]:#x}" for s in inner if s[0] <= ins.address <= s[1]), None)
        if where is None:
            where = "other loops" if any(s[0] <= ins.address <= s[1] for s in spans) else "outside loops"
        out[where] = out.get(where, 0.0) + ins.samples
    return out


def report(name: str, instructions: list[Instruction], top: int) -> str:
    total = sum(i.samples for i in instructions) or 1.0
    lines = [f"{name}: {total:.0f} stall samples, {len(instructions)} instructions"]
    if not loops(instructions):   # branch targets not printed as addresses: every sample lands outside
        lines.append("  no backward branch found: the regions below are not the kernel's loops")
    for where, samples in sorted(regions(instructions).items(), key=lambda kv: -kv[1]):
        lines.append(f"  {where:40s} {samples:10.0f}  {100 * samples / total:5.1f} %")
    lines.append(f"  top {top} instructions:")
    for ins in sorted(instructions, key=lambda i: -i.samples)[:top]:
        leading = ", ".join(f"{h} {v:.0f}" for h, v in sorted(ins.reasons.items(), key=lambda kv: -kv[1])[:3])
        lines.append(f"    {ins.address:#07x} {100 * ins.samples / total:5.1f} %  {ins.text[:60]:60s} {leading}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", nargs="+")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    for path in args.csv:
        with open(path) as handle:
            print(report(path.rsplit("/", 1)[-1], read_source_csv(handle.read()), args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
