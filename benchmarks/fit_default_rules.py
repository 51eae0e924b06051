"""Judge the sm90 default rules on the searches' own measurements: train shapes to fit, held-out to judge.

Every configuration a search timed at a shape is a measurement of that configuration there (GPU time,
the search's timing). For each shape of a shapes file that has a study in the given optuna storages,
this prints what the default rules pick, whether that configuration was timed there, and its time over
the best time the study found; then the geometric mean over the shapes where it was timed.

    python benchmarks/fit_default_rules.py --shapes-file results/wide/train.toml \\
        --journal results/h200/wide/wide_a.journal.gz --journal results/h200/wide/wide_b.journal.gz

`--near N` also lists, per shape, the configurations within N of the best (e.g. 0.02): what a rule has
to pick to be near-best there. A rule is changed by editing `kernels/sm90/defaults.py`; this script only
measures, and only on the shapes it is given (fit on train.toml; judge on heldout.toml, whose studies
exist only once the held-out set was searched for that purpose, which the rules never look at).
"""

from __future__ import annotations

import argparse
import gzip
import math
import os
import shutil
import sys
import tempfile
import warnings
from typing import Iterator

from fa4.kernels import Config, default_config
from fa4tune.inputs.shape_sets import load_shapes_file
from fa4tune.inputs.shapes import shape_key

ARCH = "sm90"


def _readable_journal(path: str, scratch: str) -> str:
    """A journal path optuna can open: a .gz copy is decompressed into `scratch`."""
    if not path.endswith(".gz"):
        return path
    plain = os.path.join(scratch, os.path.basename(path)[:-3])
    with gzip.open(path, "rb") as src, open(plain, "wb") as dst:
        shutil.copyfileobj(src, dst)
    return plain


def timed_trials(journals: list[str]) -> Iterator[tuple[str, list]]:
    """(study name, its completed trials that carry a time, in the order they were timed) for every
    study of every journal."""
    import optuna

    from fa4tune.searches.storage import open_for_reading

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    with tempfile.TemporaryDirectory() as scratch:
        for path in journals:
            storage = open_for_reading(_readable_journal(path, scratch))
            for summary in optuna.get_all_study_summaries(storage):
                trials = optuna.load_study(study_name=summary.study_name, storage=storage).trials
                yield summary.study_name, sorted(
                    (t for t in trials if t.state.name == "COMPLETE" and t.user_attrs.get("us") is not None),
                    key=lambda t: t.number)


def search_curves(journals: list[str]) -> None:
    """How many configurations a search needs: per study, the place (in the order timed) of the first
    configuration within 1 % of the study's best; the distribution over the studies (`--curves`)."""
    import statistics

    places, default_near = [], 0
    for _, trials in timed_trials(journals):
        times = [t.user_attrs["us"] for t in trials]
        best = min(times)
        places.append(next(i for i, us in enumerate(times) if us <= best * 1.01) + 1)
        default_near += any(t.user_attrs.get("is_default") and t.user_attrs["us"] <= best * 1.01 for t in trials)
    places.sort()
    print(f"{len(places)} studies: first configuration within 1 % of the study's best at place median "
          f"{statistics.median(places):g}; within 10: {sum(p <= 10 for p in places)}, within 20: "
          f"{sum(p <= 20 for p in places)}, latest {max(places)}; the default within 1 %: {default_near}")


def timed_configurations(journals: list[str]) -> dict[str, dict[str, float]]:
    """{study name: {configuration label: GPU us}} over every completed trial of every journal (the
    lowest time where a configuration was timed twice)."""
    times: dict[str, dict[str, float]] = {}
    for study, trials in timed_trials(journals):
        timed = times.setdefault(study, {})
        for trial in trials:
            label = Config.from_dict(ARCH, trial.params).label()
            timed[label] = min(trial.user_attrs["us"], timed.get(label, math.inf))
    return times


def judge(shapes_file: str, journals: list[str], near: float | None) -> int:
    times = timed_configurations(journals)
    ratios = []
    missing = []
    for problem in load_shapes_file(shapes_file):
        study = shape_key(ARCH, problem)
        timed = times.get(study)
        if not timed:
            missing.append(study)
            continue
        best_label = min(timed, key=timed.get)
        best = timed[best_label]
        chosen = default_config(ARCH, problem).label()
        us = timed.get(chosen)
        verdict = f"{us / best:6.3f}" if us is not None else "  n/a "
        if us is not None:
            ratios.append(us / best)
        print(f"{study:58s} default/best {verdict}  default {chosen}")
        if near is not None or us is None:
            for label, t in sorted(timed.items(), key=lambda item: item[1]):
                if t <= best * (1 + (near or 0.0)):
                    print(f"{'':60s}{t / best:6.3f}  {label}")
    if ratios:
        geomean = math.exp(sum(map(math.log, ratios)) / len(ratios))
        print(f"\ndefault / best: geometric mean {geomean:.3f}, worst {max(ratios):.3f}, "
              f"over {len(ratios)} shapes where the default was timed")
    if missing:
        print(f"{len(missing)} shapes have no study in these journals: {', '.join(missing)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes-file")
    parser.add_argument("--curves", action="store_true",
                        help="instead: how many configurations the searches needed (for `search --effort`)")
    parser.add_argument("--journal", action="append", required=True, help="optuna journal (.gz read too)")
    parser.add_argument("--near", type=float, default=None,
                        help="also list the configurations within this fraction of each shape's best")
    args = parser.parse_args(argv)
    if args.curves:
        search_curves(args.journal)
        return 0
    if not args.shapes_file:
        parser.error("--shapes-file is needed (or --curves)")
    return judge(args.shapes_file, args.journal, args.near)


if __name__ == "__main__":
    sys.exit(main())
