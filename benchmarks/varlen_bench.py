"""GPU time of fa4.attention_varlen's implementations on packed batches of mixed lengths, beside the
padded alternative (fa4.attention on (B, max_len) with every sequence padded, which computes the padding
too and, without a key mask, is not the same answer: it is the cost a varlen kernel saves).

    python benchmarks/varlen_bench.py --out results/h200/varlen_bench.json

Batches (fixed seeds, bf16, Hq/Hkv 32/8, D 128, causal, Sq = Sk per sequence):
- "uniform": 16 sequences of 2048;
- "mixed": 32 lengths drawn log-uniformly from 64..8192 (a prefill batch of a serving engine: many
  short prompts and a few long documents);
- "one_long": one sequence of 16384 and 31 of 128 (the case longest-first scheduling exists for).
GPU time by CUDA-graph replay (fa4tune's timing; the per-sequence path runs with CPU offsets so the
capture holds it) and the eager wall time per call, for every implementation (`varlen.implementations()`:
ours, flash-attn-4, per sequence) that runs here.
"""

from __future__ import annotations

import argparse
import json
import math

import torch

import fa4
from fa4 import varlen
from fa4tune.workers.timing import TimingSettings, time_cuda, time_eager

HEADS_Q, HEADS_KV, HEAD_DIM = 32, 8, 128


def batches() -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(0)
    mixed = [int(math.exp(x)) for x in torch.empty(32).uniform_(math.log(64), math.log(8192), generator=gen).tolist()]
    return {"uniform": [2048] * 16, "mixed": mixed, "one_long": [16384] + [128] * 31}


def packed(lengths: list[int]):
    total = sum(lengths)
    q = torch.randn(total, HEADS_Q, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(total, HEADS_KV, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    return q, k, v, cu


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    rows = []
    for name, lengths in batches().items():
        q, k, v, cu = packed(lengths)
        longest = max(lengths)
        tokens = sum(lengths)
        calls = {}
        for implementation in varlen.implementations():
            offsets = cu if implementation == varlen.PER_SEQUENCE else cu.cuda()
            if varlen.unsupported(implementation, q):
                continue
            calls[implementation] = (lambda o=offsets, i=implementation: fa4.attention_varlen(
                q, k, v, o, o, longest, longest, causal=True, backend=i))
        padded_q = q.new_zeros(len(lengths), longest, HEADS_Q, HEAD_DIM)
        padded_kv = k.new_zeros(len(lengths), longest, HEADS_KV, HEAD_DIM)
        calls["padded_dense"] = lambda: fa4.attention(padded_q, padded_kv, padded_kv, causal=True)
        row = {"batch": name, "lengths": lengths, "tokens": tokens, "max_len": longest}
        for label, call in calls.items():
            call()
            torch.cuda.synchronize()
            row[f"{label}_us"] = round(time_cuda(call, TimingSettings()).us, 1)
            row[f"{label}_eager_us"] = round(time_eager(call, calls=20, repeats=3), 1)
        rows.append(row)
        print(json.dumps({key: value for key, value in row.items() if key != "lengths"}), flush=True)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
