"""Shape sets: shapes files, model presets, FA4_RECORD_SHAPES, the bench grid file, the CLI options
and the progress of a search over a set (fake evaluator)."""

from __future__ import annotations

import io
import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner

from fa4.kernels import AttentionProblem, family
from fa4tune.cli import main
from fa4tune.progress import Progress, format_duration, set_left_s, study_left_s
from fa4tune.inputs.shape_sets import ShapeSetError, load_model, load_shapes_file, model_names, parse_shapes
from fa4tune.inputs.shapes import parse_shape

REPO = Path(__file__).resolve().parents[1]


def test_a_table_with_lists_stands_for_every_combination_and_both_masks():
    problems = parse_shapes(textwrap.dedent("""
        [[problem]]
        heads_q = 32
        gqa = 4
        head_dim = 128
        dtype = "bf16"
        batch = [1, 8]
        seqlen = [1024, 4096]

        [[problem]]          # Sq != Sk, one mask, LSE; and a repeat of the first table's problem
        batch = 1
        seqlen_q = 128
        seqlen_k = 4096
        heads_q = 16
        heads_kv = 16
        head_dim = 64
        causal = true
        return_lse = true

        [[problem]]
        batch = 1
        seqlen = 1024
        heads_q = 32
        heads_kv = 8
        head_dim = 128
        dtype = "bf16"
        causal = false
    """))
    assert len(problems) == 2 * 2 * 2 + 1
    assert problems[0] == AttentionProblem(1, 1024, 1024, 32, 8, 128, "bf16", causal=False)
    assert {(p.batch, p.seqlen_q, p.causal) for p in problems[:8]} == {
        (b, s, c) for b in (1, 8) for s in (1024, 4096) for c in (False, True)}
    assert problems[8] == AttentionProblem(1, 128, 4096, 16, 16, 64, "fp16", causal=True, return_lse=True)


@pytest.mark.parametrize("text, message", [
    ("[[problem]]\nbatch = 1\nseqlen = 1\nheads_q = 8\nheads_kv = 8\nhead_dim = 64\nheads = 8", "unknown name"),
    ("[[problem]]\nbatch = 1\nseqlen = 1\nheads_q = 8\nhead_dim = 64", "missing"),
    ("[[problem]]\nbatch = 1\nseqlen = 1\nseqlen_q = 2\nheads_q = 8\nheads_kv = 8\nhead_dim = 64", "not both"),
    ("[[problem]]\nbatch = 1\nseqlen = 1\nheads_q = 8\ngqa = 3\nhead_dim = 64", "not divisible"),
    ("[[problem]]\nbatch = 0\nseqlen = 1\nheads_q = 8\nheads_kv = 8\nhead_dim = 64", "positive integer"),
    ("[[problem]]\nbatch = 1\nseqlen = 1\nheads_q = 8\nheads_kv = 8\nhead_dim = 64\ncausal = \"yes\"", "true or false"),
    ("[[problem]]\nbatch = 1\nseqlen = 1\nheads_q = 8\nheads_kv = 8\nhead_dim = 64\ndtype = \"fp8\"", "dtype"),
    ("[defaults]\nbatch = 1", "unknown top-level"),
    ("", "no \\[\\[problem\\]\\]"),
    ("[[problem]\n", "not valid TOML"),
])
def test_a_malformed_shapes_file_is_an_error_that_names_the_table(text, message):
    with pytest.raises(ShapeSetError, match=message):
        parse_shapes(text, "f.toml")


def test_the_bench_grid_file_holds_exactly_the_scripts_14_problems():
    script = (REPO / "benchmarks" / "h200_kernel_v2.sh").read_text()
    keys = re.search(r'BENCH_SHAPES="([^"]*)"', script).group(1).replace("\\\n", " ").split()
    defaults = {"batch": 1, "seqlen_q": 1024, "seqlen_k": 1024, "heads_q": 32, "heads_kv": 8, "head_dim": 128,
                "dtype": "fp16", "causal": False, "return_lse": False}
    from_script = [parse_shape(k, defaults)[1] for k in keys]
    from_file = load_shapes_file(REPO / "benchmarks" / "h200_grid.toml")
    assert len(from_script) == 14 and sorted(from_file, key=repr) == sorted(from_script, key=repr)


