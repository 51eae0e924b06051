"""Draw a `ReportData` as plotly figures and assemble one self-contained HTML file.

plotly.js is inlined once, so the file opens offline. Per-study views reuse optuna.visualization (the
optimisation history and the parallel coordinates) on the study's successful trials; the cross-study
views (comparison bars, the training pass's bars, speedup heatmaps, failures, knob importance) are drawn
here from plain data.
Also: `render_in_chromium`, which loads a report in headless Chromium (the browser test and the committed
screenshot, `results/report.png`). The command `fa4tune report` is `fa4tune.report.command.report_command`.
"""

from __future__ import annotations

import html
import os
import shutil
import subprocess
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import optuna
import plotly.graph_objects as go
import plotly.offline
from plotly.subplots import make_subplots

from fa4 import backends
from fa4.config_text import label_of

from fa4tune.workers.outcomes import ALL_OUTCOMES
from fa4tune.report.data import (DISPATCH_MODES, DISPATCH_TOLERANCE, DISPATCHED, TRAINING_FA4, ReportData,
                                 ShapeRow, StudyInfo, TrainingRow, baselines, describe_timing, impls,
                                 training_order)

# the rows of ours and fa4.attention's own; every peer brings its colour and title (`fa4.backends`)
OWN_COLORS = {"tuned": "#1f77b4", "default": "#aec7e8", DISPATCHED: "#ff7f0e"}
OWN_NAMES = {"tuned": "fa4tune tuned", "default": "fa4tune default config",
             DISPATCHED: "fa4.attention (dispatched)"}


def impl_colors() -> dict[str, str]:
    """{implementation (`report_data.impls()`): its colour in every figure}."""
    return {**OWN_COLORS, **{peer.name: peer.color for peer in backends.peers()}}


def impl_names() -> dict[str, str]:
    """{implementation: its name in legends and tables}."""
    return {**OWN_NAMES, **{peer.name: peer.title for peer in backends.peers()}}


def _impl_name(impl: str) -> str:
    return impl_names().get(impl, impl)


def _training_name(impl: str) -> str:
    """A training row's implementation as people read it: fa4.attention's row, else the peer's title."""
    return "fa4.attention" if impl == TRAINING_FA4 else _impl_name(impl)


def _training_color(impl: str) -> str | None:
    # fa4.attention has the colour of its forward row ("dispatched": fa4.attention itself)
    return impl_colors().get(DISPATCHED if impl == TRAINING_FA4 else impl)


OUTCOME_COLORS = {
    "ok": "#2ca02c", "infeasible": "#bcbd22", "compile_error": "#ff7f0e", "launch_error": "#d62728",
    "fault": "#8c564b", "timeout": "#7f7f7f", "mismatch": "#e377c2", "interrupted": "#17becf",
    "unrecorded": "#c7c7c7",
}
assert set(ALL_OUTCOMES) <= set(OUTCOME_COLORS), "an outcome without a color"
PLOT_CONFIG = {"displaylogo": False, "responsive": True}
# Bar labels of grouped bars stand upright above their own bar: read horizontally, "1.05×" is wider than
# a bar once five or six implementations share a shape, and neighbouring labels run into each other.
BAR_LABEL = {"textangle": -90, "textfont": {"size": 10}}


# --------------------------------------------------------------------------------------------------
# figures
# --------------------------------------------------------------------------------------------------

def _row_names(rows: Sequence[ShapeRow]) -> list[str]:
    """x labels; arch and device are added only when the rows span more than one."""
    many = len({(r.arch, r.device) for r in rows}) > 1
    return [f"{r.label}<br>{r.arch} {r.device}" if many else r.label for r in rows]


def _ran(entry: dict) -> str:
    """"graph: flash-attn-4, eager: ours": which backend a dispatched row ran in each mode."""
    ran = entry.get("backend") or {}
    return ", ".join(f"{mode}: {_e(backends.title(ran[mode]))}" for mode in DISPATCH_MODES if mode in ran)


def _hover_extra(entry: dict) -> str:
    """What a bar's hover (and a table cell) adds to its time, as HTML: the backends a dispatched row
    ran; the row's eager time per call where the bench measured it; that a SDPA row was timed on
    expanded K and V."""
    parts = []
    if entry.get("backend"):
        parts.append("ran: " + _ran(entry))
    if entry.get("eager_us") is not None:
        parts.append(f"eager: {entry['eager_us']:.2f} µs per call")
    if entry.get("kv_expanded"):
        parts.append("K and V expanded to the query heads")
    return "".join("<br>" + p for p in parts)


