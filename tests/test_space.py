"""Search spaces narrow the declared knobs and never invent one."""

from __future__ import annotations

import math

import pytest

from fa4.kernels import ARCHS, Config, knobs_for
from fa4.kernels.knobs import KNOB_SETS
from fa4tune.inputs.space import SearchSpace, SpaceError, full_space, load_space, space_path


def write(tmp_path, text: str):
    path = tmp_path / "space.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("arch", KNOB_SETS)
def test_packaged_space_loads_and_only_narrows(arch):
    space = load_space(arch)
    declared = {k.name: k.choices for k in knobs_for(arch)}
    assert space.knob_names == tuple(declared)
    for name, values in space.choices:
        assert values and set(values) <= set(declared[name]), name
    assert space.source == (str(space_path(arch)) if space_path(arch).exists() else None)


def test_missing_packaged_file_means_every_declared_choice(tmp_path, monkeypatch):
    import fa4tune.inputs.space as space_mod

    monkeypatch.setattr(space_mod, "space_path", lambda arch: tmp_path / f"{arch}.toml")
    space = load_space("sm90")
    assert space == full_space("sm90") and space.source is None
    assert space.size == len(list(space.configs()))


def test_narrowing_forms(tmp_path):
    path = write(tmp_path, """
arch = "sm90"
description = "test"
[knobs]
tile_n = [176, 64]
pack_gqa = true
kv_stages = { choices = [3] }
rescale_threshold = [0, 8]
""")
    space = load_space("sm90", path)
    assert space.choices_of("tile_n") == (176, 64)            # the file's order
    assert space.choices_of("pack_gqa") == (True,)
    assert space.choices_of("kv_stages") == (3,)
    assert space.choices_of("rescale_threshold") == (0.0, 8.0)  # canonical float values
    assert all(isinstance(v, float) for v in space.choices_of("rescale_threshold"))
    assert space.choices_of("tile_m") == knobs_for("sm90")[0].choices  # untouched knob: all choices
    narrowed = {"tile_n": 2, "pack_gqa": 1, "kv_stages": 1, "rescale_threshold": 2}
    untouched = math.prod(len(k.choices) for k in knobs_for("sm90") if k.name not in narrowed)
    assert space.size == math.prod(narrowed.values()) * untouched
    configs = list(space.configs())
    assert len(configs) == space.size and len(set(configs)) == space.size
    assert all(space.contains(c) for c in configs)
    assert not space.contains(Config.make("sm90", tile_n=128))


def test_top_level_knob_names_are_accepted(tmp_path):
    space = load_space("sm90", write(tmp_path, "tile_m = [128]\n"))
    assert space.choices_of("tile_m") == (128,)


@pytest.mark.parametrize("text, message", [
    ("[knobs]\ntile_k = [64]\n", "unknown knob 'tile_k'"),
    ("[knobs]\ntmem_stages = [2]\n", "unknown knob 'tmem_stages' for sm90"),   # an sm100 knob
    ("[knobs]\ntile_n = [100]\n", "tile_n=100 is not a declared choice"),
    ("[knobs]\npack_gqa = [1]\n", "pack_gqa=1 is not a declared choice"),     # 1 is not True
    ("[knobs]\ntile_n = []\n", "no choices left"),
    ("[knobs]\ntile_n = [64, 64]\n", "twice"),
    ("arch = \"sm100\"\n", "declares arch = 'sm100'"),
    ("tile_n = [64]\n[knobs]\ntile_n = [64]\n", "given twice"),
    ("[knobs]\ntile_n = { values = [64] }\n", "only hold 'choices'"),
    ("[knobs\n", "not a readable TOML"),
])
def test_errors_name_the_file_the_knob_and_what_is_allowed(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(SpaceError, match=message) as info:
        load_space("sm90", path)
    assert str(path) in str(info.value)


def test_missing_explicit_file_is_an_error(tmp_path):
    with pytest.raises(SpaceError, match="does not exist"):
        load_space("sm90", tmp_path / "nope.toml")


def test_fingerprint_changes_with_the_choices():
    a = full_space("sm90")
    b = SearchSpace("sm90", tuple((n, v[:1]) if n == "tile_n" else (n, v) for n, v in a.choices))
    assert a.fingerprint() != b.fingerprint() and a.fingerprint() == full_space("sm90").fingerprint()


@pytest.mark.parametrize("arch", KNOB_SETS)
def test_every_declared_value_is_searched_or_excluded_on_purpose(arch):
    # a value added to knobs.py must show up here: searched, or named under [exclude] with a reason
    assert load_space(arch).unlisted() == {}


def test_exclude_leaves_values_out_on_purpose(tmp_path):
    narrowed = load_space("sm90", write(tmp_path, "[knobs]\ntile_n = [64, 128]\n"))
    assert narrowed.unlisted() == {"tile_n": [80, 96, 112, 144, 160, 176, 192]}   # silently not searched
    excluded = load_space("sm90", write(tmp_path, "[exclude]\ntile_n = [176, 192]\nrescale_threshold = [0]\n"))
    assert excluded.choices_of("tile_n") == (64, 80, 96, 112, 128, 144, 160)
    assert excluded.choices_of("rescale_threshold") == (4.0, 8.0, 12.0)            # 0 means 0.0
    assert excluded.unlisted() == {} and excluded.size == full_space("sm90").size * 7 // 9 * 3 // 4


@pytest.mark.parametrize("text, message", [
    ("[exclude]\ntile_q = [1]\n", "unknown knob 'tile_q'"),
    ("[exclude]\ntile_n = [65]\n", "not a declared choice"),
    ("[knobs]\npv_operand = ['rs']\n[exclude]\npv_operand = ['rs']\n", "no choices left"),
])
def test_exclude_errors(tmp_path, text, message):
    with pytest.raises(SpaceError, match=message):
        load_space("sm90", write(tmp_path, text))
