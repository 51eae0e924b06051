"""SASS of the sm90 attention backward's main loop, ours beside flash-attn-4's, counted per block.

Compiles on a CPU for sm_90a (fake tensors, nothing runs), disassembles with nvdisasm (the
nvidia-cuda-nvdisasm wheel) and counts, on the way once around the MMA warpgroups' block loop that
applies no mask where one exists (`steady_path`), the instructions that decide a block's time: wgmma
(HGMMA, by shape), warpgroup fences and waits (WARPGROUP.ARRIVE / WARPGROUP.DEPBAR), named barriers
(BAR.SYNC / BAR.ARV), mbarrier operations (SYNCS), global atomics (REDG), bulk reduces (UBLKRED),
exp2 (MUFU.EX2), shuffles, shared-memory stores and loads, global loads.

    python benchmarks/sm90_bwd_sass.py                            # D128 causal and D64 full, bf16
    python benchmarks/sm90_bwd_sass.py --head-dim 128 --causal --set dq_accum=bulk --json out.json

flash-attn-4 (the `peer` extra, 4.0.0b36) is compiled in a child process with the configuration its
`interface._tile_size_bwd_sm90` picks (copied below, `flash_attn4_config`: the interface module is
not imported, it needs einops and torch's CUDA); its quack dependency imports triton for an autotuner
this does not use, so that one module is stubbed. Compile-time figures: no timing.
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from functools import lru_cache

from fa4tune.sm100.sass import control_flow, kernel_function, parse_sass
from fa4tune.sm100.sass_build import disassemble

# what is counted: a name per instruction class (None: not counted beside the total)
def instruction_class(instr) -> str | None:
    op, base = instr.opcode, instr.base
    if base == "HGMMA":
        return "HGMMA." + op.split(".")[1]          # the shape, e.g. HGMMA.64x128x16
    if base in ("WARPGROUP", "BAR", "SYNCS", "FENCE", "MEMBAR"):
        return ".".join(op.split(".")[:2])
    if op.startswith("MUFU.EX2"):
        return "MUFU.EX2"
    if base in ("REDG", "RED", "ATOMG", "UBLKRED", "UTMAREDG", "UTMASTG", "UTMALDG", "UBLKCP", "SHFL", "STSM",
                "STS", "LDS", "LDG", "STG", "LDSM"):
        return base
    return None


def _masked(func, block) -> bool:
    return any("-INF" in func.instructions[j].operands for j in range(block.start, block.end))


def steady_path(func, blocks, loops, loop) -> list:
    """The instructions on the longest way once around `loop` (forward edges only, spin-wait retries
    left out) that avoids blocks applying a key mask (an FSEL to -INF) wherever it can: the path of a
    block away from the diagonal and the sequence end, with every non-rare branch taken."""
    spin = set().union(*[lp.blocks for lp in loops if lp.spin]) if loops else set()
    inside = set(loop.blocks) - spin
    weight = {b: blocks[b].end - blocks[b].start - (10**6 if _masked(func, blocks[b]) else 0) for b in inside}

    @lru_cache(maxsize=None)
    def longest(b):
        best = (None, float("-inf"))
        for s in blocks[b].successors:
            if s == loop.header:
                cand = ((b,), weight[b])
            elif s in inside and s > b:
                sub = longest(s)
                if sub[0] is None:
                    continue
                cand = ((b,) + sub[0], weight[b] + sub[1])
            else:
                continue
            if cand[1] > best[1]:
                best = cand
        return best

    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))
    path, _ = longest(loop.header)
    return [func.instructions[j] for bi in path or () for j in range(blocks[bi].start, blocks[bi].end)]


def block_loop_counts(sass_text: str) -> dict:
    """Counts on the steady path of the MMA warpgroups' block loop (the innermost loop issuing the most
    wgmma, one without a mask where masked and unmasked blocks have loops of their own), and the other
    loops that move data (the producer's, a dQ-store warp's)."""
    func = kernel_function(parse_sass(sass_text))
    blocks, loops = control_flow(func)
    found = []
    for loop in loops:
        if loop.spin:
            continue
        path = steady_path(func, blocks, loops, loop)
        counts = Counter(filter(None, map(instruction_class, path)))
        if not any(k.startswith(("HGMMA", "UTMA", "UBLK")) for k in counts):
            continue
        counts["instructions"] = len(path)
        counts["masked_path"] = any("-INF" in i.operands for i in path)
        found.append((loop, dict(counts)))
    # an outer loop (over query heads) walks once through an inner block loop: not a block's path
    inner = [(loop, c) for loop, c in found
             if not any(other is not loop and set(other.blocks) < set(loop.blocks) for other, _ in found)]
    wgmma = lambda c: sum(v for k, v in c.items() if k.startswith("HGMMA"))
    mma = max(inner, key=lambda lc: (wgmma(lc[1]), not lc[1]["masked_path"]))[1]
    return {"mma_loop": mma, "other_loops": [c for _, c in found if c is not mma]}


# ------------------------------------------------------------------------------------------------
# compiling

def ours_cubin(problem, config) -> bytes:
    from fa4.kernels import sm90_bwd

    with tempfile.TemporaryDirectory(prefix="fa4-bwd-sass-") as tmp:
        (compiled, _, _), = sm90_bwd._compile_all(config, problem, options=f"--keep-cubin --dump-dir {tmp}",
                                                  tvm_ffi=False, only=("main",)).values()
        return bytes(compiled.__cubin__)


def flash_attn4_config(head_dim: int, causal: bool) -> dict:
    """flash-attn-4 4.0.0b36 `interface._tile_size_bwd_sm90` for head dims 64 and 128 (no local
    window, no block sparsity), as its constructor's arguments."""
    cfg = dict(Q_stage=2, dO_stage=2, PdS_stage=2, SdP_swapAB=True, dKV_swapAB=False, AtomLayoutMSdP=1,
               AtomLayoutNdKV=2, num_threads=384, dQ_single_wg=False)
    if head_dim == 64:
        return {**cfg, "tile_m": 128, "tile_n": 128, "dQ_swapAB": False, "AtomLayoutMdQ": 2}
    tile_m = 64 if causal else 80
    return {**cfg, "tile_m": tile_m, "tile_n": 128, "dQ_swapAB": tile_m % 64 != 0, "AtomLayoutMdQ": 1}


