"""Sequence lengths of variable-length batches: named distributions and the batches drawn from them.

    lengths("azure-conv-2023", tokens=16384, seed=0)     # prompts until 16384 tokens, the last one cut
    lengths("log-uniform", sequences=32, seed=1)         # 32 documents

A batch is drawn with a seeded `random.Random` (the same lengths on every machine and Python) either
as `sequences` draws, or as draws until their sum reaches `tokens`, the last one cut so the batch
holds exactly `tokens` (as a serving engine fills its prefill token budget with chunked prefill, or a
packer fills a training step's tokens). `fa4tune search --varlen NAME` and shapes files
(`[[varlen]]` with `distribution = "NAME"`, `fa4tune.inputs.shape_sets`) use them.

The distributions (`DISTRIBUTIONS`):
- "azure-conv-2023", "azure-code-2023": measured. The prompt lengths (ContextTokens) of the Azure
  LLM inference trace 2023 (Azure/AzurePublicDataset, data/AzureLLMInferenceTrace_conv.csv, 19,366
  requests of a conversation service, and ..._code.csv, 8,819 requests of a coding service, collected
  on 2023-11-16; CC-BY; described in Patel et al., "Splitwise", ISCA 2024). Kept as the trace's
  percentiles 0, 1, ..., 99, 99.9 and 100 (inverted CDF, computed from the CSVs), drawn by inverse
  transform, linear between two percentiles. Conversation: median 1020 tokens, mean 1155, 39 % at most
  512, 2.1 % past 4096, longest 14050; code: median 1469, mean 2048, 14 % past 4096, longest 7437.
  So a conversation batch is many prompts of a few hundred to a thousand tokens and a few of 4k: the
  case a varlen kernel's scheduler must balance.
- "log-uniform": synthetic, not measured: lengths spread evenly over log2 64 .. log2 8192 (as many
  of 64-128 tokens as of 4096-8192), a stand-in for packed pretraining documents cut to an 8192-token
  context (benchmarks/varlen_bench.py's "mixed" batch draws the same law).
"""

from __future__ import annotations

import bisect
import math
import random
from dataclasses import dataclass
from typing import Callable, Optional

# percentiles of the tables below: 0, 1, ..., 99, 99.9, 100
_PERCENTS = tuple(range(100)) + (99.9, 100.0)

# ContextTokens of data/AzureLLMInferenceTrace_conv.csv at `_PERCENTS` (numpy percentile, inverted_cdf)
AZURE_CONV_2023 = (
    2, 29, 91, 161, 181, 181, 191, 197, 201, 203, 207, 212, 222, 242, 317, 372, 375, 378, 381, 384, 387, 390, 392,
    394, 395, 396, 398, 399, 400, 402, 403, 405, 406, 408, 411, 414, 419, 424, 433, 456, 703, 863, 903, 946, 972,
    984, 994, 1002, 1009, 1014, 1020, 1025, 1031, 1036, 1041, 1045, 1050, 1055, 1060, 1065, 1071, 1076, 1081, 1086,
    1092, 1097, 1102, 1109, 1116, 1122, 1130, 1139, 1147, 1160, 1171, 1189, 1215, 1249, 1311, 1314, 1315, 1321,
    1369, 1508, 1690, 1877, 2032, 2221, 2402, 2584, 2735, 3292, 4073, 4076, 4079, 4083, 4086, 4090, 4098, 4142,
    6212, 14050)
# the same of data/AzureLLMInferenceTrace_code.csv
AZURE_CODE_2023 = (
    3, 17, 35, 50, 62, 75, 88, 97, 109, 130, 147, 162, 179, 193, 209, 232, 253, 283, 319, 352, 385, 423, 469, 501,
    539, 578, 604, 651, 698, 745, 770, 816, 848, 880, 908, 938, 969, 997, 1027, 1049, 1075, 1105, 1133, 1174, 1205,
    1261, 1296, 1346, 1377, 1417, 1469, 1500, 1555, 1600, 1642, 1690, 1724, 1774, 1823, 1874, 1909, 1964, 2024,
    2077, 2128, 2164, 2226, 2284, 2329, 2387, 2433, 2480, 2546, 2615, 2672, 2745, 2805, 2896, 2975, 3066, 3193,
    3295, 3452, 3599, 3714, 3923, 4107, 4320, 4559, 4759, 5194, 5636, 5961, 6194, 6585, 7315, 7431, 7435, 7436,
    7436, 7437, 7437)


def _from_percentiles(table: tuple) -> Callable[[random.Random], int]:
    """A draw by inverse transform from a percentile table, linear between two percentiles."""
    assert len(table) == len(_PERCENTS)

    def draw(rng: random.Random) -> int:
        u = rng.random() * 100.0
        i = min(bisect.bisect_right(_PERCENTS, u), len(_PERCENTS) - 1)
        lo, hi = _PERCENTS[i - 1], _PERCENTS[i]
        return max(1, round(table[i - 1] + (table[i] - table[i - 1]) * (u - lo) / (hi - lo)))
    return draw


def _log_uniform(low: int, high: int) -> Callable[[random.Random], int]:
    def draw(rng: random.Random) -> int:
        return int(math.exp(rng.uniform(math.log(low), math.log(high))))
    return draw


@dataclass(frozen=True)
class Distribution:
    name: str
    source: str            # where the law comes from (measured, or "synthetic")
    draw: Callable[[random.Random], int]


DISTRIBUTIONS = {d.name: d for d in (
    Distribution("azure-conv-2023", "measured: prompt lengths of the Azure LLM inference trace 2023, "
                 "conversation service (19,366 requests)", _from_percentiles(AZURE_CONV_2023)),
    Distribution("azure-code-2023", "measured: prompt lengths of the Azure LLM inference trace 2023, "
                 "coding service (8,819 requests)", _from_percentiles(AZURE_CODE_2023)),
    Distribution("log-uniform", "synthetic: log-uniform over 64..8192, a stand-in for packed pretraining "
                 "documents (not measured from a corpus)", _log_uniform(64, 8192)),
)}


def names() -> list[str]:
    return list(DISTRIBUTIONS)


def lengths(distribution: str, *, sequences: Optional[int] = None, tokens: Optional[int] = None,
            seed: int = 0) -> list[int]:
    """A batch's sequence lengths drawn from `distribution` (module docstring): exactly one of
    `sequences` (that many draws) and `tokens` (draws until they sum to it, the last cut). ValueError
    naming the problem otherwise."""
    if distribution not in DISTRIBUTIONS:
        raise ValueError(f"no length distribution {distribution!r}; known: {', '.join(DISTRIBUTIONS)}")
    if (sequences is None) == (tokens is None):
        raise ValueError("give the batch's sequences or its total tokens, one of them")
    for name, value in (("sequences", sequences), ("tokens", tokens)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    rng = random.Random(f"{distribution}:{seed}")   # a string seed: stable across Python versions
    draw = DISTRIBUTIONS[distribution].draw
    if sequences is not None:
        return [draw(rng) for _ in range(sequences)]
    out: list[int] = []
    left = tokens
    while left > 0:
        out.append(min(draw(rng), left))
        left -= out[-1]
    return out
