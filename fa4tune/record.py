"""The database write: a study's best configuration becomes an entry of the best-config database.

The database itself (format, lock, atomic write, lookup) is `fa4.database`; this is the harness side:
what of a study goes into an entry, and into which file (`--db`, else `$FA4_CONFIG_DB`, else the
results directory's `best_configs.json`, started from the packaged database the first time).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Optional

from fa4.kernels import AttentionProblem
from fa4tune.study import best_ok_trial


def database_for_writing(path: Optional[str]) -> Path:
    """The file a search records into. A default database that does not exist yet starts as a copy of
    the packaged one, so what a user tunes adds to what ships instead of hiding it."""
    from fa4.database import ENV_VAR, packaged_path
    from fa4tune.paths import database_path

    if path is not None:
        return Path(path)
    if os.environ.get(ENV_VAR):
        return Path(os.environ[ENV_VAR])
    target = database_path()
    packaged = packaged_path()
    if not target.exists() and packaged.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(packaged, target)
        target.chmod(0o644)
    return target


def record_best(study, db_path: Optional[str]) -> Optional[dict]:
    """Merge the study's best ok trial into the database; {"path", "key", "written"}, or None when the
    study has no working configuration (or no device to file it under)."""
    from fa4.database import Entry, record

    best = best_ok_trial(study)
    attrs = study.user_attrs
    device = (attrs.get("device") or {}).get("name")
    if best is None or not device:
        return None
    problem = AttentionProblem(**attrs["problem"])
    peers_us = {n: d.get("us") for n, d in (attrs.get("peers") or {}).items() if isinstance(d, dict)}
    entry = Entry.from_result(
        arch=attrs["arch"], device=device, problem=problem, config=dict(best.params), us=best.value,
        tflops=best.user_attrs.get("tflops") or 0.0, default_us=attrs.get("default_us"),
        peers_us=peers_us, max_err=best.user_attrs.get("max_err"),
        kernel_fingerprint=attrs.get("kernel_fingerprint", ""), versions=attrs.get("versions") or {},
        study=study.study_name, trial=best.number)
    path = database_for_writing(db_path)
    changed = record(entry, path)
    return {"path": str(path), "key": entry.key, "written": changed}
