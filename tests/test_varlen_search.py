"""Variable-length batches in the harness and the database, on CPU: the batch description and its key
(`fa4.varlen_batch`), the length distributions and shapes files' [[varlen]] tables, and `fa4tune search`
of a varlen batch with the real kernel API (its varlen feasibility) and the fake evaluator of
tests/test_search_fakes.py in real worker processes."""

from __future__ import annotations

import json

import optuna
import pytest

import test_search_fakes as fakes
from fa4 import kernels
from fa4.database import BestConfigDB, Entry, entry_key, field_error, record
from fa4.kernels import AttentionProblem, Config
from fa4.varlen_batch import VarlenProblem, problem_from_dict, tokens_of
from fa4tune.inputs.shape_sets import ShapeSetError, parse_shapes
from fa4tune.inputs.shapes import shape_key
from fa4tune.inputs.varlen_lengths import DISTRIBUTIONS, lengths
from fa4tune.progress import Progress
from fa4tune.searches.runner import SearchSettings, run_search
from fa4tune.searches.storage import open_storage

QUIET = Progress(quiet=True)
# one long sequence among short ones: most of the grid's cells are empty
ONE_LONG = VarlenProblem.of([4096] + [128] * 31, heads_q=16, heads_kv=4, head_dim=128, dtype="bf16", causal=True)


# ---- the batch and its key -----------------------------------------------------------------------

def test_a_varlen_problem_is_the_compiled_problem_with_its_lengths():
    p = VarlenProblem.of([100, 0, 3000, 7], heads_q=8, heads_kv=2, head_dim=128, causal=True, window_size=(255, 0))
    assert (p.batch, p.seqlen_q, p.seqlen_k, p.varlen, p.window) == (4, 3000, 3000, True, (255, 0))
    assert p.tokens_q == 3107 and p.cu_seqlens()[0] == [0, 100, 100, 3100, 3107]
    assert p.base() == AttentionProblem(4, 3000, 3000, 8, 2, 128, "fp16", True, window=(255, 0), varlen=True)
    assert problem_from_dict(p.to_dict()) == p and problem_from_dict(p.base().to_dict()) == p.base()
    # the work done, sequence by sequence (a window wider than a sequence is none there), not the grid's
    assert p.flops() == sum(AttentionProblem(1, n, n, 8, 2, 128, "fp16", True, window=(255, 0) if n > 256 else None
                                             ).flops() for n in (100, 3000, 7)) < p.base().flops()
    # what the kernels see is the compiled problem: its default and compile key ignore the lengths
    config = kernels.default_config("sm90", p)
    assert config == kernels.default_config("sm90", p.base())
    assert kernels.compile_key(config, p) == kernels.compile_key(config, p.base())
    for bad, message in (({"lengths_q": (5, 6), "lengths_k": (5,)}, "same sequences"),
                         ({"batch": 3}, "number of sequences"), ({"seqlen_q": 4000}, "longest"),
                         ({"varlen": False}, "varlen must be True"), ({"lengths_q": (1, -1, 3000, 7)}, ">= 0")):
        with pytest.raises(ValueError, match=message):
            VarlenProblem(**{**p.to_dict(), **bad})


def test_varlen_keys_never_meet_dense_keys():
    dense = ONE_LONG.base()
    key = entry_key("sm90", "NVIDIA H200", ONE_LONG)
    assert key == "sm90|NVIDIA H200|bf16|d128|gqa4|causal-varlen|sq4096|sk4096|w128|t8192"
    # the dense problem of the same buckets has another key; without tokens a varlen key cannot be made
    assert entry_key("sm90", "NVIDIA H200", AttentionProblem(32, 4096, 4096, 16, 4, 128, "bf16", True)) == \
        "sm90|NVIDIA H200|bf16|d128|gqa4|causal|sq4096|sk4096|w128"
    with pytest.raises(ValueError, match="total query tokens"):
        entry_key("sm90", "NVIDIA H200", dense)
    assert entry_key("sm90", "NVIDIA H200", dense, tokens=8000) == key   # a runtime call: q's rows
    assert tokens_of(dense, 8000) == 8000 and tokens_of(ONE_LONG) == 8064 and tokens_of(AttentionProblem(1, 1, 1, 1, 1, 64)) is None


