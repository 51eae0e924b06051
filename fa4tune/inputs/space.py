"""Search spaces: the knob choices a search samples from, loaded from `search_spaces/<arch>.toml`.

A space file may only NARROW the knobs declared in `fa4.kernels.knobs`; it never declares a knob or a
value. Format (every part optional; a knob not mentioned keeps all its declared choices):

    arch = "sm90"                       # when present, must be the architecture the file is loaded for
    description = "why this narrowing"  # free text, shown by nothing, for the reader of the file

    [knobs]
    tile_n = [64, 128, 176]             # a list: these choices, in this order (each must be declared)
    pack_gqa = true                     # a scalar: the knob is fixed to that value
    kv_stages = { choices = [2, 3] }    # the same as a list

    [exclude]
    tile_n = [176]                      # declared values left out on purpose (say why in description)

Knob names may also appear at the top level instead of under `[knobs]`. An unknown knob, a value that
is not one of the knob's declared choices, an empty list or a duplicate is a `SpaceError` naming the
file, the knob and what is allowed.

Every declared value of a packaged space is searched or excluded on purpose: a value that is listed
under neither (a value added to `knobs.py` after a `[knobs]` list was written) fails
`tests/test_space.py`, so nothing declared goes unsearched silently. `SearchSpace.unlisted()` names them.

Values are matched as the knob model matches them (`Config`: a float knob's 8 is 8.0, True is not 1),
through its public API only.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional

from fa4.kernels import Config, knobs_for
from fa4.kernels.knobs import Scalar

__all__ = ["SpaceError", "SearchSpace", "load_space", "space_path", "full_space"]

_META_KEYS = {"arch", "description"}
_TABLES = {"knobs", "exclude"}


class SpaceError(ValueError):
    """A search-space file that does not narrow the declared knobs (unknown knob or value, bad form)."""


@dataclass(frozen=True)
class SearchSpace:
    """The choices per knob, in knob declaration order. `source`: the file it came from, or None."""

    arch: str
    choices: tuple[tuple[str, tuple[Scalar, ...]], ...]
    source: Optional[str] = None
    excluded: tuple[tuple[str, tuple[Scalar, ...]], ...] = ()   # left out on purpose ([exclude])

    @property
    def knob_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.choices)

    def choices_of(self, name: str) -> tuple[Scalar, ...]:
        for knob_name, values in self.choices:
            if knob_name == name:
                return values
        raise KeyError(f"{self.arch} search space has no knob {name!r}")

    @property
    def size(self) -> int:
        n = 1
        for _, values in self.choices:
            n *= len(values)
        return n

    def configs(self) -> Iterator[Config]:
        """Every configuration of the space (the cartesian product), in a stable order."""
        names = self.knob_names
        for values in itertools.product(*(v for _, v in self.choices)):
            yield Config(self.arch, tuple(zip(names, values)))

    def contains(self, config: Config) -> bool:
        # a Config's values and the space's choices are both canonical (`_declared`): plain equality
        return config.arch == self.arch and all(value in self.choices_of(name) for name, value in config.items)

    def unlisted(self) -> dict[str, list]:
        """Declared values that are neither searched nor excluded on purpose, per knob."""
        excluded = dict(self.excluded)
        out = {}
        for knob in knobs_for(self.arch):
            kept = set(self.choices_of(knob.name)) | set(excluded.get(knob.name, ()))
            missing = [c for c in knob.choices if c not in kept]
            if missing:
                out[knob.name] = missing
        return out

    def to_dict(self) -> dict[str, list]:
        return {name: list(values) for name, values in self.choices}

    def fingerprint(self) -> str:
        """A short hash of the choices: a study refuses to continue on a different space."""
        text = json.dumps([self.arch, [[n, list(v)] for n, v in self.choices]])
        return hashlib.sha256(text.encode()).hexdigest()[:12]


def full_space(arch: str) -> SearchSpace:
    """Every declared choice of every knob of `arch`."""
    return SearchSpace(arch, tuple((k.name, tuple(k.choices)) for k in knobs_for(arch)), None)


def space_path(arch: str) -> Path:
    """The packaged space file of an architecture (it may not exist)."""
    import fa4tune.search_spaces as pkg

    return Path(pkg.__file__).resolve().parent / f"{arch}.toml"


def load_space(arch: str, path: str | Path | None = None) -> SearchSpace:
    """The space of `arch` from `path`, else from the packaged file, else the full declared space."""
    declared = knobs_for(arch)  # raises on an unknown architecture
    p = Path(path) if path is not None else space_path(arch)
    if not p.exists():
        if path is not None:
            raise SpaceError(f"search space file {p} does not exist")
        return full_space(arch)
    try:
        data = tomllib.loads(p.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise SpaceError(f"{p}: not a readable TOML file: {exc}") from exc
    choices = _narrow(arch, declared, data, p)
    excluded = _exclusions(arch, declared, data, p)
    for name, values in excluded:
        remaining = tuple(c for c in dict(choices)[name] if c not in values)
        if not remaining:
            raise SpaceError(f"{p}: knob {name!r} has no choices left after [exclude]")
        choices = tuple((n, remaining if n == name else v) for n, v in choices)
    return SearchSpace(arch, choices, str(p), excluded)


def _declared(arch: str, name: str, value: Any) -> Optional[Scalar]:
    """The declared choice `value` stands for, or None: the knob model's own rule, asked through `Config`."""
    try:
        return getattr(Config.make(arch, **{name: value}), name)
    except ValueError:
        return None


