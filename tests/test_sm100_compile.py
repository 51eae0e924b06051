"""The sm100 (Blackwell) kernel on CPU: feasibility model, search space, and sm_100a compiles.

No Blackwell GPU exists here; the kernel has not run on hardware. What CI checks instead:
- the TMEM budget (q_stages*head_dim + tmem_stages*tile_n <= 512) and the 232,448-byte shared-memory
  limit reject exactly what they should, with reasons;
- every configuration of search_spaces/sm100.toml is, for each test problem, either rejected with a
  reason or within every budget;
- a representative sample (every value of every sm100 knob at least once) compiles for sm_100a with
  no register spills, its PTX holds tcgen05.mma/ld/st and TMA instructions, and the model's shared
  memory equals the compiled SharedStorage size.
"""

from __future__ import annotations

import pytest

from fa4.kernels import AttentionProblem, Config, compile_key, feasible, knobs_for
from fa4.kernels.device import B200
from fa4.kernels import sm100
from fa4.kernels.sm100.plan import TMEM_COLUMNS, kv_ring_deadlock, make_plan

BASE = AttentionProblem(1, 1024, 1024, 32, 8, 128)
PROBLEMS = [
    BASE,
    AttentionProblem(2, 4099, 17, 32, 8, 64, "bf16", causal=True, return_lse=True),
    AttentionProblem(1, 1000, 1000, 24, 8, 128, causal=True),  # GQA ratio 3: no packing
    AttentionProblem(1, 128, 2048, 8, 1, 64),                  # MQA, ratio 8
]


def cfg(**kw) -> Config:
    return Config.make("sm100", **kw)


# --- the feasibility model --------------------------------------------------------------------

def test_tmem_budget_is_exactly_512_columns():
    # 2*128 (O) + 2*128 (S/P ring) = 512: fits exactly
    assert not [r for r in sm100.resource_reasons(cfg(q_stages=2, tmem_stages=2, tile_n=128), BASE)
                if "TMEM" in r]
    reasons = sm100.resource_reasons(cfg(q_stages=2, tmem_stages=3, tile_n=128), BASE)
    assert any("TMEM" in r and "640 > 512" in r for r in reasons), reasons
    # the same ring fits with one Q stage (128 + 3*128 = 512) or with 64-key blocks (256 + 192)
    assert not [r for r in sm100.resource_reasons(cfg(q_stages=1, tmem_stages=3), BASE) if "TMEM" in r]
    assert not [r for r in sm100.resource_reasons(cfg(tmem_stages=3, tile_n=64), BASE) if "TMEM" in r]
    d64 = AttentionProblem(1, 1024, 1024, 32, 8, 64)
    assert not [r for r in sm100.resource_reasons(cfg(tmem_stages=3, tile_n=128), d64) if "TMEM" in r]


def test_shared_memory_limit():
    # Q (2x32 KiB) + O staging (2x32 KiB) + 4 K/V slots of 32 KiB = 256 KiB > 227 KiB
    reasons = sm100.resource_reasons(cfg(kv_stages=4), BASE)
    assert any("shared memory" in r and str(B200.smem_per_block_bytes) in r for r in reasons), reasons
    # three slots fit, at exactly the limit once rounded to the 1 KiB alignment of the struct
    res = sm100.resources(cfg(kv_stages=3), BASE)
    assert res["smem_bytes"] <= B200.smem_per_block_bytes
    assert not [r for r in sm100.resource_reasons(cfg(kv_stages=3), BASE) if "shared" in r]
    # 64-key blocks halve the K/V slots: four fit
    assert not [r for r in sm100.resource_reasons(cfg(kv_stages=4, tile_n=64), BASE) if "shared" in r]


def test_smem_model_adds_up_the_buffers():
    plan = make_plan(cfg(kv_stages=2, q_stages=2, tile_n=128), BASE)
    tiles = 2 * 128 * 128 * 2 + 2 * 128 * 128 * 2 + 2 * 128 * 128 * 2
    assert tiles < plan.smem_bytes <= tiles + 4096


