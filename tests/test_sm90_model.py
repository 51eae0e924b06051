"""CPU checks of the sm90 family: feasibility rules, the whole search space against the budgets, and
a representative sample compiled for sm_90a (no GPU) to hold the resource model to the compiler."""

from __future__ import annotations

import importlib.util
import itertools
import json
import tomllib
from pathlib import Path

import pytest

from fa4.kernels import AttentionProblem, Config, feasible, knobs_for
from fa4.kernels import sm90
from fa4.kernels.sm90.plan import SUPPORTED_HEAD_DIMS

SPACE = Path(__file__).resolve().parents[1] / "search_spaces" / "sm90.toml"
BASE = AttentionProblem(1, 1024, 1024, 32, 8, 128, "fp16", causal=True, return_lse=True)


def _space_configs():
    data = tomllib.loads(SPACE.read_text())["knobs"]
    names = [k.name for k in knobs_for("sm90")]
    assert sorted(names) == sorted(data), "sm90.toml must mention every sm90 knob"
    for values in itertools.product(*(data[n] for n in names)):
        yield Config.make("sm90", **dict(zip(names, values)))


def test_can_implement_reasons():
    assert sm90.can_implement(BASE) == []
    bad = AttentionProblem(1, 128, 128, 4, 4, 80, "fp16")
    assert any("head dim 80" in r for r in sm90.can_implement(bad))
    for head_dim in (96, 192, 256):
        assert sm90.can_implement(AttentionProblem(1, 128, 128, 4, 4, head_dim, "bf16")) == []
    assert feasible(sm90.default_config(bad), bad)


@pytest.mark.parametrize("ratio", [1, 2, 4, 6, 7, 8, 16])
@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True])
def test_default_config_is_feasible(ratio, head_dim, dtype, causal):
    prob = AttentionProblem(2, 1000, 1000, 2 * ratio, 2, head_dim, dtype, causal=causal)
    cfg = sm90.default_config(prob)
    assert feasible(cfg, prob) == []


def test_specific_rejections():
    p = BASE
    assert any("persistent" in r for r in feasible(Config.make("sm90", q_stages=2, scheduler="single"), p))
    assert feasible(Config.make("sm90", q_stages=2, scheduler="lpt"), p) == []
    # 7 does not divide 128 rows: packing must be refused, unpacked runs
    p7 = AttentionProblem(1, 1000, 1000, 14, 2, 128, "fp16")
    assert any("ratio 7" in r for r in feasible(Config.make("sm90", pack_gqa=True), p7))
    assert feasible(Config.make("sm90", pack_gqa=False), p7) == []
    p1 = AttentionProblem(1, 1000, 1000, 4, 4, 128, "fp16")
    assert any("ratio > 1" in r for r in feasible(Config.make("sm90", pack_gqa=True), p1))
    # shared memory: 4 stages of 128-row K and V tiles at D=128 is 256 KiB + Q
    assert any("shared memory" in r for r in feasible(Config.make("sm90", kv_stages=4), p))
    # registers: three consumer warpgroups cannot hold a 64x128 S next to O at D=128
    assert any("registers" in r for r in feasible(Config.make("sm90", tile_m=192, tile_n=128), p))
    # ... but can at D=64 (flash-attn-4's tile there), with P in registers and overlap
    p64 = AttentionProblem(1, 2048, 2048, 32, 8, 64, "fp16", causal=True)
    assert feasible(Config.make("sm90", tile_m=192, tile_n=128), p64) == []
    # P in registers without overlap: ptxas serialises the value wgmma at some widths
    assert any("serialises" in r for r in feasible(Config.make("sm90", softmax_overlap=False), p))
    assert feasible(Config.make("sm90", softmax_overlap=False, pv_operand="ss"), p) == []


def test_smem_counts_p_only_through_shared_memory():
    rs = sm90.resources(Config.make("sm90", pv_operand="rs"), BASE)["smem_bytes"]
    ss = sm90.resources(Config.make("sm90", pv_operand="ss"), BASE)["smem_bytes"]
    assert ss - rs == 128 * 128 * 2


