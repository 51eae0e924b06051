"""The training pass alone: fa4.attention's backward and forward + backward beside the peers' on a shapes
file, by CUDA-graph replay, in one process (about 3 minutes for the 14 grid shapes on an H100).

`fa4tune bench --backward` times the same rows (`fa4tune.workers.training.time_training`) and the
forward's too, in worker processes; this is the short form for a device call that only needs the
backward's standing. `$FA4_BACKWARD` picks fa4.attention's backward (`ours` times our kernel where
"auto" would run a peer's):

    FA4_BACKWARD=ours python benchmarks/training_pass.py --json /tmp/out/training_pass.json
    python benchmarks/training_pass.py --summary /tmp/out/training_pass.json

`--set KNOB=VALUE` (repeatable) runs our backward's default with those knobs changed wherever the
model admits the change (the default elsewhere): an A/B of a default rule by CUDA-graph replay, e.g.
`--set dq_accum=fragment`. `--deterministic` calls fa4.attention with deterministic=True (the cost of
ordered sums beside a plain run).

Rows (one JSON object a shape): {"shape", "fa4": {...}, <peer>: {...}} with `time_training`'s fields
(bwd_us, fwdbwd_us, bwd_peak_extra_mib, validated, backward, kv_expanded, error). The summary divides
fa4's time by the fastest peer's, per shape, for the backward alone and for forward + backward.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from statistics import geometric_mean

from fa4.files import atomic_write
from fa4tune.workers.training import FA4   # the row of fa4.attention itself

GRID = Path(__file__).with_name("h200_grid.toml")


def shape_label(problem) -> str:
    return (f"b{problem.batch}-s{problem.seqlen_q}-{problem.heads_q}/{problem.heads_kv}-d{problem.head_dim}-"
            f"{problem.dtype}-{'causal' if problem.causal else 'full'}")


def measure(problems, names) -> list[dict]:
    import torch

    from fa4tune.workers.timing import TimingSettings
    from fa4tune.workers.training import time_training

    rows = []
    for problem in problems:
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[problem.dtype]
        gen = torch.Generator(device="cuda").manual_seed(0)
        shapes = [(problem.batch, problem.seqlen_q, problem.heads_q, problem.head_dim)] + \
            [(problem.batch, problem.seqlen_k, problem.heads_kv, problem.head_dim)] * 2
        inputs = [torch.randn(*s, device="cuda", dtype=dtype, generator=gen) for s in shapes]
        row = {"shape": shape_label(problem), **time_training(problem, TimingSettings(), names, inputs,
                                                               lambda: True)}
        print(json.dumps(row), flush=True)
        rows.append(row)
        del inputs
    return rows


def override_default(overrides: dict) -> None:
    """Our backward's default configuration (what an untuned problem runs) with `overrides`, where the
    model admits them."""
    from fa4.kernels import sm90_bwd

    default = sm90_bwd.default_config

    def changed(problem, device=None):
        config = default(problem, device)
        candidate = config.replace(**overrides)
        return config if sm90_bwd.reasons(candidate, problem, device) else candidate
    sm90_bwd.default_config = changed


def parse_overrides(texts: list[str]) -> dict:
    from fa4.kernels.knobs import knob

    out = {}
    for text in texts:
        name, _, raw = text.partition("=")
        choices = knob("sm90_bwd", name).choices
        matches = [c for c in choices if str(c).lower() == raw.lower()]
        if not matches:
            raise SystemExit(f"--set {text}: {name} takes one of {choices}")
        out[name] = matches[0]
    return out


def ratios(rows: list[dict], key: str) -> dict[str, float]:
    """{shape: fa4's `key` / the fastest peer's}, over shapes where fa4 and some peer measured it."""
    out = {}
    for row in rows:
        ours = row.get(FA4, {}).get(key)
        peers = [row[name][key] for name in row if name not in ("shape", FA4) and row[name].get(key)]
        if ours and peers:
            out[row["shape"]] = ours / min(peers)
    return out


def summary(rows: list[dict]) -> str:
    lines = []
    for key, what in (("bwd_us", "backward alone"), ("fwdbwd_us", "forward + backward")):
        r = ratios(rows, key)
        if not r:
            continue
        geomean = geometric_mean(r.values())
        worst = max(r, key=r.get)
        lines.append(f"{what}: fa4 / fastest peer geomean {geomean:.3f}, worst {r[worst]:.3f} ({worst}), "
                     f"at most 1.00 on {sum(x <= 1.0 for x in r.values())} of {len(r)}")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes-file", default=str(GRID))
    ap.add_argument("--peers", default=None, help="comma-separated peer names (default: every registered peer, "
                    "fa4.backends)")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--summary", default=None, metavar="JSON", help="summarise rows written before; time nothing")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KNOB=VALUE",
                    help="our backward's default with this knob changed where the model admits it")
    ap.add_argument("--deterministic", action="store_true", help="fa4.attention(..., deterministic=True)")
    args = ap.parse_args(argv)
    if args.summary:
        print(summary(json.loads(Path(args.summary).read_text())))
        return
    if args.overrides:
        override_default(parse_overrides(args.overrides))
    if args.deterministic:
        import functools

        import fa4
        # the harness calls fa4.attention through the module (`fa4tune.workers.training`)
        fa4.attention = functools.partial(fa4.attention, deterministic=True)
    from fa4tune.inputs.shape_sets import load_shapes_file

    from fa4 import backends

    peers = args.peers.split(",") if args.peers else [peer.name for peer in backends.peers()]
    rows = measure(load_shapes_file(args.shapes_file), [FA4] + [p for p in peers if p])
    if args.json:   # whole or not at all: a run killed mid-write leaves the file it had
        atomic_write(args.json, json.dumps(rows, indent=1) + "\n")
    print(summary(rows), file=sys.stderr)


if __name__ == "__main__":
    main()
