"""Writing result files: whole or not at all, readable by others, one writer at a time.

`atomic_write` writes a temporary file in the target's folder, fsyncs it and renames it over the
target, so a reader never sees half a file. `tempfile.mkstemp` creates files readable by their owner
only (0600); a result file is meant to be read by other users and tools, so it gets 0644 before the
rename. A writer killed before the rename leaves its temporary file (`.<name>.<8 characters>.tmp`):
the writer holds an `flock` on its temporary file from its creation until after the rename, so a later
`atomic_write` of the same target removes the ones of the current user that no one holds and that are
older than `STALE_TEMPORARY_S` (the age covers the moment between creating the file and locking it).

`exclusive_file_lock(path)`, an `flock` the kernel releases when the holder dies (a killed process
never leaves it taken), locks the file itself and leaves nothing beside it. A lock belongs to the
file's inode, and a writer replaces the file by rename (`atomic_write`), which puts a new inode at the
path; so once the lock is taken the path is checked to still name the locked inode, and if a writer
replaced it meanwhile the lock is taken again on the new one. Every writer holds the lock of the file
it replaces until the rename is done, so the holders of a path's lock follow one another. A missing
file is created empty to have something to lock (an empty file reads as an empty database) and removed
again on the way out when nothing was written to it; only a holder killed in between leaves it. It
needs read access to the file only, so every user who may replace a file can lock it, and it does not
depend on any setting (a lock file found through `$FA4TUNE_HOME` would not exclude a writer that has
another). `filelock`, which locks a separate lock file, can do none of this; it serves what has no file
of its own to lock (a GPU: `fa4tune.workers.worker.gpu_lock`; a shape being autotuned: `fa4.autotuning`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import stat
import tempfile
import time
from pathlib import Path
from typing import Iterator

RESULT_FILE_MODE = 0o644
# a temporary file of `atomic_write` no one holds is removed once it is this old (seconds)
STALE_TEMPORARY_S = 5.0


@contextlib.contextmanager
def exclusive_file_lock(path: str | os.PathLike) -> Iterator[None]:
    """Hold an exclusive `flock` on the regular file at `path` itself (see the module docstring), for
    writers that replace it by rename. Raises OSError when the path is not a regular file or cannot be
    opened or created (a missing folder, no permission)."""
    fd, created = _open_locked(path)
    try:
        yield
    finally:
        try:
            if created:  # the empty file made only to be locked: remove it unless it was written
                with contextlib.suppress(OSError):
                    now = os.stat(path)
                    mine = os.fstat(fd)
                    if (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino) and now.st_size == 0:
                        os.unlink(path)
        finally:
            # unlock before closing: a child forked meanwhile shares the descriptor, and would
            # otherwise hold the lock until it exits
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


def _open_locked(path: str | os.PathLike) -> tuple[int, bool]:
    """(descriptor holding the lock on the file now at `path`, whether it was created here)."""
    while True:
        created = False
        try:
            # O_NONBLOCK: opening a FIFO must not wait for a writer; a regular file ignores it
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            try:
                # O_EXCL: neither follows a symbolic link nor takes a file another process just made
                fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, RESULT_FILE_MODE)
                created = True
            except FileExistsError:
                if os.path.islink(path) and not os.path.exists(path):
                    raise FileNotFoundError(errno.ENOENT, "a symbolic link to a missing file",
                                            os.fspath(path)) from None
                continue   # another process created it first: open that one
        try:
            mine = os.fstat(fd)
            if not stat.S_ISREG(mine.st_mode):
                raise OSError(errno.EINVAL, "not a regular file", os.fspath(path))
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                now = os.stat(path)
            except FileNotFoundError:
                now = None
            if now is not None and (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino):
                return fd, created
            fcntl.flock(fd, fcntl.LOCK_UN)   # replaced (or removed) while we waited: lock what is there now
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


def atomic_write(path: str | os.PathLike, text: str | bytes) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        # held until the descriptor closes, after the rename: a live writer's file is never removed
        # as a dead one's (a file system without flock: nothing is removed, see below)
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        binary = isinstance(text, bytes)
        with (os.fdopen(fd, "wb", closefd=False) if binary
              else os.fdopen(fd, "w", encoding="utf-8", closefd=False)) as handle:
            handle.write(text)
            handle.flush()
            os.fsync(fd)
        os.fchmod(fd, RESULT_FILE_MODE)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    finally:
        os.close(fd)
    _remove_abandoned_temporaries(path)
    return path


def _remove_abandoned_temporaries(path: Path) -> None:
    """Remove the temporary files of `path` that writers killed before their rename left behind:
    named as `atomic_write` names them (mkstemp's 8 characters), the current user's, older than
    `STALE_TEMPORARY_S` and locked by no one. Anything else, or any doubt, leaves the file."""
    pattern = re.compile(re.escape(f".{path.name}.") + r"[a-z0-9_]{8}\.tmp")
    try:
        names = [name for name in os.listdir(path.parent) if pattern.fullmatch(name)]
    except OSError:
        return
    for name in names:
        with contextlib.suppress(OSError):   # gone meanwhile, not ours to open, no flock: left
            _remove_if_abandoned(path.parent / name)


def _remove_if_abandoned(temporary: Path) -> None:
    fd = os.open(temporary, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mine = os.fstat(fd)
        if (not stat.S_ISREG(mine.st_mode) or mine.st_uid != os.getuid()
                or time.time() - mine.st_mtime < STALE_TEMPORARY_S):
            return
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)   # BlockingIOError: its writer is alive
        now = os.lstat(temporary)
        if (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino):   # not renamed meanwhile
            os.unlink(temporary)
    finally:
        os.close(fd)
