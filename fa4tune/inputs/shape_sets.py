"""Shape sets: the list of problems one `fa4tune search` tunes, from a shapes file or a model preset.

A shapes file is TOML, a list of `[[problem]]` tables. Each names the fields of
`fa4.kernels.AttentionProblem` (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype, causal,
return_lse, window, softcap, head_dim_v: v's head dim where it differs), plus two short forms: `seqlen` (query and key length alike) and `gqa`
(query heads per KV head, instead of heads_kv). Any value may be a list: the table then stands for every
combination. A table without `causal` stands for both masks, as the command line's default. Unknown
names are errors. `window` is a pair [left, right] (flash-attn's convention: -1 for an unbounded side;
under causal the right side is 0, and a window at least as wide as the sequences is none), or a list of
pairs; `softcap` a number > 0.

    [[problem]]                     # 2 batches x 2 lengths x 2 masks: 8 problems
    heads_q = 32
    heads_kv = 8
    head_dim = 128
    dtype = "bf16"
    batch = [1, 8]
    seqlen = [1024, 4096]

Model presets (`--model NAME`) are shapes files shipped with the package (`models/<name>.toml`, the
package `fa4tune.models`); each says where its head counts and head dim come from. `FA4_RECORD_SHAPES`
(`fa4.record_shapes`) writes shapes files too, one single-valued table per problem.

Problems repeat only once in a set (first occurrence kept), in file order.
"""

from __future__ import annotations

import itertools
import tomllib
from importlib import resources
from pathlib import Path

from fa4.kernels import AttentionProblem
from fa4.kernels.problem import resolve_mask
from fa4.record_shapes import problem_table  # noqa: F401  (the writer of the tables read here)

_FIELDS = ("batch", "seqlen_q", "seqlen_k", "heads_q", "heads_kv", "head_dim", "dtype", "causal", "return_lse",
           "window", "softcap", "head_dim_v")
_SHORT_FORMS = ("seqlen", "gqa")
_REQUIRED = ("batch", "heads_q", "head_dim")


class ShapeSetError(ValueError):
    """A shapes file or preset that cannot be read; the message names the file and the table."""


def _as_list(value, name: str = "") -> list:
    if name == "window" and isinstance(value, list) and value and not isinstance(value[0], list):
        return [value]   # one window, [left, right]
    return list(value) if isinstance(value, list) else [value]


def _expand(table: dict, where: str) -> list[AttentionProblem]:
    unknown = sorted(set(table) - set(_FIELDS) - set(_SHORT_FORMS))
    if unknown:
        raise ShapeSetError(f"{where}: unknown name(s) {unknown}; known: {list(_FIELDS + _SHORT_FORMS)}")
    missing = [f for f in _REQUIRED if f not in table]
    if "seqlen" not in table and "seqlen_q" not in table:
        missing.append("seqlen (or seqlen_q)")
    if "gqa" not in table and "heads_kv" not in table:
        missing.append("heads_kv (or gqa)")
    if missing:
        raise ShapeSetError(f"{where}: missing {missing}")
    for a, b in (("seqlen", "seqlen_q"), ("seqlen", "seqlen_k"), ("gqa", "heads_kv")):
        if a in table and b in table:
            raise ShapeSetError(f"{where}: give {a} or {b}, not both")
    table = {"causal": [False, True], **table}
    names = sorted(table)
    problems = []
    for values in itertools.product(*(_as_list(table[n], n) for n in names)):
        fields = dict(zip(names, values))
        if "seqlen" in fields:
            fields["seqlen_q"] = fields["seqlen_k"] = fields.pop("seqlen")
        fields.setdefault("seqlen_k", fields["seqlen_q"])
        if "gqa" in fields:
            gqa = fields.pop("gqa")
            if not isinstance(gqa, int) or gqa < 1 or fields["heads_q"] % gqa:
                raise ShapeSetError(f"{where}: {fields['heads_q']} query heads are not divisible by gqa {gqa}")
            fields["heads_kv"] = fields["heads_q"] // gqa
        for flag in ("causal", "return_lse"):
            if not isinstance(fields.get(flag, False), bool):
                raise ShapeSetError(f"{where}: {flag} must be true or false, got {fields[flag]!r}")
        for name in ("batch", "seqlen_q", "seqlen_k", "heads_q", "heads_kv", "head_dim"):
            if not isinstance(fields[name], int) or isinstance(fields[name], bool) or fields[name] < 1:
                raise ShapeSetError(f"{where}: {name} must be a positive integer, got {fields[name]!r}")
        try:
            if "window" in fields or "softcap" in fields:   # flash-attn's arguments, as fa4.attention reads them
                fields["causal"], fields["window"], fields["softcap"] = resolve_mask(
                    fields.get("causal", False), fields.get("window"), fields.get("softcap"),
                    fields["seqlen_q"], fields["seqlen_k"])
            problems.append(AttentionProblem(**fields))
        except ValueError as exc:
            raise ShapeSetError(f"{where}: {exc}") from exc
    return problems


def parse_shapes(text: str, source: str = "<shapes>") -> list[AttentionProblem]:
    """The problems of a shapes file's text (see the module docstring)."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ShapeSetError(f"{source}: not valid TOML: {exc}") from exc
    extra = sorted(set(doc) - {"problem"})
    if extra:
        raise ShapeSetError(f"{source}: unknown top-level name(s) {extra}; a shapes file holds [[problem]] tables")
    tables = doc.get("problem", [])
    if not isinstance(tables, list) or not tables:
        raise ShapeSetError(f"{source}: no [[problem]] table")
    out: dict[AttentionProblem, None] = {}
    for i, table in enumerate(tables):
        for problem in _expand(table, f"{source}, problem {i + 1}"):
            out.setdefault(problem)
    return list(out)


def load_shapes_file(path: str | Path) -> list[AttentionProblem]:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ShapeSetError(f"shapes file {path}: {exc.strerror or exc}") from exc
    return parse_shapes(text, str(path))


def model_names() -> list[str]:
    """The model presets shipped with the package."""
    import fa4tune.models as pkg

    return sorted(p.name[:-5] for p in resources.files(pkg).iterdir() if p.name.endswith(".toml"))


def load_model(name: str) -> list[AttentionProblem]:
    """The problems of a model preset (`models/<name>.toml`)."""
    import fa4tune.models as pkg

    names = model_names()
    if name not in names:
        raise ShapeSetError(f"no model preset {name!r}; presets: {', '.join(names)}")
    return parse_shapes(resources.files(pkg).joinpath(f"{name}.toml").read_text(encoding="utf-8"),
                        f"model preset {name}")