def test_register_split_and_its_limits():
    res = sm100.resources(cfg(softmax_regs=192), BASE)
    # four warpgroups share 64 K registers: 2*softmax + correction + other <= 512 per thread slot
    assert 2 * res["regs_softmax"] + res["regs_correction"] + res["regs_other"] <= 512
    assert res["regs_correction"] == 80
    # a 64-column rescale chunk needs the correction group's 112 registers (softmax_regs=176)
    assert not [r for r in sm100.resource_reasons(cfg(rescale_tile=64, softmax_regs=176), BASE)
                if "correction" in r]
    for regs in (184, 192, 200):
        reasons = sm100.resource_reasons(cfg(rescale_tile=64, softmax_regs=regs), BASE)
        assert any("correction" in r for r in reasons), (regs, reasons)
    # 16-column chunks fit even the smallest correction group; 32 needs 96 (softmax_regs <= 184)
    assert not [r for r in sm100.resource_reasons(cfg(rescale_tile=16, softmax_regs=200), BASE)
                if "correction" in r]
    assert any("correction" in r for r in sm100.resource_reasons(cfg(rescale_tile=32, softmax_regs=192), BASE))
    assert not [r for r in sm100.resource_reasons(cfg(rescale_tile=32, softmax_regs=184), BASE)
                if "correction" in r]


def test_kv_ring_deadlock_model():
    # the load warp fills the ring in the MMA warp's order of first use, so 2 slots always suffice
    for q in (1, 2):
        for t in (1, 2, 3):
            assert kv_ring_deadlock(q, t, 2) is None
    # one slot cannot hold K[n+1] while V[n] waits for its value MMA (not a knob value: a model check)
    assert "deadlock" in kv_ring_deadlock(2, 3, 1)


def test_pack_gqa_needs_ratio_dividing_the_tile():
    p3 = AttentionProblem(1, 1000, 1000, 24, 8, 128)
    assert any("pack_gqa" in r for r in sm100.resource_reasons(cfg(pack_gqa=True), p3))
    assert not [r for r in sm100.resource_reasons(cfg(pack_gqa=False), p3) if "pack_gqa" in r]


def test_two_cta_rules():
    """The cluster pair: non-causal only (a stated reason, not a silently ignored knob); each CTA
    holds half of every K/V tile, so four K/V stages fit at D=128 (three without the pair); the MMA
    warp's p_full and o_ready count both CTAs' warpgroups (p_full the correction's too when merged);
    the pair is a codegen knob."""
    causal = AttentionProblem(1, 1024, 1024, 32, 8, 128, causal=True)
    reasons = sm100.resource_reasons(cfg(two_cta=True, scheduler="lpt"), causal)
    assert any(r.startswith("two_cta: non-causal only") for r in reasons), reasons
    assert not sm100.resource_reasons(cfg(two_cta=True, kv_stages=4), BASE)
    assert any("shared memory" in r for r in sm100.resource_reasons(cfg(kv_stages=4), BASE))
    single, pair = make_plan(cfg(kv_stages=3), BASE), make_plan(cfg(kv_stages=3, two_cta=True), BASE)
    # half of three 32 KiB slots (the 8-byte TMEM-dealloc barrier fits the struct's 1 KiB rounding)
    assert single.smem_bytes - pair.smem_bytes == 3 * 128 * 128 * 2 // 2
    # tmem_stages == q_stages here: p_full also takes the correction's O-ready arrivals
    assert single.p_o_merged and pair.p_o_merged
    assert pair.barrier_arrivals["o_ready"] == 256 and pair.barrier_arrivals["p_full"] == 512
    assert single.barrier_arrivals["p_full"] == 256 and pair.mma_m == 256 and pair.tmem_columns == 512
    apart = make_plan(cfg(kv_stages=3, tmem_stages=1, two_cta=True), BASE)
    assert not apart.p_o_merged and apart.barrier_arrivals["p_full"] == 256
    assert compile_key(cfg(two_cta=True), BASE) != compile_key(cfg(), BASE)
    # the pair's measured spill (poly 8, one Q stage, softmax_regs 192) is a reason; neighbours are not
    spill = cfg(two_cta=True, exp2_poly_columns=8, softmax_regs=192, q_stages=1, tmem_stages=3)
    assert any("two_cta with exp2_poly_columns=8" in r for r in sm100.resource_reasons(spill, BASE))
    for ok in (spill.replace(softmax_regs=200), spill.replace(tmem_stages=1), spill.replace(two_cta=False)):
        assert not sm100.resource_reasons(ok, BASE), ok.label()
    # and the one a sample on the H200 host's cores found (poly 4, two Q stages, softmax_regs 176)
    spill = cfg(two_cta=True, exp2_poly_columns=4, softmax_regs=176, q_stages=2, tmem_stages=1, rescale_tile=32)
    assert any("two_cta with exp2_poly_columns=4" in r for r in sm100.resource_reasons(spill, BASE))
    for ok in (spill.replace(softmax_regs=184), spill.replace(exp2_poly_columns=8), spill.replace(two_cta=False)):
        assert not sm100.resource_reasons(ok, BASE), ok.label()


