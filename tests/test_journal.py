"""The journal survives a killed writer: a torn line is repaired (and kept aside), a lock left by
`kill -9` does not stall the next writer."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import optuna
import pytest
from optuna.distributions import CategoricalDistribution

from fa4tune.searches.journal import JournalFlock, repair_journal
from fa4tune.searches.storage import find_storages, open_storage

DIST = {"x": CategoricalDistribution([1, 2, 3])}


def _journal_with_trials(path, n=3) -> bytes:
    study = optuna.create_study(study_name="s", storage=open_storage(path))
    for i in range(n):
        trial = study.ask(DIST)
        study.tell(trial, float(i))
    return path.read_bytes()


def _values(path) -> list:
    return [t.value for t in optuna.load_study(study_name="s", storage=open_storage(path)).trials]


def test_an_intact_journal_is_left_alone(tmp_path):
    path = tmp_path / "studies.journal"
    data = _journal_with_trials(path)
    mtime = path.stat().st_mtime_ns
    assert repair_journal(path) is None and path.read_bytes() == data and path.stat().st_mtime_ns == mtime
    assert repair_journal(tmp_path / "absent.journal") is None


def test_a_torn_last_line_is_cut_off_kept_aside_and_reported_and_later_runs_work(tmp_path):
    path = tmp_path / "studies.journal"
    data = _journal_with_trials(path)
    torn = b'{"op_code":6,"worker_id":"w","trial_id":2,"par'
    path.write_bytes(data + torn)
    # what optuna does without the repair: the next append merges with the torn bytes, and from then
    # on the journal cannot be read
    copy = tmp_path / "elsewhere" / "copy.journal"
    copy.parent.mkdir()
    copy.write_bytes(data + torn)
    plain = optuna.storages.journal.JournalFileBackend(str(copy))
    plain.append_logs([{"op_code": 0, "worker_id": "w", "study_name": "t", "directions": [1]}])
    plain.append_logs([{"op_code": 0, "worker_id": "w", "study_name": "u", "directions": [1]}])
    with pytest.raises(Exception):
        list(optuna.storages.journal.JournalFileBackend(str(copy)).read_logs(0))

    said = []
    storage = open_storage(path, say=said.append)
    assert path.read_bytes() == data                                    # cut off in place
    [side] = tmp_path.glob("studies.journal.torn-*")
    assert side.read_bytes() == torn + b"\n"
    assert len(said) == 1 and f"repaired 1 damaged line(s) (line {len(data.splitlines()) + 1})" in said[0] and str(side) in said[0]
    study = optuna.load_study(study_name="s", storage=storage)
    study.tell(study.ask(DIST), 5.0)
    assert _values(path) == [0.0, 1.0, 2.0, 5.0]
    assert repair_journal(path) is None                                 # once repaired, intact
    assert find_storages(tmp_path) == [path]                            # the side file is no storage
    with pytest.warns(RuntimeWarning, match="repaired"):                # without `say`: a warning
        path.write_bytes(path.read_bytes() + b'{"op_co')
        open_storage(path)


def test_a_line_lacking_only_its_newline_is_kept(tmp_path):
    path = tmp_path / "studies.journal"
    data = _journal_with_trials(path)
    path.write_bytes(data[:-1])
    repair = repair_journal(path)
    assert repair.salvaged == 1 and repair.side_file is None and path.read_bytes() == data
    assert _values(path) == [0.0, 1.0, 2.0]


def test_a_torn_line_an_append_already_landed_on_keeps_the_appended_operation(tmp_path):
    path = tmp_path / "studies.journal"
    data = _journal_with_trials(path, n=2)
    lines = data.splitlines(keepends=True)
    # a writer died mid-line after the 2nd trial's creation; another process then appended the rest
    cut = len(lines) - 3
    damaged = b'{"op_code":9,"worker_id":"dead","trial_id":1,"us' + lines[cut]
    path.write_bytes(b"".join(lines[:cut]) + damaged + b"".join(lines[cut + 1:]))
    with pytest.raises(Exception):
        list(optuna.storages.journal.JournalFileBackend(str(path)).read_logs(0))
    torn_length = len(damaged) - len(lines[cut])
    repair = repair_journal(path)
    assert repair.torn_lines == [cut + 1] and repair.salvaged == 1
    # in place: the torn bytes became spaces (JSON allows them), every line keeps its offset
    assert path.read_bytes() == b"".join(lines[:cut]) + b" " * torn_length + b"".join(lines[cut:])
    assert _values(path) == [0.0, 1.0]
    assert repair_journal(path) is None


def test_the_journal_lock_is_what_optuna_calls(tmp_path):
    """JournalFlock stands in for optuna's lock through the two methods its backend calls: a failure
    here means an optuna upgrade changed how the backend uses lock_obj."""
    path = tmp_path / "studies.journal"
    calls = []

    class Counting(JournalFlock):
        def acquire(self):
            calls.append("acquire")
            return super().acquire()

        def release(self):
            calls.append("release")
            super().release()

    backend = optuna.storages.journal.JournalFileBackend(str(path), lock_obj=Counting(path))
    backend.append_logs([{"op_code": 0, "worker_id": "w", "study_name": "t", "directions": [1]}])
    assert calls == ["acquire", "release"]


_HOLD_LOCK = """
import sys, time
from fa4tune.searches.journal import JournalFlock
lock = JournalFlock(sys.argv[1])
lock.acquire()
print("held", flush=True)
time.sleep(600)
"""


def test_a_lock_held_by_a_process_killed_with_sigkill_does_not_stall_the_next_writer(tmp_path):
    path = tmp_path / "studies.journal"
    _journal_with_trials(path, n=1)
    # the state optuna's own lock leaves after a kill -9: a dangling symlink lock (ignored now)
    os.symlink(str(path), str(path) + ".lock")
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        # while it lives, it holds the lock: a flock on the journal file itself
        probe = textwrap.dedent(f"""
            import fcntl, sys
            fd = open({str(path)!r}, "rb")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                sys.exit(3)
        """)
        assert subprocess.run([sys.executable, "-c", probe]).returncode == 3
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(30)
    start = time.monotonic()
    study = optuna.load_study(study_name="s", storage=open_storage(path))
    study.tell(study.ask(DIST), 7.0)
    assert time.monotonic() - start < 5.0      # optuna's symlink lock would wait out 30 s
    assert _values(path) == [0.0, 7.0]
