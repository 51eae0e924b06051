"""Per-block instruction counts of the masked path: ours (masked loop) beside flash-attn-4 (its loop, masked branch)."""
import sys
from collections import Counter
from functools import lru_cache
sys.path.insert(0, "benchmarks")
import sm90_bwd_sass as S
from fa4tune.sm100.sass import control_flow, kernel_function, parse_sass

def path(func, blocks, loops, loop, prefer_masked):
    spin = set().union(*[lp.blocks for lp in loops if lp.spin]) if loops else set()
    inside = set(loop.blocks) - spin
    sgn = 1 if prefer_masked else -1
    weight = {b: blocks[b].end - blocks[b].start + sgn * (10**6 if S._masked(func, blocks[b]) else 0) for b in inside}
    @lru_cache(maxsize=None)
    def longest(b):
        best = (None, float("-inf"))
        for s in blocks[b].successors:
            if s == loop.header:
                cand = ((b,), weight[b])
            elif s in inside and s > b:
                sub = longest(s)
                if sub[0] is None: continue
                cand = ((b,) + sub[0], weight[b] + sub[1])
            else: continue
            if cand[1] > best[1]: best = cand
        return best
    p, _ = longest(loop.header)
    return [func.instructions[j] for bi in p or () for j in range(blocks[bi].start, blocks[bi].end)]

def report(name, text):
    func = kernel_function(parse_sass(text)); blocks, loops = control_flow(func)
    for lp in loops:
        if lp.spin: continue
        for pm in (False, True):
            p = path(func, blocks, loops, lp, pm)
            c = Counter(filter(None, map(S.instruction_class, p)))
            h = sum(v for k, v in c.items() if k.startswith("HGMMA"))
            if h < 8: continue
            masked = any("-INF" in i.operands for i in p)
            print(name, "loop", lp.header, "prefer_masked", pm, "masked", masked, "len", len(p), "hgmma", h,
                  {k: c[k] for k in ("LDS", "STS", "STSM", "MUFU.EX2", "SHFL")})

from fa4.kernels import sm90_bwd
from kernels.problem import AttentionProblem
hd = int(sys.argv[1]) if len(sys.argv) > 1 else 128
prob = S.AttentionProblem(batch=4, seqlen_q=2048, seqlen_k=2048, heads_q=16, heads_kv=4, head_dim=hd, causal=True, dtype="bf16") if hasattr(S, "AttentionProblem") else None
