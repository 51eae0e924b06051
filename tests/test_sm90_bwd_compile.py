"""Our sm90 attention backward (`fa4.kernels.sm90_bwd`) compiles for sm_90a on a CPU: preprocess, main
kernel and postprocess, for both head dims, both 16-bit dtypes, causal and full, with no register
spills; its knobs are the knob set "sm90_bwd" of `fa4.kernels.knobs`; its resource model
(`sm90_bwd.feasibility`) agrees with the compiler (shared memory byte for byte, registers: what it
admits compiles clean, what it refuses for registers spills); and it rejects, loudly, what it cannot
run. (Whether its gradients are right is tests/gpu/test_sm90_bwd_gpu.py's question, on an H200.)

The whole space x every compiled-in problem kind is `slow` (minutes on CI's two cores); the default run
compiles the defaults and a sample that takes every knob value once."""

from __future__ import annotations

import functools
import itertools
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

import pytest

from fa4.kernels import Config, knobs_for, sm90_bwd
from fa4.kernels.problem import AttentionProblem
from fa4tune.inputs.space import load_space

# GQA ratio 4, odd lengths, Sq != Sk: what is compiled in is only dtype, head dim and causal (the
# rest is symbolic), but the problem a test names is one the kernel must run
CASES = [AttentionProblem(2, 177, 301, 8, 2, d, dtype, causal)
         for d, dtype, causal in itertools.product((64, 128), ("fp16", "bf16"), (True, False))]


def _case_id(problem: AttentionProblem) -> str:
    return f"d{problem.head_dim}-{problem.dtype}-{'causal' if problem.causal else 'full'}"


def _problem(head_dim: int, dtype: str = "bf16", causal: bool = True, heads_kv: int = 2) -> AttentionProblem:
    return AttentionProblem(2, 177, 301, 8, heads_kv, head_dim, dtype, causal)


@pytest.mark.parametrize("problem", CASES, ids=_case_id)
def test_the_default_backward_compiles_clean(problem):
    config = sm90_bwd.default_config(problem)
    reports = sm90_bwd.compile_report(config, problem)
    assert tuple(reports) == sm90_bwd.kernel_names(config)
    for name, report in reports.items():
        assert report["spill_stores"] == 0 and report["spill_loads"] == 0, (name, report)
        assert not report["wgmma_serialized"], (name, report)
        assert report["registers"] is not None, (name, report)
    main = reports["main"]
    assert main["ptx_markers"]["wgmma"] and main["ptx_markers"]["tma_load"], main["ptx_markers"]
    assert main["ptx_markers"]["setmaxnreg"] and main["ptx_markers"]["stmatrix"], main["ptx_markers"]
    # the traced shared memory is the model's, byte for byte
    assert main["smem_bytes"] == sm90_bwd.smem_bytes(config, problem) <= sm90_bwd.REFERENCE_DEVICE.smem_per_block_bytes
    # the preprocess is elementwise: no wgmma, no TMA, no atomics
    assert not any(reports["preprocess"]["ptx_markers"].values())


# the main kernel alone, whatever the model says (picklable: the whole-space test compiles in processes)
_MAIN_REPORT = functools.partial(sm90_bwd.compile_report, only=("main",), check=False)


def _compile_main(config: Config, problem: AttentionProblem, reports: dict = None) -> dict:
    """Compile the main kernel (whatever the model says; or take its `reports`, compiled elsewhere)
    and hold the model to what came out: shared memory byte for byte; what it admits compiles clean,
    with the PTX of its dQ path. Returns the report with `broken` (spills or serialised wgmma)."""
    report = (reports or _MAIN_REPORT(config, problem))["main"]
    broken = bool(report["spill_stores"] or report["spill_loads"] or report["wgmma_serialized"])
    assert report["smem_bytes"] == sm90_bwd.smem_bytes(config, problem), config.label()
    if not sm90_bwd.reasons(config, problem):
        assert not broken, f"the model admits {config.label()} at {problem.label()}, which compiles to {report}"
        markers = report["ptx_markers"]
        assert markers["wgmma"] and markers["tma_load"] and markers["setmaxnreg"], markers
        assert markers["dq_atomics"] == (config.dq_accum == "atomic"), markers
        assert markers["dq_vector_atomics"] == (config.dq_accum == "fragment_atomic"), markers
        # dQ's reduce-add per block, or dK's and dV's at the end of a split group's CTAs
        assert markers["tma_reduce"] == (config.dq_accum in ("bulk", "fragment") or config.group_split > 1), markers
    return {**report, "broken": broken}


