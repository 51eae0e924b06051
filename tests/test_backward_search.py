"""`fa4tune search --backward` on CPU: the real kernel API (the sm90_bwd knob set, its feasibility model,
default and fingerprint) with the fake evaluator of tests/test_search_fakes.py in real worker processes;
the database's backward entries beside forward ones."""

from __future__ import annotations

import json
import math

import optuna
import pytest

import test_search_fakes as fakes
from fa4 import kernels
from fa4.database import BestConfigDB, Entry, entry_key, record
from fa4.kernels import AttentionProblem, Config, knobs_for
from fa4tune.progress import Progress
from fa4tune.searches.runner import SearchSettings, run_search
from fa4tune.searches.storage import open_storage
from fa4tune.searches.trial_loop import peers_backward
from fa4tune.workers.worker import INJECT_ENV

PROBLEM = AttentionProblem(2, 1024, 1024, 16, 4, 128, "bf16", causal=True)
QUIET = Progress(quiet=True)


def settings(tmp_path, **kw) -> SearchSettings:
    base = dict(trials=300, sampler="grid", processes=2, storage=str(tmp_path / "studies.journal"),
                db_path=str(tmp_path / "db.json"), evaluator="test_search_fakes:FakeBackwardEvaluator",
                kernel_api="fa4.kernels", trial_timeout_s=3, seed=1, peers=("sdpa_cudnn", "flash_attn_4"),
                retime_rounds=0)
    base.update(kw)
    return SearchSettings(**base)


def test_kernel_api_answers_for_the_backward_knob_set():
    default = kernels.default_config("sm90_bwd", PROBLEM)
    # the timed choices, and the grid model's split (64 CTAs unsplit at B2 S1024 H16/4)
    assert default == Config.make("sm90_bwd", tile_m=80, dq_accum="bulk", sdp_swap=True, pds_stages=2,
                                  scheduler="sectioned_lpt", group_split=4)
    assert kernels.feasible(default, PROBLEM) == []
    assert kernels.feasible(default.replace(sdp_swap=True, tile_n=64), PROBLEM)   # the model's own rule
    assert kernels.compile_key(default, PROBLEM)[0] == "sm90_bwd"
    assert kernels.arch_of("sm90_bwd") == "sm90" and kernels.arch_of("sm100") == "sm100"
    assert kernels.backward_knob_set("sm90") == "sm90_bwd"
    with pytest.raises(ValueError, match="no backward kernel of ours runs on sm100"):
        kernels.backward_knob_set("sm100")
    # the backward's fingerprint is its own: an edit of its folder leaves the forward's tunings current
    assert kernels.source_fingerprint("sm90_bwd") not in (kernels.source_fingerprint("sm90"),
                                                            kernels.source_fingerprint("sm100"))


def test_the_backward_fingerprint_covers_what_its_kernel_borrows(tmp_path, monkeypatch):
    import re
    from pathlib import Path

    folder = Path(kernels.__file__).parent / "sm90_bwd"
    borrowed = {f"../{family}/{module.strip()}.py"
                for path in folder.glob("*.py")
                for family, modules in re.findall(r"from \.\.(sm\d+\w*) import ([\w, ]+)", path.read_text())
                for module in re.sub(r" as \w+", "", modules).split(",")}
    assert borrowed and borrowed <= set(kernels.BACKWARD_BORROWED_FILES["sm90_bwd"])
    # an edit of a borrowed file changes the backward's fingerprint
    before = kernels.source_fingerprint("sm90_bwd")
    real_read = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda self: real_read(self) + (b"#" if self.name == "layouts.py" else b""))
    assert kernels.source_fingerprint("sm90_bwd") != before


