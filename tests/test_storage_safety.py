"""A storage given to a search never destroys a user's file: a file that is not an optuna journal is
refused and left byte-identical (through `open_storage` and through `fa4tune search`), a symbolic link to
a journal is never rewritten behind the link, the journal's lock leaves no file beside it, and reading
an `sqlite:///` URL creates nothing."""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import optuna
import pytest
from optuna.distributions import CategoricalDistribution

from test_cli import fake_gpu, invoke  # noqa: F401  (fake_gpu: the fixture)
from fa4tune.searches.journal import NotAJournalError, repair_journal, scan_journal
from fa4tune.searches.storage import StorageError, open_for_reading, open_storage

REPO = Path(__file__).resolve().parent.parent
DIST = {"x": CategoricalDistribution([1, 2, 3])}
TORN = b'{"op_code":6,"worker_id":"w","trial_id":2,"par'


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _journal_with_trials(path: Path, n: int = 3) -> bytes:
    study = optuna.create_study(study_name="s", storage=open_storage(path))
    for i in range(n):
        study.tell(study.ask(DIST), float(i))
    return path.read_bytes()


def _optuna_sqlite(path: Path) -> None:
    optuna.create_study(study_name="s", storage=f"sqlite:///{path}").optimize(
        lambda t: t.suggest_float("x", 0, 1), n_trials=2)


def _plain_sqlite(path: Path) -> None:
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE notes (text)")
        conn.execute("INSERT INTO notes VALUES ('mine')")
    conn.close()


def _journal_then_junk(path: Path) -> None:
    """Valid operations, then a line no killed writer leaves (text written into the journal), then more."""
    lines = _journal_with_trials(path).splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:2]) + b"a note I pasted here\n" + b"".join(lines[2:]))


NOT_JOURNALS = {
    # name: (how to make it, what the error says it is)
    "optuna.db": (_optuna_sqlite, "an optuna SQLite database"),
    "notes.db": (_plain_sqlite, "an SQLite database without optuna's tables"),
    "best_configs.json": (lambda p: p.write_text(json.dumps({"schema": 1, "entries": []}, indent=2) + "\n"),
                          "a JSON document"),
    "one_line.json": (lambda p: p.write_text('{"op": 1}'), "a JSON document"),
    "notes.txt": (lambda p: p.write_text("hello\nworld\n"), r"a text file \(line 1 is not an optuna operation"),
    "blank_lines": (lambda p: p.write_text("\n\n"), r"a text file \(line 1 is blank"),
    "data.bin": (lambda p: p.write_bytes(bytes(range(256)) * 4), "binary data"),
    "journal_then_junk": (_journal_then_junk, r"a text file \(line 3 is not an optuna operation"),
    "a complete line then a newline-less non-operation": (
        lambda p: p.write_bytes(_journal_with_trials(p) + b"trailing words"), "a text file"),
}


@pytest.mark.parametrize("name", list(NOT_JOURNALS))
def test_a_file_that_is_not_a_journal_is_refused_and_left_byte_identical(tmp_path, name):
    make, what = NOT_JOURNALS[name]
    path = tmp_path / name.replace(" ", "_")
    make(path)
    before, listing = _digest(path), sorted(os.listdir(tmp_path))
    with pytest.raises(StorageError, match=f"is {what}.*it was left unchanged") as refused:
        open_storage(path)
    if name == "optuna.db":
        assert str(refused.value).endswith(f"Pass it as the URL sqlite:///{path}")
    assert _digest(path) == before
    assert sorted(os.listdir(tmp_path)) == listing        # no lock, side or temp file beside it


@pytest.mark.parametrize("name", ["optuna.db", "best_configs.json", "notes.txt", "data.bin"])
def test_fa4tune_search_refuses_a_file_that_is_not_a_journal_with_a_one_line_error(tmp_path, fake_gpu, name):
    make, what = NOT_JOURNALS[name]
    path = tmp_path / name
    make(path)
    before, listing = _digest(path), sorted(os.listdir(tmp_path))
    result = invoke("search", "--seqlen", "1024", "--gqa", "4", "--causal", "--trials", "2", "--storage", str(path),
                    "--no-db", "--no-peers", "--retime", "0")
    assert result.exit_code == 1, result.stderr
    [line] = [x for x in result.stderr.splitlines() if x.startswith("Error:")]
    assert f"storage {path} is" in line and "it was left unchanged" in line and "Traceback" not in result.stderr
    assert _digest(path) == before and sorted(os.listdir(tmp_path)) == listing


