"""`fa4tune bench` on CPU with the fake kernel API and evaluator: which rows, which lookups."""

from __future__ import annotations

import csv
import io
import json

import pytest
import test_search_fakes as fakes
from fa4.database import Entry, record
from fa4.kernels import AttentionProblem, Config
from fa4tune.benchmark import runner as bench_mod
from fa4tune.benchmark.runner import run_bench, write_bench
from fa4tune.report.data import dispatch_rows, problem_label, rows_from_bench, training_rows
from fa4tune.searches.runner import Progress

EVALUATOR = "test_search_fakes:FakeEvaluator"


def _entry(p: AttentionProblem, config: Config, fingerprint="fake-fingerprint-1") -> Entry:
    return Entry.from_result(arch="sm90", device="Fake H200", problem=p, config=config.to_dict(), us=1.0,
                             tflops=1.0, default_us=None, peers_us={}, max_err=None,
                             kernel_fingerprint=fingerprint, versions={}, study="s", trial=3)


def test_rows_for_exact_nearest_stale_and_infeasible(tmp_path, monkeypatch):
    db = tmp_path / "db.json"
    fast = Config.make("sm90", tile_n=112, scheduler="lpt", kv_stages=3)
    base = dict(batch=1, heads_q=32, heads_kv=8, head_dim=128, dtype="fp16", causal=True)
    record(_entry(AttentionProblem(seqlen_q=1024, seqlen_k=1024, **base), fast), db)
    record(_entry(AttentionProblem(seqlen_q=8192, seqlen_k=8192, **base), fast, fingerprint="old"), db)
    record(_entry(AttentionProblem(seqlen_q=1024, seqlen_k=1024, **{**base, "causal": False}),
                  Config.make("sm90", tile_m=192, tile_n=192)), db)   # infeasible in the fake model
    problems = [AttentionProblem(seqlen_q=2048, seqlen_k=2048, **base),                 # nearest: 1024
                AttentionProblem(seqlen_q=8192, seqlen_k=8192, **{**base, "batch": 64}),  # only stale/far
                AttentionProblem(seqlen_q=1024, seqlen_k=1024, **{**base, "causal": False})]
    monkeypatch.setattr(bench_mod, "kernel_fingerprint", lambda arch, api="fa4.kernels": "fake-fingerprint-1")
    said = io.StringIO()
    doc = run_bench("sm90", problems, db_path=str(db), peers=("sdpa_cudnn",), processes=2,
                    evaluator=EVALUATOR, api="test_search_fakes", progress=Progress(stream=said), rounds=1)
    assert "sq1024|sk1024|w8 cannot be used: infeasible for the problem it was tuned on" in said.getvalue()
    rows = {(r["shape"].split("-")[6], r["shape"].split("-")[-1], r["variant"]): r for r in doc["rows"]}
    nearest = rows[("sq2048", "causal", "tuned")]
    assert nearest["lookup"] == "nearest" and nearest["outcome"] == "ok"
    assert nearest["us"] == fakes.fake_us(fast.to_dict()) and nearest["config"] == fast.to_dict()
    assert rows[("sq2048", "causal", "default")]["speedup_of_tuned"] > 1.0
    assert rows[("sq2048", "causal", "sdpa_cudnn")]["us"] == 31.6
    # the 8192 entry is stale; the nearest fresh one, 1024, is too far away (the runtime's rules)
    far = rows[("sq8192", "causal", "tuned")]
    assert far["lookup"] == "default" and far["outcome"] == "missing"
    assert "1 stale" in far["error"] and "past the limit of 2" in far["error"]
    # an entry infeasible where it was tuned is skipped, as the runtime skips it, and the row says why
    infeasible = rows[("sq1024", "full", "tuned")]
    assert infeasible["outcome"] == "missing" and "skipped: infeasible" in infeasible["error"]
    assert "shared memory" in infeasible["error"]
    assert rows[("sq1024", "full", "default")]["outcome"] == "ok"
    assert [r["variant"] for r in doc["rows"][:4]] == ["tuned", "default", "sdpa_cudnn", "dispatched"]
    # one round: every timed row's one time, as before rounds existed
    assert doc["timing"]["rounds"] == 1 and all(r["us_rounds"] == [r["us"]] for r in doc["rows"] if r["us"])
    assert far["us_rounds"] is None and infeasible["us_rounds"] is None
    # fa4.attention itself, beside each implementation: GPU time, eager time per call, what ran
    ran = rows[("sq2048", "causal", "dispatched")]
    assert (ran["us"], ran["eager_us"], ran["backend"]) == (30.0, 31.0, {"eager": "ours", "graph": "ours"})
    # eager time per call beside every GPU time: each peer's own, and ours (fa4.attention forced to our
    # kernel) on the row fa4.attention runs: the tuned row where it ran, else the default
    assert rows[("sq2048", "causal", "sdpa_cudnn")]["eager_us"] == 32.4
    assert rows[("sq2048", "causal", "tuned")]["eager_us"] == 31.0
    assert rows[("sq2048", "causal", "default")]["eager_us"] is None
    assert rows[("sq8192", "causal", "default")]["eager_us"] == 31.0
    assert rows[("sq1024", "full", "default")]["eager_us"] == 31.0
    assert rows[("sq1024", "full", "dispatched")]["eager_us"] == 33.5
    # the dispatch bar from this one run, as the report judges it: the non-causal shape is within 2 % of
    # the fastest by GPU time (30.0 vs SDPA cuDNN's 31.6) but not per eager call (33.5 vs ours' 31.0)
    verdicts = {d.label: d for d in dispatch_rows(rows_from_bench(doc["rows"], doc))}
    full = verdicts[problem_label(problems[2].to_dict())]
    assert (full.fastest, full.fastest_us, full.ratio) == ("sdpa_cudnn", 31.6, pytest.approx(30.0 / 31.6))
    assert (full.eager_fastest, full.eager_fastest_us) == ("default", 31.0)
    assert full.eager_ratio == pytest.approx(33.5 / 31.0)
    assert full.graph_within_tolerance and full.eager_within_tolerance is False and full.within_tolerance is False
    near = verdicts[problem_label(problems[0].to_dict())]
    assert (near.eager_fastest, near.eager_fastest_us, near.eager_ratio) == ("tuned", 31.0, 1.0)
    assert (near.fastest, near.ratio) == ("tuned", pytest.approx(30.0 / 30.5)) and near.within_tolerance

    out, out_csv = tmp_path / "b.json", tmp_path / "b.csv"
    write_bench(doc, out, out_csv)
    assert json.loads(out.read_text()) == json.loads(json.dumps(doc))
    with open(out_csv) as handle:
        read = list(csv.DictReader(handle))
    assert len(read) == len(doc["rows"]) and read[0]["config"].startswith("tile_m=128 tile_n=112")
    assert read[3]["backend"] == "eager ours / graph ours" and read[3]["eager_us"] == "31.0"
    assert (read[0]["eager_us"], read[1]["eager_us"], read[2]["eager_us"]) == ("31.0", "", "32.4")


