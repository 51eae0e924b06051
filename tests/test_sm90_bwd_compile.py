"""Our sm90 attention backward (`fa4.kernels.sm90_bwd`) compiles for sm_90a on a CPU: preprocess, main
kernel and postprocess, for both head dims, both 16-bit dtypes, causal and full, with no register
spills; its knobs are the knob set "sm90_bwd" of `fa4.kernels.knobs`; its resource model
(`sm90_bwd.feasibility`) agrees with the compiler (shared memory byte for byte, registers: what it
admits compiles clean, what it refuses for registers spills); and it rejects, loudly, what it cannot
run. (Whether its gradients are right is tests/gpu/test_sm90_bwd_gpu.py's question, on an H200.)

The whole space x every compiled-in problem kind is `slow` (minutes on CI's two cores); the default run
compiles the defaults and a sample that takes every knob value once."""

from __future__ import annotations

import itertools

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


def _problem(head_dim: int, dtype: str = "bf16", causal: bool = True) -> AttentionProblem:
    return AttentionProblem(2, 177, 301, 8, 2, head_dim, dtype, causal)


@pytest.mark.parametrize("problem", CASES, ids=_case_id)
def test_the_default_backward_compiles_clean(problem):
    config = sm90_bwd.default_config(problem)
    reports = sm90_bwd.compile_report(config, problem)
    assert tuple(reports) == sm90_bwd.KERNELS
    for name, report in reports.items():
        assert report["spill_stores"] == 0 and report["spill_loads"] == 0, (name, report)
        assert not report["wgmma_serialized"], (name, report)
        assert report["registers"] is not None, (name, report)
    main = reports["main"]
    assert main["ptx_markers"]["wgmma"] and main["ptx_markers"]["tma_load"], main["ptx_markers"]
    assert main["ptx_markers"]["setmaxnreg"] and main["ptx_markers"]["stmatrix"], main["ptx_markers"]
    # the traced shared memory is the model's, byte for byte
    assert main["smem_bytes"] == sm90_bwd.smem_bytes(config, problem) <= sm90_bwd.REFERENCE_DEVICE.smem_per_block_bytes
    # the elementwise kernels use no tensor cores and no shared memory
    assert reports["preprocess"]["smem_bytes"] == reports["postprocess"]["smem_bytes"] == 0
    assert not any(reports["preprocess"]["ptx_markers"].values())


def _check_main(config: Config, problem: AttentionProblem) -> dict:
    """Compile the main kernel (whatever the model says) and hold the model to what came out."""
    report = sm90_bwd.compile_report(config, problem, only=("main",), check=False)["main"]
    why = sm90_bwd.reasons(config, problem)
    broken = report["spill_stores"] or report["spill_loads"] or report["wgmma_serialized"]
    assert report["smem_bytes"] == sm90_bwd.smem_bytes(config, problem), config.label()
    if not why:
        assert not broken, f"the model admits {config.label()} at {problem.label()}, which compiles to {report}"
        # the PTX holds what this configuration's dQ path is built from
        assert report["ptx_markers"]["wgmma"] and report["ptx_markers"]["tma_load"]
        assert report["ptx_markers"]["dq_atomics"] == (config.dq_accum == "atomic")
    elif all(reason.startswith("registers") for reason in why):
        # refused for registers alone: it really spills (the limits are not loose guesses)
        assert broken, f"the model refuses {config.label()} at {problem.label()} ({why}), which compiles clean"
    return report


# every value of every backward knob at least once, each feasible on its problem, plus the defaults
SAMPLE = [
    (dict(), _problem(128)),
    (dict(tile_m=128, tile_n=64, q_stages=1), _problem(64, "fp16", causal=False)),
    (dict(tile_m=64, tile_n=64, q_stages=1), _problem(128, "fp16")),
    (dict(tile_m=128, tile_n=64), _problem(128, causal=False)),
]
# refused for registers, and compiled anyway: they spill
REFUSED = [
    (dict(tile_m=128, tile_n=128), _problem(64, "fp16")),
]


def test_sample_covers_every_knob_value():
    seen = {k.name: set() for k in knobs_for("sm90_bwd")}
    for over, _ in SAMPLE:
        for name, value in Config.make("sm90_bwd", **over).items:
            seen[name].add(value)
    for k in knobs_for("sm90_bwd"):
        assert set(k.choices) <= seen[k.name], f"{k.name}: the sample misses {set(k.choices) - seen[k.name]}"


@pytest.mark.parametrize("over, problem", SAMPLE + REFUSED,
                         ids=[f"{Config.make('sm90_bwd', **o).label()}-{_case_id(p)}" for o, p in SAMPLE + REFUSED])
def test_a_sample_holds_the_model_to_the_compiler(over, problem):
    config = Config.make("sm90_bwd", **over)
    assert bool(sm90_bwd.reasons(config, problem)) == ((over, problem) in REFUSED)
    _check_main(config, problem)


@pytest.mark.slow
@pytest.mark.parametrize("problem", CASES, ids=_case_id)
def test_the_whole_space_holds_the_model_to_the_compiler(problem):
    """Every configuration of search_spaces/sm90_bwd.toml at every compiled-in problem kind: what the
    model admits compiles clean, what it refuses for registers spills, shared memory is exact."""
    admitted = 0
    for config in load_space("sm90_bwd").configs():
        _check_main(config, problem)
        admitted += not sm90_bwd.reasons(config, problem)
    assert admitted > 0


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
    # the kernel object itself refuses what its code does not implement, whatever a caller checked
    from fa4.kernels.sm90_bwd.kernel import FlashAttentionBackwardSm90

    knobs = Config.make("sm90_bwd").to_dict()
    with pytest.raises(ValueError, match="dq_accum='tma' is not implemented"):
        FlashAttentionBackwardSm90(dtype="bf16", head_dim=128, causal=False, **{**knobs, "dq_accum": "tma"})


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
