"""A best-config database with bad values: each entry is checked at load (types, ranges, a known arch,
its key), a bad one is skipped with one warning naming the file and the key, a file that cannot be
read is skipped whole, and the runtime never raises because of a database. Writers never write an
entry that fails the check.

The runtime parts use test_runtime's stand-in kernels (`fake`) on a pretend H200."""

from __future__ import annotations

import json
import math
import re
import warnings

import pytest

import fa4
from fa4 import database
from fa4.database import BestConfigDB, DatabaseError, Entry, record
from fa4.kernels import AttentionProblem, Config
from test_runtime import FINGERPRINT, add_entry, fake, qkv  # noqa: F401  (fake: the fixture)

H200 = "NVIDIA H200"


def good_entry(seqlen=64, us=10.0, tile_n=96) -> Entry:
    """The entry test_runtime's qkv() (seqlen 64) finds exactly."""
    problem = AttentionProblem(1, seqlen, seqlen, 4, 2, 64, "fp16", False)
    return Entry.from_result(
        arch="sm90", device=H200, problem=problem, config=Config.make("sm90", tile_n=tile_n).to_dict(), us=us,
        tflops=100.0, default_us=12.0, peers_us={"sdpa_cudnn": 11.0}, max_err=1e-3,
        kernel_fingerprint=FINGERPRINT, versions={"torch": "2.11", "cuda": None}, study="s", trial=1)


def write(path, *entries) -> None:
    """A database file holding these raw entries (dicts, written as given: NaN included)."""
    path.write_text(json.dumps({"schema": database.SCHEMA_VERSION, "entries": list(entries)}))


def bad(**fields) -> dict:
    """The seqlen-64 entry as a dict with `fields` changed (its key kept, unless a field sets it)."""
    return {**good_entry().to_dict(), **fields}


def key_of(raw: dict) -> str:
    return raw["key"]


# every field of an entry, a wrong type or an out-of-range value, and what the skip reason names
BAD_VALUES = [
    ({"arch": "sm80", "key": good_entry().key.replace("sm90", "sm80")}, "arch"),
    ({"arch": 90}, "arch"),
    ({"device": ""}, "device"),
    ({"device": ["NVIDIA H200"]}, "device"),
    ({"dtype": "fp8"}, "dtype"),
    ({"head_dim": "64"}, "head_dim"),
    ({"head_dim": True}, "head_dim"),
    ({"head_dim": 10 ** 40}, "head_dim"),
    ({"gqa_ratio": 0}, "gqa_ratio"),
    ({"gqa_ratio": 2.0}, "gqa_ratio"),
    ({"causal": 0}, "causal"),
    ({"causal": "false"}, "causal"),
    ({"seqlen_q_bucket": 60}, "seqlen_q_bucket"),
    ({"seqlen_k_bucket": -64}, "seqlen_k_bucket"),
    ({"work_bucket": None}, "work_bucket"),
    ({"problem": None}, "problem"),
    ({"problem": {"batch": 1}}, "problem"),
    ({"problem": {**good_entry().problem, "seqlen_q": "64"}}, "problem"),
    ({"problem": {**good_entry().problem, "heads_q": 3}}, "problem"),          # not a multiple of heads_kv
    ({"config": "tile_n=96"}, "config"),
    ({"config": {"tile_n": [96]}}, "config"),
    ({"us": math.nan}, "us"),
    ({"us": math.inf}, "us"),
    ({"us": -10.0}, "us"),
    ({"us": 0.0}, "us"),
    ({"us": True}, "us"),
    ({"us": "10"}, "us"),
    ({"tflops": -1.0}, "tflops"),
    ({"tflops": math.nan}, "tflops"),
    ({"default_us": 0}, "default_us"),
    ({"default_us": "12"}, "default_us"),
    ({"speedup": {"default": math.nan}}, "speedup"),
    ({"speedup": {"default": "fast"}}, "speedup"),
    ({"speedup": [1.2]}, "speedup"),
    ({"max_err": -0.5}, "max_err"),
    ({"max_err": math.nan}, "max_err"),
    ({"kernel_fingerprint": None}, "kernel_fingerprint"),
    ({"versions": ["2.11"]}, "versions"),
    ({"versions": {"torch": {"nested": 1}}}, "versions"),
    ({"date": 20261201}, "date"),
    ({"study": None}, "study"),
    ({"trial": -1}, "trial"),
    ({"trial": False}, "trial"),
    ({"trial": "1"}, "trial"),
    ({"backend_us": {"ours": "fast"}}, "backend_us"),
    ({"backend_us": {"ours": -3.0}}, "backend_us"),
    ({"backend_us": {"ours": math.inf}}, "backend_us"),
    ({"backend_us": {"ours": True}}, "backend_us"),
    ({"backend_us": ["ours"]}, "backend_us"),
    ({"backend_source": 3}, "backend_source"),
    ({"key": "sm90|elsewhere"}, "key"),
    ({"key": 7}, "key"),
    ({"tile_q": 64}, "unknown field"),
]


