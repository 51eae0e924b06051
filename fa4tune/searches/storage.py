"""The optuna storage of the searches: opening it to write (the search) or only to read (the report).

One storage holds every study: by default an optuna `JournalStorage` over a `JournalFileBackend` (one
JSON line per operation; `fa4tune.searches.journal` locks the journal file itself with `flock` and repairs a torn
line first), `studies.journal` in the results directory (`fa4tune.paths`). A URL (`sqlite:///...`,
`postgresql://...`) selects an `RDBStorage` instead.

Writing never destroys a file that is not a journal: `open_storage` refuses an SQLite database, a JSON
document, other text or binary data given as a journal path (`StorageError`, naming what the file looks
like and the option that fits, e.g. `sqlite:///s.db`) and leaves it byte-identical; an absent or empty
file is a new journal. A symbolic link to a journal that needs repair is refused too (see
`fa4tune.searches.journal`).

Reading must not write: `open_for_reading` opens an SQLite file read-only and only when it already holds
optuna's tables (optuna's `RDBStorage` would otherwise create them in whatever file it is given); an
`sqlite:///` URL is read the same way, and one naming a missing file is an error (SQLAlchemy's sqlite
driver would create it).

Trials and studies are addressed through the storage's public API (`get_study_id_from_name`,
`get_trial_id_from_study_id_trial_number`), never through private attributes of a study or a trial.
"""

from __future__ import annotations

import json
import os
import random
import sqlite3
import time
import warnings
from pathlib import Path
from typing import Callable

import optuna

from fa4tune.searches.journal import JournalError, JournalFlock, NotAJournalError, repair_journal

_SQLITE_MAGIC = b"SQLite format 3\x00"
# files that sit in a results folder but are never a storage
_NOT_STORAGE_NAMES = ("best_configs.json", "bench.json")
_NOT_STORAGE_SUFFIXES = (".html", ".png", ".py", ".csv", ".lock", ".flock")


def rdb_url(url: str) -> str:
    """The SQLAlchemy URL to open: a plain postgresql:// URL names the driver `fa4tune[postgres]`
    installs (psycopg2), since SQLAlchemy 2.1 would otherwise look for psycopg 3, when only psycopg2
    is present. Any other URL, or one naming its driver (postgresql+psycopg://), is used as given."""
    import importlib.util

    if url.startswith("postgresql://") and importlib.util.find_spec("psycopg") is None \
            and importlib.util.find_spec("psycopg2") is not None:
        return "postgresql+psycopg2://" + url[len("postgresql://"):]
    return url


class StorageError(ValueError):
    """A storage that cannot be opened as asked; nothing in it was changed."""


def open_storage(spec: str | os.PathLike | None = None,
                 say: Callable[[str], None] | None = None) -> optuna.storages.BaseStorage:
    """The storage a search writes: a journal file path (default: the results directory's) or an RDB
    URL. The journal's folder is created; a journal damaged by a killed writer is repaired first
    (`fa4tune.searches.journal`), and `say` (default: a warning) is told what was done. A file that is not an
    optuna journal (an SQLite database, a JSON document, other text or binary data), or a symbolic link
    to a journal that needs repair, raises StorageError and is left byte-identical."""
    from fa4tune.paths import storage_path

    text = str(spec) if spec is not None else str(storage_path())
    if "://" in text:
        return _open_rdb(rdb_url(text))
    Path(text).parent.mkdir(parents=True, exist_ok=True)
    lock = JournalFlock(text)
    try:
        repair = repair_journal(text, lock)
    except NotAJournalError as exc:
        raise StorageError(_not_a_journal_message(text, exc)) from exc
    except JournalError as exc:
        raise StorageError(str(exc)) from exc
    if repair is not None:
        if say is None:
            warnings.warn(repair.describe(), RuntimeWarning, stacklevel=2)
        else:
            say(repair.describe())
    return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(text, lock_obj=lock))


def _not_a_journal_message(spec: str, exc: NotAJournalError) -> str:
    """What the file looks like, and the option that fits it."""
    path = Path(spec)
    unchanged = "not an optuna journal; it was left unchanged"
    new_journal = "a journal path (one that does not exist yet starts a new journal)"
    if _is_sqlite_file(path):
        if _has_optuna_tables(path):
            return f"storage {spec} is an optuna SQLite database, {unchanged}. Pass it as the URL sqlite:///{spec}"
        return (f"storage {spec} is an SQLite database without optuna's tables, {unchanged}. Pass {new_journal}, "
                f"or sqlite:///{spec} to add optuna's tables to this database")
    if _is_json_document(path):
        what = "a JSON document (such as a best-config database)"
    elif _is_text(path):
        what = f"a text file (line {exc.line} {exc.why})"
    else:
        what = "binary data"
    return f"storage {spec} is {what}, {unchanged}. Pass {new_journal} or an optuna storage URL (sqlite:///...)"


# Processes (or hosts) that open a new database at once race to create optuna's tables and stamp its
# schema version: the losers get a unique-key violation or "relation already exists". Once the winner
# is done, opening again finds everything in place.
RDB_OPEN_ATTEMPTS = 6


