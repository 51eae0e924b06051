"""Fault injection on what fa4tune writes (CPU only): the best-config database and the search journal.

    python benchmarks/fault_injection.py                 # about 100 s
    python benchmarks/fault_injection.py --seconds 5 --seed 1

Four parts, each printing its counts, then a summary line: writes acknowledged, writes present, writes
lost, files changed that the user did not ask to change, calls that raised where they must not. The
exit status is 1 when anything acknowledged was lost, such a file changed (or appeared, or vanished),
or something raised.

1. Storage that is not a journal: an optuna SQLite file, an SQLite file of other tables, a
   best_configs.json, a text file, a journal with a line of text pasted in, binary data, a JSON
   document, a symbolic link to a journal that needs repair and a dangling one, each given to
   `fa4tune.searches.storage.open_storage`, which must refuse it (`StorageError`); every file, link and name of
   the folder is compared before and after. (`fa4tune search --storage X` is not run: it needs a GPU
   to get that far; tests/test_storage_safety.py runs it on a faked one.)
2. Concurrent database writers with SIGKILLs, for `--seconds`: `record()` writers, `fa4tune db merge
   OTHER -o DB` and `fa4tune db import-bench BENCH --db DB` run through the CLI's click main in
   process, and a Python-API user that loads, merges and saves (again from the load when another
   writer changed the file meanwhile; after three refusals through `fa4.database.update`, as the
   refusal advises: beside four busy writers load-merge-save rarely wins). This process SIGKILLs a
   random writer at random moments and starts it again. A writer acknowledges a write (a line
   appended with O_APPEND and fsync) only after its call returned. At the end: the database parses,
   every acknowledged write is in it, the inputs (OTHER, BENCH files) and a user's file beside the
   database are byte-identical, and nothing is left beside the database but temporary files of
   writers killed mid-write, counted apart (`fa4.files.atomic_write` removes those of dead writers
   once they are a few seconds old).
3. The journal with SIGKILLs, for `--seconds`: writers run optuna trials (ask, tell) in one study on a
   journal opened with `open_storage` and acknowledge each told trial; this process kills them at
   random. A kill does not cut these short appends (one write() each); a kill inside a long append
   would, so the last line is then cut as it would be. A fresh `open_storage` (which repairs it) must
   load the study with every acknowledged trial COMPLETE with its value. Repairs and their side files
   (`.torn-*`) are counted.
4. Bad-typed database entries: a database file with one good entry and one bad of each kind
   (non-numeric backend_us, arch sm80, a huge integer, NaN us, head_dim text, negative us, boolean
   us), and files the JSON parser cannot read (an integer of 5000 digits, deep nesting); for each,
   as the user layer (`$FA4_CONFIG_DB`) and alone (`fa4.use_config_db`): `BestConfigDB.load_layers`,
   `fa4.explain(q, k, v)` and `fa4.attention(q, k, v, fallback="sdpa")` on CPU tensors must not
   raise, the bad entries are skipped, the good one and the packaged layer's entries stay visible.

Writers are forked from this process after its imports (a restart costs no import), before part 4
starts torch's threads. Everything happens in a temporary folder, removed at the end unless `--keep`.
"""

import argparse
import collections
import contextlib
import fcntl
import hashlib
import json
import math
import multiprocessing
import os
import random
import re
import shutil
import sqlite3
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import optuna
from optuna.distributions import FloatDistribution

from fa4 import database, kernels, places
from fa4.database import BestConfigDB, DatabaseError, Entry, record
from fa4.kernels import AttentionProblem
from fa4tune import cli
from fa4tune.searches.journal import OPERATION_START, JournalFlock
from fa4tune.searches.storage import StorageError, open_storage

ARCH, DEVICE = "sm90", "NVIDIA H200"
FINGERPRINT = kernels.kernel_fingerprint(ARCH)   # entries of this checkout: current, never stale
DB_NAME = "best_configs.json"
USER_FILE = "notes.txt"                          # a file of the user's beside what is written
USER_TEXT = "my notes: never touch\n"
STUDY = "fault"


