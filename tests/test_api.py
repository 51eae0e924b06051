"""The Python API (`fa4tune.search`, `fa4tune.bench`) on CPU: the same code path as the commands (GPU
detection replaced, the fake kernel API and evaluator injected where the CLI tests inject them)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pandas as pd
import pytest
from click.testing import CliRunner

import fa4tune
import test_search_fakes as fakes
from fa4.kernels import AttentionProblem, Config
from fa4tune import api, cli
from fa4tune.benchmark import runner as bench_runner
from fa4tune.searches import runner as search_runner

FAKE_GPU = [{"index": 0, "name": "Fake H200", "cc": (9, 0)}]
EVALUATOR = "test_search_fakes:FakeEvaluator"
BASE = AttentionProblem(1, 1024, 1024, 32, 8, 128, "fp16")


@pytest.fixture
def fakes_injected(monkeypatch):
    monkeypatch.setattr(api, "detect_gpus", lambda: list(FAKE_GPU))
    monkeypatch.setattr(cli, "detect_gpus", lambda: list(FAKE_GPU))
    real_search, real_bench = search_runner.run_search, bench_runner.run_bench

    def search_with_fakes(arch, problems, settings, progress=None, pool=None):
        settings = replace(settings, evaluator=EVALUATOR, kernel_api="test_search_fakes", processes=2)
        return real_search(arch, problems, settings, progress, pool)

    monkeypatch.setattr(search_runner, "run_search", search_with_fakes)
    monkeypatch.setattr(bench_runner, "run_bench", lambda *a, **kw: real_bench(
        *a, **{**kw, "evaluator": EVALUATOR, "api": "test_search_fakes", "processes": 2}))
    monkeypatch.setattr(bench_runner, "kernel_fingerprint", lambda arch, api="fa4.kernels": "fake-fingerprint-1")


def test_problems_of_names_problems_as_the_cli_does():
    assert api.problems_of("s2048") == [replace(BASE, seqlen_q=2048, seqlen_k=2048),
                                        replace(BASE, seqlen_q=2048, seqlen_k=2048, causal=True)]
    assert api.problems_of(["b2-causal", BASE], causal=True) == [replace(BASE, batch=2, causal=True)]
    assert api.problems_of("b2-full, d64-causal") == [replace(BASE, batch=2), replace(BASE, head_dim=64, causal=True)]
    assert len(api.problems_of(model="llama-3-8b", causal=False)) == 6
    with pytest.raises(ValueError, match="exactly one"):
        api.problems_of("s1024", model="llama-3-8b")
    with pytest.raises(ValueError, match="no problem left"):
        api.problems_of("s1024-full", causal=True)
    # the CLI's shape options default to the same problem
    assert cli.problems_from_options(**{"batch": 1, "heads": 32, "gqa": None, "heads_kv": None, "head_dim": 128,
                                        "seqlen": 1024, "seqlen_k": None, "dtype": "fp16", "lse": False,
                                        "mask": "full"}) == [BASE]


def test_shape_keys_with_a_window_stand_for_both_masks_as_a_shapes_file_table_does():
    """A key without a mask is each mask with the key's window and softcap, resolved as fa4.attention
    resolves them (a causal window has no right side; a window as wide as the sequences is none)."""
    long = replace(BASE, seqlen_q=8192, seqlen_k=8192, softcap=50.0)
    assert api.problems_of("s8192-wl4095-cap50") == [replace(long, window=(4095, -1)),
                                                     replace(long, causal=True, window=(4095, 0))]
    assert api.problems_of("s8192-wl4095-wr0") == [replace(long, causal=True, window=(4095, 0), softcap=None)]
    assert api.problems_of("s1024-wl4095-causal") == [replace(BASE, causal=True)]
    # the line a search prints first names the window and softcap of each mask
    assert api.describe_problems(api.problems_of("s1024-wl100-cap50")).endswith(
        "fp16, non-causal window (100, -1) softcap 50 and causal window (100, 0) softcap 50")


def test_search_returns_a_frame_of_the_summaries_the_command_prints(tmp_path, fakes_injected):
    storage, db = str(tmp_path / "studies.journal"), str(tmp_path / "db.json")
    frame = fa4tune.search("s1024", trials=5, storage=storage, db=db, quiet=True)
    assert isinstance(frame, pd.DataFrame) and len(frame) == 2
    summaries = frame.attrs["summaries"]
    assert list(frame["study"]) == [s["study"] for s in summaries] == [
        "sm90-fp16-b1-hq32-hkv8-d128-sq1024-sk1024-full", "sm90-fp16-b1-hq32-hkv8-d128-sq1024-sk1024-causal"]
    assert list(frame["causal"]) == [False, True] and set(frame["heads_kv"]) == {8}
    assert list(frame["evaluated"]) == [5, 5]
    for (_, row), s in zip(frame.iterrows(), summaries):
        assert row["best_us"] == s["best"]["us"] and row["default_us"] == s["default_us"]
        assert row["best_label"] == Config.from_dict("sm90", s["best"]["config"]).label()
        assert row["sdpa_cudnn_us"] == 31.6 and row["speedup_over_default"] == s["speedup"]["default"]
        assert row["n_ok"] + row["n_infeasible"] + row["n_compile_error"] == s["configurations"]
    # the command, on the same storage, resumes the same studies: the same results
    result = CliRunner().invoke(cli.main, ["-q", "search", "--trials", "5", "--storage", storage, "--db", db,
                                           "--format", "json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)
    assert [(p["study"], p["best"], p["evaluated"]) for p in printed] == [
        (s["study"], s["best"], s["evaluated"]) for s in summaries]


def test_search_without_a_gpu_raises_what_the_command_prints(monkeypatch):
    monkeypatch.setattr(api, "detect_gpus", lambda: [])
    with pytest.raises(api.NoGpuError, match="--compile-only"):
        fa4tune.search("s1024", quiet=True)


def test_bench_returns_its_rows_as_a_frame_and_writes_bench_json(tmp_path, fakes_injected):
    out = tmp_path / "bench.json"
    frame = fa4tune.bench("s1024-causal", db=str(tmp_path / "db.json"), out=str(out), peers=False, quiet=True)
    doc = json.loads(out.read_text())
    assert list(frame["variant"]) == [r["variant"] for r in doc["rows"]] == ["tuned", "default", "dispatched"]
    assert frame.attrs["device"]["name"] == "Fake H200" and frame.attrs["timing"]["method"] == "cuda_graph"
    default = frame[frame["variant"] == "default"].iloc[0]
    assert default["us"] == fakes.fake_us(Config.make("sm90").to_dict()) and bool(default["causal"])
    assert frame[frame["variant"] == "tuned"].iloc[0]["outcome"] == "missing"


def test_import_fa4tune_stays_light():
    code = "import sys, fa4tune; print('pandas' in sys.modules, 'torch' in sys.modules, callable(fa4tune.search))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False", "True"]