def _open_rdb(url: str) -> optuna.storages.RDBStorage:
    from sqlalchemy.exc import IntegrityError, ProgrammingError

    for attempt in range(RDB_OPEN_ATTEMPTS - 1):
        try:
            return optuna.storages.RDBStorage(url)
        except (IntegrityError, ProgrammingError):
            time.sleep(0.05 * 2 ** attempt * (1 + random.random()))   # apart, so one wins the next round
    return optuna.storages.RDBStorage(url)   # the last attempt's error, if any, is the caller's


def _is_sqlite_file(path: Path) -> bool:
    try:
        with open(path, "rb") as fh:
            return fh.read(len(_SQLITE_MAGIC)) == _SQLITE_MAGIC
    except OSError:
        return False


def _is_json_document(path: Path) -> bool:
    try:
        json.loads(path.read_bytes())
    except (OSError, ValueError):
        return False
    return True


def _is_text(path: Path) -> bool:
    try:
        data = path.read_bytes()
        data.decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return False
    return b"\x00" not in data


def _is_journal_file(path: Path) -> bool:
    """An optuna journal is one JSON object per line, each with an "op_code"."""
    try:
        with open(path, "rb") as fh:
            first = fh.readline()
    except OSError:
        return False
    try:
        record = json.loads(first)
    except ValueError:
        return False
    return isinstance(record, dict) and "op_code" in record


def _has_optuna_tables(path: Path) -> bool:
    try:
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
            names = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    except sqlite3.Error:
        return False
    return {"studies", "trials", "version_info"} <= names


def storage_kind(spec: str) -> str:
    """"url" (an SQLAlchemy URL such as sqlite:///x.db), "sqlite" (a database file) or "journal".

    Raises FileNotFoundError for a path that does not exist and ValueError for a file that is neither
    (an SQLite file without optuna's tables is neither).
    """
    if "://" in spec:
        return "url"
    path = Path(spec)
    if not path.is_file():
        raise FileNotFoundError(f"optuna storage {spec} does not exist")
    if _is_sqlite_file(path):
        if not _has_optuna_tables(path):
            raise ValueError(f"{spec} is an SQLite database without optuna's tables")
        return "sqlite"
    if _is_journal_file(path) or path.stat().st_size == 0:
        return "journal"
    raise ValueError(f"{spec} is neither an SQLite database nor an optuna journal file")


def open_for_reading(spec: str) -> optuna.storages.BaseStorage:
    """Open a storage named by a URL or by a path to an SQLite or journal file (detected by content)
    without creating anything in it."""
    kind = storage_kind(spec)
    if kind == "url":
        sqlite_file = sqlite_file_of(spec)
        if sqlite_file is None:
            return optuna.storages.RDBStorage(rdb_url(spec), skip_table_creation=True)
        # SQLAlchemy's sqlite driver creates a missing file when it connects: the file is checked and
        # opened read-only as a path to it would be
        if not sqlite_file.is_file():
            raise FileNotFoundError(f"optuna storage {spec}: the SQLite file {sqlite_file} does not exist")
        if storage_kind(str(sqlite_file)) != "sqlite":
            raise ValueError(f"optuna storage {spec}: {sqlite_file} is not an SQLite database")
        kind, spec = "sqlite", str(sqlite_file)
    if kind == "sqlite":
        url = f"sqlite:///file:{Path(spec).resolve()}?mode=ro&uri=true"
        return optuna.storages.RDBStorage(url, skip_table_creation=True)
    return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(spec)))


def sqlite_file_of(url: str) -> Path | None:
    """The database file an sqlite URL names (None for another URL, a plain path or an in-memory
    database): SQLAlchemy's sqlite driver creates that file when it connects, so readers and the
    checks of outputs look at it first."""
    if "://" not in str(url):
        return None
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    database = parsed.database
    if parsed.get_backend_name() != "sqlite" or database in (None, "", ":memory:"):
        return None
    if parsed.query.get("uri") == "true" and database.startswith("file:"):
        database = database[len("file:"):]
    return Path(database)


def find_storages(results_dir: Path) -> list[Path]:
    """The optuna storages directly in a results folder, recognised by their content, sorted by name."""
    found = []
    if not results_dir.is_dir():
        return found
    for path in sorted(results_dir.iterdir()):
        if not path.is_file() or path.stat().st_size == 0:
            continue
        if path.name in _NOT_STORAGE_NAMES or path.suffix in _NOT_STORAGE_SUFFIXES:
            continue
        if (_is_sqlite_file(path) and _has_optuna_tables(path)) or _is_journal_file(path):
            found.append(path)
    return found


# ------------------------------------------------------------------------------------------------
# ids through the public storage API

def study_id(storage: optuna.storages.BaseStorage, study: optuna.Study) -> int:
    return storage.get_study_id_from_name(study.study_name)


def trial_id(storage: optuna.storages.BaseStorage, study: optuna.Study, number: int) -> int:
    return storage.get_trial_id_from_study_id_trial_number(study_id(storage, study), number)
