"""The best-config database: format, merge rule, lookup, staleness, atomic and locked writes."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time

import pytest

from fa4 import database
from fa4.database import BestConfigDB, DatabaseError, Entry, bucket, entry_key, record
from fa4.kernels import AttentionProblem, Config

H200 = "NVIDIA H200"


def problem(sq=1024, sk=None, batch=1, hq=32, hkv=8, d=128, causal=True, dtype="fp16"):
    return AttentionProblem(batch, sq, sk or sq, hq, hkv, d, dtype, causal)


def entry(p=None, us=30.0, device=H200, fingerprint="fp-1", tile_n=128, trial=1) -> Entry:
    p = p or problem()
    return Entry.from_result(
        arch="sm90", device=device, problem=p, config=Config.make("sm90", tile_n=tile_n).to_dict(), us=us,
        tflops=500.0, default_us=33.0, peers_us={"sdpa_flash": 53.0, "sdpa_cudnn": 31.6, "flash_attn_4": None},
        max_err=0.001, kernel_fingerprint=fingerprint, versions={"torch": "2.11"}, study="s", trial=trial)


def test_bucket_is_next_power_of_two():
    assert [bucket(n) for n in (0, 1, 2, 3, 4, 5, 1000, 1024, 1025)] == [1, 1, 2, 4, 4, 8, 1024, 1024, 2048]


def test_entry_key_has_every_field_of_the_bucket():
    key = entry_key("sm90", H200, problem(sq=1000, sk=3000, batch=3, hkv=8))
    assert key == "sm90|NVIDIA H200|fp16|d128|gqa4|causal|sq1024|sk4096|w32"


def test_speedups_are_peer_time_over_ours_and_skip_untimed_peers():
    e = entry(us=25.0)
    assert e.speedup == {"sdpa_flash": 2.12, "sdpa_cudnn": 1.264, "default": 1.32}
    assert e["config"]["tile_n"] == 128 and e["key"] == e.key


def test_schema_1_files_are_read_without_backend_times(tmp_path):
    old = {k: v for k, v in entry().to_dict().items() if k not in ("backend_us", "backend_source")}
    path = tmp_path / "v1.json"
    path.write_text(json.dumps({"schema": 1, "entries": [old]}))
    [read] = BestConfigDB.load(path).entries
    assert read.backend_us == {} and read.backend_source == "" and read.us == 30.0
    path.write_text(json.dumps({"schema": 1, "entries": [entry().to_dict()]}))
    with pytest.raises(DatabaseError, match="schema 1 has no backend_us"):
        BestConfigDB.load(path)


def test_a_search_result_records_every_implementation_it_timed():
    e = entry(us=25.0)  # flash_attn_4 was not timed (None)
    assert e.backend_us == {"ours": 25.0, "sdpa_flash": 53.0, "sdpa_cudnn": 31.6} and e.backend_source == "search"
    none = Entry.from_result(arch="sm90", device=H200, problem=problem(), config=Config.make("sm90").to_dict(),
                             us=25.0, tflops=1.0, default_us=None, peers_us={}, max_err=None,
                             kernel_fingerprint="f", versions={}, study="s", trial=0)
    assert none.backend_us == {} and none.backend_source == ""


def test_round_trip_is_sorted_json_with_schema(tmp_path):
    path = tmp_path / "db.json"
    assert record(entry(problem(sq=4096)), path)
    assert record(entry(problem(sq=512)), path)
    text = path.read_text()
    doc = json.loads(text)
    assert doc["schema"] == database.SCHEMA_VERSION
    keys = [e["key"] for e in doc["entries"]]
    assert keys == sorted(keys) and len(keys) == 2
    assert text == json.dumps(doc, sort_keys=True, indent=2) + "\n"
    loaded = BestConfigDB.load(path)
    assert [e.to_dict() for e in loaded.entries] == doc["entries"]


def test_record_keeps_the_faster_entry_unless_the_stored_one_is_stale(tmp_path):
    path = tmp_path / "db.json"
    assert record(entry(us=30.0, tile_n=128), path)
    assert not record(entry(us=31.0, tile_n=96), path)          # slower: kept the old one
    assert BestConfigDB.load(path).entries[0].config["tile_n"] == 128
    assert record(entry(us=29.0, tile_n=112), path)             # faster: replaced
    assert BestConfigDB.load(path).entries[0].config["tile_n"] == 112
    assert record(entry(us=40.0, tile_n=64, fingerprint="fp-2"), path)  # stored one is stale now
    only = BestConfigDB.load(path).entries
    assert len(only) == 1 and only[0].config["tile_n"] == 64 and only[0].kernel_fingerprint == "fp-2"


def test_missing_file_is_empty_and_corrupt_file_raises(tmp_path):
    assert len(BestConfigDB.load(tmp_path / "none.json")) == 0
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": 1, "entries": [')
    with pytest.raises(DatabaseError, match="cannot read"):
        BestConfigDB.load(bad)
    bad.write_text(json.dumps({"schema": 99, "entries": []}))
    with pytest.raises(DatabaseError, match="schema 99"):
        BestConfigDB.load(bad)
    # a malformed entry skips that entry, not the file (tests/test_database_entries.py)
    broken = entry().to_dict()
    broken["key"] = "sm90|elsewhere"
    bad.write_text(json.dumps({"schema": database.SCHEMA_VERSION, "entries": [broken]}))
    db = BestConfigDB.load(bad)
    assert len(db) == 0 and "does not match" in db.skipped[0].reason
    del broken["us"]
    bad.write_text(json.dumps({"schema": database.SCHEMA_VERSION, "entries": [broken]}))
    assert "lacks" in BestConfigDB.load(bad).skipped[0].reason


def test_env_var_selects_the_file(tmp_path, monkeypatch):
    path = tmp_path / "user.json"
    monkeypatch.setenv(database.ENV_VAR, str(path))
    record(entry())
    assert path.exists() and len(BestConfigDB.load()) == 1


def test_packaged_database_is_valid_and_every_entry_usable():
    db = BestConfigDB.load(database.packaged_path())
    assert len(db) > 0 and db.layer_of(db.entries[0].key) is None
    assert {e.key: database.entry_problems(e) for e in db.entries} == {e.key: [] for e in db.entries}


def test_the_packaged_entries_are_current_for_these_kernel_sources():
    """A kernel-source edit makes the shipped tunings stale (never used by lookup). An edit that left
    the generated code alone is re-stamped (`benchmarks/restamp_unchanged_code.py --rev REV`); one that
    changed it needs a re-tune, or its entries' removal, in the same change."""
    from fa4 import state
    from fa4.kernels.knobs import KNOB_SETS

    stale = BestConfigDB.load(database.packaged_path()).stale_entries({a: state.fingerprint(a) for a in KNOB_SETS})
    assert not stale, f"stale packaged entries (re-stamp or re-tune): {[e.key for e in stale]}"