def _entry(problem, us=40.0, peer_us=50.0, config=None, fingerprint=None, default_us=None, device="NVIDIA H200"):
    config = config or kernels.default_config("sm90", problem).to_dict()
    return Entry.from_result(arch="sm90", device=device, problem=problem, config=config, us=us, tflops=1.0,
                             default_us=default_us or us * 1.5, peers_us={"flash_attn_4": peer_us, "per_sequence": 90.0},
                             max_err=0.001, kernel_fingerprint=fingerprint or kernels.kernel_fingerprint("sm90"),
                             versions={}, study="s", trial=0)


def test_varlen_entries_round_trip_and_are_checked(tmp_path):
    entry = _entry(ONE_LONG)
    assert entry.varlen == {"lengths_q": list(ONE_LONG.lengths_q), "lengths_k": list(ONE_LONG.lengths_k)}
    assert entry.problem == ONE_LONG.base().to_dict() and entry.tokens_bucket == 8192
    path = tmp_path / "db.json"
    dense = _entry(AttentionProblem(32, 4096, 4096, 16, 4, 128, "bf16", True))
    assert record(entry, path) and record(dense, path)
    data = json.loads(path.read_text())
    assert "varlen" not in next(e for e in data["entries"] if e["key"] == dense.key)   # dense entries as before
    db = BestConfigDB.load(path)
    assert {e.key for e in db.entries} == {entry.key, dense.key} and db.get(entry.key) == entry and not db.skipped
    raw = entry.to_dict()
    assert field_error(raw) is None
    assert "needs the batch's lengths" in field_error({k: v for k, v in raw.items() if k != "varlen"} | {"key": dense.key})
    assert "number of sequences" in field_error({**raw, "varlen": {"lengths_q": [1, 2], "lengths_k": [1, 2]}})
    assert "varlen" in field_error({**raw, "varlen": {"lengths_q": [1.5], "lengths_k": [1]}})
    assert "not varlen" in field_error({**dense.to_dict(), "varlen": raw["varlen"]})


def test_lookup_keeps_the_kinds_apart_and_measures_tokens():
    entry = _entry(ONE_LONG)
    dense = AttentionProblem(32, 4096, 4096, 16, 4, 128, "bf16", True)
    db = BestConfigDB({entry.key: entry})
    fp = kernels.kernel_fingerprint("sm90")
    assert db.lookup("sm90", "NVIDIA H200", dense, fp).kind == "default"       # a dense call never sees it
    found = db.lookup("sm90", "NVIDIA H200", ONE_LONG.base(), fp, tokens=6000)
    assert (found.kind, found.entry) == ("exact", entry)
    near = db.lookup("sm90", "NVIDIA H200", ONE_LONG.base(), fp, tokens=30000, max_distance=2)
    assert (near.kind, near.distance) == ("nearest", 2.0)                     # two doublings of tokens
    assert db.lookup("sm90", "NVIDIA H200", ONE_LONG.base(), fp, tokens=40000, max_distance=2).kind == "default"
    # and a dense entry is never a varlen call's
    dense_entry = _entry(dense)
    assert BestConfigDB({dense_entry.key: dense_entry}).lookup("sm90", "NVIDIA H200", ONE_LONG, fp).kind == "default"


# ---- length distributions and shapes files -------------------------------------------------------

def test_length_distributions_are_seeded_and_fill_their_budget():
    first = lengths("azure-conv-2023", tokens=16384, seed=3)
    assert first == lengths("azure-conv-2023", tokens=16384, seed=3) != lengths("azure-conv-2023", tokens=16384, seed=4)
    assert sum(first) == 16384 and min(first) >= 1
    many = lengths("azure-conv-2023", sequences=4000, seed=0)
    many.sort()
    # the trace's own figures (module docstring): median 1020, 39 % at most 512, 2.1 % past 4096
    assert 950 <= many[2000] <= 1100
    assert 0.35 < sum(n <= 512 for n in many) / 4000 < 0.44 and 0.01 < sum(n > 4096 for n in many) / 4000 < 0.035
    assert max(lengths("azure-code-2023", sequences=4000)) <= 7437
    assert all(64 <= n <= 8192 for n in lengths("log-uniform", sequences=200))
    assert set(DISTRIBUTIONS) == {"azure-conv-2023", "azure-code-2023", "log-uniform"}
    for kwargs, message in (({}, "one of them"), ({"sequences": 3, "tokens": 9}, "one of them"),
                            ({"sequences": 0}, "positive"), ({"tokens": True}, "positive")):
        with pytest.raises(ValueError, match=message):
            lengths("log-uniform", **kwargs)
    with pytest.raises(ValueError, match="no length distribution"):
        lengths("zipf", sequences=3)