def test_every_space_config_is_rejected_or_within_budget():
    counts = {"ok": 0, "rejected": 0}
    for prob in (BASE, AttentionProblem(2, 1000, 1000, 8, 2, 64, "bf16")):
        for cfg in _space_configs():
            reasons = feasible(cfg, prob)
            res = sm90.resources(cfg, prob)
            if reasons:
                counts["rejected"] += 1
                assert all(isinstance(r, str) and r for r in reasons)
            else:
                counts["ok"] += 1
                assert res["smem_bytes"] <= sm90.REFERENCE_DEVICE.smem_per_block_bytes
                assert res["registers_per_consumer_thread"] <= res["register_budget"]
    assert counts["ok"] > 100 and counts["rejected"] > 100


def test_problem_key_ignores_lengths_and_batch():
    a = AttentionProblem(1, 1024, 1024, 32, 8, 128, "fp16")
    b = AttentionProblem(4, 77, 5000, 64, 16, 128, "fp16")
    cfg = Config.make("sm90", pack_gqa=False)
    assert sm90.problem_key(cfg, a) == sm90.problem_key(cfg, b)
    c = AttentionProblem(1, 1024, 1024, 16, 8, 128, "fp16")  # ratio 2 vs 4: packed tiles differ
    packed = cfg.replace(pack_gqa=True)
    assert sm90.problem_key(packed, a) != sm90.problem_key(packed, c)


# A representative sample: every value of every sm90 knob at least once, each feasible on its problem.
D128 = dict(batch=1, seqlen_q=1024, seqlen_k=1024, heads_q=32, heads_kv=8, head_dim=128)
D64 = dict(D128, head_dim=64)
SAMPLE = [
    (dict(), dict(D128, causal=True, return_lse=True)),
    (dict(tile_m=64, tile_n=64, kv_stages=4, rescale_threshold=0.0), dict(D128)),
    (dict(tile_m=192, tile_n=64, scheduler="lpt", q_stages=2), dict(D128, causal=True)),
    (dict(tile_n=80, pv_operand="ss", softmax_overlap=False), dict(D64, dtype="bf16")),
    (dict(tile_n=96, kv_stages=3, rescale_threshold=4.0, scheduler="static"), dict(D128, dtype="bf16", causal=True)),
    (dict(tile_n=112, pack_gqa=False, q_stages=2, scheduler="static"), dict(D64, return_lse=True)),
    (dict(tile_n=144, rescale_threshold=12.0, scheduler="single_lpt", exp2_poly_columns=2),
     dict(D64, causal=True)),
    (dict(tile_n=160, pack_gqa=False), dict(D128, dtype="bf16")),
    (dict(tile_n=176, scheduler="lpt"), dict(D128, causal=True)),
    (dict(tile_n=192, softmax_overlap=False, pv_operand="ss", kv_stages=2), dict(D64, causal=True)),
    (dict(tile_m=192, tile_n=80, pack_gqa=False), dict(D64, dtype="bf16")),
    (dict(tile_m=192, tile_n=128, scheduler="single_lpt", exp2_poly_columns=4),
     dict(D64, causal=True, return_lse=True)),
    (dict(tile_m=64, tile_n=128, pv_operand="ss", scheduler="lpt", q_stages=2), dict(D128, return_lse=True)),
    (dict(pack_gqa=True), dict(D128, heads_q=8, heads_kv=1, causal=True)),  # MQA, ratio 8
]


def test_sample_covers_every_knob_value():
    seen = {k.name: set() for k in knobs_for("sm90")}
    for over, _ in SAMPLE:
        for name, value in Config.make("sm90", **over).items:
            seen[name].add(value)
    for k in knobs_for("sm90"):
        assert set(k.choices) <= seen[k.name], f"{k.name}: sample misses {set(k.choices) - seen[k.name]}"


@pytest.mark.parametrize("over,prob", SAMPLE, ids=[Config.make("sm90", **o).label() for o, _ in SAMPLE])
def test_sample_compiles_for_sm90a_without_spills(over, prob):
    problem = AttentionProblem(**prob)
    cfg = Config.make("sm90", **over)
    assert feasible(cfg, problem) == []
    report = sm90.compile_report(cfg, problem)
    assert report["ok"], report.get("error")
    assert report["spill_stores"] == 0 and report["spill_loads"] == 0, report
    assert not report["wgmma_serialized"], report
    assert report["smem_bytes"] == sm90.resources(cfg, problem)["smem_bytes"]
    assert report["smem_bytes"] <= sm90.REFERENCE_DEVICE.smem_per_block_bytes
    markers = report["ptx_markers"]
    assert markers["wgmma"] and markers["tma_load"] and markers["setmaxnreg"]


