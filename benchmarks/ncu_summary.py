"""Summarise Nsight Compute raw CSVs (`ncu --csv --page raw`, one file per shape and implementation) as
one table: the headline metrics, every pipe's utilisation, and the warp stall reasons, side by side.

    python benchmarks/ncu_summary.py $OUT/ncu/*.csv

Each file's kernel is its longest profiled launch (an implementation may launch helpers).
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

HEADLINE = {
    "gpu__time_duration.sum": "duration",
    "sm__cycles_elapsed.max": "cycles elapsed (max SM)",
    "smsp__cycles_active.avg": "SMSP cycles active (avg)",
    "launch__grid_size": "grid",
    "launch__block_size": "block",
    "launch__registers_per_thread": "registers/thread",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "SM throughput %",
    "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed": "memory throughput %",
    "smsp__issue_active.avg.pct_of_peak_sustained_active": "issue slots busy %",
    "smsp__inst_executed.sum": "instructions executed",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "achieved occupancy %",
    "lts__t_sector_hit_rate.pct": "L2 hit %",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "DRAM throughput %",
}
STALL = "smsp__average_warps_issue_stalled_"


def read_all(path: Path) -> list[dict[str, str]]:
    """Every profiled launch of one file, in launch order."""
    rows = [r for r in csv.reader(line for line in path.read_text().splitlines() if line.startswith('"'))]
    if len(rows) < 3:
        return []
    header, kernels = rows[0], rows[2:]  # rows[1] holds the units
    return [dict(zip(header, r)) for r in kernels]


def duration(record: dict[str, str]) -> float:
    return number(record.get("gpu__time_duration.sum")) or 0.0


def number(text: str | None) -> float | None:
    try:
        return float((text or "").replace(",", ""))
    except ValueError:
        return None


def main(paths: list[str]) -> None:
    launches = {Path(p).stem: read_all(Path(p)) for p in paths}
    records = {name: max(runs, key=duration) for name, runs in launches.items() if runs}
    if not records:
        print("no profiles")
        return
    names = list(records)
    width = max(12, *(len(n) for n in names))
    print(f"{'metric':<44}" + "".join(f"{n:>{width + 2}}" for n in names))

    def line(label, metric):
        values = [records[n].get(metric) for n in names]
        if all(v is None for v in values):
            return
        print(f"{label:<44}" + "".join(f"{(v or '-'):>{width + 2}}" for v in values))
    for metric, label in HEADLINE.items():
        line(label, metric)
    for n in names:
        print(f"{'kernel of ' + n:<44} {records[n].get('Kernel Name', '?')[:100]}")
    # every launch of each profile (a backward is a preprocess, the main kernel, a postprocess...)
    for name, runs in launches.items():
        if len(runs) > 1:
            print(f"{'launches of ' + name:<44} " + ", ".join(
                f"{r.get('Kernel Name', '?')[:40]} {duration(r):g}" for r in runs))
    pipes = sorted({m for r in records.values() for m in r
                    if m.startswith("sm__inst_executed_pipe_") and m.endswith("pct_of_peak_sustained_active")
                    or m.startswith("sm__pipe_") and m.endswith("pct_of_peak_sustained_active")})
    for metric in pipes:
        if any((number(records[n].get(metric)) or 0) >= 1 for n in names):
            line(metric.replace(".avg.pct_of_peak_sustained_active", " %")[:44], metric)
    stalls = sorted({m for r in records.values() for m in r if m.startswith(STALL) and m.endswith(".ratio")})
    for metric in stalls:
        if any((number(records[n].get(metric)) or 0) >= 0.05 for n in names):
            line("stall " + metric[len(STALL):].replace("_per_issue_active.ratio", ""), metric)


if __name__ == "__main__":
    main(sys.argv[1:])
