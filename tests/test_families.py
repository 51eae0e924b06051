"""Both kernel families implement one protocol with the same signatures, compile through one module
with one report schema, and build their defaults from the declared knob defaults (CPU, no compile)."""

from __future__ import annotations

import inspect

import pytest

from fa4.kernels import ARCHS, AttentionProblem, Config, KernelFamily, default_config, family, knob
from fa4.kernels import compiling
from fa4.kernels.family import protocol_members

PROBLEMS = [AttentionProblem(b, s, s, hq, hkv, d, causal=c)
            for b, s, hq, hkv, d, c in [(1, 1024, 32, 8, 128, False), (1, 1024, 32, 8, 128, True),
                                        (1, 2048, 32, 8, 64, False), (16, 1024, 32, 8, 128, True),
                                        (2, 100, 16, 16, 64, True), (1, 4096, 48, 48, 128, False)]]


@pytest.mark.parametrize("arch", ARCHS)
def test_every_family_implements_the_protocol(arch):
    fam = family(arch)
    assert isinstance(fam, KernelFamily) and fam.ARCH == arch
    assert fam.SOURCE_FILES and fam.PTX_MARKERS
    assert fam.REFERENCE_DEVICE.arch == arch and fam.REFERENCE_DEVICE.sm_count > 0


def test_the_families_functions_have_the_same_signatures():
    functions = [n for n in protocol_members() if callable(getattr(KernelFamily, n, None))]
    assert "compile_report" in functions and "make_kernel" in functions
    for name in functions:
        signatures = {arch: str(inspect.signature(getattr(family(arch), name))) for arch in ARCHS}
        assert len(set(signatures.values())) == 1, (name, signatures)


def test_the_registry_refuses_what_is_no_family():
    with pytest.raises(ValueError, match="unknown architecture"):
        family("sm80")


def test_a_module_missing_a_member_is_no_family(monkeypatch):
    fam = family("sm90")
    monkeypatch.delattr(fam, "traced_smem_bytes")
    with pytest.raises(TypeError, match="traced_smem_bytes"):
        family("sm90")


def test_the_report_schema_is_one_for_every_family():
    assert len(set(compiling.REPORT_KEYS)) == len(compiling.REPORT_KEYS)
    parsed = compiling.parse_remarks("ptxas info    : Used 168 registers, 0 bytes stack frame, "
                                     "8 bytes spill stores, 4 bytes spill loads")
    assert parsed["registers"] == 168 and parsed["spill_stores"] == 8 and parsed["spill_loads"] == 4
    assert parsed["stack_frame"] == 0 and set(parsed) <= set(compiling.REPORT_KEYS)


def test_the_dsl_target_cache_is_where_target_arch_expects_it():
    # target_arch is the one place that uses the DSL's private target cache: a DSL upgrade that moves
    # it fails here, not in a compile that silently traces for the wrong architecture
    pytest.importorskip("cutlass")
    from cutlass.cutlass_dsl import BaseDSL
    envar = BaseDSL._get_dsl().envar
    before = envar._arch
    with compiling.target_arch("sm90"):
        assert envar._arch == "sm_90a"
        with compiling.target_arch("sm100"):
            assert envar._arch == "sm_100a"
        assert envar._arch == "sm_90a"
    assert envar._arch == before


# knobs no per-problem rule sets: the default runs exactly what knobs.py declares
UNRULED = {"sm90": ("kv_stages", "rescale_threshold", "pv_operand", "softmax_overlap", "exp2_poly_columns"),
           "sm100": ("tile_m", "tile_n", "q_stages", "tmem_stages", "rescale_tile", "rescale_threshold")}


@pytest.mark.parametrize("arch", ARCHS)
def test_defaults_come_from_the_declared_knob_defaults(arch):
    for problem in PROBLEMS:
        config = default_config(arch, problem)
        for name in UNRULED[arch]:
            assert getattr(config, name) == knob(arch, name).default, (problem.label(), name)


def test_sm100_default_rules_are_applied_in_order_to_the_declared_defaults():
    from fa4.kernels import sm100
    problem = AttentionProblem(1, 1024, 1024, 32, 8, 64, causal=True)
    config = Config.make("sm100")
    for rule in sm100.DEFAULT_RULES:
        config = (rule(config, problem, sm100.REFERENCE_DEVICE) if getattr(rule, "device_facts", ())
                  else rule(config, problem))
    assert config == sm100.default_config(problem)
    assert (config.scheduler, config.pack_gqa, config.exp2_poly_columns) == ("lpt", True, 8)


def test_sm90_default_rules_are_applied_in_order_to_the_declared_defaults():
    from fa4.kernels import sm90
    from fa4.kernels.sm90 import defaults
    problem = AttentionProblem(1, 2048, 2048, 32, 8, 128, causal=True)
    config = Config.make("sm90")
    for rule in defaults.DEFAULT_RULES:
        config = (rule(config, problem, sm90.REFERENCE_DEVICE) if getattr(rule, "device_facts", ())
                  else rule(config, problem))
    assert config == default_config("sm90", problem)
    assert (config.tile_m, config.tile_n, config.scheduler, config.pack_gqa) == (192, 80, "single_lpt", True)
    # each rule leaves a problem it is not about alone
    assert defaults.wide_tiles_at_head_dim_64(Config.make("sm90"), problem) == Config.make("sm90")


def test_sm90_long_causal_keys_take_the_wide_tiles_too():
    """Measured on the H200 in one bench (192 x 80 against 128 x 128): B1 S8192 bf16 846 vs 909 us,
    B2 S16384 H8/1 1611 vs 1726; the rule once stopped at Sk = 4096, unmeasured beyond it."""
    for problem in (AttentionProblem(1, 8192, 8192, 32, 8, 128, dtype="bf16", causal=True),
                    AttentionProblem(2, 16384, 16384, 8, 1, 128, dtype="bf16", causal=True)):
        config = default_config("sm90", problem)
        assert (config.tile_m, config.tile_n, config.scheduler) == (192, 80, "single_lpt"), problem.label()
    full = default_config("sm90", AttentionProblem(1, 8192, 8192, 32, 8, 128, dtype="bf16"))
    assert (full.tile_m, full.tile_n) == (128, 128)  # the rule is about causal masks only


def test_the_registry_of_families_is_one_table():
    """A family is one line of kernels/archs.py, its folder and its search space; every other table of
    families (knob archs, GPU capability, DSL target, reference device) derives from that line."""
    from pathlib import Path

    from fa4.kernels import archs, device, family as family_of, knobs
    from fa4.kernels.family import CAPABILITY_ARCH, DSL_TARGET

    root = Path(__file__).resolve().parents[1]
    assert knobs.ARCHS == tuple(archs.FAMILIES)
    for name, arch in archs.FAMILIES.items():
        assert (root / "kernels" / name / "__init__.py").exists()
        assert (root / "search_spaces" / f"{name}.toml").exists()
        assert CAPABILITY_ARCH[arch.capability] == name and DSL_TARGET[name] == arch.dsl_target
        assert device.reference_device(name).name == arch.reference_device
        assert device.reference_device(name).arch == name
        assert family_of(name).REFERENCE_DEVICE == device.reference_device(name)