def comparison_figure(rows: Sequence[ShapeRow]) -> go.Figure:
    """Per shape: µs (top) and TFLOP/s (bottom) of every implementation; labels = time / tuned time."""
    names = _row_names(rows)
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.06,
                        subplot_titles=("kernel time, µs (lower is better); label: its time ÷ tuned time",
                                        "TFLOP/s (higher is better)"))
    for impl in impls():
        if not any("us" in r.impls.get(impl, {}) for r in rows):
            continue
        us = [r.impls.get(impl, {}).get("us") for r in rows]
        tf = [r.impls.get(impl, {}).get("tflops") for r in rows]
        labels = []
        for r in rows:
            s = r.speedup.get(impl)
            labels.append("tuned" if impl == "tuned" and "us" in r.impls.get("tuned", {})
                          else (f"{s:.2f}×" if s is not None else ""))
        common = dict(name=_impl_name(impl), marker_color=impl_colors().get(impl), legendgroup=impl,
                      textposition="outside", cliponaxis=False, **BAR_LABEL)
        extra = [_hover_extra(r.impls.get(impl, {})) for r in rows]
        fig.add_trace(go.Bar(x=names, y=us, text=labels, customdata=extra,
                             hovertemplate="%{x}<br>%{y:.2f} µs%{customdata}<extra>" + _impl_name(impl)
                             + "</extra>", **common), row=1, col=1)
        fig.add_trace(go.Bar(x=names, y=tf, showlegend=False, texttemplate="%{y:.0f}",
                             hovertemplate="%{x}<br>%{y:.0f} TFLOP/s<extra>" + _impl_name(impl)
                             + "</extra>", **common), row=2, col=1)
    times = [us for r in rows for e in r.impls.values() for us in [e.get("us")] if us]
    if times and max(times) > 8 * min(times):  # shapes of very different cost: keep small ones readable
        ticks = [m * 10 ** e for e in range(-1, 6) for m in (1, 2, 5)
                 if min(times) / 2 <= m * 10 ** e <= max(times) * 2]
        fig.update_yaxes(type="log", tickvals=ticks, row=1, col=1)
    fig.update_layout(barmode="group", height=760, margin=dict(t=60, b=40),
                      legend=dict(orientation="h", y=1.08, x=0), uniformtext=dict(minsize=8, mode="hide"))
    fig.update_yaxes(title_text="µs", row=1, col=1)
    fig.update_yaxes(title_text="TFLOP/s", row=2, col=1)
    return fig


def training_figure(rows: Sequence[TrainingRow]) -> go.Figure:
    """Per shape: the backward alone (top) and forward + backward (bottom) of every implementation that
    trained it; labels = its time ÷ the fastest peer's in that pass."""
    shapes: list[tuple] = []
    for r in rows:
        if (r.arch, r.device, r.label) not in shapes:
            shapes.append((r.arch, r.device, r.label))
    many = len({(a, d) for a, d, _ in shapes}) > 1
    names = [f"{label}<br>{arch} {device}" if many else label for arch, device, label in shapes]
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        subplot_titles=("backward alone, µs (lower is better); label: its time ÷ the fastest "
                                        "peer's", "forward + backward, µs (lower is better)"))
    implementations = sorted({r.implementation for r in rows}, key=lambda i: (training_order(i), i))
    for impl in implementations:
        mine = {(r.arch, r.device, r.label): r for r in rows if r.implementation == impl}
        if not any(r.bwd_us is not None or r.fwdbwd_us is not None for r in mine.values()):
            continue
        common = dict(name=_training_name(impl), marker_color=_training_color(impl), legendgroup=impl,
                      textposition="outside", cliponaxis=False, **BAR_LABEL)
        for subplot, pass_ in ((1, "bwd"), (2, "fwdbwd")):
            us = [getattr(mine[s], f"{pass_}_us") if s in mine else None for s in shapes]
            ratios = [getattr(mine[s], f"{pass_}_ratio") if s in mine else None for s in shapes]
            extra = ["".join("<br>" + e for e in _training_notes(mine[s])) if s in mine else "" for s in shapes]
            fig.add_trace(go.Bar(x=names, y=us, text=[f"{x:.2f}×" if x is not None else "" for x in ratios],
                                 customdata=extra, showlegend=subplot == 1,
                                 hovertemplate="%{x}<br>%{y:.2f} µs%{customdata}<extra>" + _training_name(impl)
                                 + "</extra>", **common), row=subplot, col=1)
    fig.update_layout(barmode="group", height=700, margin=dict(t=60, b=40),
                      legend=dict(orientation="h", y=1.08, x=0), uniformtext=dict(minsize=8, mode="hide"))
    fig.update_yaxes(title_text="µs", row=1, col=1)
    fig.update_yaxes(title_text="µs", row=2, col=1)
    return fig