@dataclass
class Counts:
    """What one part saw. `acknowledged` writes were reported done to their writer; `present` of them
    were found at the end; `changed` counts files the user did not ask to change that changed,
    appeared or vanished; `raised` counts calls that raised where they must not (or a writer that
    failed by itself); `problems` says what went wrong, one line each."""

    part: str
    acknowledged: int = 0
    present: int = 0
    changed: int = 0
    raised: int = 0
    kills: int = 0
    temporaries: int = 0      # temporary files left by writers killed mid-write
    problems: list[str] = field(default_factory=list)

    @property
    def lost(self) -> int:
        return self.acknowledged - self.present

    @property
    def ok(self) -> bool:
        return self.lost == 0 and self.changed == 0 and self.raised == 0 and not self.problems

    def line(self) -> str:
        return (f"{self.part}: writes acknowledged {self.acknowledged}, present {self.present}, lost {self.lost}; "
                f"files changed that the user did not ask to change {self.changed}; raised {self.raised}"
                + (f"; SIGKILLs {self.kills}" if self.kills else "")
                + ("" if self.ok else " -- FAILED"))


def say(text: str) -> None:
    print(f"  {text}", flush=True)


# ------------------------------------------------------------------------------------------------
# small helpers: snapshots of a folder, acknowledgements, entries

def snapshot(root: Path) -> dict[str, str]:
    """{path relative to root: what it is} for everything under root: a file's sha256, a link's
    target, or "folder"."""
    found = {}
    for folder, subfolders, files in os.walk(root):
        for name in subfolders + files:
            path = Path(folder) / name
            if path.is_symlink():
                what = f"link to {os.readlink(path)}"
            elif path.is_dir():
                what = "folder"
            else:
                what = "sha256 " + hashlib.sha256(path.read_bytes()).hexdigest()
            found[str(path.relative_to(root))] = what
    return found


def differences(before: dict[str, str], after: dict[str, str], expected: Callable[[str], bool] = lambda _: False
                ) -> list[str]:
    """One line per path that changed, appeared or vanished, but those `expected` names."""
    lines = []
    for name in sorted(before.keys() | after.keys()):
        if before.get(name) == after.get(name) or expected(name):
            continue
        how = "created" if name not in before else "removed" if name not in after else "changed"
        lines.append(f"{name} {how}")
    return lines


def acknowledge(log: Path, line: str) -> None:
    """Append one line, durably, after the write it reports returned."""
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def acknowledged(log: Path) -> list[str]:
    """The complete lines of an acknowledgement log."""
    if not log.exists():
        return []
    return [line for line in log.read_text().split("\n")[:-1] if line]


def fault_entry(device: str, us: float = 20.0, problem: AttentionProblem | None = None) -> Entry:
    """A valid entry; its key is its own per device name."""
    problem = problem or AttentionProblem(1, 1024, 1024, 32, 8, 128, "fp16", True)
    return Entry.from_result(arch=ARCH, device=device, problem=problem,
                             config=kernels.default_config(ARCH, problem).to_dict(), us=us, tflops=100.0,
                             default_us=us * 1.1, peers_us={"sdpa_cudnn": us * 1.2}, max_err=1e-3,
                             kernel_fingerprint=FINGERPRINT, versions={}, study="fault", trial=0)


# ------------------------------------------------------------------------------------------------
# writers killed at random

@dataclass
class Slot:
    """One writer: what it runs, its acknowledgement log, the process now running it."""

    name: str
    run: Callable[[Path, int], None]     # run(ack log, generation): writes until killed or done
    ack: Path
    log: Path
    generation: int = 0
    process: multiprocessing.Process | None = None
    done: bool = False                    # it returned by itself: finished, not to be started again


