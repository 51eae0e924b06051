"""The journal file of the searches, made to survive a killed writer: its lock, its repair, and the
refusal of anything that is not a journal.

Optuna's `JournalFileBackend` appends one JSON line per storage operation (`{"op_code":...}`), opening
the file for each append. Two ways a killed process (`kill -9`, power loss, a full disk) used to hurt
every later run:

- **A torn line.** A write cut short leaves a last line without its end. Optuna reads past it once, but
  the next append lands on the same line, the merged line is no JSON, and from then on every reader
  raises "Invalid log format". `repair_journal` runs before a search opens the journal, under its
  lock, and only ever changes the file in place (no rename: other processes hold the same file open
  and lock it): a complete last line that only lacks its newline gets one; a torn last line is cut
  off; in a line already merged with a later append, the torn bytes are overwritten with spaces
  (JSON allows them before the operation), so every offset stays where running readers cached it.
  The torn bytes are first kept in a side file `<journal>.torn-<UTC time>`. It says what it did; an
  intact journal is only read.
- **A stale lock.** Optuna's default lock is a symlink that a killed holder leaves behind; the next
  writer waits out its 30 s grace period (on every such kill). `JournalFlock` locks the journal file
  itself with `flock` instead: the kernel drops the lock of a dead process, so nothing is ever stale,
  and no lock file is left beside the journal. `flock` locks belong to an open file description, so
  the lock's own descriptor excludes every other process (and optuna's appends, made under it, never
  touch the lock). `flock` needs a local file system or NFSv4; searches on several hosts share a
  PostgreSQL storage instead (docs/search-at-scale.md). Every writer of a journal must use the same lock:
  fa4tune opens journals only through `fa4tune.searches.storage.open_storage`.

What is a journal (`scan_journal`): an empty file, or lines each of which is a complete operation (a
JSON object with "op_code", ending in a newline) or damage of the only shapes a killed writer leaves:
the last line cut short (it begins as an operation begins, `{"op_code":`, or is a start of that), or
such a start followed by a complete operation that a later append wrote onto it. Anything else (an
SQLite database, a JSON document, other text, binary data, a line damaged any other way) raises
`NotAJournalError` and the file is left byte-identical. A journal reached through a symbolic link is
opened as usual when intact, but never repaired: the repair would change the link's target behind the
user's back, so it is refused with the real path to repair.
"""

from __future__ import annotations

import fcntl
import json
import os
import stat
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

TORN_SUFFIX = ".torn-"
# how optuna starts every operation it writes (json.dumps of a dict whose first key is op_code)
OPERATION_START = b'{"op_code":'


class JournalError(ValueError):
    """A journal that cannot be opened or repaired safely; the file was left as it was."""


class NotAJournalError(JournalError):
    """The file is not an optuna journal (or is damaged where no killed writer leaves damage)."""

    def __init__(self, path: str, line: int, why: str):
        self.path, self.line, self.why = path, line, why
        super().__init__(f"{path} is not an optuna journal: line {line} {why}")


class JournalFlock:
    """A lock object for `JournalFileBackend(lock_obj=...)`: `acquire()` and `release()`, as optuna's
    own locks. (optuna types the parameter with a base class it does not export; the backend only calls
    these two methods, and tests/test_journal.py fails if that changes.)

    The lock is an exclusive `flock` on the journal file itself, through a descriptor of its own
    opened on every acquire (close-on-exec: a spawned worker process does not inherit it). A journal
    absent at that moment is created empty, never truncated, as optuna's append would create it."""

    def __init__(self, journal_path: str | os.PathLike):
        self.path = str(journal_path)
        self._thread_lock = threading.Lock()   # one holder per process at a time, then the flock
        self._fd: Optional[int] = None

    def acquire(self) -> bool:
        self._thread_lock.acquire()
        try:
            self._fd = _open_for_lock(self.path)
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        except BaseException:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            self._thread_lock.release()
            raise
        return True

    def release(self) -> None:
        fd, self._fd = self._fd, None
        try:
            if fd is not None:
                os.close(fd)   # closing the lock's only descriptor drops the flock
        finally:
            self._thread_lock.release()


def _open_for_lock(path: str) -> int:
    # O_NONBLOCK: opening a FIFO put where the journal should be returns at once instead of waiting for
    # a writer (flock itself ignores the flag)
    fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise JournalError(f"{path} is not a regular file, so it cannot be an optuna journal")
    return fd


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


@dataclass(frozen=True)
class Damage:
    """One damaged line: `torn` bytes at file offset `offset`, then `tail` (an intact operation a later
    append wrote onto it, or nothing) and whether the line has its newline."""

    number: int
    offset: int
    torn: bytes
    tail: bytes
    has_newline: bool


def _is_operation(data: bytes) -> bool:
    try:
        record = json.loads(data)
    except ValueError:
        return False
    return isinstance(record, dict) and "op_code" in record


def _begins_like_an_operation(data: bytes) -> bool:
    """Bytes a cut-short write of an operation can leave: `{"op_code":...`, or a shorter start of it."""
    return bool(data) and OPERATION_START.startswith(data[:len(OPERATION_START)])