def test_register_rejection_matches_a_real_spill():
    """The other side of the register model: a configuration it rejects for registers (three consumer
    warpgroups with 192 x 144 tiles and P in registers at D=64) really spills when compiled anyway."""
    problem = AttentionProblem(**dict(D64, causal=True))
    cfg = Config.make("sm90", tile_m=192, tile_n=144)
    assert any("registers" in r for r in feasible(cfg, problem))
    report = sm90.compile_report(cfg, problem)
    assert report["ok"], report.get("error")
    assert report["spill_stores"] > 0 or report["wgmma_serialized"], report


REGISTER_TABLE = Path(__file__).resolve().parents[1] / "results" / "sm90_register_table.json"


def _sweep_script():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "sm90_register_sweep.py"
    spec = importlib.util.spec_from_file_location("sm90_register_sweep", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_register_model_rejects_every_spill_of_the_ptxas_sweep():
    """The model against what ptxas reported for every tile shape x head dim x P operand x overlap x
    mask (benchmarks/sm90_register_sweep.py, compiled on the H200 machine's cores): nothing it admits
    spills or serialises a wgmma, and it admits most of what compiles clean."""
    rows = json.loads(REGISTER_TABLE.read_text())["rows"]
    sweep = _sweep_script()
    compiled = [r for r in rows if r["outcome"] == "ok"]
    assert len(compiled) > 300
    # a head dim the kernel admits has been swept (`--head-dims D` adds one to the table)
    assert {r["head_dim"] for r in compiled} == set(SUPPORTED_HEAD_DIMS)
    # what ptxas refused outright (an instruction needing more registers than the cap) the model refuses
    for row in (r for r in rows if r["outcome"] == "error"):
        problem, config = sweep.problem_and_config(row)
        assert feasible(config, problem), f"model admits {config.label()} at {problem.label()}: {row['error']}"
    admitted_clean = 0
    for row in compiled:
        problem, config = sweep.problem_and_config(row)
        reasons = feasible(config, problem)
        broken = row["spill_bytes"] > 0 or row["wgmma_serialized"]
        if broken:
            assert reasons, f"model admits {config.label()} at {problem.label()}, which ptxas {row}"
        elif not reasons:
            admitted_clean += 1
    # P in registers without overlap is refused as a whole (ptxas serialises it at some widths)
    clean = sum(1 for r in compiled if not (r["spill_bytes"] or r["wgmma_serialized"])
                and not (r["pv_operand"] == "rs" and not r["softmax_overlap"]))
    assert admitted_clean >= 0.9 * clean, (admitted_clean, clean)


def test_default_rules_are_outside_the_fingerprint():
    """A default rule picks among configurations and never changes what one compiles to: moving a
    rule must not mark the tuned database stale."""
    from fa4.kernels import sm90
    from fa4.kernels.sm90 import defaults

    assert sm90.default_config is defaults.default_config
    assert "defaults.py" not in sm90.SOURCE_FILES


def _wide_set_defaults():
    """The distinct default configurations (by compile key) of the wide set's problems."""
    from fa4.kernels import compile_key, default_config
    from fa4tune.inputs.shape_sets import load_shapes_file

    wide = Path(__file__).resolve().parents[1] / "results" / "wide"
    seen = {}
    for name in ("train.toml", "heldout.toml"):
        for problem in load_shapes_file(wide / name):
            cfg = default_config("sm90", problem)
            seen.setdefault(compile_key(cfg, problem), (cfg, problem))
    return list(seen.values())


@pytest.mark.parametrize("cfg,problem", _wide_set_defaults(), ids=lambda x: x.label())
def test_default_rules_never_pick_a_spilling_or_serialised_kernel(cfg, problem):
    """What the default rules pick on every shape of the wide set compiles clean: no spill and no
    wgmma that ptxas serialises (a bf16 D64 causal 192 x 96 tile did, at 1.5x the time)."""
    report = sm90.compile_report(cfg, problem)
    assert report["spill_stores"] == 0 and report["spill_loads"] == 0, report
    assert not report["wgmma_serialized"], report