def test_missing_entry_and_all_stale(tmp_path, monkeypatch):
    db = tmp_path / "db.json"
    p = AttentionProblem(1, 1024, 1024, 32, 8, 128, "fp16", True)
    record(_entry(p, Config.make("sm90"), fingerprint="old"), db)
    monkeypatch.setattr(bench_mod, "kernel_fingerprint", lambda arch, api="fa4.kernels": "new")
    doc = run_bench("sm90", [p], db_path=str(db), peers=(), processes=1, evaluator=EVALUATOR,
                    api="test_search_fakes", progress=Progress(quiet=True))
    tuned = next(r for r in doc["rows"] if r["variant"] == "tuned")
    assert tuned["outcome"] == "missing" and "1 stale" in tuned["error"]
    assert [r["variant"] for r in doc["rows"]] == ["tuned", "default", "dispatched"]


def test_rounds_keep_each_rows_lowest_time_and_any_rounds_failure(tmp_path, monkeypatch):
    """Three interleaved rounds: a transient in one round (the fake times a kernel, a peer and
    fa4.attention 20 us slow the first time) leaves every row's us at its lowest round; a failure in
    one round (the default's first launch) stays the row's outcome."""
    db = tmp_path / "db.json"
    fast = Config.make("sm90", tile_n=112, scheduler="lpt", kv_stages=3)
    p = AttentionProblem(1, 1024, 1024, 32, 8, 128, "fp16", True)
    record(_entry(p, fast), db)
    (tmp_path / "slow").mkdir()
    (tmp_path / "fail").mkdir()
    monkeypatch.setenv(fakes.FAKE_SLOW_ENV, f"{tmp_path / 'slow'}:tile_n=112|sdpa_cudnn|dispatched")
    monkeypatch.setenv(fakes.FAKE_FAIL_ONCE_ENV, f"{tmp_path / 'fail'}:tile_n=128")
    monkeypatch.setattr(bench_mod, "kernel_fingerprint", lambda arch, api="fa4.kernels": "fake-fingerprint-1")
    doc = run_bench("sm90", [p], db_path=str(db), peers=("sdpa_cudnn",), processes=2, evaluator=EVALUATOR,
                    api="test_search_fakes", progress=Progress(quiet=True), rounds=3)
    assert doc["timing"]["rounds"] == 3
    rows = {r["variant"]: r for r in doc["rows"]}
    assert all(len(r["us_rounds"]) == 3 for r in doc["rows"])
    slow = fakes.SLOW_US
    tuned, us = rows["tuned"], fakes.fake_us(fast.to_dict())
    assert tuned["outcome"] == "ok" and tuned["us"] == us
    # the repeat of a kernel goes to the worker that compiled it, after its first round: round 1 is slow
    assert tuned["us_rounds"] == [us + slow, us, us]
    assert tuned["tflops"] == round(p.flops() / us / 1e6, 2)
    peer = rows["sdpa_cudnn"]
    assert (peer["us"], peer["eager_us"]) == (31.6, 32.4)
    assert sorted(peer["us_rounds"]) == [31.6, 31.6, 31.6 + slow]
    assert sorted(peer["eager_us_rounds"]) == [32.4, 32.4, 32.4 + slow]
    ran = rows["dispatched"]
    assert (ran["us"], ran["eager_us"]) == (30.0, 31.0) and sorted(ran["us_rounds"]) == [30.0, 30.0, 30.0 + slow]
    # ours' eager time (fa4.attention forced to our kernel, timed with the dispatched task) likewise
    assert tuned["eager_us"] == 31.0 and sorted(tuned["eager_us_rounds"]) == [31.0, 31.0, 31.0 + slow]
    # a failure in one round is never hidden by the other rounds' successes
    default = rows["default"]
    assert default["outcome"] == "launch_error" and "once" in default["error"] and default["us"] is None
    assert sorted(default["us_rounds"], key=lambda x: x is None) == [
        fakes.fake_us(Config.make("sm90").to_dict())] * 2 + [None]
    assert default["speedup_of_tuned"] is None
    # the dispatch summary and the CSV read the final values
    reason = doc["dispatch"][tuned["shape"]]["graph"]["reason"]
    assert f"GPU time {us:.1f} us" in reason and "(31.6 us)" in reason
    out, out_csv = tmp_path / "b.json", tmp_path / "b.csv"
    write_bench(doc, out, out_csv)
    with open(out_csv) as handle:
        first = next(csv.DictReader(handle))
    assert (first["variant"], float(first["us"]), first["us_rounds"]) == ("tuned", us, f"{us + slow} {us} {us}")


