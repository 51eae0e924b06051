"""The sm90 forward with a sliding window and a softcap, on the CPU: configurations over both dtypes,
head dims 64, 128 and 256, each kind of window (causal with a left side, two-sided, one side only)
with and without a softcap, and the knobs that change the block loop (overlap, P operand, tiles, K/V
stages, schedulers, packed GQA, the exp2 polynomial) compile for sm_90a without spills or a
serialised wgmma; the softcap's tanh is the MUFU one. The GPU suite (tests/gpu/test_window_softcap_gpu.py)
checks what these compute."""

from __future__ import annotations

import tempfile

import pytest

from fa4.kernels import AttentionProblem, Config, compiling, default_config, family, sm90
from sm90_compile_checks import assert_compiles_clean


def _problem(d, dtype, causal, window=None, softcap=None, heads=(32, 8), return_lse=False):
    return AttentionProblem(1, 4096, 4096, *heads, d, dtype, causal=causal, return_lse=return_lse,
                            window=window, softcap=softcap)


# (problem, knobs over the heuristic default: None keeps the default)
CASES = {
    "d128-fp16-causal-window": (_problem(128, "fp16", True, (255, 0)), None),
    "d128-bf16-two-sided": (_problem(128, "bf16", False, (128, 64)), None),
    "d128-fp16-softcap": (_problem(128, "fp16", False, softcap=30.0), None),
    "d64-bf16-causal-window-softcap": (_problem(64, "bf16", True, (511, 0), 50.0), None),
    "d64-fp16-right-only-ss-no-overlap": (_problem(64, "fp16", False, (-1, 32)),
                                          dict(softmax_overlap=False, pv_operand="ss", tile_m=128, tile_n=128)),
    "d128-bf16-left-only-lpt-unpacked": (_problem(128, "bf16", False, (64, -1)),
                                         dict(scheduler="lpt", q_stages=2, pack_gqa=False, tile_m=128)),
    "d64-fp16-causal-softcap-poly-192x96": (_problem(64, "fp16", True, (100, 0), 5.0),
                                            dict(tile_m=192, tile_n=96, exp2_poly_columns=4,
                                                 rescale_threshold=0)),
    "d128-fp16-two-sided-softcap-3-stages": (_problem(128, "fp16", False, (30, 30), 20.0, heads=(16, 16)),
                                             dict(tile_m=128, tile_n=128, kv_stages=3, q_stages=1,
                                                  scheduler="single")),
    "d128-bf16-causal-window-lse-static": (_problem(128, "bf16", True, (1023, 0), return_lse=True),
                                           dict(scheduler="static", q_stages=2, tile_m=128, tile_n=128)),
    "d256-bf16-gemma": (_problem(256, "bf16", True, (4095, 0), 50.0, heads=(16, 8)), None),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_window_and_softcap_compile_clean(name):
    assert_compiles_clean(*CASES[name])


def test_the_softcap_is_the_mufu_tanh_and_a_dense_kernel_has_none():
    def ptx(problem):
        cfg = default_config("sm90", problem)
        with tempfile.TemporaryDirectory() as tmp:
            compiled, *_ = compiling.compile_kernel(family("sm90"), cfg, problem, sm90.REFERENCE_DEVICE,
                                                    options=f"--keep-ptx --dump-dir {tmp}")
            return compiled.__ptx__

    assert "tanh.approx.f32" in ptx(_problem(128, "bf16", True, softcap=50.0))
    assert "tanh" not in ptx(_problem(128, "bf16", True, (255, 0)))


def test_a_kernel_is_built_with_the_flags_of_its_problem():
    base = _problem(128, "fp16", True)
    cfg = default_config("sm90", base)
    kernel = sm90.make_kernel(cfg, _problem(128, "fp16", True, (255, 0), 3.0), sm90.REFERENCE_DEVICE)
    assert (kernel.bounded_left, kernel.bounded_right, kernel.softcap) == (True, False, True)
    kernel = sm90.make_kernel(cfg, _problem(128, "fp16", False, (-1, 7)), sm90.REFERENCE_DEVICE)
    assert (kernel.bounded_left, kernel.bounded_right, kernel.softcap) == (False, True, False)
    dense = sm90.make_kernel(cfg, base, sm90.REFERENCE_DEVICE)
    assert (dense.bounded_left, dense.bounded_right, dense.softcap) == (False, False, False)
    assert Config.from_dict("sm90", cfg.to_dict()) == cfg