H100 = "NVIDIA H100 80GB HBM3"


def test_lookup_exact_nearest_default_and_stale():
    db = BestConfigDB()
    db.merge(entry(problem(sq=1024), us=30.0, tile_n=128))
    db.merge(entry(problem(sq=8192), us=300.0, tile_n=176))
    db.merge(entry(problem(sq=2048), us=25.0, tile_n=64, device=H100))
    db.merge(entry(problem(sq=4096), us=90.0, tile_n=80, fingerprint="old"))

    hit = db.lookup("sm90", H200, problem(sq=1000), "fp-1")
    assert hit.kind == "exact" and hit.entry.config["tile_n"] == 128 and hit.distance == 0
    assert [e.config["tile_n"] for e in hit.stale] == [80]

    # 2048 is one doubling from 1024 on the H200 and exact on the H100: only the H200's is used
    near = db.lookup("sm90", H200, problem(sq=2048), "fp-1", max_distance=2.0)
    assert near.kind == "nearest" and near.entry.config["tile_n"] == 128 and near.distance == 2.0
    assert any("tuned on NVIDIA H100 80GB HBM3" in why and "another GPU model" in why for why in near.passed_over)
    # 6000 falls in the 8192 bucket: an exact hit
    far = db.lookup("sm90", H200, problem(sq=6000), "fp-1")
    assert far.kind == "exact" and far.entry.config["tile_n"] == 176
    # nothing compatible (head dim, causal, gqa, dtype differ): default
    for p in (problem(d=64), problem(causal=False), problem(hkv=32), problem(dtype="bf16")):
        assert db.lookup("sm90", H200, p, "fp-1").kind == "default"
    # everything stale: default, with the stale entries listed
    stale = db.lookup("sm90", H200, problem(sq=1024), "fp-new")
    assert stale.kind == "default" and stale.entry is None and len(stale.stale) == 4
    # fingerprint None trusts every entry
    assert db.lookup("sm90", H200, problem(sq=4096), None).entry.config["tile_n"] == 80