def _refused_for_registers_alone(config: Config, problem: AttentionProblem) -> bool:
    why = sm90_bwd.reasons(config, problem)
    return bool(why) and all(reason.startswith("registers") for reason in why)


# every value of every backward knob at least once, each feasible on its problem, plus the defaults
SAMPLE = [
    (dict(), _problem(128)),
    (dict(tile_m=128, tile_n=64, q_stages=1, scheduler="single_lpt"), _problem(64, "fp16", causal=False)),
    (dict(tile_m=64, tile_n=64, q_stages=1, dq_accum="bulk"), _problem(128, "fp16")),
    (dict(sdp_swap=True, dq_accum="bulk", pds_stages=2), _problem(128)),
    (dict(tile_m=128, sdp_swap=True, dq_accum="bulk", pds_stages=2), _problem(64, causal=False)),
    (dict(pds_stages=2, scheduler="single_lpt"), _problem(64, "fp16")),
    # a split group: dK and dV by fp32 reduce-adds, through sQ/sdO and sK/sV (two tiles) or sK/sV
    # alone (one Q/dO stage of 64 rows holds less than 128 keys' tile), beside each dQ path
    (dict(sdp_swap=True, dq_accum="bulk", pds_stages=2, group_split=2), _problem(128)),
    (dict(sdp_swap=True, q_stages=1, group_split=4), _problem(128, "fp16", causal=False)),
    (dict(tile_m=128, sdp_swap=True, dq_accum="bulk", pds_stages=2, group_split=8),
     _problem(64, causal=False, heads_kv=1)),
    (dict(tile_n=64, q_stages=1, dq_accum="bulk", group_split=2), _problem(64, "fp16")),
    # 80 query rows a block: S^T's N, and dQ^T = K^T dS^T through the transposed fp32 tile (the
    # accumulators at 208 registers, shared memory at the H200's 227 KB)
    (dict(tile_m=80, sdp_swap=True, dq_accum="bulk", pds_stages=2), _problem(128, causal=False)),
    # dQ in fragment order: swapped at 80 rows (with a split group's own dK/dV converter), unswapped at 128
    (dict(tile_m=80, sdp_swap=True, dq_accum="fragment", pds_stages=2, group_split=2), _problem(128)),
    (dict(tile_m=128, sdp_swap=True, dq_accum="fragment", pds_stages=2), _problem(64, causal=False)),
    # ... added from registers by 128-bit reds (no dQ tile in shared memory): swapped at 80 rows beside a
    # split group's converter, unswapped at 64
    (dict(tile_m=80, sdp_swap=True, dq_accum="fragment_atomic", pds_stages=2, group_split=2), _problem(128)),
    (dict(tile_m=64, dq_accum="fragment_atomic"), _problem(128, "fp16", causal=False)),
    (dict(tile_m=80, sdp_swap=True, dq_accum="bulk", q_stages=1, group_split=2, scheduler="single_lpt"),
     _problem(64, "fp16")),
    # sections of GQA groups on a one-axis grid, each CTA finding its tile (plan.sectioned_tile)
    (dict(tile_m=80, sdp_swap=True, dq_accum="bulk", pds_stages=2, group_split=2, scheduler="sectioned_lpt"),
     _problem(128)),
    # ... and with one P/dS buffer, S and dP through shared memory (the whole-space test's sectioned
    # configurations all have two)
    (dict(scheduler="sectioned_lpt"), _problem(128)),
    # at head dim 64 (the whole-space test takes sectioned_lpt under a causal mask only, at head dim 128)
    (dict(tile_m=128, sdp_swap=True, dq_accum="fragment", pds_stages=2, scheduler="sectioned_lpt"),
     _problem(64, causal=False)),
]
# refused for registers, and compiled anyway: they spill (S and dP through shared memory at 128 x 128;
# all four accumulators at 128 x 128 and head dim 128)
REFUSED = [
    (dict(tile_m=128, tile_n=128), _problem(64, "fp16")),
    (dict(tile_m=128, tile_n=128, sdp_swap=True, q_stages=1), _problem(128)),
]


