"""GPU time of one attention call, measured the same way for our kernel and for every peer.

Method ("cuda_graph"): run the call a few times eagerly (compile, lazy loading), capture
`launches_per_graph` back-to-back calls in one CUDA graph, replay it for at least `warmup_ms` (the
GPU idles at 345 MHz and needs load to clock up; the first trial of a study and the peers would
otherwise be timed slow), then time `replays` replays with CUDA events, each on its own; the result
is the median replay time divided by the launches per graph. Graph replay removes Python launch overhead, which at seqlen 1024 is larger
than the kernel itself.

L2 state, one per study, recorded with it:
- "warm" (default): the inputs stay in L2 across the launches of a replay, as they do when a model
  calls attention on tensors it has just written. At the mission shape Q, K and V (12 MB) fit in L2.
- "flushed": every launch in the graph is preceded by a write of a buffer twice the L2 size; a second
  graph of the flushes alone is timed the same way and its median subtracted.

This module needs CUDA only when its functions are called.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Callable

L2_STATES = ("warm", "flushed")


@dataclass(frozen=True)
class TimingSettings:
    launches_per_graph: int = 20
    replays: int = 7
    warmup_calls: int = 3
    warmup_replays: int = 2
    l2: str = "warm"
    # the GPU idles at a low clock and ramps up under load: replay for at least this long first
    warmup_ms: float = 100.0

    def __post_init__(self) -> None:
        if self.launches_per_graph < 20:
            raise ValueError("launches_per_graph must be >= 20 (launch gaps would show otherwise)")
        if self.replays < 5:
            raise ValueError("replays must be >= 5 (the median needs them)")
        if self.l2 not in L2_STATES:
            raise ValueError(f"l2 must be one of {L2_STATES}, got {self.l2!r}")

    def describe(self) -> dict:
        """The study's "timing" attribute."""
        return {"method": "cuda_graph", "launches_per_graph": self.launches_per_graph,
                "replays": self.replays, "l2": self.l2, "warmup_ms": self.warmup_ms}

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "TimingSettings":
        return cls(**data)


@dataclass
class Timing:
    us: float                       # median GPU time per call, microseconds
    replay_us: list = field(default_factory=list)  # per-call time of each timed replay

    @property
    def spread(self) -> float:
        """(max - min) / median over the timed replays: a noisy measurement shows here."""
        if not self.replay_us or self.us <= 0:
            return 0.0
        return (max(self.replay_us) - min(self.replay_us)) / self.us


def _replay_times_us(graph, replays: int, warmup: int, per_replay_calls: int) -> list[float]:
    import torch

    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    out = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) * 1000.0 / per_replay_calls)
    return out


def _warm_up(graph, min_ms: float) -> None:
    """Replay until `min_ms` of wall time passed, so clocks are up before anything is timed."""
    import time

    import torch

    deadline = time.perf_counter() + min_ms / 1000.0
    while True:
        for _ in range(4):
            graph.replay()
        torch.cuda.synchronize()
        if time.perf_counter() >= deadline:
            return


def _capture(fn: Callable[[], object], launches: int, before_each: Callable[[], object] | None, stream=None):
    import torch

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(launches):
            if before_each is not None:
                before_each()
            fn()
    return graph


def _l2_flush_buffer():
    import torch

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    l2_bytes = int(getattr(props, "L2_cache_size", 0) or 64 * 2**20)
    return torch.empty(2 * l2_bytes, dtype=torch.uint8, device="cuda")


def time_cuda(fn: Callable[[], object], settings: TimingSettings = TimingSettings(), stream=None) -> Timing:
    """GPU time of `fn` (which launches work on the current torch stream) by CUDA-graph replay.
    `stream`: the stream to capture on (default: a fresh one, torch's choice). A backward whose forward
    ran outside the capture needs that forward's stream here: autograd launches each backward op on
    its forward op's stream, and a launch on a stream not being captured breaks the capture."""
    import torch

    for _ in range(settings.warmup_calls):
        fn()
    torch.cuda.synchronize()
    n = settings.launches_per_graph
    if settings.l2 == "warm":
        graph = _capture(fn, n, None, stream)
        _warm_up(graph, settings.warmup_ms)
        times = _replay_times_us(graph, settings.replays, settings.warmup_replays, n)
        del graph
        return Timing(statistics.median(times), times)
    flush_buf = _l2_flush_buffer()
    flush = flush_buf.zero_
    flush()
    torch.cuda.synchronize()
    both = _capture(fn, n, flush, stream)
    only_flush = _capture(lambda: None, n, flush, stream)
    _warm_up(both, settings.warmup_ms)
    t_both = _replay_times_us(both, settings.replays, settings.warmup_replays, n)
    t_flush = _replay_times_us(only_flush, settings.replays, settings.warmup_replays, n)
    base = statistics.median(t_flush)
    times = [t - base for t in t_both]
    del both, only_flush, flush_buf
    return Timing(statistics.median(times), times)


def time_events_us(fn: Callable[[], object], runs: int = 5, calls: int = 10, warmup_calls: int = 3) -> float:
    """GPU time per call of `fn` between two CUDA events around `calls` back-to-back calls, the best of
    `runs`, after `warmup_calls`: no graph, so it takes what a capture cannot (a backward that allocates
    its workspaces, a call with host syncs). Prefer `time_cuda` where the call can be captured."""
    import torch

    for _ in range(warmup_calls):
        fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(runs):
        start.record()
        for _ in range(calls):
            fn()
        stop.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(stop) * 1000 / calls)
    return best


def time_eager(fn: Callable[[], object], calls: int = 100, repeats: int = 5, warmup_calls: int = 10) -> float:
    """Wall time per call of `fn` called back to back eagerly, in microseconds (median of `repeats`
    runs of `calls` calls, each ended by a synchronize): the larger of the host's time per call and the
    GPU's, which is what an eager caller pays (`fa4.dispatch.call_cost`). Not a GPU time: use
    `time_cuda` for that."""
    import time

    import torch

    for _ in range(warmup_calls):
        fn()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        per_call.append((time.perf_counter() - start) * 1e6 / calls)
    return statistics.median(per_call)


def tflops(flops: int, us: float) -> float:
    return flops / (us * 1e-6) / 1e12 if us > 0 else 0.0