_PEER_CHILD = r"""
import json, sys, types
stub = types.ModuleType("quack.autotuner")   # quack's autotuner imports triton; tracing needs neither
stub.autotune = lambda *a, **k: (lambda f: f)
stub.AutotuneConfig = lambda *a, **k: None
sys.modules.setdefault("quack.autotuner", stub)
import cutlass, cutlass.cute as cute
from cutlass.cute.runtime import make_fake_stream, make_fake_tensor
from flash_attn.cute.flash_bwd_sm90 import FlashAttentionBackwardSm90

cfg, d, ratio, causal, dtype, out = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1", sys.argv[5], sys.argv[6]
dt = {"fp16": cutlass.Float16, "bf16": cutlass.BFloat16}[dtype]
b, sq, sk, hq, hk, sqr, skr = (cute.sym_int() for _ in range(7))
def bshd(s, h):
    stride = tuple(cute.sym_int64(divisibility=8) for _ in range(3)) + (1,)
    return make_fake_tensor(dt, (b, s, h, d), stride=stride, assumed_align=16)
def flat(h, n):   # (B, H, n) fp32: LSE2, dPsum, and the dQ / dK / dV accumulators
    return make_fake_tensor(cutlass.Float32, (b, h, n), stride=(cute.sym_int64(divisibility=4), cute.sym_int64(divisibility=4), 1), assumed_align=16)
kernel = FlashAttentionBackwardSm90(dt, d, d, ratio, causal, is_local=False, deterministic=False, **cfg)
dkv = (flat(hk, skr), flat(hk, skr)) if ratio > 1 else (bshd(sk, hk), bshd(sk, hk))
compiled = cute.compile(kernel, bshd(sq, hq), bshd(sk, hk), bshd(sk, hk), bshd(sq, hq), flat(hq, sqr), flat(hq, sqr),
                        flat(hq, sqr), *dkv, cutlass.Float32(1.0), stream=make_fake_stream(use_tvm_ffi_env_stream=True),
                        options="--gpu-arch sm_90a --keep-cubin --enable-tvm-ffi")
open(out, "wb").write(compiled.__cubin__)
"""


