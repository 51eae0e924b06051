"""The knob model: one declaration per knob and architecture, validated configurations."""

import pytest

from fa4.kernels import ARCHS, KNOBS, AttentionProblem, Config, compile_key, knob, knobs_for
from fa4.kernels.knobs import KNOB_SETS


@pytest.mark.parametrize("arch", KNOB_SETS)
def test_defaults_make_a_valid_config(arch):
    cfg = Config.make(arch)
    assert [name for name, _ in cfg] == [k.name for k in knobs_for(arch)]
    for k in knobs_for(arch):
        assert getattr(cfg, k.name) == k.default


def test_every_knob_has_meaning_and_plain_scalar_choices():
    for k in KNOBS:
        assert k.meaning.strip(), k.name
        assert k.choices, k.name
        for c in k.choices:
            assert isinstance(c, (bool, int, float, str)), (k.name, c)


def test_unknown_knob_and_value_are_errors():
    with pytest.raises(ValueError, match="unknown knob"):
        Config.make("sm90", tile_q=64)
    with pytest.raises(ValueError, match="tile_n=100"):
        Config.make("sm90", tile_n=100)
    with pytest.raises(ValueError, match="unknown architecture"):
        Config.make("sm80")
    with pytest.raises(KeyError, match="unknown knob"):
        knob("sm90", "rescale_tile")  # an sm100-only knob


def test_the_backward_is_a_knob_set_of_its_own():
    """The sm90 backward's knobs share names with the forward's (tile_m, tile_n, q_stages) but are
    other declarations: its choices and defaults, and no forward knob leaks into it."""
    fwd, bwd = knobs_for("sm90"), knobs_for("sm90_bwd")
    assert {"tile_m", "tile_n", "q_stages", "dq_accum"} <= {k.name for k in bwd}
    assert not {k.name for k in bwd} & {"pv_operand", "kv_stages", "pack_gqa"}
    assert knob("sm90_bwd", "tile_m").choices != knob("sm90", "tile_m").choices
    assert all("sm90_bwd" not in k.archs for k in fwd) and all(k.archs == ("sm90_bwd",) for k in bwd)
    assert Config.make("sm90_bwd") != Config.make("sm90") and "sm90_bwd" not in ARCHS


def test_bool_and_int_do_not_alias():
    with pytest.raises(ValueError):
        Config.make("sm90", pack_gqa=1)
    with pytest.raises(ValueError):
        Config.make("sm90", kv_stages=True)


def test_float_knob_accepts_int_and_canonicalises():
    assert Config.make("sm90", rescale_threshold=8) == Config.make("sm90", rescale_threshold=8.0)
    assert isinstance(Config.make("sm90", rescale_threshold=4).rescale_threshold, float)


def test_round_trip_and_replace():
    cfg = Config.make("sm90", tile_n=176, scheduler="lpt")
    assert Config.from_dict("sm90", cfg.to_dict()) == cfg
    assert cfg.replace(tile_n=128).tile_n == 128
    with pytest.raises(ValueError):
        Config.from_dict("sm90", {"tile_n": 128})  # incomplete
    with pytest.raises(ValueError, match="unknown knob"):
        cfg.replace(bogus=1)


def test_compile_key_ignores_sequence_lengths_and_batch():
    base = AttentionProblem(1, 1024, 1024, 32, 8, 128)
    other = AttentionProblem(4, 4099, 17, 32, 8, 128)
    cfg = Config.make("sm90")
    assert compile_key(cfg, base) == compile_key(cfg, other)
    assert compile_key(cfg, base) != compile_key(cfg.replace(tile_n=176), base)


def test_problem_flops_convention():
    p = AttentionProblem(1, 1024, 1024, 32, 8, 128)
    assert p.flops() == 4 * 32 * 1024 * 1024 * 128
    assert AttentionProblem(1, 1024, 1024, 32, 8, 128, causal=True).flops() == p.flops() // 2
    # Sq > Sk causal: the first Sq - Sk rows see no key
    assert AttentionProblem(1, 4, 2, 1, 1, 1, causal=True).visible_pairs_per_head() == 0 + 0 + 1 + 2
    with pytest.raises(ValueError, match="multiple"):
        AttentionProblem(1, 8, 8, 6, 4, 64)
