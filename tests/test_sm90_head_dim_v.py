"""A value head dim of its own on the sm90 forward (D=192 for Q and K, Dv=128 for V and O, DeepSeek's
shapes), on the CPU: the default configuration and knob variants compile for sm_90a without spills or
a serialised wgmma, with the shared memory of the kernel's SharedStorage equal to the model's (which
counts V at Dv); the problem, key and model keep Dv = D problems as they were, and pairs no kernel has
are refused with a reason. tests/gpu/test_sm90_head_dim_v.py checks what the kernel computes."""

from __future__ import annotations

import pytest

from fa4.kernels import AttentionProblem, compile_key, default_config, family, feasible, sm90
from fa4.kernels.sm90 import feasibility

from sm90_compile_checks import assert_compiles_clean


def _problem(dtype="bf16", causal=True, heads=(16, 16), **extra):
    return AttentionProblem(1, 2048, 2048, *heads, 192, dtype, causal=causal, head_dim_v=128, **extra)


@pytest.mark.parametrize("dtype,causal", [("bf16", True), ("fp16", False)])
def test_default_config_compiles_clean(dtype, causal):
    assert_compiles_clean(_problem(dtype, causal, return_lse=causal))


# knob variants: P through shared memory, three consumer warpgroups (O at Dv fits their registers
# where D=192's does not), two Q buffers under a persistent scheduler, rows packed for GQA, varlen
VARIANTS = [
    ({"pv_operand": "ss"}, {}),
    ({"tile_m": 192, "tile_n": 64, "pv_operand": "ss"}, {}),
    ({"q_stages": 2, "tile_n": 64, "scheduler": "static"}, {}),
    ({"pack_gqa": True}, {"heads": (32, 8)}),
    ({}, {"varlen": True, "return_lse": True}),
]


@pytest.mark.parametrize("knobs,extra", VARIANTS, ids=["ss", "192rows", "two-q-buffers", "pack-gqa", "varlen"])
def test_knob_variants_compile_clean(knobs, extra):
    assert_compiles_clean(_problem(**extra), knobs)


def test_model_counts_v_and_o_at_dv():
    """V's buffer and O's accumulator at Dv: less shared memory and fewer registers than D=192's."""
    dv, same = _problem(), AttentionProblem(1, 2048, 2048, 16, 16, 192, "bf16", causal=True)
    cfg = default_config("sm90", same)
    v_tile_bytes = cfg.kv_stages * cfg.tile_n * (192 - 128) * 2
    assert sm90.smem_bytes(cfg, same) - sm90.smem_bytes(cfg, dv) in (v_tile_bytes, v_tile_bytes + 1024 - v_tile_bytes % 1024)
    assert feasibility.estimated_registers(cfg, same) - feasibility.estimated_registers(cfg, dv) == 64 * 64 // 128
    # 192-row tiles: O at D=192 does not fit 160 registers, at Dv=128 it does
    wide = cfg.replace(tile_m=192, tile_n=64, pv_operand="ss")
    assert any("registers" in r for r in feasible(wide, same))
    assert feasible(wide, dv) == []


def test_problem_without_a_value_head_dim_is_as_before():
    plain = AttentionProblem(2, 100, 200, 8, 2, 128, "fp16", causal=True)
    same = AttentionProblem(2, 100, 200, 8, 2, 128, "fp16", causal=True, head_dim_v=128)
    assert same == plain and same.head_dim_v is None
    assert "head_dim_v" not in repr(plain) and "head_dim_v" not in plain.to_dict()
    assert plain.label() == "B2 Sq100 Sk200 H8/2 D128 fp16 causal"
    cfg = default_config("sm90", plain)
    assert compile_key(cfg, same) == compile_key(cfg, plain)
    assert not any(k == "head_dim_v" for k, _ in sm90.problem_key(cfg, plain))


def test_problem_with_a_value_head_dim():
    p = _problem(causal=False)
    assert p.value_head_dim == 128 and p.head_dim_v == 128
    assert p.label() == "B1 Sq2048 Sk2048 H16/16 D192 Dv128 bf16 full"
    assert p.to_dict()["head_dim_v"] == 128 and AttentionProblem(**p.to_dict()) == p
    assert "head_dim_v=128" in repr(p)
    # QK^T at D, PV at Dv
    assert p.flops() == 2 * 16 * 2048 * 2048 * (192 + 128)
    cfg = default_config("sm90", p)
    assert ("head_dim_v", 128) in sm90.problem_key(cfg, p)
    assert compile_key(cfg, p) != compile_key(cfg, AttentionProblem(1, 2048, 2048, 16, 16, 192, "bf16"))
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="head_dim_v"):
            AttentionProblem(1, 8, 8, 1, 1, 192, head_dim_v=bad)


def test_unsupported_pairs_are_refused_with_a_reason():
    assert sm90.can_implement(_problem()) == []
    for d, dv in ((128, 64), (192, 64), (128, 192), (256, 128)):
        reasons = sm90.can_implement(AttentionProblem(1, 64, 64, 1, 1, d, head_dim_v=dv))
        assert any(f"value head dim {dv} != head dim {d}" in r and "192/128" in r for r in reasons), reasons
    sm100_pair = AttentionProblem(1, 64, 64, 1, 1, 128, head_dim_v=64)
    assert any("Dv = D only" in r for r in family("sm100").can_implement(sm100_pair))
    from fa4.kernels import sm90_bwd
    assert any("value head dim 128" in r for r in sm90_bwd.can_implement(_problem()))
