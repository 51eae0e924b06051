"""Write the problems of a database's stale entries (tuned with other kernel sources than today's) as a
shapes file, to re-tune them after a kernel change that changed their generated code:

    python benchmarks/stale_problems.py fa4/data/best_configs.json stale.toml [--arch sm90]
    fa4tune search --shapes-file stale.toml --effort quick --db fa4/data/best_configs.json

The search seeds each study with its own stale winner first (`fa4tune.searches.warm_start`).
"""

from __future__ import annotations

import argparse

from fa4.database import BestConfigDB
from fa4.kernels import AttentionProblem, kernel_fingerprint
from fa4.record_shapes import problem_table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("db")
    parser.add_argument("out")
    parser.add_argument("--arch", default="sm90")
    args = parser.parse_args(argv)
    stale = BestConfigDB.load(args.db).stale_entries({args.arch: kernel_fingerprint(args.arch)})
    problems = sorted({AttentionProblem(**e.problem) for e in stale}, key=repr)
    with open(args.out, "w") as f:
        f.write("\n".join(problem_table(p) for p in problems))
    print(f"{args.out}: {len(problems)} problems of {len(stale)} stale {args.arch} entries in {args.db}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
