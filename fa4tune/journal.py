"""The journal file of the searches, made to survive a killed writer: its lock and its repair.

Optuna's `JournalFileBackend` appends one JSON line per storage operation. Two ways a killed process
(`kill -9`, power loss, a full disk) used to hurt every later run:

- **A torn line.** A write cut short leaves a last line without its end. Optuna reads past it once, but
  the next append lands on the same line, the merged line is no JSON, and from then on every reader
  raises "Invalid log format". `repair_journal` runs before a search opens the journal, under its
  lock: a complete last line that only lacks its newline gets one; the torn bytes of a line are cut
  out and kept in a side file `<journal>.torn-<UTC time>`; a line already merged with a later
  append keeps its intact tail (the later operation). It says what it did; an intact journal is only
  read.
- **A stale lock.** Optuna's default lock is a symlink that a killed holder leaves behind; the next
  writer waits out its 30 s grace period (on every such kill). `JournalFlock` locks with `flock`
  on `<journal>.flock` instead (`fa4.files.exclusive_lock`): the kernel drops the lock of a dead
  process, so nothing is ever stale. `flock` needs a local file system or NFSv4; searches on several
  hosts share a PostgreSQL storage instead (see the README). Every writer of a journal must use the
  same lock: fa4tune opens journals only through `fa4tune.storage.open_storage`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from fa4.files import exclusive_lock

FLOCK_SUFFIX = ".flock"
TORN_SUFFIX = ".torn-"
# how optuna starts every operation it writes (json.dumps of a dict whose first key is op_code)
_OPERATION_START = re.compile(rb'\{"op_code":')


class JournalFlock:
    """A lock object for `JournalFileBackend(lock_obj=...)`: `acquire()` and `release()`, as optuna's
    own locks. (optuna types the parameter with a base class it does not export; the backend only calls
    these two methods, and tests/test_journal.py fails if that changes.)"""

    def __init__(self, journal_path: str | os.PathLike):
        self.path = str(journal_path) + FLOCK_SUFFIX
        self._thread_lock = threading.Lock()   # one holder per process at a time, then the flock
        self._held: Optional[contextlib.ExitStack] = None

    def acquire(self) -> bool:
        self._thread_lock.acquire()
        stack = contextlib.ExitStack()
        try:
            stack.enter_context(exclusive_lock(self.path))
        except BaseException:
            self._thread_lock.release()
            raise
        self._held = stack
        return True

    def release(self) -> None:
        held, self._held = self._held, None
        try:
            if held is not None:
                held.close()
        finally:
            self._thread_lock.release()


@dataclass
class Repair:
    """What `repair_journal` changed in a journal."""

    path: str
    torn_lines: list[int] = field(default_factory=list)   # 1-based line numbers of the damaged lines
    torn_bytes: int = 0                                    # bytes moved to the side file
    salvaged: int = 0                                      # operations kept from damaged lines
    side_file: Optional[str] = None

    def describe(self) -> str:
        kept = f", kept {self.salvaged} intact operation(s) from them" if self.salvaged else ""
        moved = f"; {self.torn_bytes} torn byte(s) moved to {self.side_file}" if self.side_file else ""
        return (f"journal {self.path}: repaired {len(self.torn_lines)} damaged line(s) (line "
                f"{', '.join(map(str, self.torn_lines))}){kept}{moved}. A trial whose last write was torn "
                "is swept as interrupted and runs again.")


def _is_operation(data: bytes) -> bool:
    try:
        record = json.loads(data)
    except ValueError:
        return False
    return isinstance(record, dict) and "op_code" in record


def _split_damaged(line: bytes) -> tuple[bytes, bytes]:
    """(torn bytes, intact tail) of a damaged line: the tail is the longest suffix that is a whole
    operation (an append that landed on a torn line), else empty."""
    body = line.rstrip(b"\r\n")
    for match in _OPERATION_START.finditer(body, 1):
        if _is_operation(body[match.start():]):
            return body[:match.start()], body[match.start():] + b"\n"
    return body, b""


def repair_journal(path: str | os.PathLike, lock: Optional[JournalFlock] = None) -> Optional[Repair]:
    """Repair a journal's damaged lines (see the module docstring), holding its lock. Returns what was
    done, or None when the journal was intact (or absent) and nothing was written."""
    path = Path(path)
    lock = lock or JournalFlock(path)
    lock.acquire()
    try:
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        lines = data.splitlines(keepends=True)
        if all(line.endswith(b"\n") and _is_operation(line) for line in lines):
            return None
        repair = Repair(str(path))
        kept, torn = [], []
        for number, line in enumerate(lines, start=1):
            if line.endswith(b"\n") and _is_operation(line):
                kept.append(line)
                continue
            repair.torn_lines.append(number)
            if not line.endswith(b"\n") and _is_operation(line):   # complete, only its newline was lost
                kept.append(line + b"\n")
                repair.salvaged += 1
                continue
            bad, tail = _split_damaged(line)
            torn.append(bad)
            if tail:
                kept.append(tail)
                repair.salvaged += 1
        if torn:
            stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
            side = Path(f"{path}{TORN_SUFFIX}{stamp}")
            with open(side, "ab") as handle:   # appended: two repairs in one second keep both
                handle.write(b"\n".join(torn) + b"\n")
            repair.side_file, repair.torn_bytes = str(side), sum(len(b) for b in torn)
        good = b"".join(kept)
        # in place where possible: the lines before the damage keep their offsets (running readers
        # cache them), only a damaged line in the middle rewrites the file
        if data.startswith(good):
            os.truncate(path, len(good))
        elif good.startswith(data):
            with open(path, "ab") as handle:
                handle.write(good[len(data):])
        else:
            _rewrite(path, good)
        return repair
    finally:
        lock.release()


def _rewrite(path: Path, data: bytes) -> None:
    """Replace the journal's content whole (temp file and rename), keeping its mode."""
    tmp = path.with_name(f".{path.name}.repair.tmp")
    with open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.chmod(tmp, path.stat().st_mode & 0o777)
    os.replace(tmp, path)