def test_rounds_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="at least one round"):
        run_bench("sm90", [], db_path=str(tmp_path / "db.json"), rounds=0, evaluator=EVALUATOR,
                  api="test_search_fakes")


class PathyEvaluator(fakes.FakeEvaluator):
    """Fails as a real toolchain does, with reasons that name files: the compiler's under
    site-packages and a home, a peer's import under /tmp."""

    def compile(self, config, problem):
        raise RuntimeError("DSLRuntimeError: /root/.venv/lib/python3.12/site-packages/cutlass/base_dsl/jit.py\n"
                           "ptxas fatal: /home/x/.cache/fa4tune/kernels/ab12.ptx: out of registers")

    def time_peers(self, problem, timing, names, eager=False):
        return {name: {"error": f"not importable: /tmp/build-7/{name}/__init__.py (from /usr/lib/python3/x.py)"}
                for name in names}


def test_bench_notes_carry_no_absolute_path(tmp_path):
    """A bench file is committed and shared: every row's reason names no machine's paths, whichever
    made it (a worker's compile error, a peer's import)."""
    from test_portable_notes import ABSOLUTE_PATH

    p = AttentionProblem(1, 1024, 1024, 32, 8, 128, "fp16", True)
    doc = run_bench("sm90", [p], db_path=str(tmp_path / "db.json"), peers=("sdpa_cudnn", "flash_attn_4"),
                    processes=1, evaluator="test_bench:PathyEvaluator", api="test_search_fakes",
                    progress=Progress(quiet=True), rounds=1)
    rows = {r["variant"]: r for r in doc["rows"]}
    assert rows["default"]["outcome"] == "compile_error"
    assert rows["default"]["error"] == ("RuntimeError: DSLRuntimeError: <site-packages>/cutlass/base_dsl/jit.py ... "
                                        "ptxas fatal: <home>/.cache/fa4tune/kernels/ab12.ptx: out of registers")
    assert rows["flash_attn_4"]["error"] == "not importable: __init__.py (from x.py)"
    assert not [r["error"] for r in doc["rows"] if r["error"] and ABSOLUTE_PATH.search(r["error"])]
    out, out_csv = tmp_path / "b.json", tmp_path / "b.csv"
    write_bench(doc, out, out_csv)
    for text in (out.read_text(), out_csv.read_text()):
        assert not any(planted in text for planted in ("/root/", "/home/x", "/tmp/build-7", "/usr/lib")), text


