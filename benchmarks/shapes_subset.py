"""Write part of a shapes file, so that one device call can take its share of a long shape set.

    python benchmarks/shapes_subset.py results/wide/train.toml OUT.toml --start 1 --step 2   # 2nd, 4th, ...
    python benchmarks/shapes_subset.py results/wide/heldout.toml OUT.toml --stop 12          # the first 12

The part is `problems[start:stop:step]` of the file as `fa4tune` reads it, written with the runtime's own
table writer (`fa4.record_shapes.problem_table`).
"""

from __future__ import annotations

import argparse
import sys

from fa4.record_shapes import problem_table
from fa4tune.inputs.shape_sets import load_shapes_file


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shapes_file")
    parser.add_argument("out")
    parser.add_argument("--start", type=int, default=None)
    parser.add_argument("--stop", type=int, default=None)
    parser.add_argument("--step", type=int, default=None)
    args = parser.parse_args(argv)
    chosen = load_shapes_file(args.shapes_file)[args.start:args.stop:args.step]
    with open(args.out, "w") as f:
        f.write("\n".join(problem_table(p) for p in chosen))
    print(f"{args.out}: {len(chosen)} problems of {args.shapes_file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
