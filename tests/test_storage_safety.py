"""A storage never destroys a user's file: reading an `sqlite:///` URL creates nothing."""

from __future__ import annotations

import hashlib
import sqlite3
from pathlib import Path

import optuna
import pytest
from optuna.distributions import CategoricalDistribution

from fa4tune.storage import open_for_reading, open_storage

DIST = {"x": CategoricalDistribution([1, 2, 3])}


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


# ------------------------------------------------------------------------------------------------
# reading creates nothing

def test_reading_an_sqlite_url_of_a_missing_file_is_an_error_and_creates_nothing(tmp_path):
    missing = tmp_path / "new.db"
    with pytest.raises(FileNotFoundError, match=f"the SQLite file {missing} does not exist"):
        open_for_reading(f"sqlite:///{missing}")
    assert not missing.exists()


def test_the_report_given_an_sqlite_url_of_a_missing_file_creates_nothing(tmp_path):
    from fa4tune.report_data import collect

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
