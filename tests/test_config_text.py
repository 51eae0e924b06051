"""A configuration label printed by the tools pastes back into `config=` (`fa4.config_text`)."""

from __future__ import annotations

import json

import pytest
import torch

import fa4
from fa4 import config_arg, config_text, database
from fa4.checks import InvalidInputError
from fa4.kernels import ARCHS, AttentionProblem, Config, knobs_for


@pytest.fixture(autouse=True)
def empty_database(tmp_path):
    path = tmp_path / "best.json"
    path.write_text(json.dumps({"schema": database.SCHEMA_VERSION, "entries": []}))
    fa4.use_config_db(path)
    yield
    fa4.use_config_db(None)


def qkv():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 128, 8, 64, generator=g).half()
    k = torch.randn(1, 128, 2, 64, generator=g).half()
    return q, k, k.clone()


@pytest.mark.parametrize("arch", ARCHS)
def test_every_declared_value_prints_and_parses_back(arch):
    for knob in knobs_for(arch):
        for choice in knob.choices:
            config = Config.make(arch, **{knob.name: choice})
            assert config_text.with_values(Config.make(arch), config_text.parse_label(config.label())) == config


def test_a_printed_label_is_a_config_argument():
    config = Config.make("sm90", tile_n=80, softmax_overlap=False, pv_operand="ss", rescale_threshold=4.0)
    assert fa4.explain(*qkv(), arch="sm90", config=config.label()).config == config
    # some pairs of a label: those knobs over the heuristic default
    partial = fa4.explain(*qkv(), arch="sm90", config="tile_n=80 softmax_overlap=off pv_operand=ss").config
    assert (partial.tile_n, partial.softmax_overlap, partial.pv_operand) == (80, False, "ss")


def test_mapping_values_may_be_written_as_printed():
    config = fa4.explain(*qkv(), arch="sm90", config={"softmax_overlap": "off", "pv_operand": "ss", "rescale_threshold": "4"}).config
    assert config.softmax_overlap is False and config.rescale_threshold == 4.0


@pytest.mark.parametrize("bad, words", [
    ("tile_n=81", "not one of"),
    ("tile_n=80 tile_q=1", "unknown knob"),
    ("tile_n=80 tile_n=96", "twice"),
    ({"softmax_overlap": "maybe"}, "not one of"),
])
def test_what_does_not_parse_is_an_input_error(bad, words):
    with pytest.raises(InvalidInputError, match=words):
        fa4.explain(*qkv(), arch="sm90", config=bad)


def test_a_label_crosses_the_custom_op_as_itself():
    # under torch.compile config= travels through the custom op as a string (`_through_op`): a label,
    # the one text form, goes as it is and comes back as the same configuration
    config = Config.make("sm90", tile_n=80, softmax_overlap=False)
    sent = config_arg.for_op(config.label())
    problem = AttentionProblem(1, 128, 128, 8, 2, 64)
    assert sent == config.label() and config_arg.coerce_config(sent, "sm90", problem) == config


@pytest.mark.parametrize("arch", ARCHS)
def test_every_knob_value_round_trips_through_its_label(arch):
    """What any tool prints (`Config.label`) is accepted verbatim by config=, directly and through the
    custom op, for every declared choice of every knob."""
    problem = AttentionProblem(1, 128, 128, 8, 2, 64)
    for k in knobs_for(arch):
        for choice in k.choices:
            config = Config.make(arch, **{k.name: choice})
            label = config.label()
            assert config_arg.coerce_config(label, arch, problem) == config, label
            assert config_arg.coerce_config(config_arg.for_op(config), arch, problem) == config, label
            assert config_arg.coerce_config(config_arg.for_op(dict(config.items)), arch, problem) == config


def test_explain_on_cpu_tensors_says_what_it_assumed():
    explanation = fa4.explain(*qkv(), causal=True)
    assert explanation.arch in ARCHS and explanation.config is not None
    text = str(explanation)
    assert "on no GPU" in text and "arch=" in text and "device_name=" in text
    named = fa4.explain(*qkv(), arch="sm100", device_name="NVIDIA B200", allow_untested_sm100=True)
    assert named.arch == "sm100" and named.device_name == "NVIDIA B200"
    assert not any("on no GPU" in n for n in named.notes)


def test_display_label_never_raises():
    from fa4.config_text import display_label

    full = Config.make("sm90").to_dict()
    assert display_label("sm90", full) == Config.make("sm90").label()
    old = {k: v for k, v in full.items() if k != "pack_gqa"}
    assert display_label("sm90", old).endswith("(not usable here: missing knob(s) for sm90: pack_gqa)")
    assert "not usable here" in display_label("sm90", {**full, "tile_n": 7})
    assert "not usable here" in display_label("sm90", 5)
