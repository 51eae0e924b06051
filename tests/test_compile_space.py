"""`fa4tune compile-space`: the verdict on one compiled configuration."""

import pytest
from click.testing import CliRunner

from fa4.kernels import ARCHS, family
from fa4tune.cli import main
from fa4tune.searches.compile_space import check_report, required_ptx

GOOD_SM100 = {"outcome": "ok", "report": {
    "smem_bytes": 1000, "spill_stores": 0, "spill_loads": 0,
    "ptx_markers": {"tcgen05.mma": True, "tcgen05.ld": True, "tcgen05.st": True, "cp.async.bulk.tensor": True}}}


def test_a_clean_compile_has_no_problems():
    assert check_report("sm100", 1000, GOOD_SM100) == []


def test_each_disagreement_is_named():
    entry = {**GOOD_SM100, "warnings": ["register spills"],
             "report": {**GOOD_SM100["report"], "smem_bytes": 1024,
                        "ptx_markers": {**GOOD_SM100["report"]["ptx_markers"], "tcgen05.st": False}}}
    problems = check_report("sm100", 1000, entry)
    assert "register spills" in problems
    assert any("tcgen05.st" in p for p in problems)
    assert any("1024 B compiled vs 1000 B modelled" in p for p in problems)


def test_a_failed_compile_is_a_problem():
    assert check_report("sm90", 0, {"outcome": "compile_error", "error": "boom"}) == ["compile_error: boom"]


def test_sm90_needs_wgmma_and_tma():
    entry = {"outcome": "ok", "report": {"smem_bytes": 5, "ptx_markers": {"wgmma": True, "tma_load": False}}}
    assert check_report("sm90", 5, entry) == ["PTX lacks tma_load, setmaxnreg, stmatrix"]


@pytest.mark.parametrize("arch", ARCHS)
def test_the_required_instructions_are_the_familys_ptx_markers(arch):
    """One list: what the compile report searches the PTX for is what the check requires, so a marker
    added to a family is required at once, and one removed is no longer asked for."""
    markers = family(arch).PTX_MARKERS
    assert required_ptx(arch) == tuple(markers) and markers
    every = {"outcome": "ok", "report": {"smem_bytes": 5, "ptx_markers": {name: True for name in markers}}}
    assert check_report(arch, 5, every) == []
    for name in markers:
        one_missing = {**every, "report": {**every["report"],
                                           "ptx_markers": {**every["report"]["ptx_markers"], name: False}}}
        assert check_report(arch, 5, one_missing) == [f"PTX lacks {name}"]


def test_bad_space_file_is_a_usage_error(tmp_path):
    bad = tmp_path / "sm90.toml"
    bad.write_text("[knobs]\ntile_q = [1]\n")
    result = CliRunner().invoke(main, ["compile-space", "--arch", "sm90", "--space", str(bad)])
    assert result.exit_code == 2 and "unknown knob 'tile_q'" in result.output



class _RecordingPool:
    """Stands in for the CPU worker pool: every compile succeeds at once; remembers what it was given."""

    submitted: list = []

    def __init__(self, *args, **kwargs):
        self._done = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def submit(self, kind, payload):
        _RecordingPool.submitted.append(tuple(sorted(payload["config"].items())))
        self._done.append((len(_RecordingPool.submitted), {"outcome": "ok", "report": {}}))
        return len(_RecordingPool.submitted)

    def poll(self, timeout):
        done, self._done = self._done, []
        return done


