"""The sm90 forward compiled for variable-length batches (`varlen`), on the CPU: both dtypes, head dims
64, 96, 128, 192 (and 192/128) and 256, full and causal masks, a window and a softcap, and the knobs that change the block loop
or the tile's walk (overlap, P operand, tiles, K/V and Q stages, every scheduler, LSE) compile for
sm_90a without spills or a serialised wgmma. What the family refuses under varlen is refused with a
reason, and a dense problem's key, label and kernel do not change. The GPU suite
(tests/gpu/test_varlen_gpu.py, implementation "ours") checks what these compute."""

from __future__ import annotations

import pytest

from fa4.kernels import AttentionProblem, Config, compile_key, default_config, feasible, sm90
from fa4.kernels.sm90.feasibility import VARLEN_HEAD_DIMS
from sm90_compile_checks import assert_compiles_clean


def _problem(d, dtype, causal, window=None, softcap=None, heads=(16, 4), return_lse=True, varlen=True,
             head_dim_v=None):
    # 64 sequences of at most 2048 queries and keys
    return AttentionProblem(64, 2048, 2048, *heads, d, dtype, causal=causal, return_lse=return_lse,
                            window=window, softcap=softcap, varlen=varlen, head_dim_v=head_dim_v)


# (problem, knobs over the heuristic default: None keeps the default)
CASES = {
    "d128-fp16-causal": (_problem(128, "fp16", True), None),
    "d128-bf16-full": (_problem(128, "bf16", False), None),
    "d64-fp16-full-no-lse": (_problem(64, "fp16", False, return_lse=False), None),
    "d64-bf16-causal": (_problem(64, "bf16", True), None),
    "d128-bf16-causal-window-softcap": (_problem(128, "bf16", True, (255, 0), 30.0), None),
    "d64-fp16-two-sided-window": (_problem(64, "fp16", False, (64, 32)), None),
    "d256-bf16-causal": (_problem(256, "bf16", True, heads=(8, 8)), None),
    # head dims whose O rows take 4 (96) and 8 (192) threads each, each thread 3 of the row's copies
    "d96-bf16-causal-window-softcap": (_problem(96, "bf16", True, (255, 0), 30.0), None),
    "d96-fp16-full-192-rows": (_problem(96, "fp16", False), dict(tile_m=192, tile_n=64, q_stages=1)),
    "d192-fp16-causal": (_problem(192, "fp16", True, heads=(8, 8)), None),
    "d192-bf16-full-64-rows": (_problem(192, "bf16", False), dict(tile_m=64, tile_n=64)),
    "d192-128-bf16-causal": (_problem(192, "bf16", True, head_dim_v=128), None),
    "d128-fp16-causal-ss-no-overlap": (_problem(128, "fp16", True),
                                       dict(softmax_overlap=False, pv_operand="ss", tile_m=128, tile_n=128)),
    "d128-fp16-full-single-3-stages": (_problem(128, "fp16", False),
                                       dict(scheduler="single", q_stages=1, kv_stages=3, tile_m=128, tile_n=64)),
    "d128-bf16-causal-lpt": (_problem(128, "bf16", True), dict(scheduler="lpt", q_stages=2, tile_m=128,
                                                               tile_n=128)),
    "d64-fp16-full-static-192x128": (_problem(64, "fp16", False), dict(scheduler="static", q_stages=2,
                                                                       tile_m=192, tile_n=128)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_varlen_compiles_clean(name):
    assert_compiles_clean(*CASES[name])


def test_the_defaults_neither_pack_nor_launch_in_m_order():
    for problem, _ in CASES.values():
        cfg = default_config("sm90", problem)
        assert not cfg.pack_gqa and cfg.scheduler != "single", (problem.label(), cfg.label())


def test_what_varlen_cannot_run_is_refused_with_a_reason():
    problem = _problem(128, "fp16", True)
    packed = default_config("sm90", problem).replace(pack_gqa=True)
    assert any("pack_gqa under varlen" in r for r in feasible(packed, problem))
    assert VARLEN_HEAD_DIMS == (64, 96, 128, 192, 256)
    for d in VARLEN_HEAD_DIMS:
        assert sm90.can_implement(_problem(d, "fp16", True)) == []
    sm100_config = default_config("sm100", _problem(128, "fp16", True, varlen=False))
    assert any("no variable-length" in r for r in feasible(sm100_config, _problem(128, "fp16", True)))


def test_varlen_is_its_own_kernel_and_a_dense_problem_is_unchanged():
    dense, packed = _problem(128, "fp16", True, varlen=False), _problem(128, "fp16", True)
    cfg = default_config("sm90", dense).replace(pack_gqa=False)
    assert compile_key(cfg, dense) != compile_key(cfg, packed)
    assert "varlen" not in repr(dense) and "varlen" not in dense.to_dict() and "varlen" not in dense.label()
    assert packed.to_dict()["varlen"] is True and packed.label().endswith("varlen")
    assert AttentionProblem(**packed.to_dict()) == packed
    assert sm90.make_kernel(cfg, packed, sm90.REFERENCE_DEVICE).varlen
    assert not sm90.make_kernel(cfg, dense, sm90.REFERENCE_DEVICE).varlen
    assert Config.from_dict("sm90", cfg.to_dict()) == cfg


@pytest.mark.parametrize("scheduler, scans", [("single", True), ("single_lpt", True), ("static", False)])
def test_one_cta_per_task_kinds_find_their_task_by_a_scan(scheduler, scans, tmp_path):
    # scheduler.py `packed_varlen`: a warp's shuffle scan and ballot over the sequences in each of the
    # two warp roles (producer, consumers); the persistent kinds walk the whole grid without one
    from fa4.kernels import compiling

    problem = _problem(128, "bf16", True)
    cfg = default_config("sm90", problem).replace(scheduler=scheduler)
    compiled, *_ = compiling.compile_kernel(compiling.family("sm90"), cfg, problem, sm90.REFERENCE_DEVICE,
                                            options=f"--keep-ptx --dump-dir {tmp_path}")
    ptx = compiled.__ptx__
    assert ("shfl.sync.up" in ptx and "vote.sync.ballot" in ptx) == scans, scheduler
