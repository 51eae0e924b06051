"""A study's last step: time its finalists again and record the one with the lowest median.

A search keeps the smallest of many noisy measurements, so its best trial is partly the luckiest one
(the winner's curse): on the H200 grid at 20 s a study, the heuristic default re-timed faster than the
recorded best on six of fourteen shapes, and one kernel timed twice in one bench differed by 2 % at
30 µs. So after the trial loop the few fastest distinct configurations and the default are timed again,
`rounds` times each in interleaved order (round-major, so drift in clocks or temperature spreads over
all of them), and the database gets the configuration with the lowest median of those re-times, with
that median as its time and the default's median as the default's time.

The re-times are not trials: they are not counted against `--trials` and do not enter the study's
history; the study keeps them in its `retime` attribute. The configurations were validated as trials,
so they are not validated again.
"""

from __future__ import annotations

import statistics
import time
from typing import Optional

from fa4.kernels import AttentionProblem, Config
from fa4tune.environment import utc_now
from fa4tune.workers.outcomes import OK
from fa4tune.searches.study import params_key

POLL_S = 1.0
TOP = 3        # finalists re-timed: the fastest distinct configurations (the default joins them)
ROUNDS = 3     # re-times of each finalist


def finalists(study, top: int) -> list[dict]:
    """The `top` fastest distinct ok configurations of the study and its default (if it ran ok), as
    {"params", "trial", "search_us", "is_default"}, fastest first, the default last if not among them."""
    from optuna.trial import TrialState

    best: dict = {}
    default = None
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        if t.user_attrs.get("outcome") != OK or t.value is None:
            continue
        key = params_key(t.params)
        if key not in best or t.value < best[key].value:
            best[key] = t
        if t.user_attrs.get("is_default") and (default is None or t.value < default.value):
            default = t
    ranked = sorted(best.values(), key=lambda t: t.value)[:top]
    if default is not None and params_key(default.params) not in {params_key(t.params) for t in ranked}:
        ranked.append(default)
    default_key = params_key(default.params) if default is not None else None
    return [{"params": dict(t.params), "trial": t.number, "search_us": t.value,
             "is_default": params_key(t.params) == default_key} for t in ranked]


def retime(study, pool, kernels, arch: str, problem: AttentionProblem, timing: dict, *, top: int,
           rounds: int, progress, name: str) -> Optional[dict]:
    """Re-time the study's finalists `rounds` times each on the pool; the document stored as the
    study's `retime` attribute, or None when there are fewer than two finalists (nothing to choose)."""
    picks = finalists(study, top)
    if rounds < 1 or len(picks) < 2:
        return None
    started = time.monotonic()
    tasks: dict[int, int] = {}
    for _ in range(rounds):
        for index, pick in enumerate(picks):
            config = Config.from_dict(arch, pick["params"])
            payload = {"arch": arch, "config": config.to_dict(), "problem": problem.to_dict(),
                       "timing": timing, "validate": False}
            tasks[pool.submit("trial", payload, compile_key=kernels.compile_key(config, problem))] = index
    times: list[list[float]] = [[] for _ in picks]
    errors: list[list[str]] = [[] for _ in picks]
    while tasks:
        for task_id, result in pool.poll(timeout=POLL_S):
            index = tasks.pop(task_id, None)
            if index is None:
                continue
            if result.get("outcome") == OK and result.get("us") is not None:
                times[index].append(float(result["us"]))
            else:
                errors[index].append(str(result.get("error") or result.get("outcome")))
    rows = []
    for pick, measured, failed in zip(picks, times, errors):
        rows.append({**pick, "us": measured, "median_us": round(statistics.median(measured), 3) if measured else None,
                     "errors": failed})
    timed = [r for r in rows if r["median_us"] is not None]
    if not timed:
        return None
    winner = min(timed, key=lambda r: r["median_us"])
    default = next((r for r in rows if r["is_default"]), None)
    doc = {"date": utc_now(), "rounds": rounds, "finalists": rows, "winner_trial": winner["trial"],
           "winner_us": winner["median_us"],
           "default_us": default["median_us"] if default is not None else None,
           "wall_s": round(time.monotonic() - started, 2)}
    study.set_user_attr("retime", doc)
    search_best = min(rows, key=lambda r: r["search_us"])
    note = ("the search's best" if winner["trial"] == search_best["trial"]
            else f"not the search's best (trial {search_best['trial']}, {search_best['search_us']:.2f} us "
                 f"in the search, median {search_best['median_us']} re-timed)")
    progress.message(f"[{name}] re-timed {len(rows)} finalists x {rounds}: trial {winner['trial']}"
                     f"{' (the default)' if winner['is_default'] else ''}, median {winner['median_us']:.2f} us, "
                     f"{note}")
    return doc