SHAPES = """
[[problem]]
batch = 1
seqlen = 1024
heads_q = 16
gqa = 4
head_dim = 128
causal = true

[[varlen]]
heads_q = 16
gqa = 4
head_dim = 128
dtype = "bf16"
causal = true
distribution = "azure-conv-2023"
tokens = [4096, 16384]
seed = 1

[[varlen]]
heads_q = 8
heads_kv = 8
head_dim = 64
lengths = [[4096, 128, 128], [300, 0, 17]]
window = [127, 0]
"""


def test_shapes_files_name_varlen_batches():
    problems = parse_shapes(SHAPES)
    varlen = [p for p in problems if isinstance(p, VarlenProblem)]
    # a right side of 0 is the causal bound: both masks of the window table are one problem each batch
    assert len(problems) == 1 + 2 + 2 and len(varlen) == 4
    drawn = varlen[:2]
    assert [p.tokens_q for p in drawn] == [4096, 16384] and all(p.causal and p.dtype == "bf16" for p in drawn)
    assert list(drawn[0].lengths_q) == lengths("azure-conv-2023", tokens=4096, seed=1)
    written = varlen[2:]
    assert [list(p.lengths_q) for p in written] == [[4096, 128, 128], [300, 0, 17]]
    assert all(p.causal and p.window == (127, 0) and p.dtype == "fp16" for p in written)
    keys = {shape_key("sm90", p) for p in problems}
    assert len(keys) == len(set(problems)) and all("-varlen-t" in shape_key("sm90", p) for p in varlen)
    for table, message in (("lengths = [1, 2]\ndistribution = 'log-uniform'", "one way"),
                           ("lengths = [1, 2]\ntokens = 5", "distribution"),
                           ("distribution = 'log-uniform'", "sequences or their total tokens|one of them"),
                           ("lengths = [1, 2]\nbatch = 2", "unknown"),
                           ("lengths_q = [1, 2]", "one way")):
        with pytest.raises(ShapeSetError, match=message):
            parse_shapes(f"[[varlen]]\nheads_q = 8\ngqa = 1\nhead_dim = 64\n{table}\n")


# ---- the search --------------------------------------------------------------------------------

def settings(tmp_path, **kw) -> SearchSettings:
    base = dict(trials=30, sampler="random", processes=2, storage=str(tmp_path / "studies.journal"),
                db_path=str(tmp_path / "db.json"), evaluator="test_search_fakes:FakeVarlenEvaluator",
                kernel_api="fa4.kernels", trial_timeout_s=5, seed=1, peers=("flash_attn_4", "sdpa_cudnn"),
                retime_rounds=1)
    base.update(kw)
    return SearchSettings(**base)


