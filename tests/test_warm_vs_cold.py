"""benchmarks/warm_vs_cold.py: how it counts trials to 1 %, and a dry run on CPU with the fake kernel
and evaluator (tests/test_search_fakes.py) through the real search, storage and warm start."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import optuna

from fa4.kernels import AttentionProblem
from fa4tune.progress import Progress
from fa4tune.searches.runner import SearchSettings, run_search
from fa4tune.searches.storage import open_storage

TESTS = Path(__file__).resolve().parent
SCRIPT = TESTS.parent / "benchmarks" / "warm_vs_cold.py"


def load_script():
    spec = importlib.util.spec_from_file_location("warm_vs_cold", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_cold_best_run_again_counts_as_reached_though_it_timed_slower():
    # the H200 case: the cold study's best was its default at 20.95 us; the warm study ran that
    # configuration first and timed it at 21.24 us (1.4 % slower), then nothing within 1 %
    wvc = load_script()
    default, other = (("tile_n", 128),), (("tile_n", 96),)
    cold = [(20.95, default), (21.5, other)]
    warm = [(21.24, default), (21.3, other), (None, (("tile_n", 64),))]
    target = 20.95 * 1.01
    assert wvc.trials_to_reach(cold, target, budget=40) == 1
    assert wvc.trials_to_reach(warm, target, budget=40) == 41  # by time alone
    assert wvc.trials_to_reach(warm, target, budget=40, reached=wvc.reached_configs(cold, target)) == 1
    # a configuration the cold study measured outside 1 % does not count
    assert wvc.reached_configs(cold, target) == frozenset({default})
    assert wvc.trials_to_reach([(21.3, other), (21.1, default)], target, 40,
                               wvc.reached_configs(cold, target)) == 2


def test_a_dry_run_counts_warm_and_cold_trials_of_every_problem(tmp_path):
    problems = [AttentionProblem(1, 1024, 1024, 32, 8, 128, "fp16", causal=c) for c in (False, True)]
    shapes = tmp_path / "shapes.toml"
    shapes.write_text("".join(f"[[problem]]\nbatch = 1\nseqlen = 1024\nheads_q = 32\nheads_kv = 8\n"
                              f"head_dim = 128\ndtype = \"fp16\"\ncausal = {str(c).lower()}\n\n"
                              for c in (False, True)))
    fake = dict(evaluator="test_search_fakes:FakeEvaluator", kernel_api="test_search_fakes")
    cold = SearchSettings(trials=8, processes=2, storage=str(tmp_path / "cold.journal"),
                          db_path=str(tmp_path / "cold.json"), warm_start=False, retime_rounds=0,
                          trial_timeout_s=20, seed=1, peers=(), **fake)
    run_search("sm90", problems, cold, Progress(quiet=True))

    out = tmp_path / "warm_vs_cold.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, str(SCRIPT), "--shapes-file", str(shapes), "--trials", "8", "--seed", "1",
                    "--cold-storage", str(tmp_path / "cold.journal"), "--seed-db", str(tmp_path / "cold.json"),
                    "--storage", str(tmp_path / "warm.journal"), "--jobs", "2", "--out", str(out),
                    "--evaluator", fake["evaluator"], "--kernel-api", fake["kernel_api"]],
                   check=True, env=env, capture_output=True, text=True, timeout=300)
    result = json.loads(out.read_text())
    rows, summary = result["rows"], result["summary"]
    assert [r["study"].endswith("causal") for r in rows] == [False, True]
    storage = open_storage(tmp_path / "warm.journal")
    for row in rows:
        warm = optuna.load_study(study_name=row["study"] + "-warm", storage=storage)
        assert row["warm_trials"] == len([t for t in warm.trials if "repeat_of" not in t.user_attrs
                                          and t.user_attrs.get("outcome") != "infeasible"])
        assert 1 <= row["warm_to_1pct"] <= row["warm_to_1pct_by_time"] <= 9
        assert 1 <= row["cold_to_1pct"] <= 9
    assert summary["cold_to_1pct_total"] == sum(r["cold_to_1pct"] for r in rows)
    assert summary["warm_to_1pct_total"] == sum(r["warm_to_1pct"] for r in rows)
    assert summary["warm_to_1pct_by_time_total"] == sum(r["warm_to_1pct_by_time"] for r in rows)
