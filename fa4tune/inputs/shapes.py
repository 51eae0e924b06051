"""Shape keys: one name per problem (the study name, the bench row), and reading one back.

`shape_key(arch, problem)` is e.g. `sm90-fp16-b1-hq32-hkv8-d128-sq1024-sk1024-causal` (`-full` when not
causal, `-lse` appended when the log-sum-exp is returned). `parse_shape` reads any dash-separated subset
of its tokens (and a few short forms: `s1024`, `gqa4`), the rest from defaults.
"""

from __future__ import annotations

import re
from typing import Optional

from fa4.kernels import ARCHS, AttentionProblem


def shape_key(arch: str, problem: AttentionProblem) -> str:
    mask = "causal" if problem.causal else "full"
    key = (f"{arch}-{problem.dtype}-b{problem.batch}-hq{problem.heads_q}-hkv{problem.heads_kv}"
           f"-d{problem.head_dim}-sq{problem.seqlen_q}-sk{problem.seqlen_k}-{mask}")
    return key + ("-lse" if problem.return_lse else "")


_TOKEN = re.compile(r"^(b|hq|hkv|d|sq|sk|s|gqa)(\d+)$")


def parse_shape(text: str, defaults: dict) -> tuple[Optional[str], AttentionProblem]:
    """A shape from dash-separated tokens in any order, the rest from `defaults`:
    `[sm90|sm100] [fp16|bf16] b<batch> hq<heads> hkv<kv heads> gqa<ratio> d<head dim> s<seqlen>
    sq<seqlen_q> sk<seqlen_k> [causal|full] [lse]`. Returns (arch or None, problem)."""
    values = dict(defaults)
    arch = None
    gqa = None
    for token in text.strip().split("-"):
        token = token.strip().lower()
        if not token:
            continue
        if token in ARCHS:
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
            if name == "s":
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
    return arch, AttentionProblem(**values)