def test_search_of_a_varlen_batch_records_ours_and_the_other_implementations(tmp_path):
    [summary] = run_search("sm90", [ONE_LONG], settings(tmp_path), QUIET)
    assert summary["study"] == shape_key("sm90", ONE_LONG) and "-varlen-t8064-" in summary["study"]
    study = optuna.load_study(study_name=summary["study"], storage=open_storage(tmp_path / "studies.journal"))
    assert problem_from_dict(study.user_attrs["problem"]) == ONE_LONG
    outcomes = {}
    for t in study.trials:
        if "repeat_of" not in t.user_attrs:
            config = Config.from_dict("sm90", t.params)
            outcomes[config.label()] = (config, t.user_attrs["outcome"])
    # the varlen kernel's own refusals: GQA packing is infeasible here, and only the model refuses
    packed = [label for label, (config, _) in outcomes.items() if config.pack_gqa]
    assert packed and all(outcomes[label][1] == "infeasible" for label in packed)
    assert all((outcome == "infeasible") == bool(kernels.feasible(config, ONE_LONG))
               for config, outcome in outcomes.values())
    best = summary["best"]
    assert best["config"]["scheduler"] in ("static", "lpt")   # the fake's empty cells favour a persistent loop
    assert summary["default_us"] == fakes.fake_varlen_us(kernels.default_config("sm90", ONE_LONG).to_dict(), ONE_LONG)
    assert summary["retime"]["winner_us"] == best["us"]
    peers = study.user_attrs["peers"]
    assert peers["flash_attn_4"]["us"] == 33.0 and peers["per_sequence"]["us"] == 80.0 and "error" in peers["sdpa_cudnn"]

    db = BestConfigDB.load(tmp_path / "db.json")
    [entry] = db.entries
    assert entry.key == entry_key("sm90", "Fake H200", ONE_LONG) and entry.key.endswith("causal-varlen|sq4096|sk4096|w128|t8192")
    assert entry.varlen["lengths_q"] == list(ONE_LONG.lengths_q) and entry.config == best["config"]
    assert entry.backend_us == {"ours": best["us"], "flash_attn_4": 33.0, "per_sequence": 80.0}
    assert entry.tflops == round(ONE_LONG.flops() / best["us"] / 1e6, 2)   # the batch's work, not the grid's
    assert db.lookup("sm90", "Fake H200", ONE_LONG.base(), tokens=8000).entry == entry   # the runtime's view
    # a dense search of the same buckets neither warm-starts from it nor finds it
    dense = AttentionProblem(32, 4096, 4096, 16, 4, 128, "bf16", True)
    assert db.lookup("sm90", "Fake H200", dense).kind == "default"
    from fa4tune.searches.warm_start import warm_start_configs

    choices = {knob.name: list(knob.choices) for knob in kernels.knobs_for("sm90")}
    assert warm_start_configs(db, "sm90", "Fake H200", dense, entry.kernel_fingerprint, choices,
                              kernels.default_config("sm90", dense).to_dict()) == []
    other = VarlenProblem.of([2048] * 4, heads_q=16, heads_kv=4, head_dim=128, dtype="bf16", causal=True)
    seeds = warm_start_configs(db, "sm90", "Fake H200", other, entry.kernel_fingerprint, choices,
                               kernels.default_config("sm90", other).to_dict())
    assert seeds == [(entry.config, entry.key)]


# ---- the command line ----------------------------------------------------------------------------

def test_cli_search_varlen_then_best_lists_the_varlen_entry(tmp_path, monkeypatch):
    from dataclasses import replace

    from click.testing import CliRunner

    from fa4tune import cli
    from fa4tune.searches import runner as search_mod

    monkeypatch.setattr(cli, "detect_gpus", lambda: [{"index": 0, "name": "Fake H200", "cc": (9, 0)}])
    real = search_mod.run_search
    seen = []

    def run_with_fakes(arch, problems, settings, progress=None, pool=None):
        seen.extend(problems)
        settings = replace(settings, evaluator="test_search_fakes:FakeVarlenEvaluator", processes=2,
                           peers=("flash_attn_4",))
        return real(arch, problems, settings, progress, pool)

    monkeypatch.setattr(search_mod, "run_search", run_with_fakes)
    db = tmp_path / "db.json"
    common = ["--heads", "16", "--gqa", "4", "--dtype", "bf16", "--causal", "--storage",
              str(tmp_path / "studies.journal"), "--db", str(db)]
    run = CliRunner().invoke(cli.main, ["search", "--varlen", "azure-conv-2023", "--varlen-tokens", "8192",
                                        "--varlen-seed", "2", "--trials", "8", "--retime", "0", "--format", "json",
                                        *common], env={"COLUMNS": "240"}, catch_exceptions=False)
    assert run.exit_code == 0, run.stderr
    [summary] = json.loads(run.stdout)
    [problem] = seen
    assert isinstance(problem, VarlenProblem) and problem.causal and problem.tokens_q == 8192
    assert list(problem.lengths_q) == lengths("azure-conv-2023", tokens=8192, seed=2)
    assert summary["peers"]["per_sequence"]["us"] == 80.0 and summary["study"] == shape_key("sm90", problem)
    [entry] = BestConfigDB.load(db).entries
    assert entry.key == entry_key("sm90", "Fake H200", problem)
    listed = CliRunner().invoke(cli.main, ["best", "--db", str(db)], env={"COLUMNS": "240"}).stdout
    assert "varlen" in listed and "best configurations (1)" in listed
    # written-out lengths, both masks
    seen.clear()
    run = CliRunner().invoke(cli.main, ["search", "--varlen", "4096,128,128", "--trials", "2", "--retime", "0",
                                        "--no-db", "--storage", str(tmp_path / "studies.journal")],
                             catch_exceptions=False)
    assert run.exit_code == 0, run.output
    assert [(p.causal, list(p.lengths_q)) for p in seen] == [(False, [4096, 128, 128]), (True, [4096, 128, 128])]
    for args, message in ((["--varlen", "log-uniform", "--batch", "4"], "--batch cannot be combined with --varlen"),
                          (["--varlen-tokens", "5"], "--varlen-tokens does something only with --varlen"),
                          (["--varlen", "1,2", "--varlen-tokens", "5"], "the lengths given are the batch"),
                          (["--varlen", "zipf"], "neither a distribution"),
                          (["--varlen", "log-uniform", "--varlen-tokens", "5", "--varlen-sequences", "2"],
                           "give --varlen-tokens or --varlen-sequences, not both"),
                          (["--varlen", "log-uniform", "--backward"], "our varlen kernel has no backward"),
                          (["--varlen", "log-uniform", "--model", "llama-3-8b"], "give --varlen or --model")):
        refused = CliRunner().invoke(cli.main, ["search", *args])
        assert refused.exit_code == 2 and message in refused.output, (args, refused.output)


