"""Search spaces: the knob choices a search samples from, loaded from `search_spaces/<arch>.toml`.

A space file may only NARROW the knobs declared in `fa4.kernels.knobs`; it never declares a knob or a
value. Format (every part optional; a knob not mentioned keeps all its declared choices):

    arch = "sm90"                       # when present, must be the architecture the file is loaded for
    description = "why this narrowing"  # free text, shown by nothing, for the reader of the file

    [knobs]
    tile_n = [64, 128, 176]             # a list: these choices, in this order (each must be declared)
    pack_gqa = true                     # a scalar: the knob is fixed to that value
    kv_stages = { choices = [2, 3] }    # the same as a list

Knob names may also appear at the top level instead of under `[knobs]`. An unknown knob, a value that
is not one of the knob's declared choices, an empty list or a duplicate is a `SpaceError` naming the
file, the knob and what is allowed.
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
from fa4.kernels.knobs import Scalar, _canonical, _in_choices

__all__ = ["SpaceError", "SearchSpace", "load_space", "space_path", "full_space"]

_META_KEYS = {"arch", "description"}


class SpaceError(ValueError):
    """A search-space file that does not narrow the declared knobs (unknown knob or value, bad form)."""


@dataclass(frozen=True)
class SearchSpace:
    """The choices per knob, in knob declaration order. `source`: the file it came from, or None."""

    arch: str
    choices: tuple[tuple[str, tuple[Scalar, ...]], ...]
    source: Optional[str] = None

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
        return config.arch == self.arch and all(
            _in_choices(value, self.choices_of(name)) for name, value in config.items)

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
    return SearchSpace(arch, _narrow(arch, declared, data, p), str(p))


def _narrow(arch: str, declared, data: Mapping[str, Any], p: Path):
    if "arch" in data and data["arch"] != arch:
        raise SpaceError(f"{p}: declares arch = {data['arch']!r} but was loaded for {arch!r}")
    by_name = {k.name: k for k in declared}
    requested: dict[str, Any] = {}
    table = data.get("knobs", {})
    if not isinstance(table, dict):
        raise SpaceError(f"{p}: [knobs] must be a table of knob = choices")
    top_level = {k: v for k, v in data.items() if k not in _META_KEYS | {"knobs"}}
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
            if not _in_choices(v, knob.choices):
                raise SpaceError(f"{p}: {arch} knob {knob.name}={v!r} is not a declared choice; "
                                 f"declared: {list(knob.choices)}")
            c = _canonical(v, knob.choices)
            if any(_in_choices(c, (seen,)) for seen in narrowed):
                raise SpaceError(f"{p}: knob {knob.name!r} lists {v!r} twice")
            narrowed.append(c)
        out.append((knob.name, tuple(narrowed)))
    return tuple(out)
