"""GPU time of fa4.attention's backward alone, per backward implementation, on a few training shapes.

The implementation is the one `$FA4_BACKWARD` forces (`fa4.backward`), so compare by running this once
per implementation, on the H200:
    for impl in flash_attn_4 ours flash_attn_4 ours; do FA4_BACKWARD=$impl python benchmarks/backward_impls.py; done
Prints one JSON line per run: {shape: us per backward}, the best of 5 runs of 10 back-to-back backwards
(torch.autograd.grad on one saved forward, CUDA events), after 3 warm-up calls.
"""

import json
import os

import torch

import fa4
from fa4tune.workers.timing import time_events_us

SHAPES = [  # (batch, seqlen, heads_q, heads_kv, head_dim, causal)
    (4, 2048, 16, 4, 128, True),
    (2, 4096, 32, 8, 128, True),
    (8, 1024, 16, 16, 64, False),
    (1, 8192, 32, 8, 128, True),
]


def backward_us(batch, seqlen, heads_q, heads_kv, head_dim, causal, runs=5, calls=10) -> float:
    def leaf(heads):
        return torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    q, k, v = leaf(heads_q), leaf(heads_kv), leaf(heads_kv)
    out = fa4.attention(q, k, v, causal=causal)
    dout = torch.randn_like(out)
    return time_events_us(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True), runs, calls)


def main():
    times = {}
    for batch, seqlen, heads_q, heads_kv, head_dim, causal in SHAPES:
        name = f"b{batch}-s{seqlen}-{heads_q}/{heads_kv}-d{head_dim}-{'causal' if causal else 'full'}"
        times[name] = round(backward_us(batch, seqlen, heads_q, heads_kv, head_dim, causal), 1)
    print(os.environ.get("FA4_BACKWARD", "auto"), json.dumps(times), flush=True)


if __name__ == "__main__":
    main()