def test_another_gpu_models_tuning_is_never_used():
    db = BestConfigDB()
    db.merge(entry(problem(sq=1024), us=20.0, device=H100))
    found = db.lookup("sm90", H200, problem(sq=1024), "fp-1")
    assert found.kind == "default" and found.entry is None
    assert found.passed_over == (f"entries tuned on {H100} exist for this kind of problem; they are not used "
                                 f"on {H200} (another GPU model)",)
    assert db.lookup("sm90", H100, problem(sq=1024), "fp-1").kind == "exact"


def test_nearest_bucket_has_a_distance_limit(monkeypatch):
    db = BestConfigDB()
    db.merge(entry(problem(sq=1024), us=20.0, tile_n=96))
    assert db.lookup("sm90", H200, problem(sq=2048), "fp-1", max_distance=2.0).kind == "nearest"
    too_far = db.lookup("sm90", H200, problem(sq=4096), "fp-1", max_distance=2.0)
    assert too_far.kind == "default"
    assert "4 log2 bucket steps away, past the limit of 2" in too_far.passed_over[0]
    assert db.lookup("sm90", H200, problem(sq=4096), "fp-1", max_distance=4.0).kind == "nearest"
    # the limit's default and its environment variable
    monkeypatch.delenv(database.MAX_DISTANCE_ENV_VAR, raising=False)
    assert database.max_distance() == database.DEFAULT_MAX_DISTANCE == 2.0
    monkeypatch.setenv(database.MAX_DISTANCE_ENV_VAR, "6")
    assert database.max_distance() == 6.0
    for bad in ("far", "-1", "nan"):
        monkeypatch.setenv(database.MAX_DISTANCE_ENV_VAR, bad)
        with pytest.raises(ValueError, match="FA4_MAX_BUCKET_DISTANCE"):
            database.max_distance()


@pytest.mark.parametrize("us,default_us,used", [(20.0, 33.0, True), (30.0, 30.0, False),
                                                (30.0, 30.2, False), (31.0, 30.0, False), (30.0, None, True)])
def test_a_neighbour_that_did_not_beat_the_default_is_not_borrowed(us, default_us, used):
    tuned = entry(problem(sq=1024), us=us, tile_n=96)
    tuned = Entry(**{**{f: getattr(tuned, f) for f in tuned.__dataclass_fields__}, "default_us": default_us})
    db = BestConfigDB({tuned.key: tuned})
    found = db.lookup("sm90", H200, problem(sq=2048), "fp-1", max_distance=2.0)
    assert (found.kind == "nearest") == used
    if not used:
        assert "did not beat the default there" in found.passed_over[0]
    assert db.lookup("sm90", H200, problem(sq=1024), "fp-1").kind == "exact"  # its own bucket: always


def _write(path, *entries):
    db = BestConfigDB()
    for e in entries:
        db.merge(e)
    db.save(path)
    return path