def test_shards_split_the_feasible_configurations(monkeypatch):
    """Shards are disjoint and together cover every feasible configuration."""
    from fa4.kernels import AttentionProblem, default_config, knobs_for, source_fingerprint
    from fa4tune.searches import compile_space
    from fa4tune.inputs.space import SearchSpace

    monkeypatch.setattr(compile_space, "WorkerPool", _RecordingPool)
    problem = AttentionProblem(1, 1024, 1024, 32, 8, 128)
    varied = {"tile_n": (64, 128, 192), "kv_stages": (2, 3), "pv_operand": ("rs", "ss")}
    space = SearchSpace("sm90", tuple((k.name, varied.get(k.name, (k.default,)))
                                      for k in knobs_for("sm90")))
    shards = []
    for i in range(3):
        _RecordingPool.submitted = []
        [result] = compile_space.run("sm90", [problem], space, 10**9, shard=(i, 3))
        assert result["shard"] == [i, 3]
        # shards of one space join only when they compiled the same kernel source
        assert result["source_fingerprint"] == source_fingerprint("sm90")
        shards.append(set(_RecordingPool.submitted))
    [whole] = compile_space.run("sm90", [problem], space, 0)
    default = default_config("sm90", problem)
    assert space.contains(default)
    assert sum(len(s) for s in shards) == len(set().union(*shards)) == whole["feasible"] > 3
    # the default is in the shard its knob values hash to (compiled first there)
    assert tuple(sorted(default.to_dict().items())) in shards[compile_space.shard_of(default.to_dict(), 3)]


def test_shard_census_holds_shards_to_the_model_as_it_is_now(monkeypatch):
    from fa4 import kernels as real
    from fa4.kernels import AttentionProblem, knobs_for
    from fa4tune.searches import compile_space
    from fa4tune.inputs.space import SearchSpace

    monkeypatch.setattr(compile_space, "WorkerPool", _RecordingPool)
    problem = AttentionProblem(1, 1024, 1024, 32, 8, 128)
    varied = {"tile_n": (64, 128, 192), "kv_stages": (2, 3), "pv_operand": ("rs", "ss")}
    space = SearchSpace("sm90", tuple((k.name, varied.get(k.name, (k.default,))) for k in knobs_for("sm90")))
    shards = [compile_space.compact(r) for i in range(3)
              for r in compile_space.run("sm90", [problem], space, 10**9, shard=(i, 3))]

    [whole] = compile_space.shard_census(shards, space)
    assert whole["complete"] and whole["shards"] == [0, 1, 2] and whole["compiled"] == whole["feasible"] > 3
    assert whole["missing"] == 0 and whole["resolved"] == 0
    # the fake pool reports nothing: every configuration fails the check, and each is named
    assert len(whole["problems"]) == whole["feasible"]
    [part] = compile_space.shard_census(shards[:2], space)
    assert not part["complete"] and part["compiled"] < part["feasible"] and part["missing"] == 0

    # a model that now rejects one compiled configuration: its problem is resolved, nothing is
    # missing, and the shards still add up
    rejected = shards[1]["compiled"][0]["config"]

    class Stricter:
        @staticmethod
        def feasible(config, prob):
            return ["measured corner"] if config.to_dict() == rejected else real.feasible(config, prob)

    [stricter] = compile_space.shard_census(shards, space, kernels=Stricter)
    assert stricter["complete"] and stricter["resolved"] == 1
    assert stricter["feasible"] == stricter["compiled"] == whole["feasible"] - 1

    # a sample (--limit) is not a whole shard: what it left out is missing
    [sample] = compile_space.run("sm90", [problem], space, 1, shard=(1, 3))
    [gappy] = compile_space.shard_census([shards[0], compile_space.compact(sample), shards[2]], space)
    assert not gappy["complete"] and gappy["missing"] == len(shards[1]["compiled"]) - 1

    with pytest.raises(ValueError, match="given twice"):
        compile_space.shard_census(shards + shards[:1], space)
    with pytest.raises(ValueError, match="kernel source"):
        compile_space.shard_census(shards[:2] + [{**shards[2], "source_fingerprint": "0" * 16}], space)


def test_a_configuration_keeps_its_shard_whatever_else_is_feasible():
    """Shards are a hash of the knob values, not positions in the feasible list: a new measured
    corner (one configuration fewer) moves no other configuration to another shard."""
    from fa4tune.searches.compile_space import shard_of

    configs = [{"tile_n": n, "kv_stages": k} for n in (64, 128, 192) for k in (2, 3, 4)]
    assert [shard_of(c, 40) for c in configs] == [shard_of(dict(reversed(c.items())), 40) for c in configs]
    assert len({shard_of(c, 40) for c in configs}) > 1
    assert all(0 <= shard_of(c, 3) < 3 for c in configs)


