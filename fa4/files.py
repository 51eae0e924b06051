"""Writing result files: whole or not at all, and readable by others.

`atomic_write` writes a temporary file in the target's folder, fsyncs it and renames it over the
target, so a reader never sees half a file. `tempfile.mkstemp` creates files readable by their owner
only (0600); a result file is meant to be read by other users and tools, so it gets 0644 before the
rename.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

RESULT_FILE_MODE = 0o644


def atomic_write(path: str | os.PathLike, text: str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, RESULT_FILE_MODE)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path
