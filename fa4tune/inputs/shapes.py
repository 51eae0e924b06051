"""Shape keys: one name per problem (the study name, the bench row), and reading one back.

`shape_key(arch, problem)` is e.g. `sm90-fp16-b1-hq32-hkv8-d128-sq1024-sk1024-causal` (`-full` when not
causal; a sliding window's bounded sides `-wl<left>` / `-wr<right>` and a softcap `-cap<c>` follow the
mask; `-lse` appended when the log-sum-exp is returned; a variable-length batch,
`fa4.varlen_batch.VarlenProblem`, ends in `-varlen-t<total query tokens>-<digest of its lengths>`, its
b, sq and sk the sequences and the max lengths). `parse_shape` reads any dash-separated subset
of its tokens (and a few short forms: `s1024`, `gqa4`), the rest from defaults; `parse_shape_masks` reads
one for each mask a command asks for when the text names none.
"""

from __future__ import annotations

import re
from typing import Optional

from fa4.kernels import ARCHS, AttentionProblem
from fa4.kernels.problem import resolve_mask


def shape_key(arch: str, problem: AttentionProblem) -> str:
    mask = "causal" if problem.causal else "full"
    if problem.window_left is not None:
        mask += f"-wl{problem.window_left}"
    if problem.window_right is not None and not problem.causal:
        mask += f"-wr{problem.window_right}"
    if problem.softcap is not None:
        mask += f"-cap{problem.softcap:g}"
    key = (f"{arch}-{problem.dtype}-b{problem.batch}-hq{problem.heads_q}-hkv{problem.heads_kv}"
           f"-d{problem.head_dim}-sq{problem.seqlen_q}-sk{problem.seqlen_k}-{mask}")
    key += "-lse" if problem.return_lse else ""
    if getattr(problem, "lengths_q", None) is not None:   # a varlen batch: its tokens and which lengths
        key += f"-varlen-t{problem.tokens_q}-{problem.lengths_digest()}"
    return key


_TOKEN = re.compile(r"^(b|hq|hkv|d|sq|sk|s|gqa|wl|wr)(\d+)$")
_SOFTCAP = re.compile(r"^cap(\d+(?:\.\d+)?)$")


def parse_shape(text: str, defaults: dict) -> tuple[Optional[str], AttentionProblem]:
    """A shape from dash-separated tokens in any order, the rest from `defaults`:
    `[sm90|sm100] [fp16|bf16] b<batch> hq<heads> hkv<kv heads> gqa<ratio> d<head dim> s<seqlen>
    sq<seqlen_q> sk<seqlen_k> [causal|full] wl<left> wr<right> cap<softcap> [lse]` (`wl`/`wr`: a
    sliding window's left and right sides, an absent one unbounded; without either, the window of
    `defaults`). The mask is resolved as `fa4.attention` and shapes files resolve it
    (`fa4.kernels.problem.resolve_mask`: a window as wide as the sequences is none). Returns (arch or
    None, problem)."""
    values = dict(defaults)
    arch = None
    gqa = None
    window = None
    for token in text.strip().split("-"):
        token = token.strip().lower()
        if not token:
            continue
        cap = _SOFTCAP.match(token)
        if cap:
            values["softcap"] = float(cap.group(1))
        elif token in ARCHS:
            arch = token
        elif token in ("fp16", "bf16"):
            values["dtype"] = token
        elif token in ("causal", "full"):
            values["causal"] = token == "causal"
        elif token == "lse":
            values["return_lse"] = True
        else:
            m = _TOKEN.match(token)
            if not m:
                raise ValueError(f"shape {text!r}: cannot read {token!r}")
            name, number = m.group(1), int(m.group(2))
            if name in ("wl", "wr"):
                window = window or [-1, -1]
                window[name == "wr"] = number
            elif name == "s":
                values["seqlen_q"] = values["seqlen_k"] = number
            elif name == "gqa":
                gqa = number
            else:
                values[{"b": "batch", "hq": "heads_q", "hkv": "heads_kv", "d": "head_dim",
                        "sq": "seqlen_q", "sk": "seqlen_k"}[name]] = number
    if gqa is not None:
        if values["heads_q"] % gqa:
            raise ValueError(f"shape {text!r}: {values['heads_q']} query heads are not divisible by gqa {gqa}")
        values["heads_kv"] = values["heads_q"] // gqa
    if window is not None and values.get("causal") and window[1] not in (-1, 0):
        raise ValueError(f"shape {text!r}: a causal window has no right side (wr{window[1]})")
    try:
        values["causal"], values["window"], values["softcap"] = resolve_mask(
            values.get("causal", False), window if window is not None else values.get("window"),
            values.get("softcap"), values["seqlen_q"], values["seqlen_k"])
    except ValueError as exc:
        raise ValueError(f"shape {text!r}: {exc}") from exc
    return arch, AttentionProblem(**values)


def parse_shape_masks(text: str, defaults: dict, masks=(False, True)) -> list[AttentionProblem]:
    """The problems of one shape text: itself when it names a mask (`causal`, `full`), else one per
    causal flag of `masks` (as a command's --causal/--no-causal/--both), each resolved with the
    window and softcap (so a window whose right side is 0 is causal under both flags: one problem)."""
    named = any(t.strip().lower() in ("causal", "full") for t in text.split("-"))
    flags = [defaults.get("causal", False)] if named else list(masks)
    return list(dict.fromkeys(parse_shape(text, {**defaults, "causal": causal})[1] for causal in flags))