def test_a_packed_output_is_held_to_the_one_rule_per_sequence():
    """What a varlen trial validates with (`fa4.varlen.expected_varlen` and `fa4.reference.compare`):
    the per-sequence path's answer passes, a wrong row, a written row that sees no key and a wrong LSE
    fail."""
    import torch

    import fa4
    from fa4.reference import compare
    from fa4.varlen import expected_varlen

    gen = torch.Generator().manual_seed(0)
    lengths_q, lengths_k = [5, 0, 37, 9], [3, 4, 40, 9]   # sequence 0: 2 rows see no key under causal
    q = torch.randn(sum(lengths_q), 4, 64, generator=gen).to(torch.bfloat16)
    k, v = (torch.randn(sum(lengths_k), 2, 64, generator=gen).to(torch.bfloat16) for _ in range(2))
    problem = VarlenProblem.of(lengths_q, lengths_k, heads_q=4, heads_kv=2, head_dim=64, dtype="bf16", causal=True)
    cu_q, cu_k = (torch.tensor(c, dtype=torch.int32) for c in problem.cu_seqlens())
    expected = expected_varlen(q, k, v, cu_q, cu_k, True)
    assert expected.seen.tolist() == [False, False] + [True] * 3 + [True] * 46
    out, lse = fa4.attention_varlen(q, k, v, cu_q, cu_k, 37, 40, causal=True, return_lse=True, fallback="sdpa",
                                    backend="per_sequence")
    assert compare(out[None], lse[None], expected)["passed"]
    wrong = out.clone()
    wrong[20] += 0.5
    assert "fp32 reference" in compare(wrong[None], lse[None], expected)["error"]
    written = out.clone()
    written[0] = 1.0
    assert "rows that see no key are not 0" in compare(written[None], lse[None], expected)["error"]
    assert "LSE differs" in compare(out[None], (lse + 0.5)[None], expected)["error"]


def test_a_varlen_trial_refuses_a_kernel_that_writes_nothing_or_a_wrong_answer():
    """The worker's varlen trial (`fa4tune.workers.varlen`) on CPU tensors, up to its validation: a
    kernel that writes nothing fails, and so does a right answer perturbed (what a trial checks before
    it times anything on a GPU)."""
    import torch

    from fa4 import varlen
    from fa4tune.workers.timing import TimingSettings
    from fa4tune.workers.varlen import VarlenInputs, run_varlen_trial

    problem = VarlenProblem.of([7, 30, 1], heads_q=4, heads_kv=2, head_dim=64, dtype="bf16", causal=True,
                               return_lse=True)
    inputs = VarlenInputs(problem, device="cpu")
    assert inputs.q.shape == (38, 4, 64) and inputs.cu_q.tolist() == [0, 7, 37, 38]
    calls = []

    class Reference:   # "compiled" for the batch: the fp32 reference, per sequence
        def __init__(self, writes: bool):
            self.writes = writes

        def run_varlen(self, q, k, v, out, lse, scale, masks, cu_q, cu_k, max_q, max_k):
            calls.append((masks, max_q, max_k, lse.shape))
            if self.writes:
                o, l = varlen.reference_varlen(q, k, v, cu_q, cu_k, True, scale)
                out.copy_(o)
                lse.copy_(l)

    timing = TimingSettings()
    nothing = run_varlen_trial(Reference(False), inputs, problem, timing, validate=True, perturb=False)
    assert nothing["outcome"] == "mismatch" and "NaN" in nothing["error"]
    perturbed = run_varlen_trial(Reference(True), inputs, problem, timing, validate=True, perturb=True)
    assert perturbed["outcome"] == "mismatch" and "fp32 reference" in perturbed["error"]
    assert calls[0] == ((None, None, None), 30, 30, (4, 38))


