"""GPU time of our sm90 backward per configuration, beside flash-attn-4's backward, on training shapes.

On the H200, with the project and its `peer` extra installed (one 10-minute device call):
    python benchmarks/sm90_bwd_configs.py --json /tmp/out/bwd_configs.json
    python benchmarks/sm90_bwd_configs.py --config default --config "sdp_swap=on dq_accum=bulk pds_stages=2"

Which configurations: `--config` labels (knob=value pairs over the default of the knob set "sm90_bwd";
"default" alone is the default; "rule", alone or followed by pairs, is `sm90_bwd.default_config` of each
shape on this GPU, what an untuned call runs, with those pairs over it), else every configuration of
search_spaces/sm90_bwd.toml (or of `--space FILE`) the model admits at one of the shapes
(`fa4.kernels.sm90_bwd.reasons`, at a shape's head dim, mask and GQA ratio; a shape it is not admitted
at is that configuration's "infeasible" row).

Each configuration runs in its own child process (a hang, a fault or a compile error is that
configuration's result, with its reason; `--timeout` seconds each), several at once (`--jobs`) so
their compiles overlap; the GPU is timed by one child at a time (a lock file). A child compiles its
kernels, checks its gradients by flash-attn's rule (`fa4.reference.check_grads`) on a small problem of
each kind (odd lengths, the shape's GQA ratio) and times only what passed: the backward alone
(preprocess, main, postprocess, workspaces included) on each shape, the best of 5 runs of 10 back-to-back calls after 3
warm-up calls, CUDA events, L2 warm (back-to-back calls leave it so). flash-attn-4's backward
(`flash_attn.cute.interface._flash_attn_bwd`, what `fa4.backends` calls) is timed the same way, in a
child of its own. Timed inputs are random (O too; LSE log Sk): neither kernel's time depends on them.
Output: a table (us, ratio to flash-attn-4) and, with --json, the rows.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

SHAPES = [  # (batch, seqlen, heads_q, heads_kv, head_dim, causal): benchmarks/backward_impls.py's
    (4, 2048, 16, 4, 128, True),
    (2, 4096, 32, 8, 128, True),
    (8, 1024, 16, 16, 64, False),
    (1, 8192, 32, 8, 128, True),
]
OURS = "ours"
DTYPE = "bf16"


def shape_label(shape) -> str:
    b, s, hq, hkv, d, causal = shape
    return f"b{b}-s{s}-{hq}/{hkv}-d{d}-{'causal' if causal else 'full'}"


RULE = "rule"   # a label's first word: the default rule's configuration of each shape


def parse_pairs(text: str) -> dict:
    """{knob: value} of a label's knob=value pairs (as `Config.label` writes them; "default" and
    "rule" name no knob)."""
    from fa4.kernels.knobs import knob

    values = {}
    for pair in text.split():
        if pair in ("default", RULE):
            continue
        name, _, raw = pair.partition("=")
        k = knob("sm90_bwd", name)
        match = [c for c in k.choices if str(c).lower() == raw.lower()
                 or (isinstance(c, bool) and raw.lower() == ("on" if c else "off"))]
        if not match:
            raise ValueError(f"{pair}: {name} takes one of {list(k.choices)}")
        values[name] = match[0]
    return values


def parse_config(text: str):
    """A configuration from its label: "default", or knob=value pairs over the default."""
    from fa4.kernels import Config

    return Config.make("sm90_bwd", **parse_pairs(text))


def config_for(text: str, shape):
    """The configuration a label names at `shape`: "rule ..." is the shape's `default_config` (on
    this process's GPU, if it has one) with the label's pairs over it; anything else `parse_config`."""
    from fa4.kernels import AttentionProblem, sm90_bwd

    if text.split()[:1] != [RULE]:
        return parse_config(text)
    device = None
    try:
        import torch

        if torch.cuda.is_available():
            from fa4.kernels import device_from_torch
            device = device_from_torch(torch.cuda.current_device())
    except ImportError:
        pass
    b, s, hq, hkv, d, causal = shape
    base = sm90_bwd.default_config(AttentionProblem(b, s, s, hq, hkv, d, DTYPE, causal), device)
    return base.replace(**parse_pairs(text))


def _kind(shape):
    """What a configuration is judged and compiled on for this shape: its head dim, mask and heads
    (`group_split` must fit the GQA ratio); lengths and batch are symbolic in the compile."""
    from fa4.kernels import AttentionProblem

    _, _, heads_q, heads_kv, head_dim, causal = shape
    return AttentionProblem(1, 128, 128, heads_q, heads_kv, head_dim, DTYPE, causal)


def admitted_configs(shapes, space_path=None) -> list:
    """Every configuration of a space file (default: the packaged space) the model admits at the head
    dim of some shape."""
    from fa4.kernels import sm90_bwd
    from fa4tune.inputs.space import load_space

    kinds = {_kind(s) for s in shapes}
    return [c for c in load_space("sm90_bwd", space_path).configs()
            if any(not sm90_bwd.reasons(c, p) for p in kinds)]


# ------------------------------------------------------------------------------------------------
# the child: one configuration (or the peer), every shape

def _inputs(shape, seq_k=None, seed=0, exact=False):
    """Q, K, V, O, LSE, dO of a shape (bf16; LSE fp32 natural log). `exact`: O and LSE of the fp32
    reference, for checking gradients; otherwise random O and a plausible LSE (log Sk), for timing
    (neither kernel's time depends on the values)."""
    import math

    import torch

    from fa4.reference import attention_fp32, softmax_scale

    b, s, hq, hkv, d, causal = shape
    sk = s if seq_k is None else seq_k
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    dout = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    if exact:
        out, lse = attention_fp32(q, k, v, causal, softmax_scale(d))
        return q, k, v, out.to(q.dtype), lse, dout
    out = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    lse = torch.full((b, hq, s), math.log(sk), device="cuda", dtype=torch.float32)
    return q, k, v, out, lse, dout


def peer_with_backward(name=None):
    """The peer whose backward is timed beside ours: `name`, else the first registered one with a
    backward (`fa4.backward.peers_with_backward`: flash-attn-4's), or None."""
    from fa4.backward import peers_with_backward

    peers = [p for p in peers_with_backward() if name in (None, p.name)]
    return peers[0] if peers else None


def _backward_fn(kind: str, config, shape, compiled: dict):
    """A function (q, k, v, out, lse, dout, scale) -> (dq, dk, dv) for ours in `config` or the peer
    named `kind`."""
    import torch

    causal = shape[5]
    if kind != OURS:
        peer = peer_with_backward(kind)
        return lambda q, k, v, out, lse, dout, scale: peer.backward(dout, q, k, v, out, lse, causal, scale)
    from fa4.kernels import sm90_bwd

    problem = _kind(shape)
    key = (problem.head_dim, causal, config)   # one compile serves every batch, length and head count
    if key not in compiled:
        compiled[key] = sm90_bwd.compile_backward(config, problem)
    kernels = compiled[key]

    def run(q, k, v, out, lse, dout, scale):
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        kernels.run(q, k, v, out, dout, lse, dq, dk, dv, scale)
        return dq, dk, dv

    return run


def child(kind: str, config_label: str, shapes: list, lock_path: str) -> list[dict]:
    import torch

    from fa4.kernels import sm90_bwd
    from fa4.reference import check_grads, softmax_scale
    from fa4tune.workers.timing import time_events_us
    from fa4tune.workers.worker import gpu_lock

    rows, compiled, checked = [], {}, {}
    for shape in shapes:
        b, s, hq, hkv, d, causal = shape
        row = {"shape": shape_label(shape), "kernel": kind, "config": config_label}
        config, why = None, []
        if kind == OURS:   # what ran: a rule label's configuration is the shape's
            config = config_for(config_label, shape)
            row["ran"] = config.label()
            why = sm90_bwd.reasons(config, _kind(shape))
        if why:
            rows.append({**row, "outcome": "infeasible", "reason": "; ".join(why)})
            continue
        try:
            fn = _backward_fn(kind, config, shape, compiled)
        except Exception as exc:  # noqa: BLE001  (a failing configuration is a result)
            rows.append({**row, "outcome": "compile", "reason": f"{type(exc).__name__}: {exc}"[:500]})
            continue
        # flash-attn's rule on a small problem of this kind, once per configuration (a rule label's
        # may differ between shapes of one kind)
        ratio = hq // hkv
        check = (config, d, causal, ratio)
        if check not in checked:
            q, k, v, out, lse, dout = _inputs((2, 333, 2 * ratio, 2, d, causal), seq_k=461, seed=d + causal,
                                              exact=True)
            grads = fn(q, k, v, out, lse, dout, softmax_scale(d))
            torch.cuda.synchronize()
            checked[check] = check_grads(list(grads), q, k, v, dout, causal)
        if checked[check]:
            rows.append({**row, "outcome": "wrong", "reason": "; ".join(checked[check])})
            continue
        q, k, v, out, lse, dout = _inputs(shape)
        scale = softmax_scale(d)
        with gpu_lock(lock_path):
            us = time_events_us(lambda: fn(q, k, v, out, lse, dout, scale))
        rows.append({**row, "outcome": "ok", "us": round(us, 1)})
        del q, k, v, out, lse, dout
    return rows


# ------------------------------------------------------------------------------------------------
# the parent

def run_child(kind: str, label: str, shapes: list, lock_path: str, timeout: float) -> list[dict]:
    args = [sys.executable, __file__, "--child", kind, "--config", label, "--lock", lock_path,
            "--shapes-json", json.dumps(shapes)]
    base = [{"shape": shape_label(s), "kernel": kind, "config": label} for s in shapes]
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return [{**b, "outcome": "timeout", "reason": f"no result within {timeout:.0f} s (a hang?)"} for b in base]
    rows = rows_from_child(proc.stdout)
    if proc.returncode != 0 or rows is None:
        reason = f"exit {proc.returncode}: {proc.stderr.strip()[-600:]}"
        return [{**b, "outcome": "fault", "reason": reason} for b in base]
    return rows


ROWS_MARK = "rows: "   # the line of a child's stdout that carries its rows (other output may precede it)


def print_rows(rows: list) -> None:
    """A child's result, for `rows_from_child`."""
    print(ROWS_MARK + json.dumps(rows), flush=True)


def rows_from_child(stdout: str):
    """The rows a child printed (`ROWS_MARK` + JSON list), or None if it printed none."""
    lines = [line for line in stdout.splitlines() if line.startswith(ROWS_MARK)]
    return json.loads(lines[-1][len(ROWS_MARK):]) if lines else None


def format_table(rows: list[dict]) -> str:
    """Markdown: a row per configuration, a column per shape; the peer's times first, each of ours
    with its ratio to the peer's (a configuration that did not run shows its outcome)."""
    peer_rows = [r for r in rows if r["kernel"] != OURS]
    peer = {r["shape"]: r.get("us") for r in peer_rows}
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    labels = list(dict.fromkeys(r["config"] for r in rows if r["kernel"] == OURS))
    by = {(r["shape"], r["config"]): r for r in rows if r["kernel"] == OURS}
    lines = ["| configuration | " + " | ".join(shapes) + " |", "|---|" + "---|" * len(shapes)]
    if peer_rows:
        lines.append(f"| {peer_rows[0]['config']} (us) | " + " | ".join(str(peer.get(s, "-")) for s in shapes) + " |")
    for label in labels:
        cells = []
        for s in shapes:
            r = by.get((s, label), {})
            if r.get("outcome") == "ok":
                ratio = f" ({r['us'] / peer[s]:.2f}x)" if peer.get(s) else ""
                cells.append(f"{r['us']}{ratio}")
            else:
                cells.append(r.get("outcome", "-"))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", action="append", default=None,
                    help='a configuration: "default" or knob=value pairs over it (repeatable)')
    ap.add_argument("--config-file", default=None,
                    help="configurations one per line (as --config takes them), run in that order")
    ap.add_argument("--space", default=None, metavar="TOML",
                    help="without --config: every admitted configuration of this space file (default: "
                         "search_spaces/sm90_bwd.toml)")
    ap.add_argument("--shape", action="append", default=None, metavar="B,S,HQ,HKV,D,causal|full",
                    help="a shape to time (repeatable; default: benchmarks/backward_impls.py's four)")
    ap.add_argument("--jobs", type=int, default=6, help="configurations compiled at once")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per configuration")
    ap.add_argument("--peer", default=None, help="the peer backward timed beside ours, by name (default: "
                    "the first registered peer with a backward)")
    ap.add_argument("--no-peer", action="store_true", help="ours only")
    ap.add_argument("--json", default=None, help="also write the rows here (sorted keys)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--lock", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--shapes-json", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.child:
        rows = child(args.child, args.config[0], [tuple(s) for s in json.loads(args.shapes_json)], args.lock)
        print_rows(rows)
        return

    shapes = SHAPES
    if args.shape:
        shapes = [tuple(int(x) for x in s.split(",")[:5]) + (s.split(",")[5] == "causal",) for s in args.shape]
    if args.config_file:
        with open(args.config_file) as handle:
            args.config = (args.config or []) + [line.strip() for line in handle
                                                 if line.strip() and not line.startswith("#")]
    # a rule label stays a label (its configuration is each shape's); any other is normalised
    labels = [c if c.split()[:1] == [RULE] else parse_config(c).label() for c in args.config] if args.config \
        else [c.label() for c in admitted_configs(shapes, args.space)]
    lock_path = os.path.join(tempfile.gettempdir(), "fa4-sm90-bwd-configs.lock")
    start = time.time()
    peer = None if args.no_peer else peer_with_backward(args.peer)
    if peer is None and not args.no_peer:
        print("no peer backward is registered: ours only", file=sys.stderr)
    tasks = ([(peer.name, peer.title)] if peer else []) + [(OURS, label) for label in labels]
    print(f"{len(tasks)} backward(s) x {len(shapes)} shape(s), {args.jobs} at once", file=sys.stderr, flush=True)
    rows = []
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = [pool.submit(run_child, kind, label, shapes, lock_path, args.timeout) for kind, label in tasks]
        for future in as_completed(futures):
            got = future.result()
            rows += got
            for r in got:
                print(json.dumps(r, sort_keys=True), file=sys.stderr, flush=True)
            if args.json:   # after every configuration: a run cut short keeps what it measured
                write_json(args.json, rows)
    print(format_table(rows))
    print(f"({time.time() - start:.0f} s; bf16; best of 5 x 10 back-to-back calls, L2 warm)")


def write_json(path: str, rows: list) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as handle:
        json.dump(sorted(rows, key=lambda r: (r["kernel"] == OURS, r["config"], r["shape"])), handle,
                  indent=1, sort_keys=True)
    os.replace(tmp, path)


if __name__ == "__main__":
    main()