def _training_notes(row: TrainingRow) -> list[str]:
    """What a training bar's hover adds (as HTML): the backward that ran, its peak extra memory, K and V
    expanded, gradients not checked."""
    notes = []
    if row.backward:
        notes.append(f"backward: {_e(row.backward)}")
    if row.peak_extra_mib is not None:
        notes.append(f"peak extra: {row.peak_extra_mib:.1f} MiB")
    if row.kv_expanded:
        notes.append("K and V expanded to the query heads (inside the timed call)")
    if row.validated is False:
        notes.append("gradients not validated (a bench file from before the reference was computed in chunks)")
    return notes


def heatmap_figure(data: ReportData) -> go.Figure:
    maps = data.heatmaps
    fig = make_subplots(rows=1, cols=len(maps), shared_yaxes=True, horizontal_spacing=0.02,
                        subplot_titles=[f"tuned vs {_impl_name(m.baseline)}" for m in maps])
    values = [v for m in maps for row in m.z for v in row if v is not None]
    spread = max([abs(v - 1.0) for v in values] + [0.05])
    for col, m in enumerate(maps, start=1):
        text = [[f"{v:.2f}×" if v is not None else "" for v in row] for row in m.z]
        fig.add_trace(go.Heatmap(
            x=m.x, y=m.y, z=m.z, text=text, texttemplate="%{text}", zmin=1 - spread, zmax=1 + spread,
            zmid=1.0, colorscale="RdBu", showscale=(col == len(maps)), hoverongaps=False,
            colorbar=dict(title="speedup"),
            hovertemplate="%{y}<br>%{x}<br>tuned is %{z:.2f}× the speed<extra>" + m.baseline + "</extra>"),
            row=1, col=col)
    fig.update_layout(height=max(320, 120 + 40 * max((len(m.y) for m in maps), default=1)),
                      margin=dict(l=10, t=60))
    fig.update_yaxes(autorange="reversed")
    return fig


def failures_figure(data: ReportData) -> go.Figure:
    names, classes, counts = data.failure_table
    labels = [_study_short(s) for s in data.studies]
    fig = go.Figure()
    for outcome, row in zip(classes, counts):
        fig.add_trace(go.Bar(y=labels, x=row, name=outcome, orientation="h",
                             marker_color=OUTCOME_COLORS.get(outcome),
                             hovertemplate="%{y}<br>%{x} trials<extra>" + outcome + "</extra>"))
    fig.update_layout(barmode="stack", height=max(300, 110 + 26 * len(labels)), xaxis_title="trials",
                      yaxis=dict(autorange="reversed"), margin=dict(l=10, t=30),
                      legend=dict(orientation="h", y=1.06, x=0))
    return fig


def importance_figure(data: ReportData) -> go.Figure:
    names, knobs, z = data.importance_table
    by_name = {s.name: s for s in data.studies}
    labels = [_study_short(by_name[n]) for n in names]
    text = [[f"{v:.2f}" if v is not None else "" for v in row] for row in z]
    fig = go.Figure(go.Heatmap(x=knobs, y=labels, z=z, text=text, texttemplate="%{text}", zmin=0, zmax=1,
                               colorscale="Blues", hoverongaps=False, colorbar=dict(title="importance"),
                               hovertemplate="%{y}<br>%{x}: %{z:.3f}<extra></extra>"))
    fig.update_layout(height=max(300, 120 + 30 * len(labels)), yaxis=dict(autorange="reversed"),
                      margin=dict(l=10, t=30))
    return fig


