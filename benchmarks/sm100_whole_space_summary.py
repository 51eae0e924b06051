"""Add up the whole-space shards of benchmarks/sm100_whole_space.sh: per problem, how much of the
feasible space has compiled and what failed the check, at which kernel source (it must be one).

    python benchmarks/sm100_whole_space_summary.py [DIR]     # default results/compile_space
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from fa4.kernels import source_fingerprint
from fa4tune.compile_space import shard_census


def main(directory: str = "results/compile_space") -> int:
    paths = sorted(Path(directory).glob("sm100-v5-shard-*-of-*.json"))
    results = [r for path in paths for r in json.loads(path.read_text())]
    if not results:
        print(f"no shard results in {directory}")
        return 1
    current = source_fingerprint("sm100")
    status = 0
    for census in shard_census(results):
        share = census["compiled"] / census["feasible"]
        print(f"{census['problem']}: {len(census['shards'])} of {census['shard_count']} shards, "
              f"{census['compiled']:,} of {census['feasible']:,} feasible configurations compiled "
              f"({share:.1%}), {len(census['problems'])} with problems; kernel source "
              f"{census['source_fingerprint']}{'' if census['source_fingerprint'] == current else ' (NOT the current ' + current + ')'}")
        for index, config, problems in census["problems"]:
            print(f"  shard {index}: {config}: {'; '.join(problems)}")
        if census["problems"] or census["source_fingerprint"] != current:
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
