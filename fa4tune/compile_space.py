"""`fa4tune compile-space`: compile a whole search space without a GPU and hold the model to it.

Every configuration of the space is first put to `fa4.kernels.feasible`; the rejected ones are counted
by reason. Every feasible one is compiled for its architecture on CPU worker processes (the search's
own pool, in "cpu" mode) and its compile report is checked: no register spills, no wgmma serialised
for lack of registers, PTX with the architecture's MMA and TMA instructions, and shared memory equal to
the feasibility model's figure. Any disagreement is a failure: exit status 1.

On 2 cores a whole space takes hours; the H200 machine's 16 cores (no GPU needed) or more serve.
"""

from __future__ import annotations

import json
import os
import sys

import click

# the `ptx_markers` (as each family's compile report names them) a right compile must show
REQUIRED_PTX = {
    "sm90": ("wgmma", "tma_load"),
    "sm100": ("tcgen05.mma", "tcgen05.ld", "tcgen05.st", "cp.async.bulk.tensor"),
}


def check_report(arch: str, model_smem: int, entry: dict) -> list[str]:
    """What is wrong with one compiled configuration (empty: nothing)."""
    if entry.get("outcome") != "ok":
        return [f"{entry.get('outcome')}: {entry.get('error', '')}".strip()]
    report = entry.get("report") or {}
    problems = list(entry.get("warnings", []))
    markers = report.get("ptx_markers") or {}
    missing = [m for m in REQUIRED_PTX[arch] if not markers.get(m)]
    if missing:
        problems.append(f"PTX lacks {', '.join(missing)}")
    if report.get("smem_bytes") != model_smem:
        problems.append(f"shared memory {report.get('smem_bytes')} B compiled vs {model_smem} B modelled")
    return problems


@click.command("compile-space")
@click.option("--arch", type=click.Choice(["sm90", "sm100"]), default="sm90", show_default=True)
@click.option("--space", "space_path", default=None, help="search-space TOML [default: search_spaces/<arch>.toml]")
@click.option("--batch", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--heads", default="32/8", show_default=True, help="query/KV heads (the ratio matters with pack_gqa)")
@click.option("--head-dim", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--seqlen", type=click.IntRange(min=1), default=1024, show_default=True)
@click.option("--dtype", type=click.Choice(["fp16", "bf16"]), default="fp16", show_default=True)
@click.option("--causal/--no-causal", default=False, show_default=True)
@click.option("--lse/--no-lse", default=False, show_default=True, help="compile the variant that writes LSE")
@click.option("--limit", type=click.IntRange(min=0), default=0, show_default=True,
              help="compile at most this many feasible configurations (0: all; the default config first)")
@click.option("--jobs", type=click.IntRange(min=1), default=None, help="processes [default: all cores]")
@click.option("--seed", type=int, default=0, show_default=True, help="which sample --limit takes")
@click.option("--shard", default="0/1", show_default=True,
              help="i/n: compile only the i-th of n interleaved parts of the feasible configurations, "
                   "so a whole space fits several time-limited runs")
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table", show_default=True)
@click.option("--out", "out_path", default=None, help="also write the full JSON here")
def compile_space_command(arch, space_path, batch, heads, head_dim, seqlen, dtype, causal, lse, limit, jobs,
                          seed, shard, fmt, out_path):
    """Compile a search space on CPU: feasibility, registers, spills, shared memory, PTX."""
    from fa4.kernels import AttentionProblem, Config, family
    from fa4tune.search import Progress, compile_space
    from fa4tune.space import SpaceError, load_space

    try:
        heads_q, heads_kv = (int(x) for x in heads.split("/"))
        shard_index, shard_count = (int(x) for x in shard.split("/"))
        if not 0 <= shard_index < shard_count:
            raise ValueError(f"--shard {shard}: want i/n with 0 <= i < n")
        problem = AttentionProblem(batch, seqlen, seqlen, heads_q, heads_kv, head_dim, dtype, causal, lse)
        space = load_space(arch, space_path)
    except (ValueError, SpaceError) as exc:
        raise click.UsageError(str(exc)) from exc
    jobs = jobs or os.cpu_count() or 2
    click.echo(f"fa4tune compile-space: {arch}, {problem.label()}, {space.size} configurations "
               f"({space.source or 'all declared choices'}), {jobs} processes", err=True)
    result = compile_space(arch, problem, space, limit or 10**9, seed=seed, processes=jobs,
                           progress=Progress(), shard=(shard_index, shard_count))
    resources = family(arch).resources
    failures = 0
    for entry in result["compiled"]:
        config = Config.from_dict(arch, entry["config"])
        entry["model_smem_bytes"] = resources(config, problem)["smem_bytes"]
        entry["problems"] = check_report(arch, entry["model_smem_bytes"], entry)
        failures += bool(entry["problems"])
    result["failures"] = failures
    if out_path:
        with open(out_path, "w") as f:
            json.dump(compact(result), f, indent=1, sort_keys=True)
    if fmt == "json":
        click.echo(json.dumps(result, indent=1, sort_keys=True))
    else:
        _print_tables(arch, result)
    click.echo(f"{result['space_size']} configurations: {result['infeasible']} rejected by the model, "
               f"{result['feasible']} feasible, {len(result['compiled'])} compiled (shard {shard}), "
               f"{failures} with problems", err=True)
    sys.exit(1 if failures or not result["default_feasible"] else 0)


def compact(result: dict) -> dict:
    """The result without what each compile report repeats (its config and problem are the entry's and
    the run's), so a whole space's results stay small enough to keep in the repository."""
    entries = []
    for entry in result["compiled"]:
        report = {k: v for k, v in (entry.get("report") or {}).items() if k not in ("config", "problem")}
        entries.append({**entry, "report": report})
    return {**result, "compiled": entries}


def _print_tables(arch: str, result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    from fa4.kernels import Config

    console = Console(file=sys.stdout, width=200)
    why = Table(title="rejected before compiling, by reason")
    why.add_column("reason")
    why.add_column("configurations", justify="right")
    for reason, n in result["infeasible_reasons"].items():
        why.add_row(reason, str(n))
    console.print(why)
    table = Table(title=f"compiled for {arch} ({len(result['compiled'])})")
    for column in ("configuration", "registers", "spills (st/ld)", "smem B", "model B", "seconds", "problems"):
        table.add_column(column)
    for entry in sorted(result["compiled"], key=lambda e: bool(e["problems"])):
        report = entry.get("report") or {}
        label = ("default " if entry["is_default"] else "") + Config.from_dict(arch, entry["config"]).label()
        table.add_row(label, str(report.get("registers", "-")),
                      f"{report.get('spill_stores', '-')}/{report.get('spill_loads', '-')}",
                      str(report.get("smem_bytes", "-")), str(entry["model_smem_bytes"]),
                      str(report.get("compile_seconds", entry.get("compile_s", "-"))),
                      "; ".join(entry["problems"]) or "ok")
    console.print(table)