def _split_damaged(body: bytes) -> tuple[bytes, bytes]:
    """(torn bytes, intact tail) of a damaged line without its newline: the tail is the longest suffix
    that is a whole operation (an append that landed on a torn line), else empty."""
    start = body.find(OPERATION_START, 1)
    while start != -1:
        if _is_operation(body[start:]):
            return body[:start], body[start:]
        start = body.find(OPERATION_START, start + 1)
    return body, b""


def _lines(data: bytes) -> list[bytes]:
    """The lines of a journal, each with its newline but the last; split on newlines only (optuna
    writes no other line break: json.dumps escapes them)."""
    lines = [line + b"\n" for line in data.split(b"\n")]
    lines[-1] = lines[-1][:-1]
    return lines if lines[-1] else lines[:-1]


def scan_journal(data: bytes, path: str = "the file") -> list[Damage]:
    """The damaged lines of a journal's content (empty when intact); raises NotAJournalError for
    content that is not a journal (see the module docstring)."""
    damage = []
    offset = 0
    for number, line in enumerate(_lines(data), start=1):
        has_newline = line.endswith(b"\n")
        if has_newline and _is_operation(line):
            offset += len(line)
            continue
        body = line[:-1] if has_newline else line
        if not has_newline and _is_operation(body):   # complete, only its newline was lost
            damage.append(Damage(number, offset, b"", body, False))
        else:
            torn, tail = _split_damaged(body)
            if not _begins_like_an_operation(torn):
                raise NotAJournalError(path, number, _what_line_is(body))
            if has_newline and not tail:
                # a cut-short write never ends in a newline, and any later append lands on its line
                raise NotAJournalError(path, number, "is not a complete optuna operation")
            damage.append(Damage(number, offset, torn, tail, has_newline))
        offset += len(line)
    return damage


def _what_line_is(body: bytes) -> str:
    if not body.strip():
        return "is blank"
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        return "is not text"
    shown = text[:40] + ("..." if len(text) > 40 else "")
    return f"is not an optuna operation: {shown!r}"


def repair_journal(path: str | os.PathLike, lock: Optional[JournalFlock] = None) -> Optional[Repair]:
    """Repair a journal's damaged lines (see the module docstring), holding its lock. Returns what was
    done, or None when the journal was intact (or absent: nothing is created) and nothing was written.
    Raises NotAJournalError for a file that is not a journal, and JournalError for a symbolic link to a
    journal that needs repair; the file is then left as it was."""
    path = Path(path)
    if not os.path.lexists(path):
        return None
    if not path.exists():
        raise JournalError(f"journal {path} is a symbolic link to {os.path.realpath(path)}, which does not "
                           "exist: fa4tune does not create a file behind a link; create it there or pass "
                           "another path")
    if not path.is_file():
        raise JournalError(f"{path} is not a regular file, so it cannot be an optuna journal")
    # every journal begins as an operation begins (after the spaces of a repaired line): anything else
    # is refused before it is locked (a lock on a database someone else uses could make them wait) or
    # read whole
    with open(path, "rb") as handle:
        start = handle.read(4096).lstrip(b" ")
    if start and not _begins_like_an_operation(start[:len(OPERATION_START)]):
        raise NotAJournalError(str(path), 1, _what_line_is(start.split(b"\n")[0]))
    lock = lock or JournalFlock(path)
    lock.acquire()
    try:
        data = path.read_bytes()
        damage = scan_journal(data, str(path))
        if not damage:
            return None
        if path.is_symlink():
            raise JournalError(
                f"journal {path} needs repair (line {', '.join(str(d.number) for d in damage)} damaged by a "
                f"killed writer), but it is a symbolic link: fa4tune does not change a link's target behind "
                f"it; pass the real path {os.path.realpath(path)} to repair it there")
        return _repair(path, damage)
    finally:
        lock.release()


def _repair(path: Path, damage: list[Damage]) -> Repair:
    """Repair in place: only the last line can be cut off or completed, and a line in the middle keeps
    its length (torn bytes become spaces), so no running reader's cached offset moves."""
    repair = Repair(str(path), torn_lines=[d.number for d in damage])
    repair.salvaged = sum(1 for d in damage if d.tail)
    torn = [d.torn for d in damage if d.torn]
    if torn:
        # kept first, so that a repair cut short loses nothing; appended: two repairs in one second keep both
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        side = Path(f"{path}{TORN_SUFFIX}{stamp}")
        with open(side, "ab") as handle:
            handle.write(b"\n".join(torn) + b"\n")
            handle.flush()
            os.fsync(handle.fileno())
        repair.side_file, repair.torn_bytes = str(side), sum(len(b) for b in torn)
    with open(path, "r+b") as handle:
        for d in damage:
            if d.torn and d.tail:
                handle.seek(d.offset)
                handle.write(b" " * len(d.torn))
        last = damage[-1]
        if not last.has_newline:
            if last.tail:
                handle.seek(0, os.SEEK_END)
                handle.write(b"\n")
            else:   # the torn last line alone: cut off
                handle.truncate(last.offset)
        handle.flush()
        os.fsync(handle.fileno())
    return repair