def test_sample_covers_every_knob_value():
    seen = {k.name: set() for k in knobs_for("sm90_bwd")}
    for over, _ in SAMPLE:
        for name, value in Config.make("sm90_bwd", **over).items:
            seen[name].add(value)
    for k in knobs_for("sm90_bwd"):
        assert set(k.choices) <= seen[k.name], f"{k.name}: the sample misses {set(k.choices) - seen[k.name]}"


@pytest.mark.parametrize("over, problem", SAMPLE,
                         ids=[f"{Config.make('sm90_bwd', **o).label()}-{_case_id(p)}" for o, p in SAMPLE])
def test_a_sample_compiles_clean_as_the_model_says(over, problem):
    config = Config.make("sm90_bwd", **over)
    assert sm90_bwd.reasons(config, problem) == []
    _compile_main(config, problem)


@pytest.mark.parametrize("over, problem", REFUSED,
                         ids=[f"{Config.make('sm90_bwd', **o).label()}-{_case_id(p)}" for o, p in REFUSED])
def test_what_the_register_model_refuses_spills(over, problem):
    config = Config.make("sm90_bwd", **over)
    assert _refused_for_registers_alone(config, problem)
    assert _compile_main(config, problem)["broken"]


# the whole space at each head dim, on one compiled-in kind each (the mask and dtype move ptxas's
# register count by a few; the sample above and the defaults cover the other kinds)
SPACE_KINDS = [_problem(128, "bf16", causal=True), _problem(64, "fp16", causal=False)]


def _whole_space_to_compile(problem: AttentionProblem) -> list[Config]:
    """The space's configurations with one CTA a group, and with two (group_split's code is the
    epilogue and the grid: 4 and 8 compile the same code as 2 with another constant, so they are the
    sample's), the knobs that do not meet the epilogue (grid order, P/dS buffers) at one value there,
    and two Q/dO stages (one, where dV's fp32 tile reuses dK's bytes, is the sample's). single_lpt is
    single reading its block indices from other grid axes: the same instructions but for which
    SR_CTAID register each S2R reads (SASS of three configurations, 2026-12-06), so the plain order
    stands for both here and single_lpt is the sample's. sectioned_lpt adds its tile's arithmetic
    before the warp roles split: here with two P/dS buffers (the register corner where sectioned grids
    once spilled), with one it is the sample's (the block loop of one buffer is the plain order's here).
    Under a full mask (the head-dim-64 kind) neither sectioned_lpt nor a split group: the default runs
    sectioned_lpt under a causal mask only, where this test takes it, and a split group's register
    corner is at head dim 128 (8 bytes spilled at 64 x 128 with S and dP through shared memory), where
    this test takes split 2; the sample has both at head dim 64, a split one without a mask. This test
    is more than half of CI's time; these cuts keep CI under 20 minutes. dq_accum "fragment_atomic" is
    "atomic"'s adds from registers (128-bit, fragment order) without its row bounds: here swapped (every
    configuration the search has kept is) in the plain order with one CTA a group; the sample has it
    unswapped, and swapped beside a split group."""
    configs = []
    for config in load_space("sm90_bwd").configs():
        if config.scheduler == "single_lpt" or (config.scheduler == "sectioned_lpt" and config.pds_stages == 1):
            continue
        if config.dq_accum == "fragment_atomic" and (config.scheduler != "single" or config.group_split > 1
                                                     or not config.sdp_swap):
            continue
        if not problem.causal and (config.scheduler == "sectioned_lpt" or config.group_split > 1):
            continue
        if config.group_split == 1 or (config.group_split == 2 and config.scheduler == "single"
                                       and config.pds_stages == 1 and config.q_stages == 2):
            configs.append(config)
    return configs