def flash_attn4_cubin(problem) -> bytes:
    cfg = flash_attn4_config(problem.head_dim, problem.causal)
    with tempfile.TemporaryDirectory(prefix="fa4-bwd-peer-") as tmp:
        out = os.path.join(tmp, "peer.cubin")
        proc = subprocess.run([sys.executable, "-c", _PEER_CHILD, json.dumps(cfg), str(problem.head_dim),
                               str(problem.gqa_ratio), "1" if problem.causal else "0", problem.dtype, out],
                              capture_output=True, text=True, env={**os.environ, "CUTE_DSL_ARCH": "sm_90a"}, cwd=tmp)
        if proc.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"flash-attn-4 backward compile failed: {proc.stderr[-3000:]}")
        return open(out, "rb").read()


def analyze(problem, config=None, peer: bool = True) -> list[dict]:
    from fa4.kernels import sm90_bwd

    config = config or sm90_bwd.default_config(problem)
    rows = [{"kernel": "ours", "config": config.label(), **block_loop_counts(disassemble(ours_cubin(problem, config)))}]
    if peer:
        cfg = flash_attn4_config(problem.head_dim, problem.causal)
        rows.append({"kernel": "flash-attn-4", "config": f"{cfg['tile_m']}x{cfg['tile_n']} SdP_swapAB dQ_swapAB={cfg['dQ_swapAB']}",
                     **block_loop_counts(disassemble(flash_attn4_cubin(problem)))})
    return rows


COLUMNS = ("instructions", "HGMMA.*", "WARPGROUP.ARRIVE", "WARPGROUP.DEPBAR", "BAR.SYNC", "BAR.ARV", "SYNCS.*",
           "REDG", "UBLKRED", "MUFU.EX2", "SHFL", "STSM", "STS", "LDS", "LDG")


def _cell(counts: dict, column: str) -> str:
    if column.endswith(".*"):
        prefix = column[:-1]
        parts = [f"{v} {k[len(prefix):]}" for k, v in sorted(counts.items()) if k.startswith(prefix)]
        return ", ".join(parts) or "0"
    return str(counts.get(column, 0))


def format_table(problem, rows: list[dict]) -> str:
    lines = [f"{problem.label()}: per block of the MMA warpgroups' loop (one warp's instructions)",
             "| kernel | config | " + " | ".join(COLUMNS) + " |", "|---|---|" + "---|" * len(COLUMNS)]
    for r in rows:
        lines.append(f"| {r['kernel']} | {r['config']} | " + " | ".join(_cell(r["mma_loop"], c) for c in COLUMNS) + " |")
    return "\n".join(lines)


def main(argv=None):
    from fa4.kernels import AttentionProblem, Config

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head-dim", type=int, choices=(64, 128), action="append")
    ap.add_argument("--causal", action="store_true", help="with --head-dim: causal (default: full)")
    ap.add_argument("--dtype", default="bf16", choices=("fp16", "bf16"))
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KNOB=VALUE",
                    help="our configuration: the default with these backward knobs changed")
    ap.add_argument("--no-peer", action="store_true", help="ours only")
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args(argv)
    cases = [(d, args.causal) for d in args.head_dim] if args.head_dim else [(128, True), (64, False)]
    from fa4.kernels.knobs import knob
    out = []
    for head_dim, causal in cases:
        problem = AttentionProblem(4, 2048, 2048, 16, 4, head_dim, args.dtype, causal)
        values = {}
        for text in args.overrides:
            name, _, raw = text.partition("=")
            values[name] = next(c for c in knob("sm90_bwd", name).choices if str(c).lower() == raw.lower())
        from fa4.kernels import sm90_bwd
        config = sm90_bwd.default_config(problem).replace(**values) if values else None
        rows = analyze(problem, config, peer=not args.no_peer)
        print(format_table(problem, rows), flush=True)
        out.append({"problem": problem.label(), "rows": rows})
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(out, handle, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