def test_compact_drops_only_what_repeats():
    from fa4tune.searches.compile_space import compact

    report = {"config": {"tile_n": 64}, "problem": {}, "registers": 128, "remarks_excerpt": "ptxas info"}
    result = {"arch": "sm100", "compiled": [{"config": {"tile_n": 64}, "outcome": "ok", "problems": [],
                                             "report": report},
                                            {"config": {"tile_n": 128}, "outcome": "ok",
                                             "problems": ["spills"], "report": dict(report)}]}
    small = compact(result)
    assert small["compiled"][0]["report"] == {"registers": 128}  # clean: the remarks say nothing more
    assert small["compiled"][1]["report"] == {"registers": 128, "remarks_excerpt": "ptxas info"}
    assert small["compiled"][0]["config"] == {"tile_n": 64} and small["arch"] == "sm100"
    assert result["compiled"][0]["report"]["config"] == {"tile_n": 64}  # the input is left alone


def test_compact_cuts_the_checkout_location_from_compiler_messages():
    from pathlib import Path

    import fa4
    from fa4tune.searches.compile_space import compact

    root = Path(fa4.__file__).resolve().parent.parent
    result = {"compiled": [{"outcome": "ok", "warnings": [f"{root}/kernels/sm90/kernel.py:138: spill"],
                            "report": {"remarks": [f"loc('{root}/kernels/sm90/kernel.py')"]}}]}
    entry = compact(result)["compiled"][0]
    assert entry["warnings"] == ["kernels/sm90/kernel.py:138: spill"]
    assert entry["report"]["remarks"] == ["loc('kernels/sm90/kernel.py')"]


def test_the_committed_whole_space_shards_add_up_and_are_clean():
    """results/compile_space/sm100-v5-shard-*: one kernel source, no shard twice, every configuration
    the model accepts now compiled, and clean (benchmarks/sm100_whole_space_summary.py says how much of
    the space they cover)."""
    from pathlib import Path

    from fa4tune.searches.compile_space import read_json, shard_census
    from fa4tune.inputs.space import load_space

    paths = sorted((Path(__file__).resolve().parents[1] / "results" / "compile_space").glob("sm100-v5-shard-*.json.gz"))
    if not paths:
        pytest.skip("no whole-space shards committed")
    census = shard_census([r for path in paths for r in read_json(path)], load_space("sm100"))
    assert len({c["source_fingerprint"] for c in census}) == 1
    assert all(c["compiled"] > 0 and not c["problems"] and not c["missing"] for c in census), census


def test_write_json_compresses_where_the_name_says_gz(tmp_path):
    from fa4tune.searches.compile_space import read_json, write_json

    result = {"arch": "sm100", "compiled": [{"config": {"tile_n": 64}, "outcome": "ok", "problems": [],
                                             "report": {"registers": 128}}]}
    write_json([result], tmp_path / "r.json.gz")
    write_json([result], tmp_path / "r.json")
    assert (tmp_path / "r.json.gz").read_bytes()[:2] == b"\x1f\x8b"
    assert read_json(tmp_path / "r.json.gz") == read_json(tmp_path / "r.json") == [result]


def test_reason_classes_keep_names_and_the_table_shows_numbers():
    from fa4tune.searches.compile_space import reason_class

    assert reason_class("head dim 96 is not supported (sm90 kernel: 64, 128)") == \
        "head dim N is not supported (sm90 kernel: N N)"
    assert reason_class("shared memory 254976 B > 232448 B per block") == "shared memory N B > N B per block"


def test_counts_show_an_eta_from_the_rate(monkeypatch):
    import io

    from fa4tune import progress as progress_module

    clock = iter([100.0, 110.0, 130.0])
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: next(clock))
    stream = io.StringIO()
    p = progress_module.Progress(stream=stream)
    p.every_s = 0.0
    p.count(1, 10, "compiled")   # the first call: no rate yet
    p.count(2, 10, "compiled")   # 1 item in 10 s: 8 left, ~80 s
    p.count(10, 10, "compiled")
    lines = stream.getvalue().splitlines()
    assert lines == ["compiled: 1/10", "compiled: 2/10, ~1m20s left", "compiled: 10/10"]
