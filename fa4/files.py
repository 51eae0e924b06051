"""Writing result files: whole or not at all, readable by others, one writer at a time.

`atomic_write` writes a temporary file in the target's folder, fsyncs it and renames it over the
target, so a reader never sees half a file. `tempfile.mkstemp` creates files readable by their owner
only (0600); a result file is meant to be read by other users and tools, so it gets 0644 before the
rename.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from pathlib import Path
from typing import Iterator

RESULT_FILE_MODE = 0o644


@contextlib.contextmanager
def exclusive_lock(lock_path: str | os.PathLike) -> Iterator[None]:
    """Hold an exclusive `fcntl` lock on a lock file (created if absent). The kernel releases it when
    the holder dies, so a killed process never leaves it taken."""
    with open(lock_path, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def atomic_write(path: str | os.PathLike, text: str | bytes) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with (os.fdopen(fd, "wb") if isinstance(text, bytes) else os.fdopen(fd, "w", encoding="utf-8")) as handle:
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
