"""The command line on CPU: GPU detection is replaced, the kernel API and evaluator are the fakes."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
from click.testing import CliRunner

import test_search_fakes as fakes
from fa4.database import BestConfigDB, Entry, record
from fa4.kernels import AttentionProblem, Config
from fa4tune.benchmark import runner as bench_mod
from fa4tune import cli
from fa4tune.searches import runner as search_mod
from fa4tune.inputs.space import load_space

FAKE_GPU = [{"index": 0, "name": "Fake H200", "cc": (9, 0)}]
EVALUATOR = "test_search_fakes:FakeEvaluator"


@pytest.fixture
def fake_gpu(monkeypatch):
    monkeypatch.setattr(cli, "detect_gpus", lambda: list(FAKE_GPU))
    real = search_mod.run_search

    def run_with_fakes(arch, problems, settings, progress=None, pool=None):
        settings = replace(settings, evaluator=EVALUATOR, kernel_api="test_search_fakes", processes=2)
        return real(arch, problems, settings, progress, pool)

    monkeypatch.setattr(search_mod, "run_search", run_with_fakes)


def invoke(*args, env=None):
    # tables take the terminal's width; these tests read whole cells, so the terminal is wide
    return CliRunner().invoke(cli.main, list(args), env={"COLUMNS": "240", **(env or {})},
                              catch_exceptions=False)


def test_search_without_a_gpu_says_so(monkeypatch):
    monkeypatch.setattr(cli, "detect_gpus", lambda: [])
    result = invoke("search", "--seqlen", "1024", "--gqa", "4")
    assert result.exit_code == 2
    assert "no CUDA GPU found" in result.stderr and "--compile-only" in result.stderr
    assert result.stdout == ""


def test_search_as_written_prints_defaults_and_results(tmp_path, fake_gpu):
    storage, db = tmp_path / "studies.journal", tmp_path / "db.json"
    result = invoke("search", "--seqlen", "1024", "--gqa", "4", "--trials", "6", "--storage", str(storage),
                    "--db", str(db), "--format", "json")
    assert result.exit_code == 0, result.stderr
    err = result.stderr
    assert "arch sm90 (detected: Fake H200)" in err
    assert "batch 1, 32 query heads, 8 KV heads (gqa 4), head dim 128, seqlen_q 1024, seqlen_k 1024, fp16" in err
    assert "non-causal and causal" in err and "6 configurations per study, sampler tpe" in err
    summaries = json.loads(result.stdout)   # stdout is only the data
    assert [s["study"] for s in summaries] == ["sm90-fp16-b1-hq32-hkv8-d128-sq1024-sk1024-full",
                                               "sm90-fp16-b1-hq32-hkv8-d128-sq1024-sk1024-causal"]
    assert all(s["evaluated"] == 6 and s["best"]["us"] <= s["default_us"] for s in summaries)
    assert len(BestConfigDB.load(db)) == 2

    # the same command again resumes: nothing new to do, same answer
    again = invoke("search", "--seqlen", "1024", "--gqa", "4", "--trials", "6", "--storage", str(storage),
                   "--db", str(db), "--format", "json")
    assert [s["best"] for s in json.loads(again.stdout)] == [s["best"] for s in summaries]


def test_search_table_and_options(tmp_path, fake_gpu):
    result = invoke("search", "--causal", "--batch", "2", "--heads", "16", "--heads-kv", "16", "--head-dim", "64",
                    "--seqlen", "512", "--seqlen-k", "2048", "--dtype", "bf16", "--trials", "4", "--sampler", "random",
                    "--seed", "3", "--storage", str(tmp_path / "s.journal"), "--no-db", "--no-peers",
                    "--study", "mine", "--l2", "flushed")
    assert result.exit_code == 0, result.stderr
    assert "mine" in result.stdout and "best trial" in result.stdout
    assert not (tmp_path / "db.json").exists()
    import optuna

    from fa4tune.searches.storage import open_storage

    study = optuna.load_study(study_name="mine", storage=open_storage(tmp_path / "s.journal"))
    assert study.user_attrs["problem"] == AttentionProblem(2, 512, 2048, 16, 16, 64, "bf16", True).to_dict()
    assert study.user_attrs["timing"]["l2"] == "flushed" and "peers" not in study.user_attrs


def test_shape_option_errors():
    result = CliRunner().invoke(cli.main, ["search", "--heads", "30", "--gqa", "4"])
    assert result.exit_code == 2 and "not divisible" in result.output
    result = CliRunner().invoke(cli.main, ["search", "--gqa", "4", "--heads-kv", "8"])
    assert result.exit_code == 2 and "not both" in result.output


@pytest.fixture
def fake_compiles(monkeypatch):
    from fa4tune.searches import compile_space

    monkeypatch.setattr(cli, "detect_gpus", lambda: [])
    real = compile_space.run
    monkeypatch.setattr(compile_space, "run",
                        lambda *a, **kw: real(*a, **{**kw, "evaluator": EVALUATOR, "api": "test_search_fakes"}))


def test_compile_only_needs_no_gpu(fake_compiles):
    result = invoke("search", "--compile-only", "--causal", "--trials", "5", "--format", "json")
    [report] = json.loads(result.stdout)
    size = load_space("sm90").size
    assert report["space_size"] == size and report["feasible"] + report["infeasible"] == size
    assert report["infeasible_reasons"] == {"shared memory N B exceeds N B": report["infeasible"]}
    [example] = report["infeasible_examples"].values()  # the class's first reason, its numbers kept
    assert re.fullmatch(r"shared memory \d+ B exceeds \d+ B", example), example
    assert len(report["compiled"]) == 5 and report["compiled"][0]["is_default"]
    for c in report["compiled"]:
        fails = c["config"]["pv_operand"] == "ss" and c["config"]["tile_n"] >= 176   # the fake's rule
        assert c["outcome"] == ("compile_error" if fails else "ok")
        assert ("register allocation failed" in c["error"]) if fails else c["report"]["spills"] == 0
        assert bool(c["problems"]) == fails
    # a feasible configuration that does not compile means the feasibility model is wrong: exit 1,
    # and the summary on stderr names it
    any_failed = any(c["outcome"] != "ok" for c in report["compiled"])
    assert result.exit_code == (1 if any_failed else 0), result.stderr
    assert f"exit status {result.exit_code}" in result.stderr.splitlines()[-1]
    table = invoke("search", "--compile-only", "--no-causal", "--trials", "2")
    assert "rejected before compiling" in table.stdout and re.search(r"shared memory \d+ B exceeds \d+ B", table.stdout)


def test_compile_only_is_compile_space(fake_compiles):
    """One code path: the same results, summary and exit status; both causal modes counted."""
    via_search = invoke("search", "--compile-only", "--trials", "3", "--format", "json")
    direct = invoke("compile-space", "--limit", "3", "--format", "json")
    strip = lambda doc: [{**r, "compiled": sorted(json.dumps({k: v for k, v in c.items() if k != "compile_s"},
                                                               sort_keys=True) for c in r["compiled"])}
                         for r in json.loads(doc)]
    assert strip(via_search.stdout) == strip(direct.stdout)
    assert via_search.exit_code == direct.exit_code
    reports = json.loads(direct.stdout)
    assert [r["problem"]["causal"] for r in reports] == [False, True]
    assert "compiled (2 problem(s)): 6/6" in direct.stderr   # progress counts both modes
    assert "non-causal and causal" in direct.stderr


def test_compile_space_exit_status_says_what_failed():
    from fa4tune.searches import compile_space

    clean = {"failures": 0, "default_feasible": True}
    assert compile_space.exit_status([clean]) == 0
    assert compile_space.exit_status([clean, {**clean, "failures": 2}]) == compile_space.EXIT_COMPILE_PROBLEMS
    assert compile_space.exit_status([{**clean, "default_feasible": False}]) == compile_space.EXIT_DEFAULT_INFEASIBLE
    assert compile_space.exit_status([{"failures": 1, "default_feasible": False}]) == 5


def _entry(fingerprint: str, sq: int) -> Entry:
    p = AttentionProblem(1, sq, sq, 32, 8, 128, "fp16", True)
    return Entry.from_result(arch="sm90", device="Fake H200", problem=p, config=Config.make("sm90").to_dict(),
                             us=30.0, tflops=300.0, default_us=31.0, peers_us={"sdpa_cudnn": 31.6}, max_err=1e-3,
                             kernel_fingerprint=fingerprint, versions={}, study="s", trial=0)


def test_best_lists_the_database_with_a_stale_column(tmp_path, monkeypatch):
    db = tmp_path / "db.json"
    record(_entry("current", 1024), db)
    record(_entry("old", 4096), db)
    from fa4tune import environment

    monkeypatch.setattr(environment, "kernel_fingerprint", lambda arch, api="fa4.kernels": "current")
    rows = json.loads(invoke("best", "--db", str(db), "--format", "json").stdout)
    assert {r["seqlen_q_bucket"]: r["stale"] for r in rows} == {1024: False, 4096: True}
    table = invoke("best", "--db", str(db)).stdout
    assert "STALE" in table and "best configurations (2)" in table
    (tmp_path / "bad.json").write_text("{")
    bad = CliRunner().invoke(cli.main, ["best", "--db", str(tmp_path / "bad.json")])
    assert bad.exit_code == 1 and "cannot read" in bad.output


def test_best_lists_an_entry_tuned_before_a_knob_existed(tmp_path):
    db = tmp_path / "db.json"
    old = _entry("old", 2048)
    old.config.pop("pack_gqa")  # as if tuned before the knob was declared
    record(old, db)
    table = invoke("best", "--db", str(db)).stdout  # lists it (it raised before)
    assert "best configurations (1)" in table and "not usable" in table


def test_best_shows_the_layer_of_each_entry(tmp_path, monkeypatch):
    from fa4 import database

    packaged = BestConfigDB.load(database.packaged_path())
    mine = tmp_path / "mine.json"
    record(_entry("current", 1024), mine)                       # a key the package does not have
    over = packaged.entries[0]                                  # and one it has, tuned again here
    record(Entry(**{**{f: getattr(over, f) for f in over.__dataclass_fields__}, "us": over.us * 2}), mine)
    peer_wins = Entry.from_result(
        arch="sm90", device="NVIDIA H200", problem=AttentionProblem(1, 333, 333, 32, 8, 128, "fp16", False),
        config=Config.make("sm90").to_dict(), us=12.5, tflops=100.0, default_us=12.5,
        peers_us={"flash_attn_4": 12.0}, max_err=1e-3, kernel_fingerprint="current", versions={}, study="s",
        trial=0)
    record(peer_wins, mine)
    rows = json.loads(invoke("best", "--format", "json", env={"FA4_CONFIG_DB": str(mine)}).stdout)
    layers = {r["key"]: (r["layer"], r["shadows"]) for r in rows}
    assert len(rows) == len(packaged) + 2
    assert layers[over.key] == ("user", ["packaged"])          # later layers win per key
    assert layers[_entry("current", 1024).key] == ("user", [])
    assert all(layers[e.key] == ("packaged", []) for e in packaged.entries[1:])
    # the fastest backend measured at each shape, per mode: a user entry on the H200 (whose host times
    # per call are packaged) where flash-attn-4's kernel is 4 % faster runs it under graph capture,
    # while eagerly its host time per call loses to ours
    fastest = {r["key"]: r["fastest_backend"] for r in rows}
    assert fastest[peer_wins.key] == {"eager": "ours", "graph": "flash_attn_4"}
    # the search timed SDPA cuDNN (31.6 us) beside ours (30.0): ours, by GPU time (no host times for this GPU)
    assert fastest[_entry("current", 1024).key] == {"eager": "ours", "graph": "ours"}
    table = invoke("best", env={"FA4_CONFIG_DB": str(mine)})
    assert "user (over packaged)" in table.stdout and f"user {mine}: 3 entries" in table.stderr
    (tmp_path / "bad.json").write_text("{")
    broken = CliRunner().invoke(cli.main, ["best"],
                                env={"FA4_CONFIG_DB": str(tmp_path / "bad.json"), "COLUMNS": "240"})
    assert broken.exit_code == 1 and "UNUSABLE" in broken.stderr and "packaged" in broken.stdout


def test_db_merge_keeps_the_fastest_current_entry(tmp_path, monkeypatch):
    from fa4tune import environment

    monkeypatch.setattr(environment, "kernel_fingerprint", lambda arch, api="fa4.kernels": "current")
    a, b, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "out.json"
    record(_entry("current", 1024), a)
    faster = _entry("current", 1024)
    record(Entry(**{**{f: getattr(faster, f) for f in faster.__dataclass_fields__}, "us": 20.0}), b)
    stale_but_fast = _entry("old", 4096)
    record(Entry(**{**{f: getattr(stale_but_fast, f) for f in stale_but_fast.__dataclass_fields__}, "us": 1.0}), b)
    record(_entry("current", 4096), a)
    result = CliRunner().invoke(cli.main, ["db", "merge", str(a), str(b), "-o", str(out)])
    assert result.exit_code == 0, result.output
    merged = {e.seqlen_q_bucket: (e.us, e.kernel_fingerprint) for e in BestConfigDB.load(out).entries}
    assert merged == {1024: (20.0, "current"), 4096: (30.0, "current")}
    assert f"{a}: 2 entries, 1 kept" in result.stderr and "wrote" in result.stderr
    # the default output is the user's database
    result = CliRunner().invoke(cli.main, ["db", "merge", str(a)], env={"FA4_CONFIG_DB": str(tmp_path / "u.json")})
    assert result.exit_code == 0 and len(BestConfigDB.load(tmp_path / "u.json")) == 2
    missing = CliRunner().invoke(cli.main, ["db", "merge", str(tmp_path / "none.json")])
    assert missing.exit_code == 1 and "no such database" in missing.output


def _bench_with_fakes(monkeypatch, processes: int) -> None:
    """`fa4tune bench` on a fake GPU: the fake evaluator and kernel API in `processes` workers."""
    monkeypatch.setattr(cli, "detect_gpus", lambda: list(FAKE_GPU))
    real = bench_mod.run_bench
    monkeypatch.setattr(bench_mod, "run_bench",
                        lambda *a, **kw: real(*a, **{**kw, "evaluator": EVALUATOR, "api": "test_search_fakes",
                                                    "processes": processes}))


def test_bench_writes_json_and_csv(tmp_path, monkeypatch):
    _bench_with_fakes(monkeypatch, processes=2)
    monkeypatch.setattr(bench_mod, "kernel_fingerprint", lambda arch, api="fa4.kernels": "fake-fingerprint-1")
    db = tmp_path / "db.json"
    record(replace(_entry("fake-fingerprint-1", 1024),
                   config=Config.make("sm90", tile_n=112, scheduler="lpt", kv_stages=3).to_dict()), db)
    out, csv_path = tmp_path / "bench.json", tmp_path / "bench.csv"
    result = invoke("bench", "--shapes", "sq1024-causal, s2048", "--no-causal", "--db", str(db),
                    "--out", str(out), "--csv", str(csv_path), "--rounds", "3")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(out.read_text())
    # every row timed in three rounds, said in the header lines
    assert doc["timing"]["rounds"] == 3 and all(len(r["us_rounds"]) == 3 for r in doc["rows"] if r["us"])
    assert "2 shape(s), 3 rounds" in result.stderr and "lowest of 3 rounds per row" in result.stdout
    shapes = sorted({r["shape"] for r in doc["rows"]})
    assert shapes == ["sm90-fp16-b1-hq32-hkv8-d128-sq1024-sk1024-causal",
                      "sm90-fp16-b1-hq32-hkv8-d128-sq2048-sk2048-full"]
    causal = {r["variant"]: r for r in doc["rows"] if r["shape"].endswith("causal")}
    assert causal["tuned"]["lookup"] == "exact" and causal["tuned"]["outcome"] == "ok"
    assert causal["tuned"]["us"] == fakes.fake_us(Config.make("sm90", tile_n=112, scheduler="lpt", kv_stages=3).to_dict())
    assert causal["default"]["speedup_of_tuned"] == round(causal["default"]["us"] / causal["tuned"]["us"], 3)
    assert causal["sdpa_cudnn"]["us"] == 31.6 and causal["flash_attn_4"]["outcome"] != "ok"
    full = {r["variant"]: r for r in doc["rows"] if r["shape"].endswith("full")}
    assert full["tuned"]["outcome"] == "missing" and full["tuned"]["lookup"] == "default"
    assert doc["timing"]["method"] == "cuda_graph" and doc["device"]["name"] == "Fake H200"
    # dispatch from this run's times (fa4.dispatch): no host time was measured on a "Fake H200", so
    # eager calls are judged by GPU time too; ours (the tuned row, else the default) against the peers
    picked = doc["dispatch"]
    assert set(picked) == set(shapes)
    for shape in shapes:
        assert picked[shape]["graph"] == picked[shape]["eager"]
    assert picked[shapes[0]]["graph"]["backend"] == "ours"  # tuned 30.5 us, SDPA cuDNN 31.6
    assert "than SDPA cuDNN (31.6 us)" in picked[shapes[0]]["graph"]["reason"]
    assert "fastest backend per shape" in result.stdout
    # what fa4.attention ran, beside the implementations (the fake evaluator's dispatched row)
    assert causal["dispatched"]["backend"] == {"eager": "ours", "graph": "ours"}
    assert "eager: ran" in result.stdout and "31.00" in result.stdout
    # the dispatch bar (within 2 %) per mode, against the fastest measured in this run: the fake's non-causal shape
    # costs 33.5 us per eager call against ours' 31.0 (1.081x), though its GPU time is the fastest
    assert causal["sdpa_cudnn"]["eager_us"] == 32.4 and causal["tuned"]["eager_us"] == 31.0
    assert "eager: fastest measured" in result.stdout and "1.081x MISS" in result.stdout
    assert ("fa4.attention within 2% of the fastest measured in this run: captured 2 of 2 shapes, "
            "eager 1 of 2 shapes") in result.stdout
    lines = csv_path.read_text().splitlines()
    assert lines[0].startswith("shape,variant,outcome,us") and len(lines) == 1 + len(doc["rows"])


def test_a_default_that_does_not_validate_fails_the_command(tmp_path, fake_gpu, monkeypatch):
    from fa4tune.workers.worker import INJECT_ENV

    default = Config.make("sm90")
    monkeypatch.setenv(INJECT_ENV, ",".join(["mismatch@" + ",".join(f"{k}={v}" for k, v in default.to_dict().items())]))
    result = invoke("search", "--causal", "--trials", "4", "--storage", str(tmp_path / "s.journal"), "--no-db",
                    "--format", "json")
    [summary] = json.loads(result.stdout)
    assert summary["default_us"] is None and summary["best"] is not None   # others still worked
    assert result.exit_code == 1 and "default configuration did not run correctly" in result.stderr


def test_help_version_and_verbosity(fake_compiles):
    for args in (["-h"], ["search", "-h"], ["compile-space", "-h"], ["bench", "-h"], ["best", "-h"], ["report", "-h"],
                 ["db", "-h"], ["db", "merge", "-h"], ["db", "import-bench", "-h"]):
        result = invoke(*args)
        assert result.exit_code == 0 and "Usage:" in result.stdout, args
    version = invoke("--version")
    assert version.exit_code == 0 and "fa4tune, version" in version.stdout
    # the same option names everywhere
    for command in ("search", "compile-space", "bench"):
        text = invoke(command, "-h").stdout
        for option in ("--heads", "--gqa", "--heads-kv", "--causal", "--no-causal", "--both", "--arch", "--jobs",
                       "--format", "--lse"):
            assert option in text, (command, option)
    for command in ("search", "bench", "best", "report"):
        assert "--db" in invoke(command, "-h").stdout, command
    normal = invoke("compile-space", "--causal", "--limit", "2")
    quiet = invoke("-q", "compile-space", "--causal", "--limit", "2")
    verbose = invoke("-v", "compile-space", "--causal", "--limit", "2")
    assert "fa4tune compile-space:" in normal.stderr and "fa4tune compile-space:" not in quiet.stderr
    assert "exit status" in quiet.stderr                        # the summary is the result, not progress
    assert verbose.stderr.count("compiled 1/2") == 1 and "compiled 1/2" not in normal.stderr
    assert invoke("-q", "-v", "best").exit_code == 2


# ------------------------------------------------------------------------------------------------
# options that contradict each other; outputs that cannot be written

CONTRADICTIONS = [
    (["search", "--causal", "--no-causal"], ("--causal", "--no-causal")),
    (["bench", "--no-causal", "--both"], ("--no-causal", "--both")),
    (["compile-space", "--both", "--causal"], ("--both", "--causal")),
    (["search", "--peers", "--no-peers"], ("--peers", "--no-peers")),
    (["bench", "--no-peers", "--peers"], ("--no-peers", "--peers")),
    (["search", "--warm-start", "--cold-start"], ("--warm-start", "--cold-start")),
    (["search", "--seqlen", "1024", "--seqlen=2048"], ("--seqlen 1024", "--seqlen 2048")),
    (["search", "--gqa", "4", "--heads-kv", "8"], ("--gqa", "--heads-kv")),
    (["search", "--db", "x.json", "--no-db"], ("--db", "--no-db")),
    (["bench", "--shapes", "s1024", "--shapes-file", "x.toml"], ("--shapes", "--shapes-file")),
    (["db", "merge", "a.json", "-o", "x.json", "-oy.json"], ("-o x.json", "-o y.json")),
    (["report", "--db", "a.json", "--database", "b.json"], ("--db a.json", "--database b.json")),
    (["sass", "--peer", "--no-peer"], ("--peer", "--no-peer")),   # defined in another module: checked too
    (["search", "--effort", "quick", "--trials", "7"], ("--effort", "--trials")),
    (["search", "--shapes-file", "x.toml", "--model", "llama-3-8b"], ("--shapes-file", "--model")),
    (["bench", "--shapes", "s1024", "--model", "llama-3-8b"], ("--shapes", "--model")),
    (["search", "--heads-kv", "8", "--gqa", "4"], ("--heads-kv", "--gqa")),
    (["rescale-stats", "--causal", "--both"], ("--causal", "--both")),
    (["report", "--out", "a.html", "--out", "b.html"], ("--out a.html", "--out b.html")),
    # a mode that makes other options do nothing (IGNORED_WITH)
    *[(["search", "--compile-only", *option], (option[0], "--compile-only"))
      for option in (["--sampler", "random"], ["--timeout", "5"], ["--trial-timeout", "5"], ["--storage", "s.journal"],
                     ["--study", "x"], ["--workers", "2"], ["--db", "x.json"], ["--no-db"], ["--l2", "flushed"],
                     ["--peers"], ["--no-peers"], ["--warm-start"], ["--cold-start"], ["--retime", "0"])],
    *[(["rescale-stats", "--show", *option], (option[0], "--show"))
      for option in (["--seqlen", "512"], ["--threshold", "8"], ["--kind", "normal"], ["--causal"], ["--no-causal"],
                     ["--both"], ["--heads", "8"], ["--heads-kv", "8"], ["--head-dim", "64"], ["--dtype", "bf16"],
                     ["--format", "json"], ["--out", "x.json"])],
    # an option that does something only with another (NEEDS)
    (["compile-space", "--seed", "3"], ("--seed", "--limit")),
    (["report", "--screenshot-size", "800x600"], ("--screenshot-size", "--screenshot")),
]


@pytest.mark.parametrize("args, named", CONTRADICTIONS, ids=[" ".join(a) for a, _ in CONTRADICTIONS])
def test_contradicting_options_are_refused(args, named, monkeypatch):
    """Click keeps the last of two flags of one setting silently; each command refuses them instead,
    naming both, before it does anything."""
    monkeypatch.setattr(cli, "detect_gpus", lambda: pytest.fail("the command ran"))
    result = CliRunner().invoke(cli.main, args)
    assert result.exit_code == 2, result.output
    error = result.stderr.strip().splitlines()[-1]
    assert all(option in error for option in named), error


def test_the_modes_and_needs_allow_what_they_should(monkeypatch):
    """The rules refuse only what does nothing: --compile-only keeps its own options, --seed with
    --limit and --screenshot-size with --screenshot pass the check."""
    from click import Context

    for command, args in ((cli.search, ["--compile-only", "--trials", "4", "--jobs", "2", "--seed", "1",
                                        "--format", "json", "--space", "s.toml", "--causal"]),
                          (cli.main.commands["compile-space"], ["--seed", "3", "--limit", "4"]),
                          (cli.main.commands["report"], ["--screenshot", "a.png", "--screenshot-size", "800x600"]),
                          (cli.main.commands["rescale-stats"], ["--show"])):
        cli.refuse_contradictions(Context(command, info_name=command.name), args)


def _every_command(group, path=()):
    yield list(path)
    for name, command in getattr(group, "commands", {}).items():
        yield from _every_command(command, path + (name,))


@pytest.mark.parametrize("path", list(_every_command(cli.main)), ids=lambda p: " ".join(p) or "fa4tune")
@pytest.mark.parametrize("columns", ["80", "200"])
def test_every_help_fits_80_columns(path, columns):
    """In an 80-column terminal and in a wide one (click sizes help by $COLUMNS, at most 80)."""
    result = CliRunner().invoke(cli.main, path + ["--help"], env={"COLUMNS": columns})
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines and max(len(line) for line in lines) <= 80, [line for line in lines if len(line) > 80]


def test_options_given_twice_alike_and_help_still_work():
    from click import Context

    ctx = Context(cli.search, info_name="search")
    cli.refuse_contradictions(ctx, ["--causal", "--causal", "--seqlen", "2048", "--seqlen=2048",
                                                "--no-peers", "--no-peers", "--storage", "--causal"])
    cli.refuse_contradictions(ctx, ["--study", "x", "--", "--causal", "--no-causal"])
    help_text = invoke("search", "--causal", "--no-causal", "-h")
    assert help_text.exit_code == 0 and "Usage:" in help_text.stdout


def _one_line_error(result, *words):
    """A ClickException: exit 1, its one line last on stderr naming the problem, no traceback."""
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), repr(result.exception)
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("Error: ") and "Traceback" not in result.output, result.output
    assert all(word in error for word in words), error


@pytest.fixture
def not_a_folder(tmp_path):
    """A path whose folder is a file: no one can write there, root included."""
    (tmp_path / "a-file").write_text("mine\n")
    return tmp_path / "a-file" / "out.json"


@pytest.mark.parametrize("option", ["--out", "--csv"])
def test_bench_refuses_an_output_it_cannot_write_before_it_runs(tmp_path, monkeypatch, not_a_folder, option):
    monkeypatch.setattr(cli, "detect_gpus", lambda: list(FAKE_GPU))
    monkeypatch.setattr(bench_mod, "run_bench", lambda *a, **kw: pytest.fail("the bench ran"))
    outputs = {"--out": str(tmp_path / "b.json"), "--csv": str(tmp_path / "b.csv"), option: str(not_a_folder)}
    result = CliRunner().invoke(cli.main, ["bench", "--causal", *[a for o, p in outputs.items() for a in (o, p)]])
    _one_line_error(result, option, "a-file", "not a directory")
    result = CliRunner().invoke(cli.main, ["bench", "--causal", option, str(tmp_path)])
    assert result.exit_code != 0 and "is a directory" in result.output.lower()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_compile_space_refuses_an_output_it_cannot_write_before_it_compiles(fake_compiles, monkeypatch, not_a_folder):
    from fa4tune.searches import compile_space

    monkeypatch.setattr(compile_space, "run", lambda *a, **kw: pytest.fail("it compiled"))
    _one_line_error(CliRunner().invoke(cli.main, ["compile-space", "--causal", "--limit", "1", "--out",
                                                  str(not_a_folder)]), "--out", "not a directory")
    _one_line_error(CliRunner().invoke(cli.main, ["compile-space", "--causal", "--limit", "1", "--out",
                                                  str(not_a_folder.parent.parent)]), "--out", "is a directory")


def test_compile_space_write_that_fails_anyway_is_one_line(fake_compiles, monkeypatch, tmp_path):
    import errno

    from fa4tune.searches import compile_space

    def full_disk(results, path):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(compile_space, "write_json", full_disk)
    _one_line_error(CliRunner().invoke(cli.main, ["compile-space", "--causal", "--limit", "1", "--out",
                                                  str(tmp_path / "c.json")]), "No space left on device", "c.json")


@pytest.mark.parametrize("option", ["--storage", "--db"])
def test_search_refuses_an_output_it_cannot_write_before_it_runs(tmp_path, monkeypatch, not_a_folder, option):
    monkeypatch.setattr(cli, "detect_gpus", lambda: list(FAKE_GPU))
    monkeypatch.setattr(search_mod, "run_search", lambda *a, **kw: pytest.fail("the search ran"))
    outputs = {"--storage": str(tmp_path / "s.journal"), "--db": str(tmp_path / "db.json"), option: str(not_a_folder)}
    result = CliRunner().invoke(cli.main, ["search", "--causal", *[a for o, p in outputs.items() for a in (o, p)]])
    _one_line_error(result, option, "a-file", "not a directory")
    url = f"sqlite:///{not_a_folder}"
    _one_line_error(CliRunner().invoke(cli.main, ["search", "--causal", "--storage", url, "--no-db"]),
                    "--storage", "not a directory")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_a_command_that_fails_on_a_file_ends_with_one_line(monkeypatch):
    """Any command (here `cache clear`, which has no handling of its own): an OSError is one line
    naming the file, not a traceback."""
    from fa4 import compile_cache

    def refused():
        raise PermissionError(13, "Permission denied", "/srv/shared/kernels/ab12.so")

    monkeypatch.setattr(compile_cache, "clear", refused)
    _one_line_error(CliRunner().invoke(cli.main, ["cache", "clear"]), "/srv/shared/kernels/ab12.so",
                    "Permission denied")


@pytest.mark.parametrize("command", [["sass", "--out"], ["rescale-stats", "--out"]])
def test_commands_of_other_modules_refuse_an_output_they_cannot_write_first(command, not_a_folder, monkeypatch):
    from fa4tune.sm100 import rescale_stats, sass_build

    monkeypatch.setattr(sass_build, "analyze", lambda *a, **kw: pytest.fail("it compiled"))
    monkeypatch.setattr(rescale_stats, "measure_rescales", lambda *a, **kw: pytest.fail("it measured"))
    _one_line_error(CliRunner().invoke(cli.main, [*command, str(not_a_folder)]), command[1], "not a directory")


def test_tables_fit_the_terminal(tmp_path):
    db = tmp_path / "db.json"
    record(_entry("old", 2048), db)
    table = invoke("best", "--db", str(db), env={"COLUMNS": "80"}).stdout
    assert max(len(line) for line in table.splitlines()) <= 80


def test_effort_presets_set_the_trials_and_refuse_a_second_count(monkeypatch):
    from fa4tune.searches.runner import EFFORTS

    seen = {}

    def fake_run(problems, **kw):
        seen["trials"] = kw["trials"]
        return []

    monkeypatch.setattr(cli, "detect_gpus", lambda: [{"name": "NVIDIA H200"}])
    monkeypatch.setattr("fa4tune.api.run_search_set", fake_run)
    for effort, expected in (("quick", 10), (None, EFFORTS["default"]), ("full", 100)):
        args = ["search", "--causal", "--no-db"] + (["--effort", effort] if effort else [])
        invoke(*args)
        assert seen["trials"] == expected
    invoke("search", "--causal", "--no-db", "--trials", "7")
    assert seen["trials"] == 7
    refused = CliRunner().invoke(cli.main, ["search", "--effort", "quick", "--trials", "7"])
    assert refused.exit_code == 2 and "give --effort or --trials, not both" in refused.output


def test_bench_backward_prints_the_training_table(tmp_path, monkeypatch):
    _bench_with_fakes(monkeypatch, processes=1)
    out = tmp_path / "bench.json"
    result = invoke("bench", "--shapes", "sq512-causal", "--db", str(tmp_path / "db.json"), "--out", str(out),
                    "--rounds", "1", "--backward")
    assert result.exit_code == 0, result.stderr
    assert "training pass" in result.stdout and "fa4.attention" in result.stdout
    # the fakes: fa4.attention 100 / 70 us, cuDNN 90 / 60, FA2 cannot train
    assert ("backward at most 1.00 on 0 of 1 shapes (of 1), geometric mean 1.167, worst 1.167; forward + backward "
            "at most 1.00 on 0 of 1 shapes (of 1), geometric mean 1.111") in result.stdout
    rows = json.loads(out.read_text())["training_rows"]
    assert {r["implementation"] for r in rows} >= {"fa4", "sdpa_cudnn"}


# ------------------------------------------------------------------------------------------------
# sliding windows and softcaps on the command line

WINDOW_CASES = [   # (options, the shapes-file table's lines with the same values)
    (["--batch", "2", "--seqlen", "8192", "--dtype", "bf16", "--window", "4095,0", "--softcap", "50"],
     "batch = 2\nseqlen = 8192\ndtype = \"bf16\"\nwindow = [4095, 0]\nsoftcap = 50.0"),
    (["--seqlen", "1024", "--window", "255,7"], "batch = 1\nseqlen = 1024\nwindow = [255, 7]"),
    (["--seqlen", "1024", "--window=-1,7", "--softcap", "2.5"],
     "batch = 1\nseqlen = 1024\nwindow = [-1, 7]\nsoftcap = 2.5"),
    (["--causal", "--seqlen", "512", "--seqlen-k", "2048", "--window", "100,7"],
     "batch = 1\nseqlen_q = 512\nseqlen_k = 2048\ncausal = true\nwindow = [100, 7]"),
    (["--seqlen", "1024", "--window", "4095,0"], "batch = 1\nseqlen = 1024\nwindow = [4095, 0]"),  # wider: none
    (["--no-causal", "--seqlen", "1024", "--softcap", "30"], "batch = 1\nseqlen = 1024\ncausal = false\nsoftcap = 30.0"),
]


@pytest.fixture
def captured_problems(monkeypatch):
    """The problems each command would run: search, bench and compile-space stop where they would start."""
    from fa4tune import api

    seen = []

    def search_set(problems, **kw):
        seen.append(problems)
        return []

    def bench_set(problems, **kw):
        seen.append(problems)
        raise api.NoGpuError("stopped by the test")

    monkeypatch.setattr(api, "run_search_set", search_set)
    monkeypatch.setattr(api, "run_bench_set", bench_set)
    monkeypatch.setattr(cli, "_run_compile_space", lambda arch, problems, *a: seen.append(problems))
    monkeypatch.setattr(cli, "detect_gpus", lambda: [])
    return seen


@pytest.mark.parametrize("options, table", WINDOW_CASES, ids=[" ".join(o) for o, _ in WINDOW_CASES])
def test_window_and_softcap_options_build_the_problems_of_a_shapes_file_table(options, table, captured_problems):
    """--window and --softcap give each command the problems a [[problem]] table with the same values
    gives (both resolved by fa4.kernels.problem.resolve_mask, as fa4.attention resolves its arguments)."""
    from fa4tune.inputs.shape_sets import parse_shapes

    want = parse_shapes(f"[[problem]]\nheads_q = 32\nheads_kv = 8\nhead_dim = 128\n{table}\n")
    for command in ("search", "bench", "compile-space"):
        result = CliRunner().invoke(cli.main, [command, *options])
        assert result.exit_code in (0, 2) and "Error" not in result.output, (command, result.output)
        assert captured_problems.pop() == want, command


def test_window_options_key_studies_and_entries_as_shapes_files_do(captured_problems):
    from fa4tune.inputs.shapes import shape_key

    invoke("search", "--seqlen", "8192", "--dtype", "bf16", "--window", "4095,0", "--softcap", "50")
    [problem] = captured_problems.pop()   # a right side 0 is causal: both masks are one problem
    assert problem == AttentionProblem(1, 8192, 8192, 32, 8, 128, "bf16", True, window=(4095, 0), softcap=50.0)
    assert shape_key("sm90", problem) == "sm90-bf16-b1-hq32-hkv8-d128-sq8192-sk8192-causal-wl4095-cap50"


def test_bench_shape_keys_take_the_window_options_and_resolve_them_per_key(captured_problems):
    invoke("bench", "--dtype", "bf16", "--window", "255,0", "--softcap", "50",
           "--shapes", "s8192 s256 s1024-wl100-full s2048-cap30")
    got = [(p.seqlen_q, p.causal, p.window, p.softcap) for p in captured_problems.pop()]
    assert got == [(8192, True, (255, 0), 50.0),       # both masks of a right side 0: the causal window
                   (256, True, None, 50.0),            # the window reaches every key: none
                   (1024, False, (100, -1), 50.0),     # the key's own window
                   (2048, True, (255, 0), 30.0)]       # the key's own softcap


BAD_WINDOWS = [
    (["--window", "4095"], "not LEFT,RIGHT"),
    (["--window", "a,0"], "not LEFT,RIGHT"),
    (["--window", "4095,0,1"], "not LEFT,RIGHT"),
    (["--window", "4095,-2"], "window_size right side must be >= 0, or -1 for unbounded, got -2"),
    (["--window", "-3,0"], "window_size left side must be >= 0, or -1 for unbounded, got -3"),
    (["--window", "4294967296,0"], "past 2**31 - 1"),
    (["--softcap", "0"], "not a finite number > 0"),
    (["--softcap", "-1"], "not a finite number > 0"),
    (["--softcap", "inf"], "not a finite number > 0"),
    (["--model", "llama-3-8b", "--window", "4095,0"], "--window cannot be combined with a shape set"),
    (["--model", "llama-3-8b", "--softcap", "50"], "--softcap cannot be combined with a shape set"),
]


@pytest.mark.parametrize("args, message", BAD_WINDOWS, ids=[" ".join(a) for a, _ in BAD_WINDOWS])
def test_bad_window_or_softcap_options_are_usage_errors(args, message, captured_problems):
    for command in ("search", "bench"):
        result = CliRunner().invoke(cli.main, [command, *args])
        assert result.exit_code == 2 and message in result.stderr, (command, result.output)
    assert captured_problems == []


def test_the_help_says_the_window_convention():
    for command in ("search", "bench", "compile-space"):
        text = " ".join(invoke(command, "-h").stdout.split())
        assert "--window LEFT,RIGHT" in text and "-1 unbounded; under causal the right side is 0" in text, command
        assert "--softcap C" in text and "C > 0" in text, command


def test_the_training_bar_says_where_the_backward_was_a_peers():
    """Where fa4.attention's backward was a peer's, its ratio is that kernel against itself: the bar
    line says on how many shapes ours ran, and its backward's geometric mean there."""
    def row(problem, name, bwd, backward=None):
        return {"shape": problem.label(), "problem": problem.to_dict(), "implementation": name, "outcome": "ok",
                "fwdbwd_us": 2 * bwd, "bwd_us": bwd, "bwd_us_rounds": [bwd], "backward": backward}

    ours_ran, peer_ran = (AttentionProblem(1, s, s, 8, 2, 128, "bf16", True) for s in (1024, 2048))
    doc = {"arch": "sm90", "device": {"name": "NVIDIA H200"}, "training_rows": [
        row(ours_ran, "fa4", 90.0, backward="ours"), row(ours_ran, "flash_attn_4", 100.0),
        row(peer_ran, "fa4", 101.0, backward="flash_attn_4"), row(peer_ran, "flash_attn_4", 100.0)]}
    line = cli._training_bar(doc)
    assert "backward at most 1.00 on 1 of 2 shapes (of 2)" in line
    assert "its backward was ours on 1 of 2 shapes (backward geometric mean 0.900 there), a peer's on the others" in line
