"""Where a run's outputs go: a results directory the user chooses, never the installed package.

`results_dir()` is `$FA4TUNE_HOME` when set, else the platform's user cache folder (`fa4.places`, through
platformdirs: `~/.cache/fa4tune` on Linux; the runtime reads the database from there too, so it is
defined below the harness). Inside it, with the same names and schemas as the repository's
committed `results/`:

    studies.journal     the optuna storage of every search (`fa4tune search --storage`)
    best_configs.json   the best-config database the search writes (`--db`): what was tuned here, read
                        over the packaged database (`fa4/data/best_configs.json`), winning per key
    bench.json          `fa4tune bench` (`--out`)
    report.html         `fa4tune report` (`--out`)

Every command names its files with options, so `--results DIR` (or FA4TUNE_HOME=DIR) points a whole
session at one folder, e.g. the repository's `results/` when refreshing the committed artifacts.
"""

from __future__ import annotations

import os

import click
from pathlib import Path

from fa4.database import user_path, user_results_dir

STORAGE_NAME = "studies.journal"
BENCH_NAME = "bench.json"
REPORT_NAME = "report.html"


def results_dir() -> Path:
    """The per-user results directory (`fa4.database.user_results_dir`; a command creates it when it
    writes)."""
    return user_results_dir()


def storage_path() -> Path:
    return results_dir() / STORAGE_NAME


def database_path() -> Path:
    """The database a search records into by default ($FA4_CONFIG_DB, when set, wins)."""
    from fa4.database import ENV_VAR

    env = os.environ.get(ENV_VAR)
    return Path(env) if env else user_path()


def bench_path() -> Path:
    return results_dir() / BENCH_NAME


# ---- checking an output path before a long run writes it (every command with a file option)

def output_problem(path: str | os.PathLike) -> str | None:
    """Why `path` could not be written as a result file (None: it can): it is a directory or a
    read-only file, or its folder is not a folder, cannot be created or cannot be written. Nothing is
    created to find out."""
    path = os.path.abspath(path)   # (os.path answers False where it cannot look, Path may raise)
    if os.path.isdir(path):
        return "is a directory"
    if os.path.exists(path) and not os.access(path, os.W_OK):
        return "is read-only"
    folder = os.path.dirname(path)
    while not os.path.lexists(folder) and folder != os.path.dirname(folder):
        folder = os.path.dirname(folder)   # the folders that do not exist yet are created by the write
    if not os.path.isdir(folder):
        return f"{folder} is not a directory"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"cannot write in {folder}"
    return None


def check_output(path: str | os.PathLike | None, option: str) -> None:
    """A ClickException naming `option` when its file could not be written (`output_problem`)."""
    problem = output_problem(path) if path is not None else None
    if problem:
        raise click.ClickException(f"cannot write {option} {path}: {problem}")


def write_failed(exc: OSError) -> click.ClickException:
    """A write that failed anyway (disk full, a folder removed meanwhile), as one line."""
    where = f" {exc.filename}" if exc.filename else ""
    return click.ClickException(f"cannot write{where}: {exc.strerror or exc}")