def history_figure(study: StudyInfo) -> go.Figure:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        fig = optuna.visualization.plot_optimization_history(study.ok_study, target_name="kernel µs")
    # optuna numbered the copied successful trials 0, 1, ...; put back the search's own trial numbers
    numbers = [number for number, _, _ in study.history]
    if len(numbers) == len(study.ok_study.trials):
        for trace in fig.data:
            if trace.x is not None and all(isinstance(x, int) and 0 <= x < len(numbers) for x in trace.x):
                trace.x = [numbers[x] for x in trace.x]
        axis_title = "trial number (successful trials only)"
    else:
        axis_title = "successful trials, in search order"
    # reference times as dashed lines named in the legend (annotations next to each other overlap)
    refs = [("default", study.default_us)] + [
        (peer, (study.peers.get(peer) or {}).get("us")) for peer in baselines()[1:]]
    first, last = (numbers[0], numbers[-1]) if numbers else (0, 1)
    last = max(last, first + 1)
    for impl, us in refs:
        if isinstance(us, (int, float)) and not isinstance(us, bool) and us > 0:
            fig.add_trace(go.Scatter(x=[first, last], y=[us, us], mode="lines", hoverinfo="name",
                                     line=dict(dash="dash", width=1.5, color=impl_colors().get(impl)),
                                     name=f"{_impl_name(impl)} {us:.1f}"))
    fig.update_layout(title=dict(text="optimisation history", font_size=14), height=440,
                      margin=dict(t=50, r=10), xaxis_title=axis_title,
                      legend=dict(orientation="h", yanchor="top", y=-0.22, x=0, font_size=11))
    return fig


def parallel_figure(study: StudyInfo) -> go.Figure:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        fig = optuna.visualization.plot_parallel_coordinate(study.ok_study, params=study.knob_names or None,
                                                            target_name="kernel µs")
    fig.update_layout(title=dict(text="knobs vs kernel time (successful trials)", font_size=14),
                      height=380, margin=dict(t=80))
    return fig


# --------------------------------------------------------------------------------------------------
# HTML
# --------------------------------------------------------------------------------------------------

def _e(x) -> str:
    return html.escape(str(x))


def _fmt(x, spec: str = ".2f", none: str = "–") -> str:
    return format(x, spec) if isinstance(x, (int, float)) and not isinstance(x, bool) else none


def _study_short(s: StudyInfo) -> str:
    return f"{s.arch} {s.label}"


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], cls: str = "") -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _config_label(config: dict) -> str:
    # the label every tool prints and config= accepts (booleans as on/off)
    return label_of(config.items())


def _state_badge(state: str) -> str:
    return f'<span class="badge {state}">{_e(state)}</span>'


CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0 auto; max-width: 1400px;
       padding: 16px 24px; color: #222; background: #fff; }