@pytest.mark.slow
@pytest.mark.parametrize("problem", SPACE_KINDS, ids=_case_id)
def test_the_whole_space_holds_the_model_to_the_compiler(problem):
    """Every configuration of search_spaces/sm90_bwd.toml that the model admits, or refuses for
    registers alone, compiled: what it admits compiles clean (shared memory exact), and it admits at
    least 90 % of what compiles clean (the register limits are not loose guesses: at head dim 64 it
    refuses one 128 x 128 variant through shared memory that ptxas fits). Refusals for shared memory or
    a tile the layout needs are the model's arithmetic alone."""
    admitted, refused, refused_clean = 0, 0, []
    configs = [c for c in _whole_space_to_compile(problem)
               if not sm90_bwd.reasons(c, problem) or _refused_for_registers_alone(c, problem)]
    # on every core: a compile is one process's work for a second or two, and there are 80-100
    with ProcessPoolExecutor(max_workers=os.cpu_count() or 1, mp_context=multiprocessing.get_context("spawn")) as pool:
        reports = list(pool.map(_MAIN_REPORT, configs, [problem] * len(configs)))
    for config, report in zip(configs, reports):
        if sm90_bwd.reasons(config, problem):
            refused += 1
            if not _compile_main(config, problem, report)["broken"]:
                refused_clean.append(config.label())
        else:
            admitted += 1
            _compile_main(config, problem, report)
    assert admitted > 0 and refused > 0
    assert admitted >= 0.9 * (admitted + len(refused_clean)), refused_clean