@pytest.mark.parametrize("change,field", BAD_VALUES, ids=[f"{f}={list(c.values())[-1]!r}"[:60] for c, f in BAD_VALUES])
def test_a_bad_value_in_any_field_skips_that_entry_only(tmp_path, change, field):
    path = tmp_path / "db.json"
    other = good_entry(seqlen=1024, tile_n=112)
    broken = bad(**change)
    write(path, broken, other.to_dict())
    db = BestConfigDB.load(path)                                  # no raise: the entry is skipped
    assert [e.key for e in db.entries] == [other.key]
    [(key, reason)] = [(s.key, s.reason) for s in db.skipped]
    assert field in reason
    assert key == (broken["key"] if isinstance(broken["key"], str) else "entry 1")
    # the runtime's list of what it skips holds it, its reason naming the file
    unusable = db.unusable_entries()
    assert [reasons for (_, k), reasons in unusable.items() if k == key] == [[f"{path}: {reason}"]]


def test_a_missing_field_skips_that_entry(tmp_path):
    path = tmp_path / "db.json"
    broken = bad()
    del broken["us"]
    write(path, broken, good_entry(seqlen=1024).to_dict())
    db = BestConfigDB.load(path)
    assert len(db) == 1 and "lacks field(s): us" in db.skipped[0].reason


def test_an_entry_that_is_not_an_object_is_skipped(tmp_path):
    path = tmp_path / "db.json"
    write(path, ["not", "an", "entry"], good_entry(seqlen=1024).to_dict())
    db = BestConfigDB.load(path)
    assert len(db) == 1 and db.skipped[0].key == "entry 1" and "not an object" in db.skipped[0].reason


def test_a_key_that_appears_twice_keeps_the_first_and_skips_the_second(tmp_path):
    path = tmp_path / "db.json"
    first, second = good_entry(us=10.0), good_entry(us=5.0)
    write(path, first.to_dict(), second.to_dict())
    db = BestConfigDB.load(path)
    assert [e.us for e in db.entries] == [10.0] and "appears twice" in db.skipped[0].reason


HUGE_INT = "1" + "0" * 5000          # more digits than Python's int parser takes (ValueError, not JSON's)
DEEP = "[" * 100000 + "]" * 100000   # RecursionError in json


@pytest.mark.parametrize("text", [
    '{"schema": 2, "entries": [{"head_dim": ' + HUGE_INT + "}]}",
    '{"schema": 2, "entries": ' + DEEP + "}",
], ids=["huge integer", "deep nesting"])
def test_a_file_json_cannot_parse_is_a_database_error_and_leaves_the_other_layers(tmp_path, text):
    packaged, user = tmp_path / "packaged.json", tmp_path / "user.json"
    write(packaged, good_entry().to_dict())
    user.write_text(text)
    with pytest.raises(DatabaseError, match="cannot read best-config database"):
        BestConfigDB.load(user)
    db = BestConfigDB.load_layers([("packaged", packaged), ("user", user)])
    assert len(db) == 1 and [(name, path) for name, path, _ in db.errors] == [("user", user)]


def test_the_packaged_database_passes_the_check():
    db = BestConfigDB.load(database.packaged_path())
    assert len(db) > 0 and db.skipped == []


# ---- writers never write a bad entry --------------------------------------------------------------

@pytest.mark.parametrize("change", [{"us": math.nan}, {"us": -1.0}, {"us": True}, {"arch": "sm80"},
                                    {"backend_us": {"ours": "fast"}}, {"head_dim": "64"}])
def test_record_refuses_a_bad_entry_and_leaves_the_file(tmp_path, change):
    path = tmp_path / "db.json"
    record(good_entry(seqlen=1024), path)
    before = path.read_bytes()
    with pytest.raises(DatabaseError, match=re.escape(list(change)[0])):
        record(Entry(**{**{f: getattr(good_entry(), f) for f in good_entry().__dataclass_fields__}, **change}), path)
    assert path.read_bytes() == before


def test_a_nan_entry_does_not_block_a_faster_record(tmp_path):
    path = tmp_path / "db.json"
    write(path, bad(us=math.nan))
    assert record(good_entry(us=50.0), path)
    [stored] = BestConfigDB.load(path).entries
    assert stored.us == 50.0 and "NaN" not in path.read_text()


def test_a_rewrite_keeps_the_entries_it_cannot_read(tmp_path):
    """They are the user's (a hand edit to fix, or a newer fa4's arch): never used, never dropped,
    unless a new entry of the same key replaces them."""
    path = tmp_path / "db.json"
    future = bad(arch="sm120", key=good_entry().key.replace("sm90", "sm120"))
    hand_edit = bad(head_dim="64")   # the key of good_entry(): a new record of that key replaces it
    write(path, future, hand_edit)
    record(good_entry(seqlen=1024), path)
    raw = json.loads(path.read_text())["entries"]
    assert future in raw and hand_edit in raw and len(raw) == 3
    record(good_entry(), path)
    raw = json.loads(path.read_text())["entries"]
    assert future in raw and hand_edit not in raw and len(raw) == 3