class _OrderPool:
    """Records submissions; every task starts at once and finishes on the next poll."""

    def __init__(self):
        self.submitted: list[str] = []
        self.pending: list[int] = []

    def submit(self, kind, payload, compile_key=None):
        self.submitted.append(payload["name"])
        self.pending.append(len(self.submitted) - 1)
        return len(self.submitted) - 1

    def busy_tasks(self):
        return [(task_id, None, None) for task_id in self.pending]

    def poll(self, timeout):
        done, self.pending = self.pending, []
        return [(task_id, {"outcome": "ok"}) for task_id in done]


def test_odd_rounds_run_in_reverse_order():
    """No row always follows the same neighbour (the peers before the dispatched row heat the GPU)."""
    specs = [bench_mod._Task("trial", {"name": name}, {"shape": "s", "variant": name}, None)
             for name in ("tuned", "default", "peers", "dispatched")]
    pool = _OrderPool()
    results = bench_mod._run_rounds(pool, specs, 3, Progress(quiet=True))
    names = [s.payload["name"] for s in specs]
    assert pool.submitted == names + names[::-1] + names
    assert all(len(r) == 3 and all(x == {"outcome": "ok"} for x in r) for r in results)


def test_backward_adds_training_rows(tmp_path):
    """--backward: per shape, fa4.attention's and every peer's training pass (the fake: fa4 100/70 us,
    cuDNN 90/60, FA2 refuses), the lowest backward over rounds; without it, no training rows."""
    db = tmp_path / "db.json"
    problem = AttentionProblem(batch=1, seqlen_q=512, seqlen_k=512, heads_q=8, heads_kv=2, head_dim=64,
                               dtype="bf16", causal=True)
    doc = run_bench("sm90", [problem], db_path=str(db), peers=("sdpa_cudnn", "sdpa_flash"), processes=2,
                    evaluator=EVALUATOR, api="test_search_fakes", progress=Progress(quiet=True), rounds=2,
                    backward=True)
    rows = {r["implementation"]: r for r in doc["training_rows"]}
    assert list(rows) == ["fa4", "sdpa_cudnn", "sdpa_flash"]
    assert (rows["fa4"]["fwdbwd_us"], rows["fa4"]["bwd_us"], rows["fa4"]["backward"]) == (100.0, 70.0, "blockwise")
    assert rows["fa4"]["bwd_us_rounds"] == [70.0, 70.0] and rows["fa4"]["validated"] is True
    assert rows["sdpa_cudnn"]["bwd_us"] == 60.0 and rows["sdpa_cudnn"]["bwd_peak_extra_mib"] == 12.5
    assert rows["sdpa_flash"]["outcome"] == "launch_error" and "cannot train" in rows["sdpa_flash"]["error"]
    assert all(r["variant"] != "training" for r in doc["rows"])
    # the report reads them as the bench wrote them: fa4.attention 100/90 and 70/60 of cuDNN's times
    report = {(r.implementation, r.outcome): r for r in training_rows(doc)}
    assert set(report) == {("fa4", "ok"), ("sdpa_cudnn", "ok"), ("sdpa_flash", "launch_error")}
    assert report[("fa4", "ok")].bwd_ratio == pytest.approx(70 / 60)
    assert report[("fa4", "ok")].fwdbwd_ratio == pytest.approx(100 / 90)
    plain = run_bench("sm90", [problem], db_path=str(db), peers=("sdpa_cudnn",), processes=1,
                      evaluator=EVALUATOR, api="test_search_fakes", progress=Progress(quiet=True), rounds=1)
    assert "training_rows" not in plain