def test_a_fifo_is_refused_at_once_not_waited_on(tmp_path):
    fifo = tmp_path / "studies.journal"
    os.mkfifo(fifo)
    code = textwrap.dedent(f"""
        from fa4tune.searches.storage import StorageError, open_storage
        try:
            open_storage({str(fifo)!r})
        except StorageError as exc:
            print(exc)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "not a regular file" in done.stdout, done.stderr
    assert sorted(os.listdir(tmp_path)) == ["studies.journal"]


def test_an_empty_or_absent_file_is_a_new_journal(tmp_path):
    empty = tmp_path / "empty.journal"
    empty.touch()
    for path in (empty, tmp_path / "new" / "studies.journal"):
        optuna.create_study(study_name="s", storage=open_storage(path)).tell(
            optuna.load_study(study_name="s", storage=open_storage(path)).ask(DIST), 1.0)
        assert [t.value for t in optuna.load_study(study_name="s", storage=open_storage(path)).trials] == [1.0]


# ------------------------------------------------------------------------------------------------
# what counts as a journal: damage only where a killed writer leaves it

def test_the_shapes_a_killed_writer_leaves_are_repaired(tmp_path):
    path = tmp_path / "studies.journal"
    data = _journal_with_trials(path)
    first, rest = data.split(b"\n", 1)[0] + b"\n", data.split(b"\n", 1)[1]
    # the very first write cut short: a torn operation alone
    path.write_bytes(b'{"op_code":0,"worker_id":"w","study_na')
    assert repair_journal(path).torn_lines == [1] and path.read_bytes() == b""
    # ... even a shorter start of one
    path.write_bytes(b'{"op')
    assert repair_journal(path).torn_lines == [1] and path.read_bytes() == b""
    # the first write cut short, then an append landed on it
    path.write_bytes(b'{"op_code":0,"wor' + first + rest)
    assert repair_journal(path).salvaged == 1
    assert path.read_bytes() == b" " * len(b'{"op_code":0,"wor') + data
    assert [t.value for t in optuna.load_study(study_name="s", storage=open_storage(path)).trials] == [0.0, 1.0, 2.0]


@pytest.mark.parametrize("damaged", [
    b"not json\n",                                  # text among operations
    b'{"op_code":6,"worker_id":"w"\n',             # a torn operation that ends in a newline: no kill leaves that
    b'{"x": 1}\n',                                  # JSON, not an operation
    b"\n",                                          # a blank line
    b'xx{"op_code":0,"worker_id":"w","study_name":"t","directions":[1]}\n',   # garbage before an operation
])
def test_damage_no_killed_writer_leaves_makes_the_file_no_journal(tmp_path, damaged):
    path = tmp_path / "studies.journal"
    data = _journal_with_trials(path)
    lines = data.splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:1]) + damaged + b"".join(lines[1:]))
    with pytest.raises(NotAJournalError, match="line 2"):
        scan_journal(path.read_bytes(), str(path))
    before = _digest(path)
    with pytest.raises(StorageError, match="line 2"):
        open_storage(path)
    assert _digest(path) == before


# ------------------------------------------------------------------------------------------------
# symbolic links

def _link(tmp_path) -> tuple[Path, Path]:
    real = tmp_path / "real" / "studies.journal"
    real.parent.mkdir()
    link = tmp_path / "link.journal"
    return real, link


def test_an_intact_symlinked_journal_opens_and_stays_a_link(tmp_path):
    real, link = _link(tmp_path)
    _journal_with_trials(real)
    link.symlink_to(real)
    study = optuna.load_study(study_name="s", storage=open_storage(link))
    study.tell(study.ask(DIST), 9.0)
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert [t.value for t in optuna.load_study(study_name="s", storage=open_storage(real)).trials][-1] == 9.0
    assert sorted(os.listdir(tmp_path)) == ["link.journal", "real"] and os.listdir(real.parent) == ["studies.journal"]


@pytest.mark.parametrize("where", ["last line", "middle line"])
def test_a_symlinked_journal_that_needs_repair_is_refused_naming_the_real_path(tmp_path, where):
    real, link = _link(tmp_path)
    data = _journal_with_trials(real)
    if where == "last line":
        real.write_bytes(data + TORN)
    else:
        lines = data.splitlines(keepends=True)
        real.write_bytes(b"".join(lines[:2]) + TORN + b"".join(lines[2:]))
    link.symlink_to(real)
    before = _digest(real)
    with pytest.raises(StorageError, match=f"symbolic link.*pass the real path {real}"):
        open_storage(link)
    assert link.is_symlink() and os.readlink(link) == str(real) and _digest(real) == before
    assert sorted(os.listdir(tmp_path)) == ["link.journal", "real"] and os.listdir(real.parent) == ["studies.journal"]
    # the real path is repaired as any journal
    assert open_storage(real, say=lambda _: None) is not None and repair_journal(real) is None


def test_a_dangling_symlink_is_refused_and_nothing_is_created_behind_it(tmp_path):
    real, link = _link(tmp_path)
    link.symlink_to(real)
    with pytest.raises(StorageError, match="symbolic link.*does not exist"):
        open_storage(link)
    assert link.is_symlink() and not real.exists() and os.listdir(real.parent) == []


# ------------------------------------------------------------------------------------------------
# the lock

def test_the_journal_lock_leaves_no_file_beside_the_journal(tmp_path):
    path = tmp_path / "studies.journal"
    _journal_with_trials(path)
    path.write_bytes(path.read_bytes() + b'{"op_co')          # a repair runs under the lock too
    open_storage(path, say=lambda _: None)
    assert sorted(p.name for p in tmp_path.iterdir() if ".torn-" not in p.name) == ["studies.journal"]


def test_no_lock_file_is_committed_and_older_ones_are_ignored():
    assert not list((REPO / "results").rglob("*.flock"))
    assert "results/*.flock" in (REPO / ".gitignore").read_text().split()


_WRITER = """
import sys
import optuna
from optuna.distributions import CategoricalDistribution
from fa4tune.searches.storage import open_storage
path, n = sys.argv[1], int(sys.argv[2])
study = optuna.create_study(study_name="s", storage=open_storage(path), load_if_exists=True)
for i in range(n):
    study.tell(study.ask({"x": CategoricalDistribution([1, 2, 3])}), float(i))
"""


def test_concurrent_writers_through_the_journal_lock_lose_nothing(tmp_path):
    path = tmp_path / "studies.journal"
    writers = [subprocess.Popen([sys.executable, "-c", _WRITER, str(path), "15"]) for _ in range(4)]
    assert [w.wait(120) for w in writers] == [0] * 4
    assert repair_journal(path) is None
    study = optuna.load_study(study_name="s", storage=open_storage(path))
    assert len([t for t in study.trials if t.value is not None]) == 60
    assert sorted(os.listdir(tmp_path)) == ["studies.journal"]


# ------------------------------------------------------------------------------------------------
# reading creates nothing

def test_reading_an_sqlite_url_of_a_missing_file_is_an_error_and_creates_nothing(tmp_path):
    missing = tmp_path / "new.db"
    with pytest.raises(FileNotFoundError, match=f"the SQLite file {missing} does not exist"):
        open_for_reading(f"sqlite:///{missing}")
    assert not missing.exists()


def test_the_report_given_an_sqlite_url_of_a_missing_file_creates_nothing(tmp_path):
    from fa4tune.report.data import collect

    missing = tmp_path / "new.db"
    data = collect(tmp_path, storage=f"sqlite:///{missing}")
    assert not missing.exists()
    assert any("new.db does not exist" in note for note in data.missing)


def test_an_sqlite_url_is_read_read_only(tmp_path):
    db = tmp_path / "s.db"
    _optuna_sqlite(db)
    before = _digest(db)
    storage = open_for_reading(f"sqlite:///{db}")
    assert optuna.study.get_all_study_names(storage) == ["s"]
    with pytest.raises(Exception):
        optuna.create_study(study_name="t", storage=storage)
    assert _digest(db) == before
    plain = tmp_path / "notes.db"
    _plain_sqlite(plain)
    with pytest.raises(ValueError, match="without optuna's tables"):
        open_for_reading(f"sqlite:///{plain}")
    journal = tmp_path / "studies.journal"
    _journal_with_trials(journal)
    with pytest.raises(ValueError, match="not an SQLite database"):
        open_for_reading(f"sqlite:///{journal}")