def test_the_benchs_dispatched_row_of_a_varlen_batch_is_attention_varlen(monkeypatch):
    """The bench's "dispatched" row of a [[varlen]] batch calls `fa4.attention_varlen` on the packed
    tensors (not `fa4.attention` on a padded batch), holds its output to the one rule and says what ran;
    on CPU tensors with the GPU timers replaced (what the worker does before it times anything)."""
    from types import SimpleNamespace

    import torch

    import fa4
    from fa4tune.workers import timing as timing_mod
    from fa4tune.workers.timing import TimingSettings
    from fa4tune.workers.varlen import VarlenInputs, time_varlen_dispatched

    problem = VarlenProblem.of([7, 30, 1], heads_q=4, heads_kv=2, head_dim=64, dtype="bf16", causal=True)
    inputs = VarlenInputs(problem, device="cpu")
    calls = []
    real = fa4.attention_varlen

    def attention_varlen(*args, backend="auto", **kwargs):
        calls.append((tuple(args[0].shape), backend))
        return real(*args, backend="per_sequence", fallback="sdpa", **kwargs)

    monkeypatch.setattr(fa4, "attention_varlen", attention_varlen)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(timing_mod, "time_cuda", lambda fn, timing: SimpleNamespace(us=12.5, spread=0.01))
    monkeypatch.setattr(timing_mod, "time_eager", lambda fn: (fn(), 20.0)[1])
    row = time_varlen_dispatched(inputs, problem, TimingSettings(), lambda: True)
    assert row["outcome"] == "ok" and row["us"] == 12.5 and row["eager_us"] == 20.0, row
    assert calls[0] == ((38, 4, 64), "auto") and ((38, 4, 64), "ours") in calls
    assert set(row["backend"]) == {"eager", "graph"}

    def wrong(*args, **kwargs):   # a wrong answer is a mismatch, never timed
        return attention_varlen(*args, **kwargs) + 1.0

    monkeypatch.setattr(fa4, "attention_varlen", wrong)
    assert time_varlen_dispatched(inputs, problem, TimingSettings(), lambda: True)["outcome"] == "mismatch"


def test_a_varlen_batch_written_as_a_table_reads_back_as_itself(tmp_path):
    """`fa4.record_shapes.problem_table` writes a varlen batch as a [[varlen]] table (what
    benchmarks/shapes_subset.py writes when a device call takes part of a shapes file), and the file's
    parts read back as the whole file's problems."""
    import importlib.util
    from pathlib import Path

    from fa4.record_shapes import problem_table
    from fa4tune.inputs.shape_sets import load_shapes_file

    batch = VarlenProblem.of([5, 0, 300], [9, 4, 310], heads_q=8, heads_kv=2, head_dim=64, dtype="fp16",
                             causal=True, window_size=(63, 0), softcap=20.0)
    assert problem_table(batch).startswith("[[varlen]]") and parse_shapes(problem_table(batch)) == [batch]
    benchmarks = Path(__file__).resolve().parents[1] / "benchmarks"
    spec = importlib.util.spec_from_file_location("benchmark_shapes_subset", benchmarks / "shapes_subset.py")
    shapes_subset = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shapes_subset)
    grid = benchmarks / "h200_features.toml"
    for start in (0, 1):
        shapes_subset.main([str(grid), str(tmp_path / f"part{start}.toml"), "--start", str(start), "--step", "2"])
    parts = load_shapes_file(tmp_path / "part0.toml") + load_shapes_file(tmp_path / "part1.toml")
    whole = load_shapes_file(grid)
    assert sorted(map(repr, parts)) == sorted(map(repr, whole)) and any(p.varlen for p in whole)