def test_backward_search_records_failures_and_the_best_under_its_own_key(tmp_path, monkeypatch):
    # one configuration faults, one hangs (killed after the trial timeout); the search goes on
    monkeypatch.setenv(INJECT_ENV, "fault@tile_m=64,tile_n=128,q_stages=2,dq_accum=bulk,sdp_swap=False,"
                                   "scheduler=single,pds_stages=1,group_split=1;"
                                   "timeout@tile_m=64,tile_n=64,q_stages=2,dq_accum=atomic,sdp_swap=False,"
                                   "scheduler=single,pds_stages=1,group_split=1")
    # trials: more than the space's feasible configurations at PROBLEM (600), so the grid covers it all
    [summary] = run_search("sm90_bwd", [PROBLEM], settings(tmp_path, retime_rounds=1, trials=620), QUIET)
    assert summary["retime"]["winner_us"] == summary["best"]["us"]   # the finalists re-timed as backward trials
    study = optuna.load_study(study_name=summary["study"], storage=open_storage(tmp_path / "studies.journal"))
    assert summary["study"].startswith("sm90_bwd-") and study.user_attrs["arch"] == "sm90_bwd"
    outcomes, configs = {}, {}
    for t in study.trials:
        if "repeat_of" not in t.user_attrs:
            config = Config.from_dict("sm90_bwd", t.params)
            outcomes[config.label()], configs[config.label()] = t.user_attrs["outcome"], config
    # the whole space (every declared value of every knob): every configuration judged, run or refused
    assert len(outcomes) == math.prod(len(k.choices) for k in knobs_for("sm90_bwd"))
    for label, outcome in outcomes.items():   # every refusal is the feasibility model's, and only those
        assert (outcome == "infeasible") == bool(kernels.feasible(configs[label], PROBLEM)), label
    fault = "tile_m=64 tile_n=128 q_stages=2 dq_accum=bulk sdp_swap=off scheduler=single pds_stages=1 group_split=1"
    hang = "tile_m=64 tile_n=64 q_stages=2 dq_accum=atomic sdp_swap=off scheduler=single pds_stages=1 group_split=1"
    assert outcomes[fault] == "fault" and outcomes[hang] == "timeout"
    assert "SIGSEGV" in next(t for t in study.trials if configs.get(Config.from_dict(
        "sm90_bwd", t.params).label()) and Config.from_dict("sm90_bwd", t.params).label() == fault).user_attrs["error"]
    compile_failures = [label for label, outcome in outcomes.items()
                        if "tile_m=128" in label and "q_stages=1" in label and outcome != "infeasible"]
    assert compile_failures and all(outcomes[label] == "compile_error" for label in compile_failures)
    # the peers' backward alone, from the training task
    assert study.user_attrs["peers"]["sdpa_cudnn"]["us"] == 60.0
    assert "error" in study.user_attrs["peers"]["flash_attn_4"]
    best = summary["best"]
    assert best["config"]["sdp_swap"] is True and best["config"]["dq_accum"] == "bulk"
    assert best["us"] == min(fakes.fake_bwd_us(Config.from_dict("sm90_bwd", t.params).to_dict(), True)
                             for t in study.trials if t.user_attrs.get("outcome") == "ok")
    assert summary["default_us"] == fakes.fake_bwd_us(kernels.default_config("sm90_bwd", PROBLEM).to_dict(), True)

    db = BestConfigDB.load(tmp_path / "db.json")
    [entry] = db.entries
    assert entry.key == entry_key("sm90_bwd", "Fake H200", PROBLEM) and entry.key.startswith("sm90_bwd|")
    assert entry.config == best["config"] and entry.us == best["us"]
    assert entry.backend_us == {"ours": best["us"], "sdpa_cudnn": 60.0}
    assert entry.kernel_fingerprint == kernels.kernel_fingerprint("sm90_bwd")
    # a forward lookup never sees it; a backward lookup does
    assert db.lookup("sm90", "Fake H200", PROBLEM).kind == "default"
    assert db.lookup("sm90_bwd", "Fake H200", PROBLEM).entry == entry


def _entry(arch: str, config: dict, us: float, problem=PROBLEM, fingerprint="fp", peer_us: float = 50.0) -> Entry:
    return Entry.from_result(arch=arch, device="NVIDIA H200", problem=problem, config=config, us=us, tflops=1.0,
                             default_us=us * 2, peers_us={"flash_attn_4": peer_us}, max_err=0.001,
                             kernel_fingerprint=fingerprint, versions={}, study="s", trial=0)


