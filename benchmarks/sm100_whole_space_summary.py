"""Add up the whole-space shards of benchmarks/sm100_whole_space.sh against the feasibility model as
it is now: per problem, how much of the feasible space has compiled, what failed the check and is
still accepted, at which kernel source (it must be one). Exit 1 on a problem, a gap in a present
shard or a stale kernel source.

    python benchmarks/sm100_whole_space_summary.py [DIR]     # default results/compile_space
"""

from __future__ import annotations

import sys
from pathlib import Path

from fa4.kernels import source_fingerprint
from fa4tune.searches.compile_space import read_json, shard_census
from fa4tune.inputs.space import load_space


def main(directory: str = "results/compile_space") -> int:
    paths = sorted(Path(directory).glob("sm100-v5-shard-*-of-*.json.gz"))
    results = [r for path in paths for r in read_json(path)]
    if not results:
        print(f"no shard results in {directory}")
        return 1
    current = source_fingerprint("sm100")
    status = 0
    for census in shard_census(results, load_space("sm100")):
        source = census["source_fingerprint"]
        print(f"{census['problem']}: {len(census['shards'])} of {census['shard_count']} shards; "
              f"{census['compiled']:,} of {census['feasible']:,} feasible configurations compiled "
              f"({census['compiled'] / census['feasible']:.1%}), {census['missing']} of the present shards' "
              f"not compiled, {len(census['problems'])} with problems ({census['resolved']} more that the "
              f"model now rejects); kernel source {source}"
              + ("" if source == current else f" (NOT the current {current})"))
        for index, config, problems in census["problems"]:
            print(f"  shard {index}: {config}: {'; '.join(problems)}")
        if census["problems"] or census["missing"] or source != current:
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