def test_a_shapes_runtime_tasks_share_one_worker(tmp_path, monkeypatch):
    """The peers, training and dispatched tasks compile on first call with the GPU held: one routing key
    per shape (so a later round runs where they are compiled), none shared between shapes or with a trial."""
    submitted = []
    real = bench_mod._run_rounds

    def recording(pool, specs, rounds, progress):
        submitted.extend(specs)
        return real(pool, specs, rounds, progress)

    monkeypatch.setattr(bench_mod, "_run_rounds", recording)
    problems = [AttentionProblem(batch=1, seqlen_q=s, seqlen_k=s, heads_q=8, heads_kv=2, head_dim=64,
                                 dtype="bf16", causal=True) for s in (512, 1024)]
    run_bench("sm90", problems, db_path=str(tmp_path / "db.json"), peers=("sdpa_cudnn",), processes=2,
              evaluator=EVALUATOR, api="test_search_fakes", progress=Progress(quiet=True), rounds=2, backward=True)
    keys: dict[str, set] = {}
    for spec in submitted:
        keys.setdefault(spec.row["shape"], set()).add((spec.kind, spec.compile_key))
    assert len(keys) == 2
    runtime = [{key for kind, key in tasks if kind in ("peers", "training", "dispatched")} for tasks in keys.values()]
    assert all(len(k) == 1 and None not in k for k in runtime) and runtime[0] != runtime[1]
    trials = {key for tasks in keys.values() for kind, key in tasks if kind == "trial"}
    assert not trials & (runtime[0] | runtime[1])


def test_the_dispatched_row_keeps_its_time_where_ours_forced_cannot_run(monkeypatch):
    """`fa4tune.workers.evaluator.dispatched_row` (the dense and the varlen "dispatched" rows): ours
    forced failing leaves the row with its reason, unless the GPU is broken (then it raises); a wrong
    answer is a mismatch and is not timed. CPU tensors, the GPU timers replaced."""
    from types import SimpleNamespace

    import torch

    from fa4tune.workers import timing as timing_mod
    from fa4tune.workers.evaluator import dispatched_row
    from fa4tune.workers.timing import TimingSettings

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(timing_mod, "time_cuda", lambda fn, timing: SimpleNamespace(us=10.0, spread=0.0))
    monkeypatch.setattr(timing_mod, "time_eager", lambda fn: (fn(), 30.0)[1])
    problem = AttentionProblem(1, 64, 64, 2, 2, 64, "fp16", False)

    def call(backend="auto"):
        if backend == "ours":
            raise RuntimeError("ours cannot run here")
        return torch.zeros(1)

    passed = lambda out, lse: {"passed": True, "max_err": 0.0}   # noqa: E731
    describe = lambda: ({"eager": "flash_attn_4", "graph": "flash_attn_4"}, None)   # noqa: E731
    row = dispatched_row(call, passed, describe, problem, TimingSettings(), lambda: True)
    assert row["outcome"] == "ok" and row["us"] == 10.0 and row["eager_us"] == 30.0
    assert "ours cannot run here" in row["ours_eager_error"] and row["backend"]["graph"] == "flash_attn_4"
    with pytest.raises(RuntimeError, match="ours cannot run here"):
        dispatched_row(call, passed, describe, problem, TimingSettings(), lambda: False)
    failed = dispatched_row(call, lambda out, lse: {"passed": False, "error": "differs"}, describe, problem,
                            TimingSettings(), lambda: True)
    assert failed["outcome"] == "mismatch" and "us" not in failed