def test_scheduler_launches_a_pair_per_task():
    """two_cta's task arithmetic lives in the scheduler (cta_group, compile-time like kind and the SM
    count): two CTAs per task, a persistent grid of at most SM count / 2 pairs."""
    pytest.importorskip("cutlass")
    from fa4.kernels.sm100.scheduler import TileScheduler

    def grid_x(kind, num_tasks, cta_group):
        sched = TileScheduler(kind, 4, 8, num_tasks, 1, 148, cta_group=cta_group)
        return int(sched.grid_shape()[0])
    for kind in ("single", "static", "lpt"):
        assert grid_x(kind, 64, 1) == 64 and grid_x(kind, 64, 2) == 128
    assert grid_x("single", 1000, 2) == 2000
    assert grid_x("static", 1000, 1) == 148 and grid_x("lpt", 1000, 2) == 148  # 74 pairs
    assert grid_x("static", 1000, 2) % 2 == 0
    # the device copy the DSL makes of a scheduler keeps the pair size
    pair = TileScheduler("static", 4, 8, 32, 1, 148, cta_group=2)
    assert pair.__new_from_mlir_values__([4, 8, 32, 1]).cta_group == 2
    with pytest.raises(ValueError, match="cta_group"):
        TileScheduler("static", 4, 8, 32, 1, 148, cta_group=4)


def test_single_cta_measured_spill_is_a_reason():
    """Found by a 1,200-configuration CPU sample (results/compile_space/sm100-v5-sample1200-full.json.gz):
    4 polynomial exp2 columns at softmax_regs 176 with one Q stage, two TMEM stages and 128-key blocks
    spilled 16 B, one CTA; its measured neighbours compiled clean and stay allowed."""
    spill = cfg(exp2_poly_columns=4, softmax_regs=176, q_stages=1, tmem_stages=2, tile_n=128, kv_stages=4,
                rescale_tile=16, scheduler="single")
    assert any("spilled 16 B" in r for r in sm100.resource_reasons(spill, BASE))
    for ok in (spill.replace(tmem_stages=1), spill.replace(tmem_stages=3), spill.replace(q_stages=2, kv_stages=2),
               spill.replace(exp2_poly_columns=8), spill.replace(exp2_poly_columns=0), spill.replace(softmax_regs=184)):
        assert not sm100.resource_reasons(ok, BASE), ok.label()