h1 { margin: 4px 0 2px; } h2 { margin-top: 34px; border-bottom: 1px solid #ddd; padding-bottom: 4px; }
h3 { margin: 22px 0 4px; }
.meta { color: #555; font-size: 14px; } .meta td { padding: 1px 10px 1px 0; vertical-align: top; }
.note { background: #fff4e5; border-left: 4px solid #f0a020; padding: 8px 12px; margin: 8px 0; }
.missing { background: #f3f3f3; border-left: 4px solid #999; padding: 8px 12px; margin: 8px 0; }
.caption { color: #444; font-size: 14px; max-width: 1100px; }
table { border-collapse: collapse; font-size: 13px; margin: 8px 0; }
th, td { border: 1px solid #ddd; padding: 3px 7px; text-align: left; vertical-align: top; }
th { background: #f6f6f6; } td.num { text-align: right; }
.badge { padding: 0 6px; border-radius: 3px; font-size: 12px; }
.badge.current { background: #dff0d8; } .badge.stale { background: #f2dede; font-weight: bold; }
.badge.unknown { background: #eee; }
.pair { display: grid; grid-template-columns: 2fr 3fr; gap: 8px; }
code { font-size: 12px; }
"""


@dataclass
class BuiltReport:
    path: Path
    figure_ids: list[str]       # the id of every plot div, in page order
    size_bytes: int


class _Page:
    def __init__(self) -> None:
        self.parts: list[str] = []
        self.figure_ids: list[str] = []

    def add(self, text: str) -> None:
        self.parts.append(text)

    def figure(self, fig: go.Figure) -> str:
        div_id = f"fig{len(self.figure_ids)}"
        self.figure_ids.append(div_id)
        fig.update_layout(template="plotly_white", autosize=True)
        return fig.to_html(full_html=False, include_plotlyjs=False, div_id=div_id, config=PLOT_CONFIG,
                           default_width="100%", default_height=f"{fig.layout.height or 450}px")


def _header(data: ReportData, page: _Page) -> None:
    page.add("<h1>fa4tune report</h1>")
    meta = [
        ("generated", _e(data.generated)),
        ("devices", _e(", ".join(data.devices) or "none recorded")),
        ("timing", "<br>".join(_e(t) for t in data.timing) or "none recorded"),
        ("versions", "<br>".join(_e(v) for v in data.versions) or "none recorded"),
        ("kernel sources now", _e(", ".join(f"{a} {fp or 'unavailable (kernel family not importable here)'}"
                                            for a, fp in data.fingerprints.items()) or "–")),
        ("inputs read", "<br>".join(f"{_e(k)}: {_e(v)}" for k, v in data.sources.items()) or "none"),
    ]
    page.add('<table class="meta">' + "".join(f"<tr><td><b>{k}</b></td><td>{v}</td></tr>" for k, v in meta)
             + "</table>")
    summary = data.speedups
    if summary:
        rows = [[_e(_impl_name(b)), str(int(v["n"])), f"{int(v['wins'])} of {int(v['n'])}",
                 f"<b>{v['geomean']:.2f}×</b>", f"{v['min']:.2f}×", f"{v['max']:.2f}×"]
                for b, v in summary.items()]
        page.add("<h3>Tuned kernel speedup over each baseline (its time ÷ tuned time)</h3>"
                 + _table(["baseline", "shapes", "tuned faster", "geometric mean", "min", "max"], rows))
    for note in data.warnings:
        page.add(f'<div class="note">{_e(note)}</div>')
    for line in data.missing:
        page.add(f'<div class="missing">missing: {_e(line)}</div>')


def _comparison_section(data: ReportData, page: _Page) -> None:
    page.add("<h2>Tuned vs default vs peers, per shape</h2>")
    rows = data.shape_rows
    if not rows:
        page.add('<div class="missing">No shape has a measurement: neither bench results nor a search '
                 "with a successful trial.</div>")
        return
    sources = sorted({r.source for r in rows})
    page.add('<p class="caption">Each group is one attention problem. "tuned" is our kernel with the best '
             'configuration found, "default" our kernel with the heuristic default configuration; peers and '
             '"dispatched" (<code>fa4.attention</code> itself, whichever implementation it ran; hover for which) '
             "were timed in the same run with the same method. A label is that implementation's time divided by "
             "the tuned time: above 1 means the tuned kernel is faster. Rows from "
             f"{' and '.join(sources)} data (bench rows are preferred where both exist).</p>")
    page.add(page.figure(comparison_figure(rows)))
    shown = [i for i in impls() if any(i in r.impls for r in rows)]
    table_rows = []
    for r in rows:
        cells = [_e(r.label), _e(r.arch), _e(r.device), _e(r.source)]
        for impl in shown:
            entry = r.impls.get(impl)
            if entry is None:
                cells.append("")
            elif "us" in entry:
                s = r.speedup.get(impl)
                cells.append(f"{entry['us']:.2f} µs<br>{_fmt(entry.get('tflops'), '.0f')} TFLOP/s"
                             + (f"<br><b>{s:.2f}×</b>" if s is not None else "")
                             + _hover_extra(entry))
            else:
                cells.append(f"<i>{_e(entry.get('error', ''))}</i>")
        table_rows.append(cells)
    page.add(_table(["shape", "arch", "device", "source"] + [_impl_name(i) for i in shown], table_rows))


def _dispatch_section(data: ReportData, page: _Page) -> None:
    """fa4.attention's own row per shape beside the fastest implementation of the same run: a table
    (its time is a bar of the comparison figure already)."""
    if not data.dispatch:
        return  # a bench without the dispatched row (or none at all): nothing to say
    page.add("<h2>What fa4.attention ran, per shape (fastest-backend dispatch)</h2>")
    page.add('<p class="caption">The "dispatched" row of <code>fa4tune bench</code>: <code>fa4.attention</code> '
             "itself, with the database the bench read, timed like every other row (GPU time by CUDA-graph "
             "replay: what a captured or compiled call costs) and per back-to-back eager call (wall time). "
             "<i>ran</i> is the implementation it ran in each mode, chosen from the database's times; "
             "<i>this run picks</i> is what dispatch would choose from this run's own times, shown where "
             "it differs. <i>fastest in the run</i> is the fastest of our kernel (as fa4.attention runs it) "
             "and every peer, leaving out SDPA rows timed on K and V expanded to the query heads, by GPU "
             "time and, separately, by eager time per call. "
             f"✓: within {DISPATCH_TOLERANCE:.0%} of it.</p>")
    rows = []
    for d in data.dispatch:
        differs = {m: n for m, n in d.picked.items() if d.ran.get(m) != n}
        rows.append([
            _e(d.label), _e(d.arch), _e(d.device),
            _e(backends.title(d.ran["graph"])) if "graph" in d.ran else "–",
            f"{d.us:.2f}",
            _fastest_cell(d.fastest, d.fastest_us),
            _ratio_cell(d.ratio, d.graph_within_tolerance),
            _e(backends.title(d.ran["eager"])) if "eager" in d.ran else "–",
            _fmt(d.eager_us),
            _fastest_cell(d.eager_fastest, d.eager_fastest_us),
            _ratio_cell(d.eager_ratio, d.eager_within_tolerance),
            _e(", ".join(f"{m}: {backends.title(n)}" for m, n in differs.items())) or "same",
        ])
    page.add(_table(["shape", "arch", "device", "graph: ran", "GPU µs", "fastest in the run", "graph ratio",
                     "eager: ran", "eager µs per call", "eager: fastest in the run", "eager ratio",
                     "this run picks"], rows))


def _training_section(data: ReportData, page: _Page) -> None:
    """The bench's training pass (`fa4tune bench --backward`): a figure and a table; nothing for a bench
    run without it."""
    if not data.training:
        return
    page.add("<h2>Training pass (forward + backward)</h2>")
    page.add('<p class="caption">From <code>fa4tune bench --backward</code>: per shape, '
             "<code>fa4.attention</code> (its forward and the backward <code>fa4.backward</code> chose; "
             "<i>backward</i> names it) and every peer through autograd. <i>fwd+bwd</i>: forward and "
             "<code>torch.autograd.grad</code> to Q, K and V; <i>bwd</i>: the backward alone on one "
             "forward's saved tensors, the lowest over rounds; both GPU time by CUDA-graph replay. A ratio is "
             "that time ÷ the fastest peer's in the same pass (below 1: faster than every peer). "
             "<i>peak extra</i>: the most memory one backward call allocated beyond what was live before it "
             "(dQ, dK, dV included). <i>validated</i>: dQ, dK, dV checked against fp32 autograd (no: a "
             "file from before the reference was computed in chunks, when it did not fit). A peer that "
             "refuses GQA ran on K and V expanded to the query heads inside its timed call, so its time "
             "includes the expansion.</p>")
    page.add(page.figure(training_figure(data.training)))
    many = len({(r.arch, r.device) for r in data.training}) > 1
    rows = []
    for r in data.training:
        shape = _e(r.label) + (f"<br><small>{_e(r.arch)} {_e(r.device)}</small>" if many else "")
        name = _e(_training_name(r.implementation)) + (
            "<br><small>K, V expanded</small>" if r.kv_expanded else "")
        if r.outcome != "ok" or r.bwd_us is None:
            rows.append([shape, name, f'<i>{_e(r.outcome)}: {_e(r.error or "no time recorded")}</i>',
                         "", "", "", "", ""])
            continue
        ratios = " / ".join(_fmt(x, ".2f") + ("×" if x is not None else "") for x in (r.fwdbwd_ratio, r.bwd_ratio))
        rows.append([shape, name, _fmt(r.fwdbwd_us), _fmt(r.bwd_us), ratios, _fmt(r.peak_extra_mib, ".1f"),
                     {True: "yes", False: "no"}.get(r.validated, "–"), _e(r.backward or "–")])
    page.add(_table(["shape", "implementation", "fwd+bwd µs", "bwd µs",
                     "ratio to the fastest peer (fwd+bwd / bwd)", "peak extra MiB", "validated", "backward"],
                    rows))


def _fastest_cell(impl: str | None, us: float | None) -> str:
    return _e(_impl_name(impl)) + f" ({_fmt(us)} µs)" if impl else "–"


def _ratio_cell(ratio: float | None, within: bool | None) -> str:
    return f"{ratio:.3f}× " + ("✓" if within else "✗") if ratio is not None else "–"


def _heatmap_section(data: ReportData, page: _Page) -> None:
    page.add("<h2>Speedup of the tuned kernel over the shapes searched</h2>")
    if not data.heatmaps:
        page.add('<div class="missing">No shape has both a tuned and a baseline time.</div>')
        return
    page.add('<p class="caption">Cell = baseline time ÷ tuned time (blue: tuned is faster, red: slower). '
             "Rows: architecture, dtype, head dim, query/KV heads, mask; columns: batch and sequence lengths."
             "</p>")
    page.add(page.figure(heatmap_figure(data)))


def _failures_section(data: ReportData, page: _Page) -> None:
    page.add("<h2>Trial outcomes by class</h2>")
    if not data.studies:
        page.add('<div class="missing">No optuna study was read.</div>')
        return
    page.add('<p class="caption">Every finished trial of every study, by the outcome the search recorded: '
             "infeasible (rejected before compiling, with reasons), compile_error, launch_error, fault, "
             "timeout, mismatch (wrong result against the reference), interrupted (the harness died "
             "meanwhile) or ok. A configuration evaluated twice counts once.</p>")
    page.add(page.figure(failures_figure(data)))


def _importance_section(data: ReportData, page: _Page) -> None:
    page.add("<h2>Knob importance</h2>")
    names, knobs, _ = data.importance_table
    if not names:
        reasons = sorted({s.importance_note for s in data.studies}) or ["no optuna study was read"]
        page.add('<div class="missing">Not computed: ' + "; ".join(_e(r) for r in reasons) + "</div>")
        return
    page.add('<p class="caption">PED-ANOVA (optuna <code>PedAnovaImportanceEvaluator</code>): how much each '
             "knob decides whether a configuration lands in the fastest 10 % of successful trials, normalised "
             "per study. Knobs a study never varied are blank.</p>")
    page.add(page.figure(importance_figure(data)))
    skipped = [s for s in data.studies if not s.importance]
    if skipped:
        page.add('<p class="caption">Not computed for: ' + "; ".join(
            f"{_e(_study_short(s))} ({_e(s.importance_note)})" for s in skipped) + "</p>")


def _best_configs_section(data: ReportData, page: _Page) -> None:
    page.add("<h2>Best configurations (the database the runtime reads)</h2>")
    if not data.best_configs:
        page.add('<div class="missing">No best-config entries.</div>')
        return
    page.add('<p class="caption">Fingerprint: hash of the kernel sources at measurement time; '
             '"stale" when it differs from the sources now (the configuration may no longer be the best, '
             "or valid).</p>")
    rows = []
    for r in data.best_configs:
        rows.append([
            _e(r.arch), _e(r.device),
            _e(r.shape) + (f"<br><small>tuned on {_e(r.tuned_on)}</small>" if r.tuned_on else ""),
            f"<code>{_e(_config_label(r.config))}</code>",
            _fmt(r.us), _fmt(r.tflops, ".0f"),
            "<br>".join(f"{_e(k)} {v:.2f}×" for k, v in sorted(r.speedup.items())) or "–",
            _fmt(r.max_err, ".1e"),
            f"<code>{_e(r.kernel_fingerprint or '–')}</code> {_state_badge(r.fingerprint_state)}",
            _e(", ".join(f"{k} {v}" for k, v in sorted(r.versions.items())) or "–"), _e(r.date),
            _e(f"{r.study} #{r.trial}" if r.study else "–"),
        ])
    page.add(_table(["arch", "device", "bucket", "config", "µs", "TFLOP/s", "speedup", "max err",
                     "fingerprint", "versions", "date", "study / trial"], rows))


def _studies_section(data: ReportData, page: _Page) -> None:
    page.add("<h2>Searches</h2>")
    if not data.studies:
        page.add('<div class="missing">No optuna study was read.</div>')
        return
    rows = []
    for s in data.studies:
        fails = sum(n for o, n in s.outcomes.items() if o != "ok")
        best = s.best["us"] if s.best else None
        gain = (s.default_us / best) if best and s.default_us else None
        rows.append([f'<a href="#{_e(s.name)}">{_e(s.label)}</a>', _e(s.arch), _e(s.device.get("name", "–")),
                     str(s.n_trials), str(s.outcomes.get("ok", 0)), str(fails), _fmt(best), _fmt(s.default_us),
                     _fmt(gain, ".2f") + ("×" if gain else ""), _state_badge(s.fingerprint_state),
                     _e(describe_timing(s.timing))])
    page.add(_table(["shape", "arch", "device", "trials", "ok", "failed", "best µs", "default µs",
                     "default ÷ best", "fingerprint", "timing"], rows))
    if data.superseded:
        page.add('<p class="caption">Superseded studies (a later "~n" study of the same shape exists, made '
                 "after the kernel or the search space changed), not shown: "
                 + ", ".join(f"<code>{_e(n)}</code>" for n in data.superseded) + "</p>")
    for s in data.studies:
        page.add(f'<h3 id="{_e(s.name)}">{_e(s.label)} <small>({_e(s.arch)}, {_e(s.name)})</small></h3>')
        outcomes = ", ".join(f"{o} {n}" for o, n in sorted(s.outcomes.items(), key=lambda kv: -kv[1]))
        best = (f"best trial #{s.best['number']}: {s.best['us']:.2f} µs, "
                f"{_fmt(s.best['tflops'], '.0f')} TFLOP/s, <code>{_e(_config_label(s.best['params']))}</code>"
                if s.best else "no successful trial")
        page.add(f'<p class="caption">{s.n_trials} trials ({_e(outcomes) or "none finished"}); {best}</p>')
        if s.ok_study is None:
            page.add('<div class="missing">No successful trial to plot.</div>')
            continue
        page.add('<div class="pair"><div>' + page.figure(history_figure(s)) + "</div><div>"
                 + page.figure(parallel_figure(s)) + "</div></div>")


def render_html(data: ReportData) -> tuple[str, list[str]]:
    """The whole report as one HTML string, and the ids of its plot divs."""
    page = _Page()
    _header(data, page)
    _comparison_section(data, page)
    _dispatch_section(data, page)
    _training_section(data, page)
    _heatmap_section(data, page)
    _failures_section(data, page)
    _importance_section(data, page)
    _best_configs_section(data, page)
    _studies_section(data, page)
    body = "\n".join(page.parts)
    doc = (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
        "<title>fa4tune report</title>"
        f"<style>{CSS}</style>"
        f"<script type=\"text/javascript\">{plotly.offline.get_plotlyjs()}</script>"
        f"</head><body data-figures=\"{len(page.figure_ids)}\">\n{body}\n</body></html>\n")
    return doc, page.figure_ids


def write_report(data: ReportData, out: str | Path) -> BuiltReport:
    """Write the report atomically (temp file + rename, mode 0644): a reader never sees half a file."""
    from fa4.files import atomic_write

    doc, ids = render_html(data)
    out = atomic_write(out, doc)
    return BuiltReport(out, ids, out.stat().st_size)


# --------------------------------------------------------------------------------------------------
# headless Chromium
# --------------------------------------------------------------------------------------------------

CHROMIUM_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--hide-scrollbars",
    # parallel coordinates draw with WebGL; with the GPU off Chromium needs this to use its software GL
    "--enable-unsafe-swiftshader",
)


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return "/usr/bin/chromium" if os.access("/usr/bin/chromium", os.X_OK) else None


def render_in_chromium(page: str | Path, screenshot: str | Path | None = None, *,
                       window: tuple[int, int] = (1400, 2400), budget_ms: int = 30000,
                       timeout_s: float = 180.0, chromium: str | None = None) -> str:
    """Load `page` in headless Chromium, let its scripts run for `budget_ms` of virtual time, and return
    the DOM as rendered (and write a PNG of the window to `screenshot` if given)."""
    exe = chromium or find_chromium()
    if exe is None:
        raise FileNotFoundError("no Chromium found (apt-get install chromium)")
    url = Path(page).resolve().as_uri()
    with tempfile.TemporaryDirectory(prefix="fa4tune-chromium-") as profile:
        base = [exe, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--window-size={window[0]},{window[1]}",
                f"--virtual-time-budget={budget_ms}"]
        dom = subprocess.run(base + ["--dump-dom", url], capture_output=True, text=True, timeout=timeout_s,
                             check=True).stdout
        if screenshot is not None:
            Path(screenshot).parent.mkdir(parents=True, exist_ok=True)
            subprocess.run(base + [f"--screenshot={Path(screenshot).resolve()}", url], capture_output=True,
                           timeout=timeout_s, check=True)
            if not Path(screenshot).is_file():
                raise RuntimeError(f"Chromium wrote no screenshot to {screenshot}")
    return dom


def rendered_plot_count(dom: str) -> int:
    """How many plot containers of a dumped DOM hold a drawn SVG."""
    # each chunk runs from one plot container to the next, so an SVG in it belongs to that plot
    chunks = dom.split('class="plot-container plotly"')[1:]
    return sum(1 for c in chunks if 'class="main-svg"' in c)
