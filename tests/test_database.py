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
    broken = entry().to_dict()
    broken["key"] = "sm90|elsewhere"
    bad.write_text(json.dumps({"schema": 1, "entries": [broken]}))
    with pytest.raises(DatabaseError, match="does not match"):
        BestConfigDB.load(bad)
    del broken["us"]
    bad.write_text(json.dumps({"schema": 1, "entries": [broken]}))
    with pytest.raises(DatabaseError, match="lacks"):
        BestConfigDB.load(bad)


def test_env_var_selects_the_file(tmp_path, monkeypatch):
    path = tmp_path / "user.json"
    monkeypatch.setenv(database.ENV_VAR, str(path))
    record(entry())
    assert path.exists() and len(BestConfigDB.load()) == 1


def test_packaged_database_is_valid():
    monkey_free = os.environ.pop(database.ENV_VAR, None)
    try:
        db = BestConfigDB.load()
        assert db.path.name == "best_configs.json" and db.path.exists()
    finally:
        if monkey_free is not None:
            os.environ[database.ENV_VAR] = monkey_free


def test_lookup_exact_nearest_default_and_stale():
    db = BestConfigDB()
    db.merge(entry(problem(sq=1024), us=30.0, tile_n=128))
    db.merge(entry(problem(sq=8192), us=300.0, tile_n=176))
    db.merge(entry(problem(sq=2048), us=80.0, tile_n=64, device="NVIDIA H100 80GB HBM3"))
    db.merge(entry(problem(sq=4096), us=90.0, tile_n=80, fingerprint="old"))

    hit = db.lookup("sm90", H200, problem(sq=1000), "fp-1")
    assert hit.kind == "exact" and hit.entry.config["tile_n"] == 128 and hit.distance == 0
    assert [e.config["tile_n"] for e in hit.stale] == [80]

    # 2048 is one doubling from 1024 on the H200 and exact on the H100: the same device wins
    near = db.lookup("sm90", H200, problem(sq=2048), "fp-1")
    assert near.kind == "nearest" and near.entry.config["tile_n"] == 128 and near.distance == 2.0
    # 6000 falls in the 8192 bucket: an exact hit
    far = db.lookup("sm90", H200, problem(sq=6000), "fp-1")
    assert far.kind == "exact" and far.entry.config["tile_n"] == 176
    # 3000 -> 4096: the stale 4096 entry is skipped; 2048 (H100) is nearer but the H200's win
    mid = db.lookup("sm90", H200, problem(sq=3000), "fp-1")
    assert mid.kind == "nearest" and mid.entry.device == H200 and mid.distance == 2.0
    # another device only: nearest from the other device
    other = db.lookup("sm90", "NVIDIA H100 80GB HBM3", problem(sq=2048), "fp-1")
    assert other.kind == "exact" and other.entry.config["tile_n"] == 64
    # nothing compatible (head dim, causal, gqa, dtype differ): default
    for p in (problem(d=64), problem(causal=False), problem(hkv=32), problem(dtype="bf16")):
        assert db.lookup("sm90", H200, p, "fp-1").kind == "default"
    # everything stale: default, with the stale entries listed
    stale = db.lookup("sm90", H200, problem(sq=1024), "fp-new")
    assert stale.kind == "default" and stale.entry is None and len(stale.stale) == 4
    # fingerprint None trusts every entry
    assert db.lookup("sm90", H200, problem(sq=4096), None).entry.config["tile_n"] == 80


def test_stale_entries_by_arch(tmp_path):
    path = tmp_path / "db.json"
    record(entry(problem(sq=1024), fingerprint="a"), path)
    record(entry(problem(sq=2048), fingerprint="b"), path)
    stale = database.stale_entries({"sm90": "b"}, path)
    assert [e.seqlen_q_bucket for e in stale] == [1024]
    assert database.stale_entries({"sm100": "x"}, path) == []


def _record_many(path: str, start: int, count: int) -> None:
    for i in range(start, start + count):
        record(entry(problem(batch=1, sq=2 ** (i % 8 + 6), hq=8 * (i // 8 + 1), hkv=8), us=float(i)), path)


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
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


def _record_one(path: str) -> None:
    record(entry(problem(sq=64)), path)


def test_writer_waits_for_the_lock(tmp_path):
    path = tmp_path / "db.json"
    ctx = mp.get_context("spawn")
    with database._locked(path):
        proc = ctx.Process(target=_record_one, args=(str(path),))
        proc.start()
        time.sleep(3.0)   # the child is up and blocked on the lock by now
        assert not path.exists()
    proc.join(60)
    assert proc.exitcode == 0 and len(BestConfigDB.load(path)) == 1


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