def test_two_cta_lpt_measured_spill_is_a_reason():
    """Found by whole-space shard 0/40 (benchmarks/sm100_whole_space.sh): the cluster pair with the LPT
    order, 8 polynomial columns, two Q stages, one TMEM stage and rescale_tile 32 spilled 32 B at
    softmax_regs 184; its measured neighbours compiled clean and stay allowed."""
    spill = cfg(two_cta=True, scheduler="lpt", exp2_poly_columns=8, softmax_regs=184, q_stages=2, tmem_stages=1,
                tile_n=128, rescale_tile=32, kv_stages=4, rescale_threshold=0.0)
    assert any("spilled 32 B" in r for r in sm100.resource_reasons(spill, BASE))
    for ok in (spill.replace(scheduler="static"), spill.replace(scheduler="single"), spill.replace(rescale_tile=16),
               spill.replace(exp2_poly_columns=4), spill.replace(exp2_poly_columns=0), spill.replace(q_stages=1),
               spill.replace(tmem_stages=2), spill.replace(tile_n=64), spill.replace(two_cta=False, kv_stages=3)):
        assert not sm100.resource_reasons(ok, BASE), ok.label()


@pytest.mark.slow
def test_two_cta_lpt_measured_spill_is_what_the_compiler_does():
    pytest.importorskip("cutlass")
    c = cfg(two_cta=True, scheduler="lpt", exp2_poly_columns=8, softmax_regs=184, q_stages=2, tmem_stages=1,
            tile_n=128, rescale_tile=32, kv_stages=3, pack_gqa=False)
    assert sm100.compile_report(c, BASE)["spill_stores"] > 0
    assert sm100.compile_report(c.replace(scheduler="static"), BASE)["spill_stores"] == 0


@pytest.mark.slow
def test_single_cta_measured_spill_is_what_the_compiler_does():
    pytest.importorskip("cutlass")
    c = cfg(exp2_poly_columns=4, softmax_regs=176, q_stages=1, tmem_stages=2, tile_n=128, kv_stages=2,
            rescale_tile=64, scheduler="static", rescale_threshold=12.0)
    assert sm100.compile_report(c, BASE)["spill_stores"] > 0
    assert sm100.compile_report(c.replace(tmem_stages=1), BASE)["spill_stores"] == 0


@pytest.mark.slow
def test_two_cta_measured_spill_is_what_the_compiler_does():
    pytest.importorskip("cutlass")
    c = cfg(two_cta=True, exp2_poly_columns=8, softmax_regs=192, q_stages=1, tmem_stages=3,
            kv_stages=2, scheduler="single")
    assert sm100.compile_report(c, BASE)["spill_stores"] > 0
    assert sm100.compile_report(c.replace(softmax_regs=200), BASE)["spill_stores"] == 0
    c = cfg(two_cta=True, exp2_poly_columns=4, softmax_regs=176, q_stages=2, tmem_stages=1, rescale_tile=32,
            kv_stages=2, scheduler="single", pack_gqa=False)
    assert sm100.compile_report(c, BASE)["spill_stores"] > 0
    assert sm100.compile_report(c.replace(softmax_regs=184), BASE)["spill_stores"] == 0


def test_plan_exp2_constants_are_the_shared_polynomial():
    """plan.py keeps the polynomial's numbers DSL-free for the emulation; the kernel's exponent add
    comes from kernels/fast_exp2.py, so both must describe the same polynomial."""
    pytest.importorskip("cutlass")
    from fa4.kernels import fast_exp2
    from fa4.kernels.sm100 import plan
    assert (plan.EXP2_POLY, plan.EXP2_ROUND_MAGIC, plan.EXP2_POLY_CHUNK) == (
        fast_exp2.EXP2_POLY, fast_exp2.EXP2_ROUND_MAGIC, fast_exp2.EXP2_POLY_CHUNK)
    assert "../fast_exp2.py" in sm100.SOURCE_FILES


def test_can_implement_head_dims():
    assert sm100.can_implement(BASE) == []
    assert sm100.can_implement(AttentionProblem(1, 8, 8, 2, 2, 96))


@pytest.mark.parametrize("problem", PROBLEMS, ids=lambda p: p.label())
def test_default_config_is_feasible(problem):
    c = sm100.default_config(problem)
    assert c.arch == "sm100"
    assert feasible(c, problem) == [], feasible(c, problem)


