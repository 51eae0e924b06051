"""A writer killed between creating its temporary file and the rename leaves the file behind
(`.<name>.<8 characters>.tmp`); a later `atomic_write` of the same target removes it once it is a few
seconds old and no writer holds it, and never removes a live writer's, a young one, another target's,
another user's, or a file that is not named as `atomic_write` names them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fa4.files import STALE_TEMPORARY_S, atomic_write

# a writer stopped before its rename: it prints the temporary file's name, then waits to be killed
_STOPPED_WRITER = """
import os, sys, time
from fa4.files import atomic_write

def stopped(temporary, target):
    print(os.path.basename(temporary), flush=True)
    time.sleep(600)

os.replace = stopped
atomic_write(sys.argv[1], "half written")
"""


def _stopped_writer(target: Path) -> tuple[subprocess.Popen, Path]:
    writer = subprocess.Popen([sys.executable, "-c", _STOPPED_WRITER, str(target)], stdout=subprocess.PIPE, text=True)
    name = writer.stdout.readline().strip()
    assert name.startswith(f".{target.name}.") and name.endswith(".tmp"), name
    return writer, target.parent / name


def _kill(writer: subprocess.Popen) -> None:
    writer.send_signal(signal.SIGKILL)
    writer.wait(30)


def _age(path: Path, seconds: float = STALE_TEMPORARY_S + 60) -> None:
    past = time.time() - seconds
    os.utime(path, (past, past), follow_symlinks=False)


def test_a_killed_writers_temporary_file_is_removed_by_the_next_write(tmp_path):
    target = tmp_path / "db.json"
    target.write_text("before")
    writer, temporary = _stopped_writer(target)
    _kill(writer)
    assert temporary.read_text() == "half written"
    atomic_write(target, "young")          # a few seconds old at most: may be a live writer's, kept
    assert temporary.exists()
    _age(temporary)
    atomic_write(target, "after")
    assert sorted(os.listdir(tmp_path)) == ["db.json"] and target.read_text() == "after"


def test_a_live_writers_temporary_file_is_kept_however_old(tmp_path):
    target = tmp_path / "db.json"
    writer, temporary = _stopped_writer(target)
    try:
        _age(temporary)
        atomic_write(target, "other writer")
        assert temporary.read_text() == "half written"   # it holds the file's lock
    finally:
        _kill(writer)
    atomic_write(target, "once it died")
    assert sorted(os.listdir(tmp_path)) == ["db.json"]


def test_only_files_named_as_its_temporary_files_are_removed(tmp_path):
    target = tmp_path / "db.json"
    kept = [tmp_path / name for name in (
        ".db.json.mine.tmp",              # not 8 characters
        ".db.json.abcdefgh.tmp.bak",      # another suffix
        ".other.json.abcdefgh.tmp",       # another target's
        "db.json.abcdefgh.tmp",           # not hidden
        ".db.json.ABCDEFGH.tmp",          # mkstemp uses lower case
    )]
    for path in kept:
        path.write_text("mine")
    folder = tmp_path / ".db.json.folder12.tmp"
    folder.mkdir()
    link = tmp_path / ".db.json.symlink1.tmp"
    link.symlink_to(tmp_path / ".db.json.mine.tmp")
    for path in kept + [folder, link]:
        _age(path)
    if os.geteuid() == 0:                 # another user's temporary file (only root can make one here)
        theirs = tmp_path / ".db.json.theirs12.tmp"
        theirs.write_text("theirs")
        os.chown(theirs, 12345, -1)
        _age(theirs)
        kept.append(theirs)
    atomic_write(target, "x")
    assert all(path.exists() for path in kept) and folder.is_dir() and link.is_symlink()
    assert sorted(os.listdir(tmp_path)) == sorted(p.name for p in kept + [folder, link, target])


@pytest.mark.parametrize("text", ["text\n", b"bytes\x00\n"])
def test_atomic_write_still_writes_text_and_bytes_readable_by_others(tmp_path, text):
    target = atomic_write(tmp_path / "out", text)
    assert (target.read_bytes() if isinstance(text, bytes) else target.read_text()) == text
    assert target.stat().st_mode & 0o777 == 0o644 and os.listdir(tmp_path) == ["out"]
