"""`fa4tune report`: the click command over `fa4tune.report.data` (compute) and `.draw` (draw).

Kept apart from both so that registering it in `fa4tune.cli` imports only click: optuna and plotly
load when the command runs, not on every `fa4tune --help`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import click


@click.command("report", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--results", "results_dir", default=None, type=click.Path(file_okay=False, path_type=Path),
              help="folder holding the inputs [default: the results directory, $FA4TUNE_HOME or "
                   "~/.cache/fa4tune; the committed report: --results results --db fa4/data/best_configs.json]")
@click.option("--storage", default=None,
              help="optuna storage: URL (sqlite:///x.db) or SQLite/journal file "
                   "[default: every one found in the results folder, e.g. studies.journal]")
@click.option("--db", "--database", "database", default=None, type=click.Path(dir_okay=False, path_type=Path),
              help="best-config database [default: RESULTS/best_configs.json]")
@click.option("--bench", default=None, type=click.Path(dir_okay=False, path_type=Path),
              help="bench results [default: RESULTS/bench.json]")
@click.option("--out", default=None, type=click.Path(dir_okay=False, path_type=Path),
              help="the HTML file to write [default: RESULTS/report.html]")
@click.option("--screenshot", default=None, type=click.Path(dir_okay=False, path_type=Path),
              help="also render the report in headless Chromium and save a PNG of its top here")
@click.option("--screenshot-size", default="1400x1800", show_default=True, help="browser window WIDTHxHEIGHT")
@click.option("--data-json", default=None, type=click.Path(dir_okay=False, path_type=Path),
              help="also write the computed numbers (speedups, outcomes, importance, ...) as JSON here")
def report_command(results_dir: Path | None, storage: str | None, database: Path | None, bench: Path | None,
                   out: Path | None, screenshot: Path | None, screenshot_size: str,
                   data_json: Path | None) -> None:
    """Build one self-contained HTML report (works offline) of the searches, the best-config database
    and the bench results. An input the results folder lacks, or a --db or --bench file that does not
    exist, becomes a note in the report; a results folder or a --storage that does not exist is an
    error, and so is an output that cannot be written (checked before anything is read)."""
    from fa4.files import atomic_write
    from fa4tune.paths import REPORT_NAME, check_output, write_failed
    from fa4tune.report.data import collect
    from fa4tune.report.draw import render_in_chromium, rendered_plot_count, write_report
    from fa4tune.searches.storage import sqlite_file_of

    if screenshot is not None:
        try:
            width, height = (int(v) for v in screenshot_size.lower().split("x"))
        except ValueError:
            raise click.BadParameter("expected WIDTHxHEIGHT, e.g. 1400x1800", param_hint="--screenshot-size")
    from fa4tune.paths import results_dir as default_results_dir

    named = results_dir is not None
    results_dir = results_dir if named else default_results_dir()
    if not results_dir.is_dir():   # a report of nothing would say only that
        raise click.ClickException(f"--results {results_dir}: no such folder" if named else
                                   f"no results folder {results_dir} (nothing was searched or benched here; "
                                   "--results DIR names another)")
    storage_file = (sqlite_file_of(storage) if "://" in storage else storage) if storage else None
    if storage_file is not None and not Path(storage_file).exists():
        raise click.ClickException(f"--storage {storage}: no such file")
    out = out if out is not None else results_dir / REPORT_NAME
    for path, option in ((out, "--out"), (data_json, "--data-json"), (screenshot, "--screenshot")):
        check_output(path, option)
    click.echo(f"reading {results_dir}/ ...", err=True)  # (only read: nothing is created there)
    data = collect(results_dir, storage=storage, database=database, bench=bench)
    for line in data.missing:
        click.echo(f"missing: {line}", err=True)
    try:
        built = write_report(data, out)
        if data_json is not None:
            atomic_write(data_json, json.dumps(data.to_dict(), indent=2, sort_keys=True) + "\n")
    except OSError as exc:
        raise write_failed(exc) from exc
    click.echo(f"{len(data.studies)} studies, {len(data.shape_rows)} shapes, {len(data.best_configs)} "
               f"best configs, {len(built.figure_ids)} figures, {built.size_bytes / 1e6:.1f} MB", err=True)
    click.echo(str(built.path))
    if data_json is not None:
        click.echo(str(data_json))
    if screenshot is None:
        return
    try:
        dom = render_in_chromium(built.path, screenshot, window=(width, height))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        click.echo(f"screenshot failed: {exc}", err=True)
        sys.exit(1)
    drawn = rendered_plot_count(dom)
    click.echo(f"screenshot {screenshot}: {drawn} of {len(built.figure_ids)} figures drawn", err=True)
    if drawn != len(built.figure_ids):
        sys.exit(1)
    click.echo(str(screenshot))