def test_problem_key_ignores_sequence_lengths_batch_and_heads():
    a = AttentionProblem(1, 1024, 1024, 32, 8, 128)
    b = AttentionProblem(4, 77, 4099, 64, 16, 128)  # same GQA ratio
    c = cfg()
    assert compile_key(c, a) == compile_key(c, b)
    assert compile_key(c, a) != compile_key(c, AttentionProblem(1, 1024, 1024, 32, 8, 128, causal=True))
    # the ratio is compiled in only when packing GQA
    d = AttentionProblem(1, 1024, 1024, 32, 16, 128)
    assert compile_key(c.replace(pack_gqa=True), a) != compile_key(c.replace(pack_gqa=True), d)
    assert compile_key(c.replace(pack_gqa=False), a) == compile_key(c.replace(pack_gqa=False), d)


def test_search_space_covers_every_declared_value():
    from fa4tune.inputs.space import load_space
    space = load_space("sm100")
    for k in knobs_for("sm100"):
        assert sorted(map(repr, space.choices_of(k.name))) == sorted(map(repr, k.choices)), k.name


@pytest.mark.parametrize("problem", PROBLEMS, ids=lambda p: p.label())
def test_every_space_config_is_rejected_with_a_reason_or_within_budget(problem):
    from fa4tune.inputs.space import load_space
    n_ok = 0
    for c in load_space("sm100").configs():
        reasons = feasible(c, problem)
        if reasons:
            assert all(isinstance(r, str) and r for r in reasons)
            continue
        n_ok += 1
        res = sm100.resources(c, problem)
        assert res["tmem_columns"] <= TMEM_COLUMNS
        assert res["smem_bytes"] <= B200.smem_per_block_bytes
        assert 2 * res["regs_softmax"] + res["regs_correction"] + res["regs_other"] <= 512
    assert n_ok > 0


def test_sample_covers_every_knob_value_and_is_feasible():
    from sm100_sample import representative_sample
    sample = representative_sample()
    assert 6 <= len(sample) <= 20
    for c, p in sample:
        assert feasible(c, p) == [], (c.label(), p.label(), feasible(c, p))
    for k in knobs_for("sm100"):
        seen = {repr(getattr(c, k.name)) for c, _ in sample}
        assert seen == {repr(v) for v in k.choices}, (k.name, seen)


# --- compiles (CPU, sm_100a) --------------------------------------------------------------------

@pytest.fixture(scope="module")
def sample_rows():
    pytest.importorskip("cutlass")
    from sm100_sample import compile_many, representative_sample
    return compile_many([], jobs=2, pairs=representative_sample())


def test_sample_compiles_without_spills_with_tcgen05_and_tma(sample_rows):
    bad = [(r["label"], r["problem"], r["status"], r["reason"]) for r in sample_rows
           if r["status"] != "ok"]
    assert not bad, bad
    for r in sample_rows:
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, r
        assert r["ptx_markers"] == {"tcgen05.mma": True, "tcgen05.ld": True, "tcgen05.st": True,
                                    "cp.async.bulk.tensor": True}, r
        # the 512-thread CTA launches with 128 registers per thread; setmaxnreg splits them
        assert r["registers"] == 128, r


def test_sample_smem_model_equals_shared_storage(sample_rows):
    for r in sample_rows:
        assert r["smem_bytes"] == r["smem_model_bytes"], r
        assert r["smem_bytes"] <= B200.smem_per_block_bytes


def test_compile_attention_refuses_without_blackwell():
    torch = pytest.importorskip("torch")
    from fa4.arch import arch_of_capability

    if torch.cuda.is_available() and arch_of_capability(torch.cuda.get_device_capability()) == "sm100":
        pytest.skip("a Blackwell GPU is present")
    with pytest.raises(RuntimeError, match="Blackwell"):
        sm100.compile_attention(sm100.default_config(BASE), BASE)


def test_compile_report_targets_sm100a_after_an_sm90_compile_in_the_same_process():
    # the DSL caches its target architecture: a process that compiled sm_90a first must still
    # trace the sm100 kernel for sm_100a (and the sm90 family its own target afterwards)
    pytest.importorskip("cutlass")
    from fa4.kernels import compile_report, default_config
    p = AttentionProblem(1, 256, 256, 4, 4, 64)
    assert compile_report(default_config("sm90", p), p).get("ok", True)
    rep = compile_report(default_config("sm100", p), p)
    assert all(rep["ptx_markers"].values()) and rep["spill_stores"] == 0, rep


