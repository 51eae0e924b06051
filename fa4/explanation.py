"""What `fa4.attention` does with some inputs, and why: the `Explanation` that `fa4.explain` returns
and the runtime's decision (`fa4.planning`) fills in."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fa4 import backends as _backends, dispatch
from fa4.kernels import Config


@dataclass
class Explanation:
    """What `fa4.attention` does with some inputs, and why. `str()` reads as a short report."""

    path: str                      # "kernel" (a launch: ours or a peer, see `runs`), "sdpa" (fallback),
    #                                "empty" (no launch), "no_keys" (O = 0, LSE = -inf)
    problem: str                   # the problem's label
    device: str
    arch: str | None = None
    device_name: str | None = None
    config: Config | None = None
    source: str | None = None      # "forced", "exact", "nearest", "default"
    entry: Any = None              # the database entry used, if any
    distance: float | None = None  # log2 bucket distance of a nearest entry
    layer: str | None = None       # the database layer of the entry ("packaged", "user"; None: one file)
    database: str | None = None    # which database file(s), and their state
    compile_key: tuple | None = None
    compiled: bool = False         # already compiled in this process
    reasons: list[str] = field(default_factory=list)  # why our kernel does not run (sdpa path)
    notes: list[str] = field(default_factory=list)
    # fastest-backend dispatch per mode ("eager", "graph"), from the entry's measured times among the
    # implementations installed and applicable here (`fa4.dispatch.Choice`); empty when nothing was
    # measured at this bucket, or a backend is forced
    backends: list = field(default_factory=list)
    # at a shape without measured times (no exact entry), the winner per mode predicted from the
    # nearest measured shapes (`fa4.prediction.Prediction`, with the neighbours it used)
    predictions: list = field(default_factory=list)
    # which implementation runs per mode: {"eager": name, "graph": name} (`fa4.backends.implementations()`;
    # "graph": under CUDA-graph capture or torch.compile); set when path == "kernel"
    runs: dict = field(default_factory=dict)
    forced_backend: str | None = None  # backend= when it names an implementation
    # under backend="auto": the implementations dispatch chose among (ours first), and why each peer
    # left out of it cannot run this call here ({name: why}: not installed, no semantics for its mask, ...)
    candidates: list = field(default_factory=list)
    left_out: dict = field(default_factory=dict)
    # the backward that runs when an input requires grad: (implementation, why) (`fa4.backward.choose`)
    backward: tuple | None = None
    # the sliding window and softcap in words (`mask_lines`), empty for a dense call
    mask: list = field(default_factory=list)

    def runs_ours(self, mode: str | None = None) -> bool:
        """Whether our kernel runs (in `mode`, or in any mode)."""
        modes = [mode] if mode else list(self.runs)
        return self.path == "kernel" and any(self.runs.get(m, dispatch.OURS) == dispatch.OURS for m in modes)

    def __str__(self) -> str:
        lines = [f"fa4.attention on {self.problem} ({self.device}"
                 + (f", {self.device_name}" if self.device_name else "")
                 + (f", {self.arch}" if self.arch else "") + ")"]
        lines += [f"  {line}" for line in self.mask]
        if self.path == "kernel":
            lines += self._runs_lines()
            if self.candidates:
                lines.append(f"  dispatch among: {', '.join(_backends.title(n) for n in self.candidates)}"
                             + (f" (left out: {'; '.join(self.left_out.values())})" if self.left_out else ""))
            if self.config is not None:
                lines.append(f"  configuration{'' if self.runs_ours() else ' (if our kernel ran)'}: "
                             f"{self.config.label()}")
                lines.append(f"  chosen by: {self._source_text()}")
                lines.append(f"  compiled: {'yes, cached in this process' if self.compiled else 'not yet (compiles on first call)'}")
            if self.backends:
                lines.append(f"  fastest backend, measured at this bucket ({self.entry.backend_source}):")
                lines += [f"    {choice}" for choice in self.backends]
            if self.predictions:
                lines.append("  fastest backend, predicted from the nearest measured shapes (fa4.prediction):")
                shown = None
                for guess in self.predictions:
                    lines.append(f"    {guess}")
                    if guess.neighbours != shown:  # the modes mostly share their neighbours: list them once
                        lines += [f"      neighbour {n}" for n in guess.neighbours]
                        shown = guess.neighbours
        elif self.path == "sdpa":
            lines.append("  runs: torch SDPA (fallback='sdpa'), because:")
            lines += [f"    - {r}" for r in self.reasons]
        elif self.path == "empty":
            lines.append("  runs: nothing (empty output, no launch)")
        elif self.path == "no_keys":
            lines.append("  runs: nothing (seqlen_k = 0: O = 0 and LSE = -inf, no launch)")
        if self.backward:
            lines.append(f"  backward (inputs that require grad): {self.backward[0]} ({self.backward[1]})")
        if self.database:
            lines.append(f"  database: {self.database}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def _runs_lines(self) -> list[str]:
        def title(name):
            return f"our {self.arch} kernel" if name == dispatch.OURS else _backends.title(name)

        why = {c.mode: c for c in self.backends + self.predictions}
        forced = f" (forced: backend={self.forced_backend!r})" if self.forced_backend else ""
        names = set(self.runs.values())
        if len(names) == 1:
            [name] = names
            reason = forced or ("" if name == dispatch.OURS else
                                f" ({'; '.join(f'{m}: {why[m].reason}' for m in dispatch.MODES if m in why)})")
            if not reason and self.candidates and not why:   # auto dispatch with nothing to go by
                reason = (f" (nothing measured at this shape, nor at a shape of its kind on "
                          f"{self.device_name or 'this GPU'} (same dtype, head dim and mask): ours runs; "
                          "`fa4tune search` it, or `fa4tune bench` it and `fa4tune db import-bench`)")
            return [f"  runs: {title(name)}{reason}"]
        lines = ["  runs:"]
        for mode in dispatch.MODES:
            lines.append(f"    {MODE_TITLES[mode]}: {title(self.runs[mode])}"
                         + (f" ({why[mode].reason})" if mode in why else ""))
        return lines

    def _source_text(self) -> str:
        if self.source == "forced":
            return "config= argument (forced)"
        if self.source == "default":
            return "heuristic default (fa4.kernels.default_config): no usable database entry"
        e = self.entry
        what = "exact database hit" if self.source == "exact" else (
            f"nearest database bucket (log2 distance {self.distance:.2f})")
        if self.layer:
            what += f" in the {self.layer} database"
        facts = [f"tuned on {e.device}", f"{e.us:.1f} us", f"{e.tflops:.0f} TFLOP/s"]
        facts += [f"{v:.2f}x vs {k}" for k, v in sorted(e.speedup.items())]
        return f"{what} {e.key} ({', '.join(facts)}; {e.date})"


def mask_lines(causal: bool, window: tuple | None, softcap: float | None) -> list[str]:
    """A resolved window and softcap (`fa4.kernels.problem.resolve_mask`'s) in words: which keys query i
    sees, and what the cap does to a score."""
    lines = []
    if window is not None:
        left, right = window[0], 0 if causal else window[1]
        first = "0" if left < 0 else f"diag - {left}"
        last = "Sk - 1" if right < 0 else "diag" if right == 0 else f"diag + {right}"
        widest = f", at most {left + right + 1} keys" if left >= 0 and right >= 0 else ""
        lines.append(f"window: query i sees keys {first} .. {last} (diag = i + Sk - Sq){widest}")
    if softcap is not None:
        lines.append(f"softcap: each scaled score s becomes {softcap:g} * tanh(s / {softcap:g}) before the softmax")
    return lines


MODE_TITLES = {"eager": "eager calls", "graph": "under CUDA-graph capture or torch.compile"}