def test_layers_later_wins_per_key_unless_stale(tmp_path):
    packaged = _write(tmp_path / "packaged.json", entry(problem(sq=1024), us=30.0, tile_n=128),
                      entry(problem(sq=4096), us=90.0, tile_n=128))
    user = _write(tmp_path / "user.json", entry(problem(sq=1024), us=35.0, tile_n=96),
                  entry(problem(sq=4096), us=80.0, tile_n=64, fingerprint="old"),
                  entry(problem(sq=8192), us=300.0, tile_n=80))
    db = BestConfigDB.load_layers([("packaged", packaged), ("user", user)])
    assert len(db) == 3 and [n for n, *_ in db.layers] == ["packaged", "user"] and db.errors == []
    k1024, k4096, k8192 = (entry_key("sm90", H200, problem(sq=s)) for s in (1024, 4096, 8192))
    # the user's layer wins its key even when slower: it was measured on this machine
    assert db.layer_of(k1024) == "user" and db.get(k1024).config["tile_n"] == 96
    assert [(layer, e.config["tile_n"]) for layer, e in db.shadowed(k1024)] == [("packaged", 128)]
    assert db.lookup("sm90", H200, problem(sq=1024), "fp-1").entry.config["tile_n"] == 96
    # a stale user entry does not hide the packaged current one
    found = db.lookup("sm90", H200, problem(sq=4096), "fp-1")
    assert (found.kind, found.layer, found.entry.config["tile_n"]) == ("exact", "packaged", 128)
    assert db.layer_of(k8192) == "user" and db.shadowed(k8192) == []
    with pytest.raises(DatabaseError, match="cannot be saved"):  # a view, not a file
        db.save(tmp_path / "all.json")
    # an entry found broken in one layer leaves the other layer's
    found = db.lookup("sm90", H200, problem(sq=1024), "fp-1", broken=frozenset({("user", k1024)}))
    assert (found.layer, found.entry.config["tile_n"]) == ("packaged", 128)


def test_a_broken_layer_is_reported_and_the_others_still_count(tmp_path):
    packaged = _write(tmp_path / "packaged.json", entry(problem(sq=1024)))
    broken = tmp_path / "user.json"
    broken.write_text("{")
    db = BestConfigDB.load_layers([("packaged", packaged), ("user", broken), ("more", tmp_path / "none.json")])
    assert len(db) == 1 and db.path == tmp_path / "none.json"
    [(name, path, error)] = db.errors
    assert name == "user" and path == broken and "cannot read" in error


def test_default_layers_are_the_package_then_the_user(tmp_path, monkeypatch):
    monkeypatch.setenv("FA4TUNE_HOME", str(tmp_path))
    monkeypatch.delenv(database.ENV_VAR, raising=False)
    assert database.default_layers() == [("packaged", database.packaged_path()),
                                         ("user", tmp_path / "best_configs.json")]
    monkeypatch.setenv(database.ENV_VAR, str(tmp_path / "elsewhere.json"))
    assert database.default_layers()[1] == ("user", tmp_path / "elsewhere.json")
    assert database.default_path() == tmp_path / "elsewhere.json"


def test_merge_keeps_the_fastest_current_entry_per_key():
    a = BestConfigDB()
    a.merge(entry(problem(sq=1024), us=30.0, tile_n=128))
    a.merge(entry(problem(sq=2048), us=50.0, tile_n=128))
    a.merge(entry(problem(sq=4096), us=90.0, tile_n=128))
    b = BestConfigDB()
    b.merge(entry(problem(sq=1024), us=29.0, tile_n=96))                     # faster: wins
    b.merge(entry(problem(sq=2048), us=10.0, tile_n=96, fingerprint="old"))  # faster but stale: loses
    b.merge(entry(problem(sq=8192), us=300.0, tile_n=96, device=H100))      # another key: kept
    merged = database.merge_databases([a, b], {"sm90": "fp-1"})
    assert {(e.seqlen_q_bucket, e.device): e.config["tile_n"] for e in merged.entries} == {
        (1024, H200): 96, (2048, H200): 128, (4096, H200): 128, (8192, H100): 96}
    # both stale: the faster; no fingerprint known: every entry counts as current
    c = BestConfigDB()
    c.merge(entry(problem(sq=2048), us=40.0, tile_n=80, fingerprint="older"))
    assert database.merge_databases([b, c], {"sm90": "fp-1"}).get(
        entry_key("sm90", H200, problem(sq=2048))).config["tile_n"] == 96
    assert database.merge_databases([a, b], {}).get(
        entry_key("sm90", H200, problem(sq=2048))).config["tile_n"] == 96