def test_forward_and_backward_entries_share_a_file_never_a_lookup(tmp_path):
    path = tmp_path / "db.json"
    forward = _entry("sm90", Config.make("sm90").to_dict(), 30.0)
    backward = _entry("sm90_bwd", Config.make("sm90_bwd", sdp_swap=True).to_dict(), 40.0)
    assert record(forward, path) and record(backward, path)
    db = BestConfigDB.load(path)
    assert {e.key for e in db.entries} == {forward.key, backward.key} and not db.skipped
    assert forward.key.split("|", 1)[1] == backward.key.split("|", 1)[1]   # the same bucket, two passes
    for arch, want in (("sm90", forward), ("sm90_bwd", backward)):
        for problem in (PROBLEM, AttentionProblem(2, 2048, 2048, 16, 4, 128, "bf16", causal=True)):
            found = db.lookup(arch, "NVIDIA H200", problem, "fp")
            assert found.entry is not None and found.entry.arch == arch and found.entry.key == want.key
    # stale by the backward's own fingerprint only
    assert db.stale_entries({"sm90_bwd": "new"}) == [db.get(backward.key)]
    assert sorted(e["arch"] for e in json.loads(path.read_text())["entries"]) == ["sm90", "sm90_bwd"]


def test_a_backward_entry_with_a_forward_knob_is_skipped(tmp_path):
    path = tmp_path / "db.json"
    bad = _entry("sm90_bwd", Config.make("sm90_bwd").to_dict(), 40.0).to_dict()
    bad["config"] = Config.make("sm90").to_dict()
    path.write_text(json.dumps({"schema": 2, "entries": [bad]}))
    db = BestConfigDB.load(path)
    problems = db.unusable_entries()
    assert any("configuration" in reason for reasons in problems.values() for reason in reasons)


def test_peers_backward_reads_the_training_task():
    got = peers_backward({"sdpa_cudnn": {"fwdbwd_us": 90.0, "bwd_us": 60.0, "validated": True},
                          "sdpa_flash": {"error": "refused"}})
    assert got == {"sdpa_cudnn": {"us": 60.0, "fwdbwd_us": 90.0, "validated": True},
                   "sdpa_flash": {"error": "refused"}}
    assert peers_backward(None) == {}


# ---- the runtime: fa4.backward reads the backward entries ---------------------------------------

class _Peer:
    name, title = "flash_attn_4", "flash-attn-4"

    @staticmethod
    def backward_unsupported(q):
        return None


@pytest.fixture
def runtime(tmp_path, monkeypatch):
    """fa4.backward as on an H200 with flash-attn-4's backward, reading a database of this test's."""
    import fa4
    from fa4 import backward

    monkeypatch.delenv(backward.ENV_VAR, raising=False)
    monkeypatch.setattr(backward, "peers_with_backward", lambda: (_Peer(),))
    monkeypatch.setattr(backward, "ours_unsupported", lambda q, window=None, softcap=None: None)
    monkeypatch.setattr(backward, "_device_name", lambda q: "NVIDIA H200")
    path = tmp_path / "db.json"

    def use(*entries):
        path.unlink(missing_ok=True)
        for entry in entries:
            record(entry, path)
        fa4.use_config_db(path)
        return backward

    yield use
    fa4.use_config_db(None)


def _inputs(seqlen: int):
    import torch

    q = torch.empty(2, seqlen, 16, 128, dtype=torch.bfloat16)
    return q, torch.empty(2, seqlen, 4, 128, dtype=torch.bfloat16)


def _timed(ours_us: float, peer_us: float, problem=PROBLEM, fingerprint=None, **knobs) -> Entry:
    entry = _entry("sm90_bwd", Config.make("sm90_bwd", **knobs).to_dict(), ours_us, problem,
                   fingerprint or kernels.kernel_fingerprint("sm90_bwd"), peer_us)
    assert entry.backend_us == {"ours": ours_us, "flash_attn_4": peer_us}
    return entry