def test_what_the_kernel_cannot_run_is_refused_loudly():
    # a value outside the declared choices is not a configuration at all
    with pytest.raises(ValueError, match="tile_m=96"):
        Config.make("sm90_bwd", tile_m=96)
    with pytest.raises(ValueError, match="unknown knob"):
        Config.make("sm90_bwd", pv_operand="rs")   # a forward knob
    # a forward configuration is not a backward one
    problem = _problem(128)
    assert any("not sm90_bwd" in r for r in sm90_bwd.reasons(Config.make("sm90"), problem))
    # a head dim without code; a tile the registers cannot hold
    assert any("head_dim=96" in r for r in sm90_bwd.reasons(Config.make("sm90_bwd"), _problem(96)))
    big = Config.make("sm90_bwd", tile_m=128, tile_n=128)
    assert any("registers" in r for r in sm90_bwd.reasons(big, _problem(64)))
    for compile_fn in (sm90_bwd.compile_report, sm90_bwd.compile_backward):
        with pytest.raises(ValueError, match="S and dP hold 128"):
            compile_fn(big, _problem(64))
    # a grid beyond CUDA's limits: longest first puts the key blocks on the grid's z (65,535 at most)
    long_keys = AttentionProblem(1, 128, 65_536 * 128 + 1, 4, 2, 128, "bf16", False)
    assert any("grid z" in r for r in sm90_bwd.reasons(Config.make("sm90_bwd", scheduler="single_lpt"), long_keys))
    assert sm90_bwd.reasons(Config.make("sm90_bwd"), long_keys) == []
    # the kernel object itself refuses what its code does not implement, whatever a caller checked
    from fa4.kernels.sm90_bwd.kernel import FlashAttentionBackwardSm90

    knobs = Config.make("sm90_bwd").to_dict()
    with pytest.raises(ValueError, match="dq_accum='tma' is not implemented"):
        FlashAttentionBackwardSm90(dtype="bf16", head_dim=128, causal=False, **{**knobs, "dq_accum": "tma"})
    with pytest.raises(ValueError, match="sdp_swap needs tile_n=128"):
        FlashAttentionBackwardSm90(dtype="bf16", head_dim=128, causal=False,
                                   **{**knobs, "sdp_swap": True, "tile_n": 64})
    # ... and the model says so before compiling
    swapped_64 = Config.make("sm90_bwd", sdp_swap=True, tile_n=64)
    assert any("sdp_swap needs tile_n=128" in r for r in sm90_bwd.reasons(swapped_64, problem))
    # a split group needs a query head in every part
    with pytest.raises(ValueError, match="group_split=3 is not implemented"):
        FlashAttentionBackwardSm90(dtype="bf16", head_dim=128, causal=False, **{**knobs, "group_split": 3})
    mha = AttentionProblem(1, 128, 128, 4, 4, 128, "bf16", False)
    assert any("group_split=2 > the GQA ratio 1" in r
               for r in sm90_bwd.reasons(Config.make("sm90_bwd", group_split=2), mha))
    gqa5 = AttentionProblem(1, 128, 128, 5, 1, 128, "bf16", False)
    assert any("leaves a part of the 5 query heads" in r
               for r in sm90_bwd.reasons(Config.make("sm90_bwd", group_split=4), gqa5))
    assert sm90_bwd.reasons(Config.make("sm90_bwd", group_split=2, sdp_swap=True), gqa5) == []   # 3 + 2 heads
    # 80 query rows are only ever a wgmma's N: S^T swapped, dQ^T by the bulk path
    for over, why in ((dict(tile_m=80, dq_accum="bulk"), "tile_m=80 (not a multiple of 64) needs sdp_swap"),
                      (dict(tile_m=80, sdp_swap=True), "by a bulk path only")):
        assert any(why in r for r in sm90_bwd.reasons(Config.make("sm90_bwd", **over), problem))
        with pytest.raises(ValueError, match=why.replace("(", r"\(").replace(")", r"\)")):
            FlashAttentionBackwardSm90(dtype="bf16", head_dim=128, causal=False, **{**knobs, **over})
    # S and dP through shared memory at the register limit leave none for a split group under a causal
    # mask with two P/dS buffers (ptxas spills); without the mask it compiles clean
    split = Config.make("sm90_bwd", group_split=2, dq_accum="bulk", pds_stages=2)
    assert any("group_split=2) under a causal mask" in r for r in sm90_bwd.reasons(split, _problem(128)))
    assert sm90_bwd.reasons(split, _problem(128, causal=False)) == []


def test_the_defaults_are_runnable_at_every_supported_head_dim():
    for head_dim in sm90_bwd.SUPPORTED_HEAD_DIMS:
        for causal in (True, False):
            problem = AttentionProblem(1, 128, 128, 4, 2, head_dim, "bf16", causal)
            assert sm90_bwd.reasons(sm90_bwd.default_config(problem), problem) == []


def test_the_compile_key_is_the_codegen_knobs_and_what_is_compiled_in():
    a, b = AttentionProblem(1, 128, 4096, 4, 2, 128, "bf16", True), AttentionProblem(8, 77, 5, 32, 32, 128, "bf16", True)
    config = Config.make("sm90_bwd")
    assert sm90_bwd.compile_key(config, a) == sm90_bwd.compile_key(config, b)
    assert sm90_bwd.compile_key(config, a) != sm90_bwd.compile_key(config.replace(q_stages=1), a)
    assert sm90_bwd.compile_key(config, a) != sm90_bwd.compile_key(config, AttentionProblem(1, 128, 128, 4, 2, 64, "bf16", True))
