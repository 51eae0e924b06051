"""The database write: a study's best configuration becomes an entry of the best-config database.

The database itself (format, lock, atomic write, lookup) is `fa4.database`; this is the harness side:
what of a study goes into an entry, and into which file (`--db`, else the user's database: `$FA4_CONFIG_DB`,
else the results directory's `best_configs.json`). The user's file holds only what was tuned here; the
runtime reads it over the packaged database (`fa4.database.default_layers`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from fa4.varlen_batch import problem_from_dict
from fa4tune.searches.study import best_ok_trial


def database_for_writing(path: Optional[str]) -> Path:
    """The file a search records into: `path`, else the user's layer (never the packaged database,
    which is package data)."""
    from fa4tune.paths import database_path

    return Path(path) if path is not None else database_path()


def record_best(study, db_path: Optional[str], retimed: Optional[dict] = None) -> Optional[dict]:
    """Merge the study's best configuration into the database; {"path", "key", "written"}, or None
    when the study has no working configuration (or no device to file it under). With a re-time of
    the finalists (`fa4tune.searches.retime`), the best is its winner, timed by its median, and the default by
    its own median; else the best ok trial and the default's trial time."""
    from fa4.database import Entry, record

    best = best_ok_trial(study)
    attrs = study.user_attrs
    device = (attrs.get("device") or {}).get("name")
    if best is None or not device:
        return None
    problem = problem_from_dict(attrs["problem"])   # a varlen batch's entry keeps its lengths
    us, default_us, tflops = best.value, attrs.get("default_us"), best.user_attrs.get("tflops") or 0.0
    if retimed is not None:
        from fa4tune.workers.timing import tflops as tflops_of

        best = study.trials[retimed["winner_trial"]]
        us = retimed["winner_us"]
        default_us = retimed["default_us"] if retimed["default_us"] is not None else default_us
        tflops = round(tflops_of(problem.flops(), us), 2)
    peers_us = {n: d.get("us") for n, d in (attrs.get("peers") or {}).items() if isinstance(d, dict)}
    entry = Entry.from_result(
        arch=attrs["arch"], device=device, problem=problem, config=dict(best.params), us=us,
        tflops=tflops, default_us=default_us,
        peers_us=peers_us, max_err=best.user_attrs.get("max_err"),
        kernel_fingerprint=attrs.get("kernel_fingerprint", ""), versions=attrs.get("versions") or {},
        study=study.study_name, trial=best.number)
    path = database_for_writing(db_path)
    changed = record(entry, path)
    return {"path": str(path), "key": entry.key, "written": changed}