def test_runtime_runs_the_tuned_configuration_and_picks_ours_where_measured_faster(runtime):
    backward = runtime(_timed(40.0, 50.0, sdp_swap=True, dq_accum="bulk"))
    q, k = _inputs(1024)
    config, source, entry = backward.tuned(q, k, True)
    assert config == Config.make("sm90_bwd", sdp_swap=True, dq_accum="bulk") and source == "exact"
    implementation, why = backward.choose(q, k=k, causal=True)
    assert implementation == "ours"
    assert f"configuration {config.label()}: tuned, exact entry {entry.key}" in why
    assert "measured faster than flash-attn-4's backward there, 40 us against 50 us" in why
    # a neighbour within the forward's distance rule lends its configuration and its verdict
    q2, k2 = _inputs(2048)
    assert backward.tuned(q2, k2, True)[:2] == (config, "nearest")
    assert backward.choose(q2, k=k2, causal=True)[0] == "ours"
    # the other mask has no entry: the default, and the peer
    full = AttentionProblem(2, 1024, 1024, 16, 4, 128, "bf16", causal=False)
    assert backward.tuned(q, k, False) == (kernels.default_config("sm90_bwd", full), "default", None)
    assert backward.choose(q, k=k, causal=False)[0] == "flash_attn_4"
    # without the shape (older callers) nothing is read: the peer, as before
    assert backward.choose(q)[0] == "flash_attn_4"


def test_runtime_keeps_the_peer_where_it_measured_faster_and_ignores_stale_entries(runtime):
    backward = runtime(_timed(60.0, 50.0, sdp_swap=True))
    q, k = _inputs(1024)
    assert backward.tuned(q, k, True)[1] == "exact"   # ours runs it where ours is forced or the peer cannot
    assert backward.choose(q, k=k, causal=True) == (
        "flash_attn_4", "flash-attn-4's backward kernels (the fastest measured; $FA4_BACKWARD picks another)")
    backward = runtime(_timed(40.0, 50.0, fingerprint="edited-since", sdp_swap=True))
    assert backward.tuned(q, k, True) == (kernels.default_config("sm90_bwd", PROBLEM), "default", None)
    assert backward.choose(q, k=k, causal=True)[0] == "flash_attn_4"
    # a forward entry of the same bucket is not a backward's
    backward = runtime(_entry("sm90", Config.make("sm90").to_dict(), 10.0, PROBLEM, kernels.kernel_fingerprint("sm90")))
    assert backward.tuned(q, k, True)[1] == "default"


def test_explain_names_the_backward_configuration_and_why(runtime, monkeypatch):
    import torch

    import fa4

    backward = runtime(_timed(40.0, 50.0, sdp_swap=True, dq_accum="bulk"))
    q, k = _inputs(1024)
    text = str(fa4.explain(q, k, torch.empty_like(k), causal=True))
    line = next(line for line in text.splitlines() if "backward (inputs that require grad)" in line)
    assert "ours (our sm90 backward kernels, configuration tile_m=64 tile_n=128" in line
    assert "sdp_swap=on" in line and "tuned, exact entry sm90_bwd|NVIDIA H200|" in line and "40 us against 50 us" in line
    monkeypatch.setenv(backward.ENV_VAR, "ours")
    assert backward.choose(q, k=k, causal=True)[1].startswith("$FA4_BACKWARD=ours; configuration tile_m=64")


# ---- the command line ----------------------------------------------------------------------------

