"""The host time per eager call of each implementation, from `benchmarks/bench_overhead.py` output.

`results/<gpu>/overhead_*.json` (one file per run of the overhead bench) are the measurements; the
runtime ships what it needs of them as `fa4/data/host_overhead.json` (`fa4.dispatch`). Refresh the
shipped table after a new overhead run:

    python -m fa4tune.benchmark.host_overhead results/h200/overhead_*.json > fa4/data/host_overhead.json

Per implementation, the median over every row that measures it in every given file (the host's
figures move by up to 50 % within a run; the median of several rows and runs resists one slow row):
the rows that call it through `fa4.attention(backend=...)` where any file of the device has one, else
the rows that call it directly ("measured" says which).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from fa4 import backends
from fa4.backends import OURS
from fa4.dispatch import HOST_OVERHEAD_SCHEMA

# The rows of bench_overhead.py that time a whole eager call of each implementation. Preferred: the call
# through fa4.attention with that backend forced, what a user pays per call when dispatch runs it (for
# ours, also fa4.attention's kernel path under "auto"). Runs made before those rows existed have only the
# peers called directly (`Backend.direct_row`; SDPA pinned with torch's sdpa_kernel context manager, as
# the runtime pins it): their figures are used where no file of the device has the fa4.attention row.
KERNEL_PATH_ROWS = ("fa4.attention (kernel path)", "fa4.attention (kernel path), again at the end")
# ours: O allocated and the compiled kernel launched with no Python of ours around it (the bench
# compares with it; the table always has a kernel-path row for ours)
OURS_DIRECT_ROW = "torch.empty_like + direct launcher, nothing else"
THROUGH = "through fa4.attention"
DIRECT = "called directly"


def through_row(impl: str) -> str:
    """The row of one implementation called as `fa4.attention(..., backend=impl)`."""
    return f"fa4.attention(backend={impl!r})"


def through_rows(impl: str) -> tuple[str, ...]:
    return (through_row(impl),) + (KERNEL_PATH_ROWS if impl == OURS else ())


def direct_row(impl: str) -> str | None:
    """The row of one implementation called with nothing of fa4 around it (None: the bench has none)."""
    return OURS_DIRECT_ROW if impl == OURS else backends.get(impl).direct_row


def derive(paths: list[str | Path]) -> dict:
    """The shipped table's document from overhead bench outputs (every file names its device)."""
    found: dict[str, dict[str, dict[str, list[float]]]] = {}  # device -> impl -> how -> host us
    sources: dict[str, list[str]] = {}
    implementations = backends.implementations()
    direct = {impl: direct_row(impl) for impl in implementations}
    for path in sorted(str(p) for p in paths):
        doc = json.loads(Path(path).read_text())
        device = doc["device"]
        sources.setdefault(device, []).append(path)
        for row in doc["rows"]:
            if row.get("host_us") is None:
                continue
            for impl in implementations:
                how = THROUGH if row.get("name") in through_rows(impl) else (
                    DIRECT if direct[impl] is not None and row.get("name") == direct[impl] else None)
                if how:
                    found.setdefault(device, {}).setdefault(impl, {}).setdefault(how, []).append(float(row["host_us"]))
    devices = {}
    for device, impls in found.items():
        chosen = {impl: (THROUGH if THROUGH in hows else DIRECT) for impl, hows in impls.items()}
        devices[device] = {
            "host_us": {impl: round(statistics.median(impls[impl][how]), 2) for impl, how in sorted(chosen.items())},
            "measured": dict(sorted(chosen.items())),
            "sources": sources[device], "method": "median over rows and files, us per eager call"}
    return {"schema": HOST_OVERHEAD_SCHEMA, "devices": devices}


def to_json(doc: dict) -> str:
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    sys.stdout.write(to_json(derive(sys.argv[1:])))
