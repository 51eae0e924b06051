"""Configurations written as text: what `Config.label()` prints can be given back as `config=`.

A label is `name=value` pairs separated by spaces, e.g.
`tile_m=128 tile_n=80 kv_stages=2 ... softmax_overlap=off ...` (booleans print as on/off, whole floats
without their ".0"). `fa4.attention(..., config=<label>)` accepts a complete label (exactly that
configuration) or some of its pairs (those knobs over the heuristic default), and a mapping's values may
be written the same way: `config={"softmax_overlap": "off"}`. The text of a value is read back by
printing every declared choice of the knob and matching, so what prints is what parses. It is the one
text form: the custom op carries `config=` as a label too (`fa4.config_arg.for_op`).
"""

from __future__ import annotations

import functools
from typing import Any, Mapping

from fa4.kernels import ARCHS, Config, knob, knobs_for
from fa4.kernels.knobs import label_of  # noqa: F401  (the label of a mapping: re-exported)


def parse_label(text: str) -> dict[str, str]:
    """{name: value text} of a label; ValueError for a part that is not name=value."""
    values: dict[str, str] = {}
    for part in text.split():
        name, eq, value = part.partition("=")
        if not eq or not name.isidentifier() or not value:
            raise ValueError(f"cannot read {part!r} of configuration {text!r}: want name=value pairs")
        if name in values:
            raise ValueError(f"configuration {text!r} names {name} twice")
        values[name] = value
    return values


@functools.lru_cache(maxsize=None)
def _choice_texts(arch: str, name: str) -> dict[str, Any]:
    """{printed text: value} of every declared choice of one knob, as `Config.label` prints it."""
    texts = {}
    for choice in knob(arch, name).choices:
        pairs = parse_label(Config.make(arch, **{name: choice}).label())
        texts[pairs[name]] = choice
    return texts


def knob_value(arch: str, name: str, value: Any) -> Any:
    """A knob value as given (a declared choice) or as printed (its label text)."""
    try:
        return getattr(Config.make(arch, **{name: value}), name)
    except ValueError:
        if not isinstance(value, str):
            raise
    texts = _choice_texts(arch, name)
    if value.strip().lower() in texts:
        return texts[value.strip().lower()]
    raise ValueError(f"{arch} knob {name}={value!r} is not one of {list(texts)}")


def with_values(base: Config, values: Mapping[str, Any]) -> Config:
    """`base` with the given knobs replaced, each value a declared choice or its printed text."""
    unknown = sorted(set(values) - set(base.to_dict()))
    if unknown:
        other = [a for a in ARCHS if a != base.arch and set(unknown) <= {k.name for k in knobs_for(a)}]
        hint = f" (knobs of {' and '.join(other)}: a configuration for another architecture)" if other else ""
        raise ValueError(f"unknown knob(s) for {base.arch}: {', '.join(unknown)}{hint}")
    return base.replace(**{name: knob_value(base.arch, name, v) for name, v in values.items()})


def display_label(arch: str, values: Mapping[str, Any]) -> str:
    """The label of a stored configuration for a table or report; never raises. A configuration
    this version cannot build (tuned before a knob was added, or a value since removed) prints its
    stored pairs and why it is not usable, so an old database or journal still lists."""
    try:
        return Config.from_dict(arch, values).label()
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        pairs = " ".join(f"{k}={v}" for k, v in dict(values).items()) if isinstance(values, Mapping) \
            else repr(values)
        return f"{pairs} (not usable here: {exc})"
