"""The `fa4tune` command line: a thin layer over fa4tune.search, fa4tune.bench and fa4.database.

Data goes to stdout (`--format table|json`), progress and the defaults in use to stderr. Shape
options come from one decorator, `shape_options`, shared by every command that takes a shape.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from typing import Optional

import click

from fa4tune.timing import L2_STATES

DEFAULT_SHAPE = {"batch": 1, "heads": 32, "gqa": 4, "head_dim": 128, "seqlen": 1024, "dtype": "fp16"}
PEERS = ("sdpa_flash", "sdpa_cudnn", "flash_attn_4")


@click.group()
def main() -> None:
    """Tune, record and compare our FA4-style attention kernels."""


# ------------------------------------------------------------------------------------------------
# shared options

def shape_options(fn):
    """--batch --heads --heads-kv/--gqa --head-dim --seqlen --seqlen-k --dtype --causal/--no-causal/--both."""
    options = [
        click.option("--batch", type=click.IntRange(min=1), default=DEFAULT_SHAPE["batch"], show_default=True),
        click.option("--heads", type=click.IntRange(min=1), default=DEFAULT_SHAPE["heads"], show_default=True,
                     help="query heads"),
        click.option("--gqa", type=click.IntRange(min=1), default=None,
                     help=f"query heads per KV head [default: {DEFAULT_SHAPE['gqa']}]"),
        click.option("--heads-kv", type=click.IntRange(min=1), default=None,
                     help="KV heads (instead of --gqa)"),
        click.option("--head-dim", type=click.IntRange(min=1), default=DEFAULT_SHAPE["head_dim"], show_default=True),
        click.option("--seqlen", type=click.IntRange(min=1), default=DEFAULT_SHAPE["seqlen"], show_default=True,
                     help="query length (and key length unless --seqlen-k)"),
        click.option("--seqlen-k", type=click.IntRange(min=1), default=None, help="key length [default: --seqlen]"),
        click.option("--dtype", type=click.Choice(["fp16", "bf16"]), default=DEFAULT_SHAPE["dtype"], show_default=True),
        click.option("--causal", "mask", flag_value="causal", help="causal only"),
        click.option("--no-causal", "mask", flag_value="full", help="non-causal only"),
        click.option("--both", "mask", flag_value="both", default=True, help="both (default)"),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def problems_from_options(batch, heads, gqa, heads_kv, head_dim, seqlen, seqlen_k, dtype, mask):
    from fa4.kernels import AttentionProblem

    if gqa is not None and heads_kv is not None:
        raise click.UsageError("give --gqa or --heads-kv, not both")
    if heads_kv is None:
        ratio = gqa or DEFAULT_SHAPE["gqa"]
        if heads % ratio:
            raise click.UsageError(f"--heads {heads} is not divisible by --gqa {ratio}")
        heads_kv = heads // ratio
    masks = {"causal": [True], "full": [False], "both": [False, True]}[mask or "both"]
    try:
        return [AttentionProblem(batch, seqlen, seqlen_k or seqlen, heads, heads_kv, head_dim, dtype, causal)
                for causal in masks]
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc


def detect_gpus() -> list[dict]:
    """Visible CUDA GPUs: [{"index", "name", "cc": (major, minor)}] (empty without CUDA)."""
    try:
        import torch
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    return [{"index": i, "name": torch.cuda.get_device_name(i), "cc": torch.cuda.get_device_capability(i)}
            for i in range(torch.cuda.device_count())]


def arch_of(cc: tuple[int, int]) -> Optional[str]:
    return {9: "sm90", 10: "sm100"}.get(cc[0])


def _resolve_arch(arch: str, gpus: list[dict], need_gpu: bool) -> str:
    if arch != "auto":
        return arch
    if gpus:
        found = arch_of(tuple(gpus[0]["cc"]))
        if found is None:
            raise click.ClickException(f"GPU {gpus[0]['name']} (sm_{gpus[0]['cc'][0]}{gpus[0]['cc'][1]}) is "
                                       "neither Hopper (sm90) nor Blackwell (sm100)")
        return found
    if need_gpu:
        raise click.ClickException("no CUDA GPU found")
    return "sm90"


def _echo_err(text: str) -> None:
    click.echo(text, err=True)


def _table(title: str, columns: list[str], rows: list[list]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for i, c in enumerate(columns):
        table.add_column(c, no_wrap=i == 0, overflow="fold")
    for r in rows:
        table.add_row(*["-" if v is None else str(v) for v in r])
    width = os.get_terminal_size(1).columns if sys.stdout.isatty() else 240
    Console(file=sys.stdout, width=max(120, width)).print(table)


def _fmt(x, digits=2):
    return None if x is None else f"{x:.{digits}f}"


# ------------------------------------------------------------------------------------------------
# search

@main.command()
@shape_options
@click.option("--arch", type=click.Choice(["auto", "sm90", "sm100"]), default="auto", show_default=True,
              help="kernel family; auto: from the GPU (sm90 with --compile-only on a machine without one)")
@click.option("--trials", type=click.IntRange(min=1), default=100, show_default=True,
              help="configurations per study that pass the feasibility model (infeasible ones are "
                   "recorded but not counted); a re-run resumes up to this many")
@click.option("--sampler", type=click.Choice(["tpe", "grid", "random"]), default="tpe", show_default=True)
@click.option("--timeout", type=float, default=None, help="wall-clock budget per study, seconds")
@click.option("--trial-timeout", type=float, default=20.0, show_default=True,
              help="GPU phase of one trial, seconds; a hung worker is killed and replaced")
@click.option("--compile-timeout", type=float, default=300.0, show_default=True)
@click.option("--storage", default=None, help="optuna storage: journal file or sqlite:/// URL "
                                               "[default: results/studies.journal]")
@click.option("--study", default=None, help="study name [default: the shape key]")
@click.option("--workers", type=click.IntRange(min=1), default=1, show_default=True,
              help="GPUs to use, one worker group per GPU")
@click.option("--jobs", type=click.IntRange(min=1), default=None,
              help="worker processes in all (they compile in parallel) [default: cores - 2, at most 12]")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table", show_default=True)
@click.option("--db", "db_path", default=None, help="best-config database [default: $FA4_CONFIG_DB or the packaged one]")
@click.option("--no-db", is_flag=True, help="do not record the best configuration")
@click.option("--space", "space_path", default=None, help="search-space TOML [default: search_spaces/<arch>.toml]")
@click.option("--l2", type=click.Choice(L2_STATES), default="warm", show_default=True, help="L2 state when timing")
@click.option("--peers/--no-peers", default=True, show_default=True, help="time SDPA flash/cuDNN and flash-attn-4")
@click.option("--compile-only", is_flag=True, help="no GPU: check feasibility of the whole space and compile "
                                                  "up to --trials feasible configurations on CPU")
def search(batch, heads, gqa, heads_kv, head_dim, seqlen, seqlen_k, dtype, mask, arch, trials, sampler, timeout,
           trial_timeout, compile_timeout, storage, study, workers, jobs, seed, fmt, db_path, no_db, space_path,
           l2, peers, compile_only):
    """Search kernel knobs per shape with optuna; validate, time, record the best."""
    from fa4tune import search as search_mod
    from fa4tune.space import SpaceError, load_space
    from fa4tune.timing import TimingSettings
    from fa4tune.worker import PoolError

    problems = problems_from_options(batch, heads, gqa, heads_kv, head_dim, seqlen, seqlen_k, dtype, mask)
    gpus = [] if compile_only else detect_gpus()
    if not compile_only and not gpus:
        _echo_err("fa4tune search: no CUDA GPU found. A search validates and times kernels on a GPU.\n"
                  "  --compile-only checks the search space and compiles it on CPU (no GPU needed).")
        sys.exit(2)
    arch = _resolve_arch(arch, gpus, need_gpu=not compile_only)
    p0 = problems[0]
    masks = " and ".join("causal" if p.causal else "non-causal" for p in problems)
    where = f"detected: {gpus[0]['name']}" if gpus else "no GPU"
    _echo_err(f"fa4tune search: arch {arch} ({where}); batch {p0.batch}, {p0.heads_q} query heads, "
              f"{p0.heads_kv} KV heads (gqa {p0.gqa_ratio}), head dim {p0.head_dim}, seqlen_q {p0.seqlen_q}, "
              f"seqlen_k {p0.seqlen_k}, {p0.dtype}, {masks}")
    try:
        space = load_space(arch, space_path)
    except SpaceError as exc:
        raise click.ClickException(str(exc)) from exc
    progress = search_mod.Progress()
    if compile_only:
        _echo_err(f"compile-only: {space.size} configurations in the space ({space.source or 'all declared choices'}); "
                  f"compiling up to {trials} feasible ones with {jobs or 2} processes")
        reports = [search_mod.compile_space(arch, p, space, trials, seed=seed, processes=jobs or 2,
                                            compile_timeout_s=compile_timeout, progress=progress)
                   for p in problems]
        _print_compile_only(reports, fmt)
        # a feasible configuration that fails to compile, spills or serialises its wgmma: the
        # feasibility model let through what it should have rejected
        failed = sum(1 for r in reports for c in r["compiled"] if c["outcome"] != "ok" or c.get("warnings"))
        sys.exit(1 if failed or not all(r["default_feasible"] for r in reports) else 0)
    if workers > len(gpus):
        raise click.ClickException(f"--workers {workers} but only {len(gpus)} GPU(s) are visible")
    settings = search_mod.SearchSettings(
        trials=trials, sampler=sampler, seed=seed, timeout_s=timeout, trial_timeout_s=trial_timeout,
        compile_timeout_s=compile_timeout, gpus=[g["index"] for g in gpus[:workers]], processes=jobs,
        timing=TimingSettings(l2=l2), peers=PEERS if peers else (), storage=storage, study_name=study,
        db_path=db_path, record_db=not no_db, space_path=space_path)
    _echo_err(f"{trials} configurations per study, sampler {sampler}, seed {seed}, "
              f"{settings.process_count()} worker processes on {workers} GPU(s), L2 {l2}; storage "
              f"{storage or search_mod.default_storage_path()}")
    try:
        summaries = search_mod.run_search(arch, problems, settings, progress)
    except (PoolError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc
    _print_summaries(summaries, fmt)
    broken_default = [s["study"] for s in summaries if s["default_us"] is None]
    if broken_default:
        # the runtime falls back to the default for untuned shapes: a default that does not
        # validate is a kernel bug, whatever the search found
        _echo_err(f"the default configuration did not run correctly in: {', '.join(broken_default)}")
    if broken_default or not all(s["best"] for s in summaries):
        sys.exit(1)


def _print_summaries(summaries: list[dict], fmt: str) -> None:
    if fmt == "json":
        click.echo(json.dumps(summaries, indent=2, sort_keys=True))
        return
    from fa4tune.worker import OUTCOMES

    rows = []
    for s in summaries:
        best = s["best"] or {}
        fails = ", ".join(f"{k} {v}" for k, v in s["outcomes"].items() if k != "ok" and v) or "-"
        peers = "; ".join(f"{n} {_fmt(d.get('us'))}" if "us" in d else f"{n} n/a"
                          for n, d in (s["peers"] or {}).items())
        speed = ", ".join(f"{k} {v}x" for k, v in s["speedup"].items()) or "-"
        rows.append([s["study"], s["evaluated"], s["outcomes"]["ok"], fails, _fmt(best.get("us")),
                     _fmt(best.get("tflops"), 1), _fmt(s["default_us"]), peers, speed, _fmt(s.get("wall_s"), 1)])
    _table("fa4tune search", ["study", "evaluated", "ok", "failures", "best us", "TFLOP/s", "default us",
                              "peers us", "speedup of best over", "wall s"], rows)
    for s in summaries:
        if s["best"]:
            from fa4.kernels import Config

            label = Config.from_dict(s["arch"], s["best"]["config"]).label()
            click.echo(f"{s['study']}: best trial {s['best']['trial']}: {label}")


def _print_compile_only(reports: list[dict], fmt: str) -> None:
    if fmt == "json":
        click.echo(json.dumps(reports, indent=2, sort_keys=True))
        return
    for r in reports:
        from fa4.kernels import AttentionProblem, Config

        title = f"{AttentionProblem(**r['problem']).label()}: {r['feasible']} of {r['space_size']} feasible"
        _table(title + " - why the rest is not", ["reason", "configurations"],
               [[reason, n] for reason, n in r["infeasible_reasons"].items()] or [["(none)", 0]])
        rows = []
        for c in r["compiled"]:
            rep = c.get("report") if isinstance(c.get("report"), dict) else {}
            rows.append([("default " if c["is_default"] else "") + Config.from_dict(r["arch"], c["config"]).label(),
                         c["outcome"], _fmt(c.get("compile_s")),
                         ", ".join(f"{k}={v}" for k, v in rep.items())[:80] if rep else (c.get("report") or ""),
                         "; ".join(filter(None, [c.get("error")] + c.get("warnings", []))) or None])
        _table("compiled", ["configuration", "outcome", "compile s", "report", "error"], rows)


# ------------------------------------------------------------------------------------------------
# best

@main.command()
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table", show_default=True)
@click.option("--db", "db_path", default=None, help="database file [default: $FA4_CONFIG_DB or the packaged one]")
def best(fmt, db_path):
    """List the best-config database, with a stale column (kernel fingerprint changed)."""
    from fa4.database import BestConfigDB, DatabaseError
    from fa4tune.search import kernel_fingerprint

    try:
        db = BestConfigDB.load(db_path)
    except DatabaseError as exc:
        raise click.ClickException(str(exc)) from exc
    current = {arch: kernel_fingerprint(arch) for arch in {e.arch for e in db.entries}}
    out = []
    for e in db.entries:
        fp = current.get(e.arch, "")
        stale = "unknown" if fp.startswith("unavailable") else e.kernel_fingerprint != fp
        out.append({**e.to_dict(), "stale": stale})
    if fmt == "json":
        click.echo(json.dumps(out, indent=2, sort_keys=True))
        return
    from fa4.kernels import Config

    rows = []
    for d in out:
        speed = ", ".join(f"{k} {v}x" for k, v in sorted(d["speedup"].items())) or "-"
        rows.append([d["key"], Config.from_dict(d["arch"], d["config"]).label(), _fmt(d["us"]),
                     _fmt(d["tflops"], 1), speed, _fmt(d["max_err"], 4),
                     {True: "STALE", False: "no"}.get(d["stale"], d["stale"]), f"{d['study']}#{d['trial']}",
                     d["date"]])
    _table(f"best configurations ({len(rows)})", ["key", "config", "us", "TFLOP/s", "speedup over", "max err",
                                                  "stale", "from", "date"], rows)


# ------------------------------------------------------------------------------------------------
# bench

@main.command()
@shape_options
@click.option("--shapes", default=None,
              help="space/comma separated shape keys, e.g. 'sq1024-gqa4-causal s4096-bf16-full' "
                   "(tokens: b hq hkv gqa d s sq sk fp16 bf16 causal full; the rest from the shape options)")
@click.option("--arch", type=click.Choice(["auto", "sm90", "sm100"]), default="auto", show_default=True)
@click.option("--db", "db_path", default=None, help="best-config database [default: $FA4_CONFIG_DB or the packaged one]")
@click.option("--out", "out_path", default=None, help="JSON output [default: results/bench.json]")
@click.option("--csv", "csv_path", default=None, help="also write the rows as CSV")
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table", show_default=True)
@click.option("--jobs", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--l2", type=click.Choice(L2_STATES), default="warm", show_default=True)
@click.option("--peers/--no-peers", default=True, show_default=True)
def bench(batch, heads, gqa, heads_kv, head_dim, seqlen, seqlen_k, dtype, mask, shapes, arch, db_path, out_path,
          csv_path, fmt, jobs, l2, peers):
    """Tuned vs default vs peers, same timing, for a list of shapes; writes results/bench.json."""
    from fa4tune.bench import default_bench_path, run_bench, write_bench
    from fa4tune.search import parse_shape
    from fa4tune.timing import TimingSettings
    from fa4tune.worker import PoolError

    problems = problems_from_options(batch, heads, gqa, heads_kv, head_dim, seqlen, seqlen_k, dtype, mask)
    if shapes:
        base = problems[0].to_dict()
        parsed = []
        for text in shapes.replace(",", " ").split():
            try:
                shape_arch, p = parse_shape(text, base)
            except ValueError as exc:
                raise click.UsageError(str(exc)) from exc
            if "causal" in text or "full" in text:
                parsed.append(p)
            else:  # no mask named: the masks of --causal/--no-causal/--both
                parsed.extend(p.__class__(**{**p.to_dict(), "causal": q.causal}) for q in problems)
        problems = parsed
    gpus = detect_gpus()
    if not gpus:
        _echo_err("fa4tune bench: no CUDA GPU found; a benchmark needs one.")
        sys.exit(2)
    arch = _resolve_arch(arch, gpus, need_gpu=True)
    _echo_err(f"fa4tune bench: arch {arch} ({gpus[0]['name']}); {len(problems)} shape(s)")
    try:
        doc = run_bench(arch, problems, db_path=db_path, timing=TimingSettings(l2=l2),
                        peers=PEERS if peers else (), gpus=[gpus[0]["index"]], processes=jobs)
    except PoolError as exc:
        raise click.ClickException(str(exc)) from exc
    path = out_path or default_bench_path()
    write_bench(doc, path, csv_path)
    _echo_err(f"wrote {path}" + (f" and {csv_path}" if csv_path else ""))
    if fmt == "json":
        click.echo(json.dumps(doc, indent=2, sort_keys=True))
        return
    _table(f"fa4tune bench on {doc['device'].get('name')} (timing: {doc['timing']})",
           ["shape", "variant", "outcome", "us", "TFLOP/s", "tuned faster by", "lookup", "error"],
           [[r["shape"], r["variant"], r["outcome"], _fmt(r["us"]), _fmt(r["tflops"], 1),
             f"{r['speedup_of_tuned']}x" if r["speedup_of_tuned"] else None, r["lookup"],
             (r["error"] or "")[:60] or None] for r in doc["rows"]])


from fa4tune.report import report_command  # noqa: E402  (the report command lives with the report code)
main.add_command(report_command)
from fa4tune.compile_space import compile_space_command  # noqa: E402
main.add_command(compile_space_command)
from fa4tune.sass_build import sass_command_factory  # noqa: E402
main.add_command(sass_command_factory())

if __name__ == "__main__":
    main()
