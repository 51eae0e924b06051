"""Fastest-backend dispatch, the data model: what each implementation costs per call, who wins, and
where the times come from (a bench folded into the database; the shipped host times)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import fa4
from fa4 import dispatch
from fa4.backends import implementations
from fa4.database import BestConfigDB, Entry, record
from fa4.dispatch import choose
from fa4.kernels import AttentionProblem, Config
from fa4tune import cli
from fa4tune.benchmark.runner import backend_times, import_backend_times

REPO = Path(__file__).resolve().parent.parent
HOST = {"ours": 9.6, "flash_attn_4": 83.9, "sdpa_cudnn": 50.8, "sdpa_flash": 53.2}  # the H200's, rounded


def test_cost_is_gpu_time_in_a_graph_and_the_larger_of_gpu_and_host_time_eagerly():
    assert dispatch.call_cost(20.0, 80.0, "graph") == 20.0
    assert dispatch.call_cost(20.0, 80.0, "eager") == 80.0
    assert dispatch.call_cost(500.0, 80.0, "eager") == 500.0
    assert dispatch.call_cost(20.0, None, "eager") == 20.0
    with pytest.raises(ValueError, match="mode"):
        dispatch.call_cost(1.0, 1.0, "captured")


def test_a_short_shape_flash_attn_4_wins_captured_and_loses_eagerly():
    # B1 S1024 causal on the H200 (results/bench.json): flash-attn-4's kernel is 2 % faster, its host
    # time per eager call four times our whole call
    times = {"ours": 22.03, "flash_attn_4": 21.56, "sdpa_cudnn": 31.04, "sdpa_flash": 54.85}
    graph = choose(times, HOST, "graph")
    assert graph.backend == "flash_attn_4" and graph.ratio == pytest.approx(22.03 / 21.56)
    assert "GPU time 21.6 us vs ours 22.0 us: 1.022x faster" in graph.reason
    eager = choose(times, HOST, "eager")
    assert eager.backend == "ours" and eager.ratio == 1.0 and eager.cost_us["flash_attn_4"] == 83.9
    assert "faster than SDPA cuDNN (50.8 us): fastest" in eager.reason


def test_a_long_shape_is_judged_by_gpu_time_in_both_modes():
    times = {"ours": 1707.1, "flash_attn_4": 1600.0, "sdpa_cudnn": 1815.8}
    assert choose(times, HOST, "eager").backend == choose(times, HOST, "graph").backend == "flash_attn_4"


def test_ours_keeps_a_tie():
    times = {"ours": 100.0, "sdpa_cudnn": 99.5, "flash_attn_4": 101.0}
    tie = choose(times, HOST, "graph")
    assert tie.backend == "ours" and "a tie, ours kept" in tie.reason
    assert choose({"ours": 100.0, "sdpa_cudnn": 98.9}, HOST, "graph").backend == "sdpa_cudnn"


def test_what_cannot_be_judged():
    assert choose({"flash_attn_4": 10.0}, HOST, "graph") is None          # ours not measured
    assert choose({}, HOST, "eager") is None
    alone = choose({"ours": 10.0}, HOST, "eager")
    assert alone.backend == "ours" and "no other implementation measured" in alone.reason
    # eager without a host time for a peer: it is left out, and the reason says so
    partial = choose({"ours": 30.0, "flash_attn_4": 10.0}, {"ours": 9.6}, "eager")
    assert partial.backend == "ours" and "flash-attn-4 left out: no host time measured" in partial.reason
    assert choose({"ours": 30.0, "flash_attn_4": 10.0}, {}, "graph").backend == "flash_attn_4"
    # a GPU model whose host times were never measured: eager calls are judged by GPU time
    unmeasured = choose({"ours": 30.0, "flash_attn_4": 10.0}, {}, "eager")
    assert unmeasured.backend == "flash_attn_4" and unmeasured.reason.startswith("GPU time")


def test_availability_of_a_peer():
    from fa4 import backends

    assert backends.unavailable("ours") is None and backends.unavailable("sdpa_cudnn") is None
    installed = backends.unavailable("flash_attn_4")
    assert installed is None or "flash-attn-4 is not installed here" in installed
    with pytest.raises(ValueError, match="unknown backend"):
        backends.unavailable("xformers")


def test_the_shipped_host_times_cover_every_implementation():
    assert implementations() == ("ours", "flash_attn_4", "sdpa_cudnn", "sdpa_flash")  # in display order
    assert set(dispatch.host_us("NVIDIA H200")) == set(implementations())
    assert dispatch.host_us("NVIDIA H100 80GB HBM3") == {}


# --- where the GPU times come from ---------------------------------------------------------------

def _bench_doc():
    return json.loads((REPO / "results" / "bench.json").read_text())


def test_every_packaged_entry_carries_the_times_of_every_implementation_at_its_shape():
    """An entry the bench timed carries the bench's times; one tuned since (the wide set, which also
    re-tuned some grid buckets and kept a faster configuration) carries its search's, which timed
    every peer in the same run."""
    doc = _bench_doc()
    times = backend_times(doc)
    db = BestConfigDB.load(REPO / "fa4" / "data" / "best_configs.json")
    assert set(times) <= {e.key for e in db.entries}
    for e in db.entries:
        if e.backend_source.startswith("bench"):
            assert e.backend_us == times[e.key] and e.backend_source == f"bench {doc['date']}"
        else:
            assert e.backend_source == "search" and e.backend_us["ours"] == e.us
        assert set(e.backend_us) == _implementations_that_run(e), e.key
    # the row of docs/measurements.md's table: B1 S1024 causal, as the bench timed it
    causal = db.get(MISSION_CAUSAL_KEY)
    assert causal.backend_us["ours"] == pytest.approx(_row_us(doc, MISSION_CAUSAL_SHAPE, "tuned"))
    assert causal.backend_us["flash_attn_4"] == pytest.approx(_row_us(doc, MISSION_CAUSAL_SHAPE, "flash_attn_4"))


def _implementations_that_run(entry) -> set[str]:
    """Every implementation that gives our semantics at an entry's problem: the search times each (a
    window or a softcap leaves SDPA out; a varlen batch has its own implementations)."""
    from fa4 import backends, varlen
    from fa4.varlen_batch import problem_from_dict

    problem = problem_from_dict(entry.problem)
    if problem.varlen:
        return set(varlen.implementations())
    return {"ours", *(name for name in backends.peer_names() if backends.unsupported(name, problem) is None)}


MISSION_CAUSAL_KEY = "sm90|NVIDIA H200|fp16|d128|gqa4|causal|sq1024|sk1024|w8"
MISSION_CAUSAL_SHAPE = "sm90-fp16-b1-hq32-hkv8-d128-sq1024-sk1024-causal"


def _row_us(doc, shape, variant) -> float:
    [row] = [r for r in doc["rows"] if r["shape"] == shape and r["variant"] == variant]
    return row["us"]


def _entry(fingerprint=None):
    fingerprint = fingerprint or _bench_doc()["kernel_fingerprint"]  # the kernel the bench ran
    p = AttentionProblem(1, 1024, 1024, 32, 8, 128, "fp16", True)
    return Entry.from_result(arch="sm90", device="NVIDIA H200", problem=p, config=Config.make("sm90").to_dict(),
                             us=21.5, tflops=1.0, default_us=22.0, peers_us={}, max_err=None,
                             kernel_fingerprint=fingerprint, versions={}, study="s", trial=0)


def test_import_bench_updates_only_entries_of_the_kernel_the_bench_ran():
    doc = _bench_doc()
    db = BestConfigDB()
    db.merge(_entry())
    other = BestConfigDB()
    other.merge(_entry("another0kernel00"))
    updated, skipped = import_backend_times(doc, db)
    assert updated == [_entry().key] and db.get(_entry().key).backend_us["sdpa_cudnn"] == pytest.approx(
        _row_us(doc, MISSION_CAUSAL_SHAPE, "sdpa_cudnn"))
    assert len(skipped) == 13 and all("not in the database" in s for s in skipped)
    updated, skipped = import_backend_times(doc, other)
    assert updated == [] and any("tuned on kernel another0kernel00" in s for s in skipped)
    assert other.get(_entry().key).backend_us == {}


def test_a_peer_timed_on_expanded_kv_is_not_recorded_for_dispatch():
    doc = _bench_doc()
    key = "sm90|NVIDIA H200|fp16|d128|gqa4|causal|sq1024|sk1024|w8"
    assert "sdpa_cudnn" in backend_times(doc)[key]
    for r in doc["rows"]:
        if r["variant"] == "sdpa_cudnn":
            r["kv_expanded"] = True  # the runtime would have to copy K and V on every call
    assert all("sdpa_cudnn" not in times for times in backend_times(doc).values())


def test_import_bench_command(tmp_path):
    db_path = tmp_path / "db.json"
    record(_entry(), db_path)
    result = CliRunner().invoke(cli.main, ["db", "import-bench", str(REPO / "results" / "bench.json"),
                                           "--db", str(db_path)])
    assert result.exit_code == 0, result.output
    assert "1 entries of" in result.stderr
    [e] = BestConfigDB.load(db_path).entries
    assert e.backend_us["ours"] == pytest.approx(_row_us(_bench_doc(), MISSION_CAUSAL_SHAPE, "tuned"))
    (tmp_path / "x.json").write_text("{}")
    bad = CliRunner().invoke(cli.main, ["db", "import-bench", str(tmp_path / "x.json"), "--db", str(db_path)])
    assert bad.exit_code == 1 and "not a fa4tune bench output" in bad.output


# --- what explain says ------------------------------------------------------------------------------

def _meta(b, s, hq, hkv, d, dtype=torch.float16):
    return tuple(torch.empty(b, s, h, d, dtype=dtype, device="meta") for h in (hq, hkv, hkv))


def measured_db(tmp_path) -> Path:
    """A database of two H200 entries with stated implementation times, tuned on the current kernel
    sources: B1 S1024 H32/8 D128 causal (flash-attn-4 21.6 us, ours 22.0, SDPA cuDNN 31.0) and B8 S512
    H16 D64 bf16 causal (ours 19.2, flash-attn-4 24.7, cuDNN 23.2)."""
    from fa4 import kernels

    path = tmp_path / "best_configs.json"
    for problem, us, peers in (
            (AttentionProblem(1, 1024, 1024, 32, 8, 128, "fp16", causal=True), 22.0,
             {"flash_attn_4": 21.6, "sdpa_cudnn": 31.0}),
            (AttentionProblem(8, 512, 512, 16, 16, 64, "bf16", causal=True), 19.2,
             {"flash_attn_4": 24.7, "sdpa_cudnn": 23.2})):
        record(Entry.from_result(
            arch="sm90", device="NVIDIA H200", problem=problem,
            config=kernels.default_config("sm90", problem).replace(kv_stages=3).to_dict(), us=us,
            tflops=400.0, default_us=us + 1.0, peers_us=peers, max_err=1e-3,
            kernel_fingerprint=kernels.kernel_fingerprint("sm90"), versions={}, study="s", trial=0), path)
    return path


def test_explain_says_which_backend_would_run_and_why(tmp_path, monkeypatch):
    from fa4 import backends

    monkeypatch.setattr(backends, "unavailable", lambda name: None)  # as if flash-attn-4 were installed
    fa4.use_config_db(measured_db(tmp_path))
    try:
        e = fa4.explain(*_meta(1, 1024, 32, 8, 128), causal=True, arch="sm90", device_name="NVIDIA H200")
        assert e.source == "exact" and [(c.mode, c.backend) for c in e.backends] == [
            ("eager", "ours"), ("graph", "flash_attn_4")]
        text = str(e)
        assert "graph: flash-attn-4 (GPU time 21.6 us vs ours 22.0 us: 1.019x faster)" in text
        assert e.runs == {"eager": "ours", "graph": "flash_attn_4"}
        assert "under CUDA-graph capture or torch.compile: flash-attn-4 (GPU time 21.6 us" in text
        # where ours wins both ways, ours runs in both
        e = fa4.explain(*_meta(8, 512, 16, 16, 64, torch.bfloat16), causal=True, arch="sm90",
                        device_name="NVIDIA H200")
        assert {c.backend for c in e.backends} == {"ours"} and e.runs == {"eager": "ours", "graph": "ours"}
        assert "runs: our sm90 kernel\n" in str(e)
        # a neighbour's times were measured at another shape: no measurement here, a prediction (one
        # neighbour 1.9 log2 steps away: not confident, the region's vote)
        e = fa4.explain(*_meta(1, 2000, 32, 8, 128), causal=True, arch="sm90", device_name="NVIDIA H200")
        assert e.source == "nearest" and e.backends == [] and "fastest backend, measured" not in str(e)
        assert [(p.mode, p.backend, p.confident) for p in e.predictions] == [
            ("eager", "ours", False), ("graph", "flash_attn_4", False)]
        assert "neighbour sm90|NVIDIA H200|fp16|d128|gqa4|causal|sq1024|sk1024|w8 (distance 1.93)" in str(e)
    finally:
        fa4.use_config_db(None)


def test_explain_says_when_the_measured_winner_cannot_run_here(tmp_path, monkeypatch):
    from fa4 import backends

    monkeypatch.setattr(backends, "unavailable",
                        lambda name: "flash-attn-4 is not installed here" if name == "flash_attn_4" else None)
    fa4.use_config_db(measured_db(tmp_path))
    try:
        e = fa4.explain(*_meta(1, 1024, 32, 8, 128), causal=True, arch="sm90", device_name="NVIDIA H200")
        assert e.runs == {"eager": "ours", "graph": "ours"}
        assert any(n.startswith("graph: flash-attn-4 measured fastest") and "not installed here" in n
                   for n in e.notes), e.notes
        # SDPA gives no LSE: with return_lse it is no candidate, whatever it measured
        lse = fa4.explain(*_meta(1, 1024, 32, 8, 128), causal=True, return_lse=True, arch="sm90",
                          device_name="NVIDIA H200")
        assert all(set(c.cost_us) <= {"ours", "flash_attn_4"} for c in lse.backends)
    finally:
        fa4.use_config_db(None)
