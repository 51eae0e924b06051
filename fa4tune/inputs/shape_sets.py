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

A shapes file may name variable-length batches too (`fa4.varlen_batch.VarlenProblem`, tuned as
`fa4tune search --varlen` tunes one): `[[varlen]]` tables with the head counts, head dim, dtype, causal,
return_lse, window and softcap of a `[[problem]]` table (the same short form `gqa`; no batch and no
lengths: the sequences give them), and the lengths either written out (`lengths`, queries and keys
alike, or `lengths_q` and `lengths_k`; a list of lists for several batches) or drawn from a named
distribution (`distribution`, `fa4tune.inputs.varlen_lengths`: "azure-conv-2023" is measured prompt
lengths of a serving trace) with `sequences` or `tokens` (the batch's total) and `seed` (default 0).
Any of the others may be a list, as in `[[problem]]`.

    [[varlen]]                      # a serving prefill batch of 16384 tokens, causal
    heads_q = 32
    gqa = 4
    head_dim = 128
    dtype = "bf16"
    causal = true
    distribution = "azure-conv-2023"
    tokens = 16384

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


_VARLEN_FIELDS = ("heads_q", "heads_kv", "gqa", "head_dim", "dtype", "causal", "return_lse", "window", "softcap",
                  "lengths", "lengths_q", "lengths_k", "distribution", "sequences", "tokens", "seed")


def _expand_varlen(table: dict, where: str) -> list[AttentionProblem]:
    """The `VarlenProblem`s of one [[varlen]] table (module docstring)."""
    from fa4.varlen_batch import VarlenProblem
    from fa4tune.inputs.varlen_lengths import lengths as draw_lengths

    unknown = sorted(set(table) - set(_VARLEN_FIELDS))
    if unknown:
        raise ShapeSetError(f"{where}: unknown name(s) {unknown}; known: {list(_VARLEN_FIELDS)}")
    written = [name for name in ("lengths", "lengths_q") if name in table]
    if len(written) + ("distribution" in table) != 1 or ("lengths_k" in table) != ("lengths_q" in table):
        raise ShapeSetError(f"{where}: give the lengths one way: lengths, lengths_q with lengths_k, or "
                            "distribution (with sequences or tokens)")
    if "distribution" not in table and any(name in table for name in ("sequences", "tokens", "seed")):
        raise ShapeSetError(f"{where}: sequences, tokens and seed draw lengths from a distribution: name one")
    batches = {}   # field -> one batch's lengths, or a list of batches
    for name in ("lengths", "lengths_q", "lengths_k"):
        if name in table:
            value = table.pop(name)
            several = isinstance(value, list) and value and all(isinstance(x, list) for x in value)
            batches[name] = value if several else [value]
    if {"heads_q", "head_dim"} - set(table) or ("gqa" in table) == ("heads_kv" in table):
        raise ShapeSetError(f"{where}: a [[varlen]] table needs heads_q, head_dim and one of heads_kv or gqa")
    table = {"causal": [False, True], **table}
    names = sorted(table)
    problems = []
    for values in itertools.product(*(_as_list(table[n], n) for n in names)):
        fields = dict(zip(names, values))
        if "gqa" in fields:
            gqa = fields.pop("gqa")
            if not isinstance(gqa, int) or gqa < 1 or fields["heads_q"] % gqa:
                raise ShapeSetError(f"{where}: {fields['heads_q']} query heads are not divisible by gqa {gqa}")
            fields["heads_kv"] = fields["heads_q"] // gqa
        for flag in ("causal", "return_lse"):
            if not isinstance(fields.get(flag, False), bool):
                raise ShapeSetError(f"{where}: {flag} must be true or false, got {fields[flag]!r}")
        for name in ("heads_q", "heads_kv", "head_dim"):
            if not isinstance(fields[name], int) or isinstance(fields[name], bool) or fields[name] < 1:
                raise ShapeSetError(f"{where}: {name} must be a positive integer, got {fields[name]!r}")
        try:
            if "distribution" in fields:
                drawn = draw_lengths(fields.pop("distribution"), sequences=fields.pop("sequences", None),
                                     tokens=fields.pop("tokens", None), seed=fields.pop("seed", 0))
                pairs = [(drawn, drawn)]
            elif "lengths" in batches:
                pairs = [(b, b) for b in batches["lengths"]]
            else:
                if len(batches["lengths_q"]) != len(batches["lengths_k"]):
                    raise ValueError("lengths_q and lengths_k name different numbers of batches")
                pairs = list(zip(batches["lengths_q"], batches["lengths_k"]))
            for lengths_q, lengths_k in pairs:
                if not isinstance(lengths_q, list) or not isinstance(lengths_k, list):
                    raise ValueError("lengths must be lists of integers")
                problems.append(VarlenProblem.of(lengths_q, lengths_k, window_size=fields.get("window"),
                                                 **{k: v for k, v in fields.items() if k != "window"}))
        except (TypeError, ValueError) as exc:
            raise ShapeSetError(f"{where}: {exc}") from exc
    return problems


def parse_shapes(text: str, source: str = "<shapes>") -> list[AttentionProblem]:
    """The problems of a shapes file's text (see the module docstring): its [[problem]] tables, then its
    [[varlen]] tables."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ShapeSetError(f"{source}: not valid TOML: {exc}") from exc
    extra = sorted(set(doc) - {"problem", "varlen"})
    if extra:
        raise ShapeSetError(f"{source}: unknown top-level name(s) {extra}; a shapes file holds [[problem]] "
                            "and [[varlen]] tables")
    tables = {kind: doc.get(kind, []) for kind in ("problem", "varlen")}
    if not all(isinstance(t, list) for t in tables.values()) or not any(tables.values()):
        raise ShapeSetError(f"{source}: no [[problem]] or [[varlen]] table")
    out: dict[AttentionProblem, None] = {}
    for kind, expand in (("problem", _expand), ("varlen", _expand_varlen)):
        for i, table in enumerate(tables[kind]):
            for problem in expand(dict(table), f"{source}, {kind} {i + 1}"):
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
