"""Which implementation is fastest for a call: ours or a peer (`fa4.backends`: flash-attn-4, SDPA's backends).

The data (nothing here is a measured number):
- per best-config entry, `backend_us`: the GPU time of every implementation timed at that shape in one
  run (the search's, or a bench folded in by `fa4tune db import-bench`), "ours" being the entry's
  configuration;
- per GPU model, the host time of one eager call of each implementation, shipped as
  `fa4/data/host_overhead.json` (derived from `results/<gpu>/overhead_*.json`, the output of
  `benchmarks/bench_overhead.py`, by `fa4tune.benchmark.host_overhead`; a test holds the two equal).

What a call costs: under CUDA-graph capture or torch.compile ("graph") the GPU time, since the host's
work is paid once at capture; in eager mode the larger of GPU and host time, since the host prepares
the next call while the GPU runs this one, so the longer of the two sets the rate of back-to-back calls
(flash-attn-4 spends ~80-90 us of host time per eager call, more than its kernel at S=1024).

The rule: our kernel runs unless another implementation's cost is lower by more than `TIMING_NOISE`;
ours stays where it wins or ties. A call with no measurement (no entry, or an entry without
`backend_us`) runs ours.

The implementations are ours and the peers of the registry, `fa4.backends` (how each is called,
whether it can give our semantics), read at each choice. `fa4.attention` runs what this module chooses
among those installed and applicable to the call; `fa4.explain` says which runs in each mode, and why,
with the measured ratio.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

from fa4 import backends
from fa4.backends import OURS

MODES = ("eager", "graph")
# Differences below this fraction are timing noise (repeated runs move by ~1 %): a tie, which ours keeps.
TIMING_NOISE = 0.01
HOST_OVERHEAD_SCHEMA = 1


@dataclass(frozen=True)
class Choice:
    """What dispatch picks in one mode. cost_us: the cost of every measured implementation; ratio:
    ours' cost over the chosen one's (1.0 when ours is chosen; > 1: how much faster the chosen is)."""

    mode: str
    backend: str
    cost_us: dict
    ratio: float
    reason: str

    def __str__(self) -> str:
        return f"{self.mode}: {backends.title(self.backend)} ({self.reason})"


def call_cost(gpu_us: float, host_us: Optional[float], mode: str) -> float:
    """The cost of one call in `mode` (see the module docstring)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "graph" or host_us is None:
        return gpu_us
    return max(gpu_us, host_us)


def choose(backend_us: Mapping[str, float], host_us: Mapping[str, float], mode: str) -> Optional[Choice]:
    """The implementation to run, or None when ours was not measured (nothing to compare with).

    In eager mode an implementation whose host time is unknown for this GPU is left out of the
    comparison (its cost cannot be judged), unless no host time is known at all (a GPU model never
    measured: GPU time alone, as in graph mode); in graph mode only GPU time counts."""
    known = backends.implementations()
    gpu = {name: float(us) for name, us in backend_us.items() if name in known and us is not None}
    if OURS not in gpu:
        return None
    # eager calls are judged with host times where this GPU model has them (ours at least); a peer
    # without one cannot be judged and is left out; with none at all, GPU time is all there is
    host = dict(host_us) if mode == "eager" and OURS in host_us else {}
    unknown = sorted(name for name in gpu if name not in host) if host else []
    if host:
        gpu = {name: us for name, us in gpu.items() if name in host}
    cost = {name: call_cost(us, host.get(name), mode) for name, us in gpu.items()}
    best = min(cost, key=lambda name: (cost[name], name != OURS))
    what = "max(GPU, host) time" if host else "GPU time"
    skipped = f"; {', '.join(backends.title(n) for n in unknown)} left out: no host time measured" if unknown else ""
    if best == OURS or cost[OURS] <= cost[best] * (1.0 + TIMING_NOISE):
        others = {n: c for n, c in cost.items() if n != OURS}
        if not others:
            return Choice(mode, OURS, cost, 1.0, f"no other implementation measured{skipped}")
        rival = min(others, key=others.get)
        verdict = "fastest" if cost[OURS] <= cost[rival] else f"within {TIMING_NOISE:.0%}: a tie, ours kept"
        return Choice(mode, OURS, cost, 1.0,
                      f"{what} {cost[OURS]:.1f} us, {cost[rival] / cost[OURS]:.3f}x faster than "
                      f"{backends.title(rival)} ({cost[rival]:.1f} us): {verdict}{skipped}")
    ratio = cost[OURS] / cost[best]
    return Choice(mode, best, cost, ratio,
                  f"{what} {cost[best]:.1f} us vs ours {cost[OURS]:.1f} us: {ratio:.3f}x faster{skipped}")


def host_overhead_path() -> Path:
    return Path(__file__).resolve().parent / "data" / "host_overhead.json"


@functools.lru_cache(maxsize=None)
def _host_table(path: str) -> dict:
    data = json.loads(Path(path).read_text())
    if data.get("schema") != HOST_OVERHEAD_SCHEMA:
        raise ValueError(f"{path}: schema {data.get('schema')!r}, this fa4 reads {HOST_OVERHEAD_SCHEMA}")
    return data["devices"]


def host_us(device_name: str, path: Optional[Path] = None) -> dict:
    """{implementation: host us per eager call} measured on this GPU model ({} when never measured)."""
    devices = _host_table(str(path or host_overhead_path()))
    return dict((devices.get(device_name) or {}).get("host_us", {}))