def test_a_fifo_or_directory_as_the_database_raises_without_blocking(tmp_path):
    fifo = tmp_path / "db.fifo"
    os.mkfifo(fifo)
    with pytest.raises(DatabaseError, match="not a regular file"):
        BestConfigDB.load(fifo)
    with pytest.raises(DatabaseError, match="not a regular file"):
        BestConfigDB.load(tmp_path)
    db = BestConfigDB.load_layers([("user", fifo)])
    assert len(db) == 0 and "not a regular file" in db.errors[0][2]


def test_entry_problems_name_unknown_out_of_range_and_infeasible_configurations():
    good = entry()
    assert database.entry_problems(good) == []

    def changed(**fields):
        return Entry(**{**{f: getattr(good, f) for f in good.__dataclass_fields__}, **fields})

    assert "unknown knob" in database.entry_problems(changed(config={**good.config, "tile_q": 64}))[0]
    assert "tile_n" in database.entry_problems(changed(config={**good.config, "tile_n": 100000}))[0]
    assert "unknown architecture 'sm120'" in database.entry_problems(changed(arch="sm120"))[0]
    infeasible = database.entry_problems(changed(config={**good.config, "q_stages": 2, "scheduler": "single"}))
    assert infeasible and infeasible[0].startswith("infeasible for the problem it was tuned on: q_stages=2")


def test_stale_entries_by_arch(tmp_path):
    path = tmp_path / "db.json"
    record(entry(problem(sq=1024), fingerprint="a"), path)
    record(entry(problem(sq=2048), fingerprint="b"), path)
    stale = database.stale_entries({"sm90": "b"}, path)
    assert [e.seqlen_q_bucket for e in stale] == [1024]
    assert database.stale_entries({"sm100": "x"}, path) == []


def _record_many(path: str, start: int, count: int) -> None:
    for i in range(start, start + count):
        record(entry(problem(batch=1, sq=2 ** (i % 8 + 6), hq=8 * (i // 8 + 1), hkv=8), us=float(i + 1)), path)


def test_concurrent_writers_lose_nothing(tmp_path):
    path = str(tmp_path / "db.json")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_record_many, args=(path, 32 * k, 32)) for k in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    db = BestConfigDB.load(path)
    assert len(db) == 128   # every writer's entries are there: no lost update
    assert os.listdir(tmp_path) == ["db.json"]   # no temporary file, no lock file beside it


def _record_one(path: str) -> None:
    record(entry(problem(sq=64)), path)


def test_writer_waits_for_the_lock(tmp_path):
    path = tmp_path / "db.json"
    ctx = mp.get_context("spawn")
    with database._locked(path):
        proc = ctx.Process(target=_record_one, args=(str(path),))
        proc.start()
        time.sleep(3.0)   # the child is up and blocked on the lock by now
        assert len(BestConfigDB.load(path)) == 0
    proc.join(60)
    assert proc.exitcode == 0 and len(BestConfigDB.load(path)) == 1
    assert os.listdir(tmp_path) == ["db.json"]


def test_failed_write_leaves_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "db.json"
    record(entry(problem(sq=1024)), path)
    before = path.read_text()

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(database.os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        record(entry(problem(sq=2048)), path)
    assert path.read_text() == before
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]