def _writer_main(slot: Slot) -> None:
    """A forked writer: its output to its log, then its loop; an error ends it with status 1."""
    fd = os.open(slot.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    try:
        slot.run(slot.ack, slot.generation)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


def _start(slot: Slot) -> None:
    sys.stdout.flush()
    sys.stderr.flush()   # a forked child would print what is buffered again
    slot.generation += 1
    slot.process = multiprocessing.get_context("fork").Process(target=_writer_main, args=(slot,), daemon=True)
    slot.process.start()


def run_killing(slots: list[Slot], seconds: float, rng: random.Random, counts: Counts,
                after_kill: Callable[[], None] = lambda: None) -> None:
    """Run the writers for `seconds`, SIGKILLing a random one every 0.1-0.8 s and starting it again;
    then SIGKILL all. A writer that ends by itself with an error is counted in `raised` (its log's
    last lines in `problems`) and started again."""
    for slot in slots:
        _start(slot)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(rng.uniform(0.1, 0.8))
        for slot in slots:
            if slot.done or slot.process.is_alive():
                continue
            slot.process.join()
            if slot.process.exitcode == 0:
                slot.done = True
                continue
            _failed(slot, counts)
            _start(slot)
        alive = [slot for slot in slots if not slot.done and slot.process.is_alive()]
        if not alive:
            break
        victim = rng.choice(alive)
        victim.process.kill()
        victim.process.join()
        counts.kills += 1
        after_kill()
        _start(victim)
    for slot in slots:
        if slot.process.is_alive():
            slot.process.kill()
            counts.kills += 1
        slot.process.join()
        if slot.process.exitcode not in (0, -9):
            _failed(slot, counts)


def _failed(slot: Slot, counts: Counts) -> None:
    """A writer that ended with an error: counted, with the last lines of its log."""
    counts.raised += 1
    tail = slot.log.read_text().strip().splitlines()[-3:]
    counts.problems.append(f"writer {slot.name} failed: {' | '.join(tail)}")


# ------------------------------------------------------------------------------------------------
# 1. storage that is not a journal

def _journal_with_trials(path: Path, trials: int = 3) -> bytes:
    study = optuna.create_study(study_name=STUDY, storage=open_storage(path))
    for i in range(trials):
        study.tell(study.ask({"x": FloatDistribution(0, 1)}), float(i))
    return path.read_bytes()


def _not_journals(root: Path) -> dict[str, Path]:
    """{what it is: path} of files a user may give as a storage by mistake, made under root."""
    made = {}
    optuna_db = root / "optuna.db"
    optuna.create_study(study_name=STUDY, storage=f"sqlite:///{optuna_db}").optimize(
        lambda t: t.suggest_float("x", 0, 1), n_trials=2)
    made["an optuna SQLite file"] = optuna_db
    other_db = root / "notes.db"
    with contextlib.closing(sqlite3.connect(other_db)) as conn, conn:
        conn.execute("CREATE TABLE notes (text)")
        conn.execute("INSERT INTO notes VALUES ('mine')")
    made["an SQLite file of other tables"] = other_db
    made["a best_configs.json"] = root / DB_NAME
    shutil.copyfile(database.packaged_path(), made["a best_configs.json"])
    made["a text file"] = root / "notes.txt"
    made["a text file"].write_text("hello\nworld\n")
    pasted = root / "pasted.journal"
    lines = _journal_with_trials(pasted).splitlines(keepends=True)
    pasted.write_bytes(b"".join(lines[:2]) + b"a note I pasted here\n" + b"".join(lines[2:]))
    made["a journal with a line of text pasted in"] = pasted
    made["binary data"] = root / "data.bin"
    made["binary data"].write_bytes(bytes(range(256)) * 16)
    made["a JSON document"] = root / "doc.json"
    made["a JSON document"].write_text(json.dumps({"runs": [1, 2, 3]}))
    real = root / "real" / "studies.journal"
    real.parent.mkdir()
    real.write_bytes(_journal_with_trials(real) + b'{"op_code":6,"worker_id":"w","trial_id":2,"par')
    made["a symbolic link to a journal that needs repair"] = root / "link.journal"
    made["a symbolic link to a journal that needs repair"].symlink_to(real)
    made["a dangling symbolic link"] = root / "dangling.journal"
    made["a dangling symbolic link"].symlink_to(root / "real" / "missing.journal")
    return made


def part_storage(counts: Counts, root: Path) -> None:
    root.mkdir()
    made = _not_journals(root)
    before = snapshot(root)
    refused = 0
    for what, path in made.items():
        try:
            open_storage(path, say=lambda _: None)
        except StorageError as exc:
            refused += 1
            message = str(exc).replace(f"{root}/", "")
            say(f"refused {what}: {message if len(message) < 150 else message[:147] + '...'}")
        except Exception as exc:   # refused, but not as a StorageError naming the problem
            counts.raised += 1
            counts.problems.append(f"{what}: {type(exc).__name__}: {exc}")
        else:
            counts.problems.append(f"{what} ({path.name}) was opened as a journal")
    changes = differences(before, snapshot(root))
    counts.changed = len(changes)
    counts.problems += changes
    say(f"refused {refused} of {len(made)}; files, links and names compared before and after: "
        f"{len(before)}, {len(changes)} changed, created or removed")


# ------------------------------------------------------------------------------------------------
# 2. concurrent database writers with SIGKILLs

def _record_writer(db: Path) -> Callable[[Path, int], None]:
    def run(ack: Path, generation: int) -> None:
        for n in range(10 ** 9):
            entry = fault_entry(f"fault-{ack.stem}-{generation}-{n}")
            record(entry, db)
            acknowledge(ack, f"entry {entry.key}")
    return run


def _api_saver(db: Path, attempts: int = 3) -> Callable[[Path, int], None]:
    """load, merge, save; a save refused because another writer changed the file since the load is
    tried again from the load, and after `attempts` refusals the change is made as the refusal advises,
    with `fa4.database.update` (beside four busy writers load-merge-save rarely wins). Each refusal is
    noted in `<ack log>.refused`."""
    def run(ack: Path, generation: int) -> None:
        for n in range(10 ** 9):
            entry = fault_entry(f"fault-{ack.stem}-{generation}-{n}")
            for _ in range(attempts):
                loaded = BestConfigDB.load(db)
                loaded.merge(entry)
                try:
                    loaded.save()
                    break
                except DatabaseError as exc:
                    if "changed since it was loaded" not in str(exc):
                        raise
                    acknowledge(ack.with_suffix(".refused"), entry.key)
            else:
                database.update(db, lambda fresh: fresh.merge(entry))
            acknowledge(ack, f"entry {entry.key}")
    return run


def _cli_writer(command: Callable[[int], list[str]], rounds: int) -> Callable[[Path, int], None]:
    """Runs `fa4tune <command(i)>` in process for i = rounds acknowledged so far .. rounds - 1; a
    failure raises (click.ClickException); acknowledges "round i" after each."""
    def run(ack: Path, generation: int) -> None:
        for i in range(len(acknowledged(ack)), rounds):
            cli.main.main(args=command(i), prog_name="fa4tune", standalone_mode=False)
            acknowledge(ack, f"round {i}")
    return run


def _bench_date(i: int) -> str:
    return f"2026-01-01T{i // 3600:02d}:{i // 60 % 60:02d}:{i % 60:02d}+00:00"


def _bench_doc(key: str, problem: AttentionProblem, i: int) -> dict:
    """A bench document timing the entry of `key` (ours and two peers); round i has its own times and
    date, later for a later i."""
    common = {"shape": "fault", "outcome": "ok", "problem": problem.to_dict()}
    return {"schema": 1, "arch": ARCH, "device": {"name": DEVICE}, "kernel_fingerprint": FINGERPRINT,
            "date": _bench_date(i),
            "rows": [{**common, "variant": "tuned", "lookup": "exact", "db_key": key, "us": 20.0 + i % 10},
                     {**common, "variant": "sdpa_cudnn", "us": 25.0},
                     {**common, "variant": "flash_attn_4", "us": 22.0}]}


# How many of a writer's acknowledged writes the final database holds: tally(acknowledged lines,
# database) -> (writes acknowledged, writes present)
Tally = Callable[[list[str], BestConfigDB], tuple[int, int]]


def _entries_tally(lines: list[str], final: BestConfigDB) -> tuple[int, int]:
    keys = [line.split(" ", 1)[1] for line in lines]   # "entry <key>"
    return len(keys), sum(1 for key in keys if final.get(key) is not None)


def _merges_tally(other_keys: list[list[str]]) -> Tally:
    def tally(lines: list[str], final: BestConfigDB) -> tuple[int, int]:
        keys = [key for line in lines for key in other_keys[int(line.split()[1])]]   # "round <i>"
        return len(keys), sum(1 for key in keys if final.get(key) is not None)
    return tally


def _imports_tally(bench_key: str, rounds: int) -> Tally:
    """An acknowledged import of round i is present when the entry holds the times of round i or of a
    later round (which the user asked for after it)."""
    def tally(lines: list[str], final: BestConfigDB) -> tuple[int, int]:
        entry = final.get(bench_key)
        sources = [f"bench {_bench_date(i)}" for i in range(rounds)]
        held = sources.index(entry.backend_source) if entry and entry.backend_source in sources else -1
        return len(lines), sum(1 for line in lines if int(line.split()[1]) <= held)
    return tally


def _abandoned(folder: Path, pattern: re.Pattern) -> set[str]:
    """The temporary files in folder that no writer holds (`atomic_write` locks its own until the
    rename): those of killed writers."""
    found = set()
    for path in folder.iterdir():
        if not pattern.fullmatch(path.name):
            continue
        with contextlib.suppress(OSError), open(path, "rb") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            found.add(path.name)
    return found


def part_database(counts: Counts, root: Path, seconds: float, rng: random.Random) -> None:
    root.mkdir()
    home, inputs, acks, logs = root / "db", root / "inputs", root / "acks", root / "logs"
    for folder in (home, inputs, acks, logs):
        folder.mkdir()
    db = home / DB_NAME
    (home / USER_FILE).write_text(USER_TEXT)
    # before the writers start: the entry the benches time, and the inputs to merge and to import
    bench_problem = AttentionProblem(1, 2048, 2048, 32, 8, 128, "bf16", True)
    bench_entry = fault_entry(DEVICE, problem=bench_problem)
    record(bench_entry, db)
    rounds = max(40, int(10 * seconds))   # more than a writer gets through
    other_keys = []
    for i in range(rounds):
        other = BestConfigDB()
        for n in range(3):
            other.put(fault_entry(f"fault-other-{i}-{n}"))
        other.save(inputs / f"other-{i}.json")
        other_keys.append([e.key for e in other.entries])
        (inputs / f"bench-{i}.json").write_text(json.dumps(_bench_doc(bench_entry.key, bench_problem, i)))
    inputs_before, home_before = snapshot(inputs), snapshot(home)

    merge = _cli_writer(lambda i: ["db", "merge", str(inputs / f"other-{i}.json"), "-o", str(db)], rounds)
    import_bench = _cli_writer(lambda i: ["db", "import-bench", str(inputs / f"bench-{i}.json"), "--db", str(db)],
                               rounds)
    writers = {"record-a": (_record_writer(db), _entries_tally), "record-b": (_record_writer(db), _entries_tally),
               "api-save": (_api_saver(db), _entries_tally), "db-merge": (merge, _merges_tally(other_keys)),
               "import-bench": (import_bench, _imports_tally(bench_entry.key, rounds))}
    slots = [Slot(name, run, acks / f"{name}.log", logs / f"{name}.log") for name, (run, _) in writers.items()]
    temporary = re.compile(re.escape(f".{DB_NAME}.") + r".*\.tmp")
    abandoned: set[str] = set()
    run_killing(slots, seconds, rng, counts, after_kill=lambda: abandoned.update(_abandoned(home, temporary)))

    # the database parses and holds every acknowledged write
    try:
        final = BestConfigDB.load(db)
    except DatabaseError as exc:
        counts.problems.append(f"the database does not parse: {exc}")
        final = BestConfigDB()
    if final.skipped:
        counts.problems.append(f"{len(final.skipped)} entries of the database fail the check")
    per_writer = []
    for slot in slots:
        writes, present = writers[slot.name][1](acknowledged(slot.ack), final)
        counts.acknowledged += writes
        counts.present += present
        refused = len(acknowledged(slot.ack.with_suffix(".refused")))
        per_writer.append(f"{slot.name} {present}/{writes}" + (f" ({refused} saves refused)" if refused else ""))
    say(f"{counts.kills} SIGKILLs; acknowledged writes present, per writer: {', '.join(per_writer)}; "
        f"the database holds {len(final)} entries")
    # nothing changed but the database; temporary files of killed writers are counted apart
    left = {path.name for path in home.iterdir() if temporary.fullmatch(path.name)}
    counts.temporaries = len(left)
    changes = differences(inputs_before, snapshot(inputs))
    changes += differences(home_before, snapshot(home),
                           expected=lambda name: name == DB_NAME or bool(temporary.fullmatch(name)))
    counts.changed = len(changes)
    counts.problems += changes
    say(f"inputs ({len(inputs_before)} files) and the user's file beside the database: {len(changes)} changed, "
        "created or removed")
    say(f"temporary files left by killed writers: {len(left)} at the end; {len(abandoned - left)} more were "
        "left during the run and removed by later writers")


# ------------------------------------------------------------------------------------------------
# 3. the journal with SIGKILLs

def _journal_writer(path: Path, repairs: Path) -> Callable[[Path, int], None]:
    def run(ack: Path, generation: int) -> None:
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        storage = open_storage(path, say=lambda text: acknowledge(repairs, text.replace("\n", " ")))
        study = optuna.load_study(study_name=STUDY, storage=storage)
        while True:
            trial = study.ask({"x": FloatDistribution(0, 1)})
            value = trial.params["x"] ** 2 + trial.number
            study.tell(trial, value)
            acknowledge(ack, f"{trial.number} {value!r}")
    return run


def _tear_last_line(path: Path, rng: random.Random) -> None:
    """Append the start of an operation (a copy of the last one, cut short), as a writer killed
    inside its append leaves it."""
    last = path.read_bytes().rstrip(b"\n").rsplit(b"\n", 1)[-1]
    lock = JournalFlock(path)
    lock.acquire()
    try:
        with open(path, "ab") as handle:
            handle.write(last[:rng.randrange(len(OPERATION_START), len(last) - 1)])
    finally:
        lock.release()


def part_journal(counts: Counts, root: Path, seconds: float, rng: random.Random) -> None:
    root.mkdir()
    home, acks, logs = root / "journal", root / "acks", root / "logs"
    for folder in (home, acks, logs):
        folder.mkdir()
    path, repairs = home / "studies.journal", acks / "repairs"
    (home / USER_FILE).write_text(USER_TEXT)
    optuna.create_study(study_name=STUDY, storage=open_storage(path))
    before = snapshot(home)
    slots = [Slot(f"trials-{i}", _journal_writer(path, repairs), acks / f"trials-{i}.log", logs / f"{i}.log")
             for i in range(4)]
    run_killing(slots, seconds, rng, counts)
    # a SIGKILL does not cut these appends short (each is one write() call), a kill inside a long
    # append would: the end of the journal is cut as such a kill leaves it, under the journal's lock
    _tear_last_line(path, rng)

    said = []
    try:
        study = optuna.load_study(study_name=STUDY, storage=open_storage(path, say=said.append))
    except Exception as exc:
        counts.raised += 1
        counts.problems.append(f"the journal cannot be loaded: {type(exc).__name__}: {exc}")
        return
    trials = {t.number: t for t in study.trials}
    for slot in slots:
        for line in acknowledged(slot.ack):
            number, value = line.split()
            counts.acknowledged += 1
            trial = trials.get(int(number))
            if trial is not None and trial.state == optuna.trial.TrialState.COMPLETE and trial.value == float(value):
                counts.present += 1
    states = collections.Counter(t.state.name for t in study.trials)
    side_files = sorted(p.name for p in home.iterdir() if ".torn-" in p.name)
    say(f"{counts.kills} SIGKILLs; trials in the study: {', '.join(f'{n} {s}' for s, n in sorted(states.items()))}")
    say(f"repairs: {len(acknowledged(repairs))} by restarted writers, {len(said)} by the final open (of the "
        f"torn last line added after the kills); side files (.torn-*) created: {len(side_files)}")
    if len(said) != 1:
        counts.problems.append(f"the final open made {len(said)} repairs, want 1 (the torn last line)")
    changes = differences(before, snapshot(home),
                          expected=lambda name: name == path.name or name in side_files)
    counts.changed = len(changes)
    counts.problems += changes
    say(f"the user's file beside the journal, and nothing else: {len(changes)} changed, created or removed")


# ------------------------------------------------------------------------------------------------
# 4. bad-typed database entries

USER_PROBLEM = AttentionProblem(1, 64, 64, 4, 2, 64, "fp16", False)      # the good entry's shape
PACKAGED_PROBLEM = AttentionProblem(1, 128, 128, 32, 8, 128, "bf16", True)   # a packaged entry's shape
HUGE_INTEGER = "1" + "0" * 5000     # more digits than Python's int parser takes
DEEP_NESTING = "[" * 100000 + "]" * 100000


def _bad_entries() -> dict[str, dict]:
    """{kind: a raw entry with that fault}, each of its own key."""
    def changed(seqlen: int, **fields) -> dict:
        problem = AttentionProblem(1, seqlen, seqlen, 4, 2, 64, "fp16", False)
        return {**fault_entry(DEVICE, problem=problem).to_dict(), **fields}

    sm80 = changed(256, arch="sm80")
    sm80["key"] = sm80["key"].replace("sm90", "sm80", 1)
    return {
        "non-numeric backend_us": changed(128, backend_us={"ours": "fast", "sdpa_cudnn": 5.0}),
        "arch sm80": sm80,
        "huge integer us": changed(512, us=10 ** 400),
        "NaN us": changed(1024, us=math.nan),
        "head_dim text": changed(2048, head_dim="64"),
        "negative us": changed(4096, us=-10.0),
        "boolean us": changed(8192, us=True),
    }


def _database_files(root: Path) -> dict[str, tuple[Path, int]]:
    """{what: (a database file, how many of its entries are bad)}."""
    good = fault_entry(DEVICE, problem=USER_PROBLEM).to_dict()
    bad = _bad_entries()
    files = {"one good entry and one bad of each kind": (root / "bad-entries.json", len(bad)),
             "an integer of 5000 digits": (root / "huge-integer.json", 0),
             "deep nesting": (root / "deep.json", 0)}
    files["one good entry and one bad of each kind"][0].write_text(
        json.dumps({"schema": database.SCHEMA_VERSION, "entries": [good, *bad.values()]}))
    files["an integer of 5000 digits"][0].write_text('{"schema": 2, "entries": [{"head_dim": ' + HUGE_INTEGER + "}]}")
    files["deep nesting"][0].write_text('{"schema": 2, "entries": ' + DEEP_NESTING + "}")
    return files


def _inputs(problem: AttentionProblem) -> tuple:
    """CPU tensors q, k, v of a problem."""
    import torch

    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[problem.dtype]
    return tuple(torch.randn(problem.batch, problem.seqlen_q, heads, problem.head_dim, dtype=dtype)
                 for heads in (problem.heads_q, problem.heads_kv, problem.heads_kv))


def _wanted_explanation(shape: str, mode: str, parses: bool) -> tuple[str, str | None] | None:
    """(source, layer) `fa4.explain` must give for a shape, or None when no entry of it is in reach:
    the good entry when its file parses, the packaged entry when the file is the user layer."""
    if shape == "user":
        return ("exact", database.USER if mode == "user layer" else None) if parses else None
    return ("exact", database.PACKAGED) if mode == "user layer" else None


def part_entries(counts: Counts, root: Path) -> None:
    import torch

    import fa4

    root.mkdir()
    files = _database_files(root)
    before = snapshot(root)
    packaged_keys = {e.key for e in BestConfigDB.load(database.packaged_path()).entries}
    tensors = {"user": _inputs(USER_PROBLEM), "packaged": _inputs(PACKAGED_PROBLEM)}
    calls = skipped = warned = hidden = 0

    def call(what: str, fn: Callable[[], object]):
        nonlocal calls
        calls += 1
        try:
            return fn()
        except Exception as exc:
            counts.raised += 1
            counts.problems.append(f"{what} raised {type(exc).__name__}: {str(exc)[:200]}")
            return None

    for kind, (path, bad) in files.items():
        for mode in ("user layer", "alone"):
            if mode == "user layer":   # above the packaged layer
                os.environ[database.ENV_VAR] = str(path)
                fa4.use_config_db(None)
            else:
                os.environ.pop(database.ENV_VAR, None)
                fa4.use_config_db(path)
            fa4.reset_caches()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                stack = call(f"{kind}, {mode}: load", lambda: BestConfigDB.load_layers(
                    None if mode == "user layer" else [(database.USER, path)]))
                for shape in ("user", "packaged"):
                    q, k, v = tensors[shape]
                    causal = shape == "packaged"
                    explained = call(f"{kind}, {mode}: fa4.explain of the {shape} shape",
                                     lambda: fa4.explain(q, k, v, causal=causal))
                    call(f"{kind}, {mode}: fa4.attention of the {shape} shape",
                         lambda: fa4.attention(q, k, v, causal=causal, fallback="sdpa"))
                    wanted = _wanted_explanation(shape, mode, parses=bad > 0)
                    if explained is not None and wanted and (explained.source, explained.layer) != wanted:
                        counts.problems.append(f"{kind}, {mode}: explain of the {shape} shape found "
                                               f"{explained.source} ({explained.layer}), not its entry")
            warned += sum(1 for w in caught if issubclass(w.category, fa4.Fa4Warning) and str(path) in str(w.message))
            if stack is not None:
                skipped += len(stack.skipped)
                if len(stack.skipped) != bad:
                    counts.problems.append(f"{kind}, {mode}: {len(stack.skipped)} entries skipped, want {bad}")
                if mode == "user layer":
                    missing = packaged_keys - {e.key for e in stack.entries}
                    hidden += len(missing)
                    if missing:
                        counts.problems.append(f"{kind}: {len(missing)} packaged entries hidden")
    os.environ.pop(database.ENV_VAR, None)
    fa4.use_config_db(None)
    changes = differences(before, snapshot(root))
    counts.changed = len(changes)
    counts.problems += changes
    say(f"database files: {len(files)} ({', '.join(files)}); calls: {calls}; runtime raised: {counts.raised}")
    say(f"bad entries skipped at load: {skipped}; warnings naming the file: {warned}; packaged entries "
        f"hidden by a bad user layer: {hidden}")


# ------------------------------------------------------------------------------------------------

PARTS = [
    ("1. storage that is not a journal", lambda counts, root, args: part_storage(counts, root)),
    ("2. concurrent database writers with SIGKILLs",
     lambda counts, root, args: part_database(counts, root, args.seconds, random.Random(args.seed))),
    ("3. journal with SIGKILLs",
     lambda counts, root, args: part_journal(counts, root, args.seconds, random.Random(args.seed + 1))),
    ("4. bad-typed database entries", lambda counts, root, args: part_entries(counts, root)),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=40.0,
                        help="how long writers run under SIGKILLs, for the database and for the journal")
    parser.add_argument("--seed", type=int, default=0, help="seed of which writer is killed when")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (its path is printed)")
    args = parser.parse_args(argv)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    root = Path(tempfile.mkdtemp(prefix="fa4-faults-"))
    # the user's own database and journal are never in reach
    os.environ[places.HOME_ENV_VAR] = str(root / "home")
    os.environ.pop(database.ENV_VAR, None)
    parts = [Counts(title) for title, _ in PARTS]
    try:
        for number, (counts, (_, run)) in enumerate(zip(parts, PARTS), 1):
            print(counts.part, flush=True)
            started = time.monotonic()
            run(counts, root / f"part{number}", args)
            for problem in counts.problems[:10]:
                say(f"PROBLEM: {problem}")
            say(f"{counts.line()} ({time.monotonic() - started:.0f} s)")
    finally:
        if args.keep:
            print(f"files kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    total = Counts("summary", **{name: sum(getattr(c, name) for c in parts)
                                 for name in ("acknowledged", "present", "changed", "raised", "kills", "temporaries")},
                   problems=[p for c in parts for p in c.problems])
    print(f"summary: writes acknowledged {total.acknowledged}, writes present {total.present}, lost {total.lost}; "
          f"files changed that the user did not ask to change {total.changed}; raised {total.raised}; "
          f"SIGKILLs {total.kills}; temporary files left by killed writers {total.temporaries}; "
          + ("OK" if total.ok else f"FAILED ({len(total.problems)} problems)"))
    return 0 if total.ok else 1


if __name__ == "__main__":
    sys.exit(main())