def test_every_model_preset_loads_names_its_source_and_runs_on_the_sm90_kernel():
    from fa4.kernels import default_config, feasible

    names = model_names()
    assert "llama-3-8b" in names and len(names) >= 4
    for name in names:
        text = (REPO / "models" / f"{name}.toml").read_text()
        assert "config.json" in text.split("[[problem]]")[0], f"{name}: say where the head counts come from"
        problems = load_model(name)
        # every preset has its model's causal attention; a dense table stands for both masks
        assert problems and any(p.causal for p in problems), name
        dense = {p.causal for p in problems if p.window is None and p.softcap is None}
        assert dense in (set(), {False, True}), name
        for p in problems:
            assert not list(family("sm90").can_implement(p)), (name, p)
            assert not feasible(default_config("sm90", p), p), (name, p)   # the default runs it on the H200
    llama = load_model("llama-3-8b")
    assert {(p.heads_q, p.heads_kv, p.head_dim) for p in llama} == {(32, 8, 128)}
    with pytest.raises(ShapeSetError, match="no model preset 'nope'; presets: .*llama-3-8b"):
        load_model("nope")


def test_presets_of_sliding_windows_softcaps_and_head_dim_96():
    """Mistral-7B-v0.1's window, Gemma 2's softcap with its local (windowed) and global layers, Phi-3
    mini's head dim 96 and its 4k model's window: the problems their config.json fields give."""
    from fa4.kernels import AttentionProblem as P

    def kinds(name):
        return {(p.heads_q, p.heads_kv, p.head_dim, p.causal, p.window, p.softcap) for p in load_model(name)}

    def lengths(name, window):
        return sorted({p.seqlen_q for p in load_model(name) if p.window == window})

    assert kinds("mistral-7b") == {(32, 8, 128, False, None, None), (32, 8, 128, True, None, None),
                                   (32, 8, 128, True, (4095, 0), None)}
    assert lengths("mistral-7b", (4095, 0)) == [8192, 16384, 32768]   # where the window hides keys
    assert kinds("gemma-2-9b") == {(16, 8, 256, True, None, 50.0), (16, 8, 256, True, (4095, 0), 50.0)}
    assert kinds("gemma-2-27b") == {(32, 16, 128, True, None, 50.0), (32, 16, 128, True, (4095, 0), 50.0)}
    for gemma in ("gemma-2-9b", "gemma-2-27b"):
        assert lengths(gemma, (4095, 0)) == [8192] and lengths(gemma, None) == [1024, 4096, 8192]
        assert {p.dtype for p in load_model(gemma)} == {"bf16"}
    assert kinds("phi-3-mini") == {(32, 32, 96, False, None, None), (32, 32, 96, True, None, None),
                                   (32, 32, 96, True, (2046, 0), None)}
    assert lengths("phi-3-mini", (2046, 0)) == [4096]
    # Gemma 2 27B's softmax scale (1/sqrt(query_pre_attn_scalar 144)) is a call's argument: the same
    # configuration and compiled kernel serve it as the default 1/sqrt(128), as its preset says
    import torch
    import fa4

    local = P(1, 8192, 8192, 32, 16, 128, "bf16", True, window=(4095, 0), softcap=50.0)
    assert local in load_model("gemma-2-27b")
    q = torch.empty(1, 8192, 32, 128, dtype=torch.bfloat16, device="meta")
    k = torch.empty(1, 8192, 16, 128, dtype=torch.bfloat16, device="meta")
    at = {scale: fa4.explain(q, k, k, causal=True, window_size=(4095, 0), softcap=50.0, softmax_scale=scale,
                             arch="sm90", device_name="NVIDIA H200") for scale in (None, 144 ** -0.5)}
    assert at[None].config == at[144 ** -0.5].config and at[None].compile_key == at[144 ** -0.5].compile_key


_RECORD = """
import torch, fa4, warnings
warnings.simplefilter("ignore")
q = torch.randn(1, 64, 4, 64, dtype=torch.float16)
k = torch.randn(1, 96, 2, 64, dtype=torch.float16)
for _ in range(5):
    fa4.attention(q, k, k, causal=True, fallback="sdpa")
fa4.attention(q, k, k, fallback="sdpa")
fa4.attention(q.transpose(1, 2).contiguous().transpose(1, 2), k, k, fallback="sdpa")  # same problem, new strides
fa4.attention(q, k, k, return_lse=True, fallback="sdpa")
"""


