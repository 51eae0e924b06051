"""The host time per eager call of each implementation, from `benchmarks/bench_overhead.py` output.

`results/<gpu>/overhead_*.json` (one file per run of the overhead bench) are the measurements; the
runtime ships what it needs of them as `fa4/data/host_overhead.json` (`fa4.dispatch`). Refresh the
shipped table after a new overhead run:

    python -m fa4tune.host_overhead results/h200/overhead_*.json > fa4/data/host_overhead.json

Per implementation, the median over every row that measures it in every given file (the host's
figures move by up to 50 % within a run; the median of several rows and runs resists one slow row).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from fa4.dispatch import HOST_OVERHEAD_SCHEMA

# which rows of bench_overhead.py measure a whole eager call of which implementation
ROWS = {
    "ours": ("fa4.attention (kernel path)", "fa4.attention (kernel path), again at the end"),
    "flash_attn_4": ("flash-attn-4 flash_attn_func",),
    # pinned with torch's sdpa_kernel context manager, as the bench times them: an upper bound of
    # what a dispatch that calls the backend directly would spend
    "sdpa_cudnn": ("SDPA cuDNN backend",),
    "sdpa_flash": ("SDPA flash (FA2) backend",),
}


def derive(paths: list[str | Path]) -> dict:
    """The shipped table's document from overhead bench outputs (every file names its device)."""
    found: dict[str, dict[str, list[float]]] = {}
    sources: dict[str, list[str]] = {}
    for path in sorted(str(p) for p in paths):
        doc = json.loads(Path(path).read_text())
        device = doc["device"]
        sources.setdefault(device, []).append(path)
        for row in doc["rows"]:
            for impl, names in ROWS.items():
                if row.get("name") in names and row.get("host_us") is not None:
                    found.setdefault(device, {}).setdefault(impl, []).append(float(row["host_us"]))
    devices = {device: {"host_us": {impl: round(statistics.median(v), 2) for impl, v in sorted(impls.items())},
                        "sources": sources[device], "method": "median over rows and files, us per eager call"}
               for device, impls in found.items()}
    return {"schema": HOST_OVERHEAD_SCHEMA, "devices": devices}


def to_json(doc: dict) -> str:
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    sys.stdout.write(to_json(derive(sys.argv[1:])))