def _exclusions(arch: str, declared, data: Mapping[str, Any], p: Path):
    table = data.get("exclude", {})
    if not isinstance(table, dict):
        raise SpaceError(f"{p}: [exclude] must be a table of knob = values")
    by_name = {k.name: k for k in declared}
    out = []
    for name, values in table.items():
        if name not in by_name:
            raise SpaceError(f"{p}: [exclude] names unknown knob {name!r} for {arch}")
        values = values if isinstance(values, list) else [values]
        canonical = []
        for v in values:
            c = _declared(arch, name, v)
            if c is None:
                raise SpaceError(f"{p}: [exclude] {arch} knob {name}={v!r} is not a declared choice; "
                                 f"declared: {list(by_name[name].choices)}")
            canonical.append(c)
        out.append((name, tuple(canonical)))
    return tuple(out)


def _narrow(arch: str, declared, data: Mapping[str, Any], p: Path):
    if "arch" in data and data["arch"] != arch:
        raise SpaceError(f"{p}: declares arch = {data['arch']!r} but was loaded for {arch!r}")
    by_name = {k.name: k for k in declared}
    requested: dict[str, Any] = {}
    table = data.get("knobs", {})
    if not isinstance(table, dict):
        raise SpaceError(f"{p}: [knobs] must be a table of knob = choices")
    top_level = {k: v for k, v in data.items() if k not in _META_KEYS | _TABLES}
    for name, value in itertools.chain(table.items(), top_level.items()):
        if name not in by_name:
            known = ", ".join(by_name)
            raise SpaceError(f"{p}: unknown knob {name!r} for {arch}; declared knobs: {known}")
        if name in requested:
            raise SpaceError(f"{p}: knob {name!r} is given twice")
        requested[name] = value
    out = []
    for knob in declared:
        if knob.name not in requested:
            out.append((knob.name, tuple(knob.choices)))
            continue
        value = requested[knob.name]
        if isinstance(value, dict):
            if set(value) != {"choices"}:
                raise SpaceError(f"{p}: knob {knob.name!r}: a table may only hold 'choices'")
            value = value["choices"]
        values = value if isinstance(value, list) else [value]
        if not values:
            raise SpaceError(f"{p}: knob {knob.name!r} has no choices left")
        narrowed = []
        for v in values:
            c = _declared(arch, knob.name, v)
            if c is None:
                raise SpaceError(f"{p}: {arch} knob {knob.name}={v!r} is not a declared choice; "
                                 f"declared: {list(knob.choices)}")
            if c in narrowed:
                raise SpaceError(f"{p}: knob {knob.name!r} lists {v!r} twice")
            narrowed.append(c)
        out.append((knob.name, tuple(narrowed)))
    return tuple(out)