def test_a_run_in_parts_writes_each_part_and_a_resumed_run_keeps_them(tmp_path):
    """shapes_per_part: the document so far goes to `partial` after every part but the last, so a run
    cut short keeps the shapes it finished; `previous` (such a document) keeps those shapes' rows as
    they are and times only the rest; a document of other settings is not resumable."""
    db = tmp_path / "db.json"
    problems = [AttentionProblem(batch=1, seqlen_q=s, seqlen_k=s, heads_q=8, heads_kv=2, head_dim=64,
                                 dtype="bf16", causal=True) for s in (512, 1024, 2048)]
    parts = []
    common = dict(db_path=str(db), peers=("sdpa_cudnn",), processes=1, evaluator=EVALUATOR, api="test_search_fakes",
                  progress=Progress(quiet=True), rounds=1, backward=True)
    whole = run_bench("sm90", problems, shapes_per_part=2, partial=parts.append, **common)
    assert [sorted({r["shape"] for r in p["rows"]}) == sorted({r["shape"] for r in p["training_rows"]})
            for p in parts] == [True]
    assert len({r["shape"] for r in parts[0]["rows"]}) == 2
    assert len({r["shape"] for r in whole["rows"]}) == 3
    # resumed from the first part: its two shapes' rows are the part's, untouched; the third is timed
    first = json.loads(json.dumps(parts[0]))
    first["rows"][0]["us"] = 12345.0   # a value no run of the fake makes: kept, not re-timed
    resumed = run_bench("sm90", problems, previous=first, **common)
    assert resumed["resumed"] == [first["date"]]
    assert resumed["rows"][0]["us"] == 12345.0
    assert [r["shape"] for r in resumed["rows"]] == [r["shape"] for r in whole["rows"]]
    assert [r["shape"] for r in resumed["training_rows"]] == [r["shape"] for r in whole["training_rows"]]
    device = first["device"]["name"]
    assert bench_mod.resumable(first, "sm90", device, 1, True, "warm") == [] or \
        all("kernels" in why for why in bench_mod.resumable(first, "sm90", device, 1, True, "warm"))
    assert any("rounds" in why for why in bench_mod.resumable(first, "sm90", device, 2, True, "warm"))
    assert any("GPU" in why for why in bench_mod.resumable(first, "sm90", "another GPU", 1, True, "warm"))
    assert any("backward" in why for why in bench_mod.resumable(first, "sm90", device, 1, False, "warm"))


def test_resume_refuses_another_runs_file(tmp_path):
    """`fa4tune bench --resume` on a file another run's settings wrote: refused before anything runs,
    naming the difference (here the round count and the pass)."""
    from fa4tune.api import run_bench_set

    out = tmp_path / "bench.json"
    out.write_text(json.dumps({"arch": "sm90", "device": {"name": "Fake H200"}, "timing": {"rounds": 2, "l2": "warm"},
                               "kernel_fingerprint": "x", "rows": [], "date": "then"}))
    problem = AttentionProblem(batch=1, seqlen_q=512, seqlen_k=512, heads_q=8, heads_kv=2, head_dim=64,
                               dtype="bf16", causal=True)
    with pytest.raises(ValueError, match="another run's.*rounds 2.*backward False"):
        run_bench_set([problem], gpus=[{"index": 0, "name": "Fake H200"}], arch="sm90", out=str(out), rounds=1,
                      backward=True, resume=True, progress=Progress(quiet=True))
    # a file that holds no bench output is refused as well, and left as it was
    for text, why in (("[1, 2]", "not a fa4tune bench output"), ("not json", "cannot read")):
        out.write_text(text)
        with pytest.raises(ValueError, match=why):
            run_bench_set([problem], gpus=[{"index": 0, "name": "Fake H200"}], arch="sm90", out=str(out),
                          rounds=1, backward=True, resume=True, progress=Progress(quiet=True))
        assert out.read_text() == text
