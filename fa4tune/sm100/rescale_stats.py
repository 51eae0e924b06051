"""`fa4tune rescale-stats`: how often the sm100 kernel's conditional O rescale fires, measured on the
CPU emulation of its tile algorithm (`fa4.kernels.sm100.emulation`) for each rescale_threshold, with
the error against the fp32 reference (`fa4.reference`). The sm100 kernel has never run on hardware.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

import click
import torch

from fa4.files import atomic_write
from fa4.kernels import Config, knob
from fa4.kernels.sm100.emulation import RescaleStats, emulate_fa4_forward
from fa4.reference import attention_fp32


INPUT_KINDS = {
    "normal": "q, k, v ~ N(0, 1)",
    "peaked": "q, k, v ~ N(0, 1) with 1/64 of the keys (key 0, an attention-sink position, among them) "
              "scaled x4, so those logits are 4x larger",
}


def make_inputs(kind: str, batch: int, seqlen_q: int, seqlen_k: int, heads_q: int, heads_kv: int,
                head_dim: int, dtype: torch.dtype = torch.float16, seed: int = 0):
    """Real-looking attention inputs of one of INPUT_KINDS, deterministic in `seed`."""
    if kind not in INPUT_KINDS:
        raise ValueError(f"unknown input kind {kind!r}; known: {', '.join(INPUT_KINDS)}")
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seqlen_q, heads_q, head_dim, generator=gen)
    k = torch.randn(batch, seqlen_k, heads_kv, head_dim, generator=gen)
    v = torch.randn(batch, seqlen_k, heads_kv, head_dim, generator=gen)
    if kind == "peaked":
        loud = torch.randperm(seqlen_k, generator=gen)[: max(1, seqlen_k // 64)]
        loud = torch.unique(torch.cat([torch.zeros(1, dtype=torch.long), loud]))
        k[:, loud] *= 4.0
    return q.to(dtype), k.to(dtype), v.to(dtype)


def measure_rescales(kinds, seqlens, thresholds, causal_modes, heads_q=32, heads_kv=8, head_dim=128,
                     batch=1, dtype=torch.float16, base: Optional[Config] = None, progress=None) -> list:
    """One row per (kind, causal, seqlen, threshold): work counters and error against fp32."""
    base = base or Config.make("sm100")
    rows = []
    for kind in kinds:
        for seqlen in seqlens:
            q, k, v = make_inputs(kind, batch, seqlen, seqlen, heads_q, heads_kv, head_dim, dtype,
                                  seed=seqlen)
            for causal in causal_modes:
                ref, _ = attention_fp32(q, k, v, causal)
                for threshold in thresholds:
                    started = time.perf_counter()
                    stats = RescaleStats()
                    out = emulate_fa4_forward(q, k, v, base.replace(rescale_threshold=threshold),
                                              causal=causal, stats=stats)
                    err = float((out.float() - ref).abs().max())
                    row = {"kind": kind, "causal": causal, "seqlen": seqlen, "threshold": float(threshold),
                           "max_abs_err_vs_fp32": err, **stats.to_dict()}
                    row["tile_rescale_fraction"] = stats.tile_rescales / max(1, stats.tile_decisions)
                    row["warp_rescale_fraction"] = stats.warp_rescales / max(1, stats.warp_decisions)
                    rows.append(row)
                    if progress:
                        progress(f"{kind} causal={causal} S={seqlen} t={threshold:g}: "
                                 f"{stats.tile_rescales}/{stats.tile_decisions} tile rescales, "
                                 f"err {err:.2e} ({time.perf_counter() - started:.1f} s)")
    return rows


def format_table(rows: list) -> str:
    """Rescales performed / decisions, per warp (the kernel's unit), per 128-row tile and per row.

    "max>basis" counts rows whose block max exceeded their basis; "row resc" those that raised the
    basis (and multiplied O and l); "row kept" those that kept the old basis although their max rose.
    "empty" counts warp rescales voted only by rows that saw their first key (O was still 0).
    """
    head = (f"{'inputs':<6} {'mask':<6} {'S':>4} {'thr':>3} | {'warp resc/decisions':>20} {'%':>5} | "
            f"{'empty':>5} | {'tile resc/decisions':>19} {'%':>5} | {'max>basis':>9} {'row resc':>8} {'row kept':>9} | "
            f"{'max P':>6} {'err fp32':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['kind']:<6} {'causal' if r['causal'] else 'full':<6} {r['seqlen']:>4} "
            f"{r['threshold']:>3g} | {r['warp_rescales']:>9}/{r['warp_decisions']:<10} "
            f"{100 * r['warp_rescale_fraction']:>5.1f} {r['warp_rescales_from_empty']:>5} | "
            f"{r['tile_rescales']:>8}/{r['tile_decisions']:<10} "
            f"{100 * r['tile_rescale_fraction']:>5.1f} | {r['row_max_moved']:>9} "
            f"{r['row_rescales'] - r['row_basis_from_empty']:>8} {r['row_rescales_skipped']:>9} | "
            f"{r['max_p_16bit']:>6g} {r['max_abs_err_vs_fp32']:>8.1e}")
    return "\n".join(lines)


def committed_stats_path() -> Path:
    """The reviewed measurement in the source tree (results/sm100_rescale_stats.json)."""
    return Path(__file__).resolve().parents[2] / "results" / "sm100_rescale_stats.json"


def _saved_summary() -> str:
    path = committed_stats_path()
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return f"No saved measurement at {path} yet: run `fa4tune rescale-stats --out {path}`."
    summary = [f"Saved measurement ({path.name}, made by: {saved.get('command', '?')}):"]
    summary += ["  " + line for line in format_table(saved["rows"]).splitlines()]
    return "\n".join(summary)


def _command_line(seqlens, thresholds, kinds, masks, heads_q, heads_kv, head_dim, dtype, output):
    # the options of every fa4tune command: --heads/--heads-kv, --causal/--no-causal/--both, --out
    """The command that reproduces a measurement, every option spelled out."""
    words = ["fa4tune rescale-stats"]
    words += [f"--seqlen {s}" for s in seqlens] + [f"--threshold {t:g}" for t in thresholds]
    words += [f"--kind {k}" for k in kinds]
    words += [{("full",): "--no-causal", ("causal",): "--causal"}.get(tuple(masks), "--both")]
    words += [f"--heads {heads_q} --heads-kv {heads_kv} --head-dim {head_dim} --dtype {dtype}"]
    if output is not None:
        words.append(f"--out {output}")
    return " ".join(words)


@click.command("rescale-stats", context_settings={"help_option_names": ["-h", "--help"]}, epilog="Input kinds: " + "; ".join(
    f"{name}: {text}" for name, text in INPUT_KINDS.items()))
@click.option("--seqlen", "seqlens", multiple=True, type=int, default=(1024, 2048, 4096),
              show_default=True, help="Sq = Sk (repeatable).")
@click.option("--threshold", "thresholds", multiple=True, type=float,
              default=knob("sm100", "rescale_threshold").choices, show_default=True,
              help="rescale_threshold values (repeatable; default: the whole sm100 space).")
@click.option("--kind", "kinds", multiple=True, type=click.Choice(list(INPUT_KINDS)),
              default=tuple(INPUT_KINDS), show_default=True)
@click.option("--causal", "mask", flag_value="causal", help="causal only")
@click.option("--no-causal", "mask", flag_value="full", help="non-causal only")
@click.option("--both", "mask", flag_value="both", default=True, help="both (default)")
@click.option("--heads", "heads_q", default=32, show_default=True, help="query heads")
@click.option("--heads-kv", default=8, show_default=True)
@click.option("--head-dim", default=128, show_default=True)
@click.option("--dtype", type=click.Choice(["fp16", "bf16"]), default="fp16", show_default=True)
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table",
              show_default=True)
@click.option("--out", "output", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write the JSON (sorted keys) here, e.g. results/sm100_rescale_stats.json.")
@click.option("--show", is_flag=True, help="Print the committed measurement "
              "(results/sm100_rescale_stats.json) and measure nothing.")
def rescale_stats_command(seqlens, thresholds, kinds, mask, heads_q, heads_kv, head_dim, dtype, fmt,
                          output, show):
    """sm100, on the CPU emulation of its tile algorithm: how many O rescales each rescale_threshold
    performs and skips on real-looking inputs, and the error against the fp32 reference at each. The
    sm100 kernel has never run on hardware; these are the emulation's counts."""
    from fa4tune.paths import check_output

    if show:
        click.echo(_saved_summary())
        return
    masks = {"causal": ("causal",), "full": ("full",)}.get(mask, ("full", "causal"))
    check_output(output, "--out")   # before the measurement, not after it
    torch_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    base = Config.make("sm100")
    rows = measure_rescales(kinds, seqlens, thresholds, [m == "causal" for m in masks],
                            heads_q=heads_q, heads_kv=heads_kv, head_dim=head_dim, dtype=torch_dtype,
                            base=base, progress=lambda s: click.echo(s, err=True))
    payload = {
        "command": _command_line(seqlens, thresholds, kinds, masks, heads_q, heads_kv, head_dim,
                                 dtype, output),
        "what": "rescales the sm100 correction warpgroup performs vs skips per rescale_threshold, "
                "from the CPU emulation of the kernel's tile algorithm",
        "shape": {"batch": 1, "heads_q": heads_q, "heads_kv": heads_kv, "head_dim": head_dim,
                  "dtype": dtype},
        "config": {k: v for k, v in base.to_dict().items() if k != "rescale_threshold"},
        "inputs": {k: INPUT_KINDS[k] for k in kinds},
        "inputs_seed": "make_inputs(kind, ..., seed=S): one torch.Generator seed per sequence length",
        "torch": torch.__version__,
        "rows": rows,
    }
    if output is not None:
        atomic_write(output, json.dumps(payload, sort_keys=True, indent=1) + "\n")
    click.echo(json.dumps(payload, sort_keys=True, indent=1) if fmt == "json" else format_table(rows))