def test_cli_search_backward_then_best_lists_both_passes(tmp_path, monkeypatch):
    from dataclasses import replace

    from click.testing import CliRunner

    from fa4tune import cli
    from fa4tune.searches import runner as search_mod

    monkeypatch.setattr(cli, "detect_gpus", lambda: [{"index": 0, "name": "Fake H200", "cc": (9, 0)}])
    real = search_mod.run_search
    seen = []

    def run_with_fakes(arch, problems, settings, progress=None, pool=None):
        seen.append(arch)
        settings = replace(settings, evaluator="test_search_fakes:FakeBackwardEvaluator", processes=2,
                           peers=("sdpa_cudnn",))
        return real(arch, problems, settings, progress, pool)

    monkeypatch.setattr(search_mod, "run_search", run_with_fakes)
    db = tmp_path / "db.json"
    record(_entry("sm90", Config.make("sm90").to_dict(), 30.0, fingerprint=kernels.kernel_fingerprint("sm90")), db)
    common = ["--batch", "2", "--heads", "16", "--gqa", "4", "--seqlen", "1024", "--dtype", "bf16", "--causal",
              "--storage", str(tmp_path / "studies.journal"), "--db", str(db)]
    run = CliRunner().invoke(cli.main, ["search", "--backward", "--trials", "6", "--retime", "0", "--format", "json",
                                        *common], env={"COLUMNS": "240"}, catch_exceptions=False)
    assert run.exit_code == 0, run.stderr
    [summary] = json.loads(run.stdout)
    assert seen == ["sm90_bwd"] and summary["arch"] == "sm90_bwd" and summary["peers"]["sdpa_cudnn"]["us"] == 60.0
    listed = CliRunner().invoke(cli.main, ["best", "--db", str(db)], env={"COLUMNS": "240"}).stdout
    rows = [line for line in listed.splitlines() if "b2-" in line or "1024" in line]
    assert "best configurations (2)" in listed
    assert any("backward" in r and "sdp_swap" in r for r in rows) and any("forward" in r for r in rows)
    as_json = json.loads(CliRunner().invoke(cli.main, ["best", "--db", str(db), "--format", "json"]).stdout)
    assert sorted(d["arch"] for d in as_json) == ["sm90", "sm90_bwd"] and not any(d["stale"] for d in as_json)
    table = CliRunner().invoke(cli.main, ["search", "--backward", "--trials", "6", "--retime", "0", *common],
                               env={"COLUMNS": "240"}, catch_exceptions=False).stdout   # resumes: nothing new
    assert f"{summary['study']}: best trial {summary['best']['trial']}: tile_m=" in table
    # db merge judges backward entries by the backward's fingerprint: a current one beats a faster stale one
    stale = tmp_path / "stale.json"
    faster = _entry("sm90_bwd", Config.make("sm90_bwd").to_dict(), 1.0, fingerprint="edited-since")
    faster = Entry.from_dict({**faster.to_dict(), "device": "Fake H200",
                              "key": faster.key.replace("NVIDIA H200", "Fake H200")})
    record(faster, stale)
    merged = CliRunner().invoke(cli.main, ["db", "merge", str(stale), "-o", str(db)])
    assert merged.exit_code == 0, merged.output
    kept = BestConfigDB.load(db).get(faster.key)
    assert kept.us == summary["best"]["us"] and kept.kernel_fingerprint == kernels.kernel_fingerprint("sm90_bwd")
    refused = CliRunner().invoke(cli.main, ["search", "--backward", "--compile-only", "--causal"])
    assert refused.exit_code == 2 and "--backward needs a GPU" in refused.output
    sm100 = CliRunner().invoke(cli.main, ["search", "--backward", "--arch", "sm100", *common])
    assert sm100.exit_code == 1 and "no backward kernel of ours runs on sm100" in sm100.output


def test_report_shows_backward_studies_beside_forward_ones(tmp_path):
    from fa4tune.report import data as rd
    from fa4tune.report import draw as report_draw

    common = dict(processes=2, storage=str(tmp_path / "studies.journal"), db_path=str(tmp_path / "best_configs.json"),
                  seed=1, retime_rounds=0, peers=("sdpa_cudnn",))
    run_search("sm90", [PROBLEM], SearchSettings(trials=4, kernel_api="test_search_fakes",
                                                  evaluator="test_search_fakes:FakeEvaluator", **common), QUIET)
    run_search("sm90_bwd", [PROBLEM], SearchSettings(trials=4, kernel_api="fa4.kernels",
                                                      evaluator="test_search_fakes:FakeBackwardEvaluator", **common),
               QUIET)
    data = rd.collect(tmp_path)
    by_arch = {s.arch: s for s in data.studies}
    assert set(by_arch) == {"sm90", "sm90_bwd"}
    assert by_arch["sm90_bwd"].fingerprint_state == "current"   # the backward's own fingerprint
    assert by_arch["sm90_bwd"].knob_names == [k.name for k in kernels.knobs_for("sm90_bwd")
                                               if k.name in by_arch["sm90_bwd"].knob_names]
    rows = {r.arch: r for r in data.shape_rows}
    assert set(rows) == {"sm90", "sm90_bwd"} and rows["sm90_bwd"].impls["sdpa_cudnn"]["us"] == 60.0
    html, _ = report_draw.render_html(data)
    assert "sm90_bwd" in html
