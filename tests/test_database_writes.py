"""Writing a best-config database never loses or destroys what is in it: `fa4tune db merge`, `fa4tune db
import-bench`, `record` and `BestConfigDB.save` each change the file in one locked step, merging into a
database keeps its entries, no lock file is left beside it, and a target that cannot be written is a
one-line error that changes nothing."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import threading
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from fa4 import database
from fa4.database import BestConfigDB, DatabaseError, Entry, record
from fa4.kernels import AttentionProblem, Config
from fa4tune import cli, environment

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "results" / "bench.json"
DEVICE = "NVIDIA H200"
# the key results/bench.json timed exactly (B1 S1024 H32/8 D128 fp16 causal)
BENCH_KEY = "sm90|NVIDIA H200|fp16|d128|gqa4|causal|sq1024|sk1024|w8"


def entry(n: int, us: float = 30.0, fingerprint: str = "current") -> Entry:
    """An entry of its own key per n (sequence length and head count vary), on a GPU of its own: no
    key of results/bench.json."""
    p = AttentionProblem(1, 2 ** (n % 8 + 6), 2 ** (n % 8 + 6), 8 * (n // 8 + 1), 8, 128, "fp16", True)
    return Entry.from_result(arch="sm90", device="Test GPU", problem=p, config=Config.make("sm90").to_dict(), us=us,
                             tflops=300.0, default_us=31.0, peers_us={"sdpa_cudnn": 31.6}, max_err=1e-3,
                             kernel_fingerprint=fingerprint, versions={}, study="s", trial=n)


def bench_entry() -> Entry:
    """The entry results/bench.json timed, tuned on the kernel the bench ran."""
    doc = json.loads(BENCH.read_text())
    p = AttentionProblem(1, 1024, 1024, 32, 8, 128, "fp16", True)
    return Entry.from_result(arch="sm90", device=DEVICE, problem=p, config=Config.make("sm90").to_dict(), us=21.5,
                             tflops=1.0, default_us=22.0, peers_us={}, max_err=None,
                             kernel_fingerprint=doc["kernel_fingerprint"], versions={}, study="s", trial=0)


def keys(path) -> set[str]:
    return {e.key for e in BestConfigDB.load(path).entries}


def run_cli(*args, env=None):
    return CliRunner().invoke(cli.main, [str(a) for a in args], env=env)


@pytest.fixture(autouse=True)
def current_fingerprint(monkeypatch):
    monkeypatch.setattr(environment, "kernel_fingerprint", lambda arch, api="fa4.kernels": "current")


def one_line_error(result) -> str:
    """The message of a command that failed as a click error: exit 1, one line, no traceback."""
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "Traceback" not in result.output, result.output
    return lines[0]


# ---- merging into a database keeps what it holds ----------------------------------------------------

def test_db_merge_without_o_keeps_the_users_entries(tmp_path):
    mine, other = tmp_path / "mine.json", tmp_path / "other.json"
    record(entry(0), mine)
    record(entry(1), other)
    result = run_cli("db", "merge", other, env={"FA4_CONFIG_DB": str(mine)})
    assert result.exit_code == 0, result.output
    assert keys(mine) == {entry(0).key, entry(1).key}   # its own entry was dropped before
    assert f"{mine} (the target): 1 entries, 1 kept" in result.stderr


def test_db_merge_into_an_existing_o_merges_its_entries_with_the_inputs(tmp_path):
    target, other = tmp_path / "X.json", tmp_path / "other.json"
    record(entry(0, us=20.0), target)           # faster than the input's: stays
    record(entry(1, us=50.0), target)           # slower than the input's: replaced
    record(entry(2, us=30.0, fingerprint="old"), target)   # stale: a current input entry replaces it
    record(entry(0, us=25.0), other)
    record(entry(1, us=40.0), other)
    record(entry(2, us=90.0), other)
    record(entry(3), other)
    result = run_cli("db", "merge", other, "-o", target)
    assert result.exit_code == 0, result.output
    merged = {e.key: (e.us, e.kernel_fingerprint) for e in BestConfigDB.load(target).entries}
    assert merged == {entry(0).key: (20.0, "current"), entry(1).key: (40.0, "current"),
                      entry(2).key: (90.0, "current"), entry(3).key: (30.0, "current")}
    help_text = run_cli("db", "merge", "-h").output
    assert "keeps its entries" in help_text.replace("\n", " ").replace("  ", " ")


def test_db_merge_refuses_a_target_that_is_not_a_database(tmp_path):
    other, notes = tmp_path / "other.json", tmp_path / "notes.json"
    record(entry(1), other)
    notes.write_text('{"my": "notes"}')
    message = one_line_error(run_cli("db", "merge", other, "-o", notes))
    assert "not a best-config database" in message
    assert notes.read_text() == '{"my": "notes"}'


# ---- read-modify-write is one locked step ----------------------------------------------------------

def _writer_in_between(monkeypatch, module, name, target, late: Entry) -> list[threading.Thread]:
    """Wrap `module.name` (a step between the command's read of the target and its write) so that it
    starts a writer recording `late` into the target and gives it a second to land."""
    real = getattr(module, name)
    threads = []

    def step(*args, **kwargs):
        thread = threading.Thread(target=record, args=(late, target))
        thread.start()
        thread.join(1.0)   # done by then unless the command holds the target's lock, as it must
        threads.append(thread)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, step)
    return threads


def test_db_merge_loses_no_record_made_while_it_runs(tmp_path, monkeypatch):
    target, other = tmp_path / "db.json", tmp_path / "other.json"
    record(entry(0), target)
    record(entry(1), other)
    threads = _writer_in_between(monkeypatch, database, "merge_databases", target, entry(2))
    result = run_cli("db", "merge", other, "-o", target)
    for thread in threads:
        thread.join(30)
    assert result.exit_code == 0, result.output
    assert keys(target) == {entry(0).key, entry(1).key, entry(2).key}


def test_db_import_bench_loses_no_record_made_while_it_runs(tmp_path, monkeypatch):
    from fa4tune.benchmark import runner as bench_runner

    target = tmp_path / "db.json"
    record(bench_entry(), target)
    threads = _writer_in_between(monkeypatch, bench_runner, "import_backend_times", target, entry(2))
    result = run_cli("db", "import-bench", BENCH, "--db", target)
    for thread in threads:
        thread.join(30)
    assert result.exit_code == 0, result.output
    assert keys(target) == {BENCH_KEY, entry(2).key}
    assert BestConfigDB.load(target).get(BENCH_KEY).backend_source.startswith("bench ")


def test_save_never_drops_what_was_recorded_since_the_load(tmp_path):
    path = tmp_path / "db.json"
    record(entry(0), path)
    db = BestConfigDB.load(path)
    db.put(replace(db.get(entry(0).key), backend_us={"ours": 30.0}, backend_source="test"))
    record(entry(1), path)                                   # another writer, after the load
    with pytest.raises(DatabaseError, match="changed since it was loaded"):
        db.save()
    assert keys(path) == {entry(0).key, entry(1).key}
    # the locked read-modify-write keeps both
    database.update(path, lambda fresh: fresh.put(replace(fresh.get(entry(0).key), backend_us={"ours": 30.0},
                                                            backend_source="test")))
    assert keys(path) == {entry(0).key, entry(1).key}
    assert BestConfigDB.load(path).get(entry(0).key).backend_source == "test"
    # with no other writer, a loaded database saves as before
    db = BestConfigDB.load(path)
    db.merge(entry(2))
    db.save()
    db.merge(entry(3))
    db.save()
    assert len(keys(path)) == 4


def _acknowledge(ack: str, key: str) -> None:
    with open(ack, "a") as handle:   # one line per write the API or the command said was done
        handle.write(key + "\n")


def _recorder(path: str, ack: str, barrier, start: int, count: int) -> None:
    barrier.wait()
    for n in range(start, start + count):
        record(entry(n), path)
        _acknowledge(ack, entry(n).key)


def _api_saver(path: str, ack: str, barrier, start: int, count: int) -> None:
    """The Python API's load, change, save, again from the load when the file changed meanwhile."""
    barrier.wait()
    for n in range(start, start + count):
        while True:
            db = BestConfigDB.load(path)
            db.merge(entry(n))
            try:
                db.save()
            except DatabaseError:
                continue
            _acknowledge(ack, entry(n).key)
            break


def _merger(path: str, ack: str, barrier, other: str, rounds: int) -> None:
    from fa4tune import environment

    environment.kernel_fingerprint = lambda arch, api="fa4.kernels": "current"
    barrier.wait()
    for _ in range(rounds):
        result = CliRunner().invoke(cli.main, ["db", "merge", other, "-o", path])
        assert result.exit_code == 0, result.output
        for e in BestConfigDB.load(other).entries:
            _acknowledge(ack, e.key)


def _importer(path: str, ack: str, barrier, bench: str, rounds: int) -> None:
    doc = json.loads(Path(bench).read_text())
    barrier.wait()
    for i in range(rounds):
        doc["date"] = f"2026-01-01T00:00:{i:02d}+00:00"   # another bench each round: the entry changes
        mine = f"{ack}.{i}.json"
        Path(mine).write_text(json.dumps(doc))
        result = CliRunner().invoke(cli.main, ["db", "import-bench", mine, "--db", path])
        assert result.exit_code == 0 and "1 entries of" in result.stderr, result.output
        _acknowledge(ack, f"{BENCH_KEY} bench {doc['date']}")


def test_concurrent_record_merge_import_and_save_lose_no_acknowledged_write(tmp_path):
    """Writers of every kind on one file at once: every write acknowledged is in the file at the end
    (the imported bench times as the last import left them)."""
    path, other = str(tmp_path / "db.json"), str(tmp_path / "other.json")
    record(bench_entry(), path)
    for n in range(200, 204):
        record(entry(n), other)
    ctx = mp.get_context("spawn")
    jobs = [(_recorder, (0, 30)), (_recorder, (30, 30)), (_api_saver, (60, 15)), (_api_saver, (100, 15)),
            (_merger, (other, 8)), (_importer, (str(BENCH), 8))]
    barrier = ctx.Barrier(len(jobs))
    acks = tmp_path / "acks"
    acks.mkdir()
    procs = [ctx.Process(target=fn, args=(path, str(acks / f"{i}"), barrier) + args) for i, (fn, args) in enumerate(jobs)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    assert [p.exitcode for p in procs] == [0] * len(jobs)
    acknowledged = [line for f in sorted(acks.glob("[0-9]")) for line in f.read_text().splitlines()]
    db = BestConfigDB.load(path)
    present = {e.key for e in db.entries} | {f"{BENCH_KEY} {db.get(BENCH_KEY).backend_source}"}
    lost = sorted(set(acknowledged) - present - {f"{BENCH_KEY} bench 2026-01-01T00:00:{i:02d}+00:00"
                                                   for i in range(7)})
    assert len(set(acknowledged)) == 30 + 30 + 15 + 15 + 4 + 8 and lost == [], f"{len(lost)} writes lost: {lost[:5]}"
    assert db.get(BENCH_KEY).backend_source == "bench 2026-01-01T00:00:07+00:00"   # the last import's
    assert sorted(os.listdir(tmp_path)) == ["acks", "db.json", "other.json"]   # no lock file, no temporary


# ---- no lock file beside the user's file -----------------------------------------------------------

def test_no_lock_file_is_left_beside_the_database(tmp_path):
    target, other = tmp_path / "X.json", tmp_path / "other.json"
    record(entry(1), other)
    assert run_cli("db", "merge", other, "-o", target).exit_code == 0
    assert sorted(os.listdir(tmp_path)) == ["X.json", "other.json"]
    record(bench_entry(), target)
    assert run_cli("db", "import-bench", BENCH, "--db", target).exit_code == 0
    database.update(target, lambda db: None)
    assert sorted(os.listdir(tmp_path)) == ["X.json", "other.json"]
    # a database that does not exist is not created by a write that changes nothing
    assert run_cli("db", "import-bench", BENCH, "--db", tmp_path / "new.json").exit_code == 0
    assert database.update(tmp_path / "new.json", lambda db: len(db)) == 0
    assert sorted(os.listdir(tmp_path)) == ["X.json", "other.json"]


def test_the_file_lock_follows_the_file_across_a_rename(tmp_path):
    """A writer waiting on the lock of a file that another writer replaces (atomic_write) locks the new
    file, not the old inode it opened: the two never hold the path's lock at once."""
    from fa4.files import atomic_write, exclusive_file_lock

    path = tmp_path / "db.json"
    path.write_text("old")
    order = []

    def second():
        with exclusive_file_lock(path):
            order.append(path.read_text())

    with exclusive_file_lock(path):
        waiter = threading.Thread(target=second)
        waiter.start()
        waiter.join(0.5)
        assert waiter.is_alive()   # blocked on the lock
        atomic_write(path, "new")
        order.append("replaced")
    waiter.join(10)
    assert order == ["replaced", "new"] and os.listdir(tmp_path) == ["db.json"]
    with pytest.raises(OSError, match="not a regular file"):
        with exclusive_file_lock(tmp_path):
            pass
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(OSError, match="not a regular file"):   # refused at once, never blocks
        with exclusive_file_lock(fifo):
            pass


# ---- a target that cannot be written ---------------------------------------------------------------

def _unwritable_targets(tmp_path):
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "keep.txt").write_text("mine")
    plain = tmp_path / "plain.json"
    plain.write_text("not a folder")
    return {"a folder given as the file": folder, "a path under a regular file": plain / "x.json",
            "a path under a regular file, deeper": plain / "sub" / "x.json"}


def _snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def test_an_unwritable_merge_or_import_target_is_a_one_line_error_and_changes_nothing(tmp_path):
    other = tmp_path / "other.json"
    record(entry(1), other)
    for what, target in _unwritable_targets(tmp_path).items():
        before = _snapshot(tmp_path)
        for command in (["db", "merge", other, "-o", target], ["db", "import-bench", BENCH, "--db", target]):
            message = one_line_error(run_cli(*command))
            assert str(target) in message and "nothing was written" in message, (what, message)
            assert _snapshot(tmp_path) == before, what


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder")
def test_a_read_only_folder_as_the_target_is_a_one_line_error(tmp_path):
    other, folder = tmp_path / "other.json", tmp_path / "ro"
    record(entry(1), other)
    folder.mkdir()
    record(bench_entry(), folder / "db.json")
    folder.chmod(0o555)
    try:
        before = _snapshot(folder)
        for target in (folder / "db.json", folder / "new.json"):
            for command in (["db", "merge", other, "-o", target], ["db", "import-bench", BENCH, "--db", target]):
                assert "Permission denied" in one_line_error(run_cli(*command))
                assert _snapshot(folder) == before
    finally:
        folder.chmod(0o755)


def test_a_write_the_folder_refuses_is_a_one_line_error(tmp_path, monkeypatch):
    """As the test above where it cannot run (root writes anywhere): the folder refuses the temporary
    file the write would rename over the target."""
    import tempfile

    other, target = tmp_path / "other.json", tmp_path / "db.json"
    record(entry(1), other)
    record(bench_entry(), target)

    def refused(*args, dir=None, **kwargs):
        raise PermissionError(13, "Permission denied", os.path.join(dir or "", ".db.json.x.tmp"))

    monkeypatch.setattr(tempfile, "mkstemp", refused)
    before = _snapshot(tmp_path)
    for command in (["db", "merge", other, "-o", target], ["db", "import-bench", BENCH, "--db", target]):
        message = one_line_error(run_cli(*command))
        assert message == f"Error: cannot write {target}: Permission denied; nothing was written"
        assert _snapshot(tmp_path) == before