# ---- the runtime -----------------------------------------------------------------------------------

def _warned(record_list, *parts) -> list[str]:
    return [str(w.message) for w in record_list
            if issubclass(w.category, fa4.Fa4Warning) and all(p in str(w.message) for p in parts)]


def _use(path):
    fa4.use_config_db(path)
    fa4.reset_caches()


@pytest.mark.parametrize("change", [
    {"backend_us": {"ours": "fast", "sdpa_cudnn": 5.0}},                     # was a raw ValueError
    {"arch": "sm80", "key": good_entry().key.replace("sm90", "sm80")},        # was: every explain raised
    {"us": math.nan}, {"us": -10.0}, {"us": True}, {"head_dim": "64"},
], ids=["backend_us text", "arch sm80", "us NaN", "us negative", "us bool", "head_dim text"])
def test_the_runtime_skips_a_bad_entry_with_one_warning_naming_file_and_key(fake, change):
    broken = bad(**change)
    write(fake.db_path, broken, good_entry(seqlen=1024, tile_n=112).to_dict())
    _use(fake.db_path)
    q, k, v = qkv()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fa4.attention(q, k, v)
        explained = fa4.explain(q, k, v)
        fa4.attention(*qkv(sq=65, sk=65))
    assert out.shape == q.shape
    assert len(_warned(caught, str(fake.db_path), broken["key"])) == 1
    assert explained.source in ("default", "nearest") and explained.entry is None or \
        explained.entry.key != broken["key"]
    assert "1 unusable entry skipped" in explained.database


@pytest.mark.parametrize("text", [
    '{"schema": 2, "entries": [{"head_dim": ' + HUGE_INT + "}]}",
    '{"schema": 2, "entries": ' + DEEP + "}",
], ids=["huge integer", "deep nesting"])
def test_an_unparsable_user_layer_leaves_the_packaged_one(fake, monkeypatch, tmp_path, text):
    packaged, user = tmp_path / "packaged.json", tmp_path / "user.json"
    tuned = add_entry(packaged, seqlen=64, tile_n=64)
    user.write_text(text)
    monkeypatch.setattr(database, "default_layers", lambda: [("packaged", packaged), ("user", user)])
    _use(None)
    with pytest.warns(fa4.Fa4Warning, match="cannot use the user best-config database .*user.json"):
        e = fa4.explain(*qkv())
    assert (e.source, e.layer, e.config) == ("exact", "packaged", tuned)
    fa4.attention(*qkv())
    # the same file given alone: defaults, a warning, no raise
    _use(user)
    with pytest.warns(fa4.Fa4Warning, match="cannot use the best-config database"):
        assert fa4.explain(*qkv()).source == "default"


def test_a_text_head_dim_in_the_user_layer_no_longer_hides_the_packaged_entry(fake, monkeypatch, tmp_path):
    packaged, user = tmp_path / "packaged.json", tmp_path / "user.json"
    tuned = add_entry(packaged, seqlen=64, tile_n=64)
    mine = json.loads(packaged.read_text())["entries"][0]
    write(user, {**mine, "head_dim": "64", "config": {**mine["config"], "tile_n": 80}})
    monkeypatch.setattr(database, "default_layers", lambda: [("packaged", packaged), ("user", user)])
    _use(None)
    with pytest.warns(fa4.Fa4Warning, match=f"{re.escape(mine['key'])}.*{re.escape(str(user))}.*head_dim"):
        e = fa4.explain(*qkv())
    assert (e.source, e.layer, e.config) == ("exact", "packaged", tuned)


def test_an_unknown_arch_entry_does_not_break_explain_of_inputs_on_no_gpu(tmp_path):
    """Inputs on no GPU are explained for the arch and device the database was measured on: an entry of
    arch sm80 sorted first and every such explain raised."""
    import torch

    from fa4 import kernels

    problem = AttentionProblem(1, 1024, 1024, 32, 8, 128, "fp16", True)
    tuned = Entry.from_result(
        arch="sm90", device=H200, problem=problem, config=kernels.default_config("sm90", problem).to_dict(),
        us=22.0, tflops=1.0, default_us=23.0, peers_us={}, max_err=1e-3,
        kernel_fingerprint=kernels.kernel_fingerprint("sm90"), versions={}, study="s", trial=0).to_dict()
    path = tmp_path / "db.json"
    write(path, {**tuned, "arch": "sm80", "key": tuned["key"].replace("sm90", "sm80")}, tuned)
    meta = tuple(torch.empty(1, 1024, h, 128, dtype=torch.float16, device="meta") for h in (32, 8, 8))
    fa4.use_config_db(path)
    try:
        with pytest.warns(fa4.Fa4Warning, match="sm80.*cannot be used"):
            e = fa4.explain(*meta, causal=True)
        assert (e.arch, e.source) == ("sm90", "exact")
    finally:
        fa4.use_config_db(None)