def test_record_shapes_appends_each_new_problem_once_per_process_as_a_shapes_file(tmp_path):
    path = tmp_path / "recorded.toml"
    for _ in range(2):   # two processes append to one file
        subprocess.run([sys.executable, "-c", _RECORD], check=True, cwd=tmp_path,
                       env={**_env(), "FA4_RECORD_SHAPES": str(path)})
    tables = tomllib.loads(path.read_text())["problem"]
    assert len(tables) == 2 * 3
    problems = load_shapes_file(path)
    assert problems == [AttentionProblem(1, 64, 96, 4, 2, 64, "fp16", causal=True),
                        AttentionProblem(1, 64, 96, 4, 2, 64, "fp16", causal=False),
                        AttentionProblem(1, 64, 96, 4, 2, 64, "fp16", causal=False, return_lse=True)]
    # unset: nothing is written
    subprocess.run([sys.executable, "-c", _RECORD], check=True, cwd=tmp_path, env=_env())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recorded.toml"]   # no lock file beside it


def _env() -> dict:
    import os

    return {k: v for k, v in os.environ.items() if k != "FA4_RECORD_SHAPES"}


def test_time_left_estimates():
    assert study_left_s(10.0, 5, 15, None) == pytest.approx(30.0)
    assert study_left_s(10.0, 5, 15, timeout_s=25.0) == pytest.approx(15.0)   # the budget caps it
    assert study_left_s(10.0, 0, 15, None) is None and study_left_s(10.0, 0, 15, 25.0) == 15.0
    assert study_left_s(10.0, 5, 0, None) == 0.0
    assert set_left_s(30.0, 10.0, [], 2) == pytest.approx(30.0 + 2 * 40.0)   # projected from this study
    assert set_left_s(30.0, 10.0, [20.0, 60.0], 2) == pytest.approx(30.0 + 2 * 40.0)
    assert set_left_s(None, 10.0, [], 3) is None and set_left_s(5.0, 1.0, [], 0) == 5.0
    assert [format_duration(s) for s in (None, 5, 125, 7322)] == ["?", "5s", "2m05s", "2h02m"]


def test_a_search_over_a_set_names_each_study_and_estimates_time_left(tmp_path):
    from test_search import EVALUATOR, settings
    from fa4tune.searches.runner import run_search
    from fa4tune.workers.pool import WorkerPool

    problems = load_shapes_file(REPO / "benchmarks" / "h200_grid.toml")[:3]
    stream = io.StringIO()
    with WorkerPool(2, [0], evaluator=EVALUATOR, trial_timeout_s=20) as pool:
        summaries = run_search("sm90", problems, settings(tmp_path, trials=3, peers=()),
                               Progress(stream=stream, every_s=0.0), pool=pool)
    assert [s["study"] for s in summaries] == [f"sm90-{p.dtype}-b{p.batch}-hq32-hkv8-d128-sq{p.seqlen_q}-"
                                               f"sk{p.seqlen_k}-{'causal' if p.causal else 'full'}" for p in problems]
    assert all(s["evaluated"] == 3 == s["evaluated_this_run"] for s in summaries)
    text = stream.getvalue()
    assert "shape set: 3 studies: " + ", ".join(s["study"] for s in summaries) in text
    assert f"[{summaries[2]['study']} (3/3)]" in text
    assert re.search(r"\(1/3\)\] \d+/3 .*left, ~[\dhms]+ for the set", text)


def test_cli_shape_set_options(tmp_path):
    runner = CliRunner()
    bad = tmp_path / "bad.toml"
    bad.write_text("[[problem]]\nbatch = 1\n")
    result = runner.invoke(main, ["search", "--shapes-file", str(bad)])
    assert result.exit_code == 2 and "missing" in result.output
    result = runner.invoke(main, ["search", "--model", "nope"])
    assert result.exit_code == 2 and "presets: " in result.output
    result = runner.invoke(main, ["search", "--model", "llama-3-8b", "--seqlen", "2048"])
    assert result.exit_code == 2 and "--seqlen cannot be combined" in result.output
    result = runner.invoke(main, ["bench", "--model", "llama-3-8b", "--shapes", "s1024"])
    assert result.exit_code == 2 and "not both" in result.output