# --- the register model against the compiler ---------------------------------------------------

def test_softmax_register_model_matches_the_measured_compiles():
    # 128-key rows fit the smallest offered softmax_regs without causal/LSE/LPT work and the next
    # one with it (the CI sample compiles both corners without spills; causal + LSE + LPT spilled
    # 8 B at 176 in one configuration); 160-key rows spill at every offered value (slow test below)
    from fa4.kernels.sm100.feasibility import _softmax_register_need
    regs = sorted(next(k for k in knobs_for("sm100") if k.name == "softmax_regs").choices)
    assert _softmax_register_need(128, busy=False) == regs[0]
    assert _softmax_register_need(128, busy=True) == regs[1]
    assert _softmax_register_need(160, busy=False) > regs[-1]


@pytest.mark.slow
@pytest.mark.parametrize("q_stages,tmem_stages", [(2, 1), (1, 2)])
def test_tile_n_160_spills_where_the_model_says_it_cannot_fit(monkeypatch, q_stages, tmem_stages):
    """Compile tile_n=160 (not a knob value: declared here for the test) at the most softmax
    registers offered: the compiler spills, as the model's register reason says."""
    pytest.importorskip("cutlass")
    from fa4.kernels import knobs as knob_table
    widened = tuple(
        knob_table.Knob(k.name, k.choices + (160,), k.default, k.meaning, k.codegen, k.archs)
        if k.name == "tile_n" and "sm100" in k.archs else k for k in knob_table.KNOBS)
    monkeypatch.setattr(knob_table, "KNOBS", widened)
    c = Config.make("sm100", tile_n=160, q_stages=q_stages, tmem_stages=tmem_stages, kv_stages=2,
                    softmax_regs=200, scheduler="static")
    assert any("registers: a softmax thread" in r for r in sm100.resource_reasons(c, BASE))
    assert not [r for r in sm100.resource_reasons(c, BASE) if "TMEM" in r]
    rep = sm100.compile_report(c, BASE)
    assert rep["spill_stores"] > 0, rep


def test_measured_spill_is_a_reason():
    busy = AttentionProblem(1, 1024, 1024, 32, 8, 128, causal=True, return_lse=True)
    c = cfg(exp2_poly_columns=8, softmax_regs=192, scheduler="lpt")
    assert any("spilled 24 B" in r for r in sm100.resource_reasons(c, busy))
    # its neighbours compiled clean: not rejected
    assert not sm100.resource_reasons(c.replace(softmax_regs=184), busy)
    assert not sm100.resource_reasons(c.replace(softmax_regs=200, rescale_tile=16), busy)
    assert not sm100.resource_reasons(c.replace(scheduler="static"), BASE)  # no causal/LSE/LPT work


@pytest.mark.slow
def test_measured_spill_is_what_the_compiler_does():
    pytest.importorskip("cutlass")
    busy = AttentionProblem(1, 1024, 1024, 32, 8, 128, causal=True, return_lse=True)
    c = cfg(exp2_poly_columns=8, softmax_regs=192, scheduler="lpt")
    assert sm100.compile_report(c, busy)["spill_stores"] > 0
    assert sm100.compile_report(c.replace(softmax_regs=184), busy)["spill_stores"] == 0


def test_the_model_and_the_default_are_outside_the_fingerprint():
    """The feasibility model and the default rules judge configurations; they never change what one
    compiles to: adding a measured spill corner must not make the whole-space shards' compile results
    (benchmarks/sm100_whole_space.sh) or the disk cache stale."""
    from fa4.kernels.sm100 import defaults, feasibility

    assert sm100.default_config is defaults.default_config
    assert sm100.resource_reasons is feasibility.resource_reasons
    assert not {"defaults.py", "feasibility.py"} & set(sm100.SOURCE_FILES)
