"""The SASS of N configurations per kernel family (forward and backward), as hashes: the check that a
refactor of the kernel sources left the generated code byte for byte the same.

The configurations are drawn from each family's search space with a fixed seed (the same list for any
sources whose knobs and feasibility agree), each on a problem that alternates causal and not, and are
compiled on this CPU for the family's reference device. The hash is `restamp_unchanged_code.sass_hash`
(the instructions, without addresses and symbol names). `--rev REV` hashes the kernel sources of a
commit instead of the installed ones (`git archive`, as the re-stamp does), so before and after come
from one command:

    python benchmarks/sass_hashes.py --rev REV --out results/sass/hashes_before.json
    python benchmarks/sass_hashes.py --out results/sass/hashes_after.json
    python benchmarks/sass_hashes.py --compare results/sass/hashes_before.json results/sass/hashes_after.json

The JSON: {"command", "rev", "fingerprints": {arch: kernel fingerprint}, "hashes": {arch: {label:
sha256}}}; a label is the configuration's label and the problem. `--compare` prints each label that
differs and exits 1 when any does.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))   # its sibling script, also when imported by path
from restamp_unchanged_code import old_sources, run_child  # noqa: E402  (one SASS hash, one source checkout)

PROBLEM = dict(batch=1, seqlen_q=1024, seqlen_k=1024, heads_q=32, heads_kv=8, head_dim=128, dtype="fp16")


def sample(arch: str, count: int, seed: int = 0) -> list[dict]:
    """`count` feasible (configuration, problem) tasks of `arch`'s search space, the first its default."""
    from fa4.kernels import AttentionProblem, Config, default_config, feasible
    from fa4tune.inputs.space import load_space

    space = load_space(arch)
    rng = random.Random(f"{arch}:{seed}")
    base = AttentionProblem(**PROBLEM)
    tasks = [(default_config(arch, base), base)]
    for _ in range(100_000):
        if len(tasks) == count:
            break
        problem = AttentionProblem(**PROBLEM, causal=len(tasks) % 2 == 1)
        config = Config(arch, tuple((name, rng.choice(values)) for name, values in space.choices))
        if not feasible(config, problem) and all(config != c for c, _ in tasks):
            tasks.append((config, problem))
    return [{"arch": arch, "config": c.to_dict(), "problem": p.to_dict(), "label": f"{c.label()} | {p.label()}"}
            for c, p in tasks]


def hashes(tasks: list[dict], root: str) -> dict:
    from fa4tune.sm100.sass_build import nvdisasm_path

    child = run_child(root, [{k: t[k] for k in ("arch", "config", "problem")} for t in tasks], nvdisasm_path())
    answer = json.loads(child.stdout.read())
    if child.wait():
        raise SystemExit(f"the compile process failed (exit {child.returncode})")
    by_arch: dict = {}
    for task, digest in zip(tasks, answer["hashes"]):
        by_arch.setdefault(task["arch"], {})[task["label"]] = digest
    return {"fingerprints": answer["fingerprints"], "hashes": by_arch}


def compare(before: dict, after: dict) -> list[str]:
    lines = []
    for arch in sorted(set(before["hashes"]) | set(after["hashes"])):
        old, new = before["hashes"].get(arch, {}), after["hashes"].get(arch, {})
        for label in sorted(set(old) | set(new)):
            if old.get(label) != new.get(label) or str(new.get(label)).startswith("error"):
                lines.append(f"{arch} {label}: {old.get(label)} -> {new.get(label)}")
        lines.append(f"{arch}: {sum(old.get(k) == v for k, v in new.items())} of {len(new)} identical")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=10, help="configurations per family")
    ap.add_argument("--rev", help="hash the kernel sources of this commit instead of the installed ones")
    ap.add_argument("--out", help="write the JSON here (default: stdout)")
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    ap.add_argument("--arch", action="append", help="only this family (repeatable; default: every forward and "
                    "backward family)")
    args = ap.parse_args()
    if args.compare:
        before, after = (json.loads(Path(p).read_text()) for p in args.compare)
        lines = compare(before, after)
        print("\n".join(lines))
        sys.exit(1 if any(": " in line and "->" in line for line in lines) else 0)
    from fa4.kernels import ARCHS, BACKWARD_KERNELS

    tasks = [t for arch in args.arch or (*ARCHS, *BACKWARD_KERNELS) for t in sample(arch, args.count)]
    with tempfile.TemporaryDirectory(prefix="fa4-sass-hashes-") as tmp:
        root = str(old_sources(args.rev, None, Path(tmp) / "old")) if args.rev else ""
        doc = {"command": " ".join(["python", "benchmarks/sass_hashes.py"] + sys.argv[1:]), "rev": args.rev,
               **hashes(tasks, root)}
    text = json.dumps(doc, indent=2, sort_keys=True) + "\n"
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
