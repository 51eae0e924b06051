"""A study: one per (architecture, problem), its lifecycle, and what is stored in it.

Storage (the report reads exactly this)
---------------------------------------
One optuna storage for all studies (`fa4tune.searches.storage`; by default `studies.journal` in the results
directory, `fa4tune.paths`).

Study name: the shape key, `fa4tune.inputs.shapes.shape_key(arch, problem)`, e.g.
`sm90-fp16-b1-hq32-hkv8-d128-sq1024-sk1024-causal` (`-full` when not causal, `-lse` appended when the
log-sum-exp is returned). When a study of that name was made with another kernel fingerprint,
another search space or on another device, its trials do not describe the current kernel: the search continues in
`<name>~2` (then `~3`, ...) and records `"previous_study"`; so does a study timed on another device. The current study of a shape is the one
with the highest suffix. A study of the name that is not this search's is never adopted (optuna's
`load_if_exists` would): one with another direction than minimise, another arch or problem, or trials
but no problem (not made by fa4tune) raises `StudyMismatchError`, naming what differs.

Study user_attrs:
    arch, problem (AttentionProblem fields), device {"name", "sm_count", "driver", "cc"},
    versions (`fa4tune.environment.versions`), kernel_fingerprint,
    timing {"method": "cuda_graph", "launches_per_graph", "replays", "l2": "warm"|"flushed"},
    peers {peer (`fa4.backends.peer_names()`): {"us", "tflops", "max_err"[, "kv_expanded"]}
           or {"error": str}}   (timed again by every run; "peers_date" says when),
    default_us (the seeded default configuration, null until it ran ok),
    space {knob: [choices]}, space_fingerprint, previous_study (only on a "~n" study).

Trials:
    params: the knob values; optuna CategoricalDistributions whose names are the knob names.
    user_attrs: outcome (`fa4tune.workers.outcomes`; "interrupted" only on a trial swept after the harness
      died), us, tflops, compile_s, max_err (vs
      fp32 reference), max_err_sdpa, error (short text), reasons (list, infeasible only), is_default
      (bool), and when they apply: gpu_s, compile_cached, replay_spread, warm_start (the key of the
      database entry a new study was seeded with, `fa4tune.searches.warm_start`).
    A repeat (a configuration the study already holds; rare, `fa4tune.searches.sampler`) is a FAIL trial with
      only user_attr repeat_of (the number of the trial that holds it): no value, no point in a plot,
      not counted. Journals written before carry repeats as COMPLETE/PRUNED trials with the result
      copied and repeat_of set; every reader skips trials with repeat_of.
    state and value:
      COMPLETE, value = GPU µs (minimise)   outcome "ok"
      PRUNED, no value                       every other measured outcome. The TPE sampler gets a
                                             constraint (violated for these), so it treats them as
                                             worse than any working configuration and steers away.
    constraint (system attrs, both COMPLETE and PRUNED trials): "constraints:works" (optuna's
      `Trial.set_constraint`) and "constraints" [value] (what optuna-dashboard shows as feasibility):
      0.0 for outcome "ok", 1.0 for every other (`record_constraint`).
      FAIL                                    a repeat (repeat_of), a trial over the study's budget
                                              (user_attr over_budget: processes sharing the study
                                              took its last places first), or
                                              interrupted: the harness died while the trial ran. On the
                                             next run, a RUNNING trial whose owner process is gone
                                             (same host) or whose heartbeat (system attr
                                             "fa4tune:heartbeat", renewed every 10 s) is older than
                                             60 s is marked FAIL with outcome "interrupted" (see
                                             `fa4tune.searches.liveness`).
"""

from __future__ import annotations

import warnings
from collections import Counter
from typing import Any, Callable, Optional

from fa4.kernels import AttentionProblem, Config
from fa4tune.environment import versions
from fa4tune.workers.outcomes import OUTCOMES
from fa4tune.progress import Progress
from fa4tune.searches.sampler import params_key, unseen_first  # noqa: F401  (params_key: one definition, used here and by the loop)
from fa4tune.inputs.space import SearchSpace
from fa4tune.workers.timing import TimingSettings

SAMPLERS = ("tpe", "grid", "random")


def make_sampler(name: str, seed: int, space: dict, trials: int):
    """The study's sampler over `space` ({knob: [choices]}); TPE and random are wrapped so that they
    propose each configuration once (`fa4tune.searches.sampler`)."""
    import optuna

    distributions = {k: optuna.distributions.CategoricalDistribution(v) for k, v in space.items()}
    return unseen_first(_make_inner_sampler(name, seed, space, trials), distributions, seed)


def _make_inner_sampler(name: str, seed: int, space: dict, trials: int):
    import optuna

    if name == "grid":
        class _Grid(optuna.samplers.GridSampler):
            def after_trial(self, study, trial, state, values):
                # GridSampler calls Study.stop() once the grid is covered, which only works inside
                # study.optimize(); this ask/tell loop stops by itself when every point was seen
                return None

        return _Grid(space, seed=seed)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        # failed outcomes carry a violated constraint (set in finish_trial): TPE ranks them below
        # every working configuration instead of ignoring them
        return optuna.samplers.TPESampler(seed=seed, multivariate=True, constant_liar=True,
                                          n_startup_trials=max(8, min(24, trials // 5)))


def open_study(storage, name: str, arch: str, problem: AttentionProblem, space: SearchSpace,
               fingerprint: str, new_sampler: Callable[[], Any], progress: Progress,
               device_name: Optional[str] = None):
    """The study to continue for this problem: `name`, or `name~n` when the stored one describes
    another kernel, space or device (see above). `new_sampler()` makes the study's sampler."""
    import optuna

    space_fp = space.fingerprint()
    base, n = name, 1
    previous = None
    while True:
        study = optuna.create_study(study_name=name, storage=storage, sampler=new_sampler(),
                                    direction="minimize", load_if_exists=True)
        refuse_another_search(study, arch, problem)
        attrs = study.user_attrs
        stored_device = (attrs.get("device") or {}).get("name")
        same_device = not device_name or not stored_device or stored_device == device_name

        def agrees(key, value):
            # a fact not written yet agrees: another process sharing the storage may be writing them
            return key not in attrs or attrs[key] == value

        if agrees("kernel_fingerprint", fingerprint) and agrees("space_fingerprint", space_fp) and same_device:
            break
        why = ("kernel fingerprint" if not agrees("kernel_fingerprint", fingerprint)
               else "search space" if not agrees("space_fingerprint", space_fp) else "device")
        progress.message(f"study {name}: its {why} differs from the current one; continuing in a new study")
        previous = name
        n += 1
        name = f"{base}~{n}"
    if previous:
        study.set_user_attr("previous_study", previous)
    return study


class StudyMismatchError(ValueError):
    """A stored study of the name a search asked for is not that search's: it is left as it is."""


def refuse_another_search(study, arch: str, problem: AttentionProblem) -> None:
    """Raise StudyMismatchError unless `study` is empty or a search of this problem: optuna's
    `load_if_exists` adopts any study of the name, whatever its direction or content."""
    from optuna.study import StudyDirection

    name = study.study_name
    proceed = "choose another --study name or another --storage"
    if study.directions != [StudyDirection.MINIMIZE]:
        directions = ", ".join(d.name.lower() for d in study.directions)
        raise StudyMismatchError(f"study {name!r} exists with direction {directions}, but a search minimises the "
                                 f"kernel time; {proceed}")
    attrs = study.user_attrs
    if "problem" not in attrs and "arch" not in attrs:
        # fa4tune writes both before the study's first trial; a process sharing the storage may be
        # writing them right now, so only a study that already holds trials is someone else's
        trials = len(study.get_trials(deepcopy=False))
        if trials:
            raise StudyMismatchError(f"study {name!r} exists with {trials} trial(s) but no problem: it is not a "
                                     f"study of fa4tune search; {proceed}")
        return
    differences = []
    if "arch" in attrs and attrs["arch"] != arch:
        differences.append(f"arch {attrs['arch']!r} (this search: {arch!r})")
    here = problem.to_dict()
    stored = attrs.get("problem", here)
    if stored != here:
        if isinstance(stored, dict):
            differences += [f"{key} {stored.get(key)!r} (this search: {here.get(key)!r})"
                            for key in list(here) + sorted(set(stored) - set(here)) if stored.get(key) != here.get(key)]
        else:
            differences.append(f"problem {stored!r}")
    if differences:
        raise StudyMismatchError(f"study {name!r} holds another problem: {', '.join(differences)}; {proceed}")


def write_study_attrs(study, arch: str, problem: AttentionProblem, device: dict, fingerprint: str,
                      timing: TimingSettings, space: SearchSpace) -> None:
    """The facts every reader of the study needs, written by the first run and again only where one
    changed (processes sharing a study write nothing twice)."""
    stored = study.user_attrs
    facts = {"arch": arch, "problem": problem.to_dict(), "device": device, "versions": versions(),
             "kernel_fingerprint": fingerprint, "timing": timing.describe(), "space": space.to_dict(),
             "space_fingerprint": space.fingerprint()}
    for key, value in facts.items():
        if key not in stored or stored[key] != value:
            study.set_user_attr(key, value)
    if "default_us" not in stored:
        study.set_user_attr("default_us", None)


def search_distributions(space: SearchSpace, config: Config) -> dict:
    """Categorical distributions of the space, widened by the default configuration's values (the
    default is always enqueued, so it must be a legal point)."""
    import optuna

    out = {}
    for name, choices in space.choices:
        value = getattr(config, name)
        # a Config's values and the space's choices are both canonical: plain membership
        values = list(choices) if value in choices else list(choices) + [value]
        out[name] = optuna.distributions.CategoricalDistribution(values)
    return out



# A trial's feasibility, as optuna and optuna-dashboard read it (violated when > 0): "works", 0 for
# outcome "ok" and 1 for every other measured outcome (infeasible, compile_error, mismatch, ...).
# optuna 5's public `Trial.set_constraint` stores it as the system attribute "constraints:works",
# which optuna's samplers (TPE ranks violated trials below every working one) and plots read through
# `FrozenTrial.constraints`. optuna-dashboard (its server and its browser-only journal/SQLite readers,
# through 2026-08) reads only the older format that samplers' `constraints_func` writes (deprecated in
# optuna 5): a list of values under the system attribute "constraints". So the value is written in both
# (the list through the storage's public `set_trial_system_attr`); `FrozenTrial.constraints` then holds
# it twice, as "works" and "0", which changes no ranking. "constraints" is optuna's private
# `_CONSTRAINTS_KEY`; tests/test_search.py fails if optuna renames it.
CONSTRAINT_NAME = "works"
DASHBOARD_CONSTRAINTS_ATTR = "constraints"


def record_constraint(storage, trial, trial_id: int, works: bool) -> None:
    """The trial's feasibility, in both formats (above); before the trial is told (finished)."""
    violation = 0.0 if works else 1.0
    trial.set_constraint(CONSTRAINT_NAME, violation)
    storage.set_trial_system_attr(trial_id, DASHBOARD_CONSTRAINTS_ATTR, [violation])


def finish_trial(study, trial, result: dict, is_default: bool, *, storage, trial_id: int) -> None:
    """Record a measured (or screened) configuration: its user attributes, its feasibility constraint,
    and its state and value (the table in the module docstring). `trial_id`: its storage id."""
    from optuna.trial import TrialState

    attrs = {"outcome": result["outcome"], "is_default": bool(is_default)}
    for key in ("us", "tflops", "compile_s", "max_err", "max_err_sdpa", "max_err_lse", "error", "reasons",
                "gpu_s", "compile_cached", "replay_spread", "repeat_of"):
        if key in result and result[key] is not None:
            attrs[key] = result[key]
    for key in ("us", "tflops", "compile_s", "max_err", "max_err_sdpa", "error"):
        attrs.setdefault(key, None)
    for key, value in attrs.items():
        trial.set_user_attr(key, value)
    record_constraint(storage, trial, trial_id, result["outcome"] == "ok")
    if result["outcome"] == "ok":
        study.tell(trial, float(result["us"]))
    else:
        study.tell(trial, state=TrialState.PRUNED)


def outcome_counts(study) -> tuple[Counter, int]:
    """(outcome -> count over distinct configurations, number of distinct configurations)."""
    from optuna.trial import TrialState

    counts: Counter = Counter()
    distinct = 0
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)):
        if "repeat_of" in t.user_attrs:
            continue
        distinct += 1
        counts[t.user_attrs.get("outcome", "unknown")] += 1
    return counts, distinct


def best_ok_trial(study):
    from optuna.trial import TrialState

    ok = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
          if t.user_attrs.get("outcome") == "ok" and t.value is not None]
    return min(ok, key=lambda t: (t.value, t.number)) if ok else None


def summarize(study) -> dict:
    """A plain summary of one study (what `fa4tune search` prints)."""
    from optuna.trial import TrialState

    attrs = study.user_attrs
    counts, distinct = outcome_counts(study)
    trials = study.get_trials(deepcopy=False)
    interrupted = sum(1 for t in trials if t.state == TrialState.FAIL
                      and t.user_attrs.get("outcome") == "interrupted")
    over_budget = sum(1 for t in trials if t.user_attrs.get("over_budget"))
    repeats = sum(1 for t in trials if "repeat_of" in t.user_attrs)
    compile_times = [t.user_attrs["compile_s"] for t in trials
                     if t.user_attrs.get("compile_s") and not t.user_attrs.get("compile_cached")
                     and "repeat_of" not in t.user_attrs]
    best = best_ok_trial(study)
    peers = attrs.get("peers") or {}
    out = {
        "study": study.study_name, "arch": attrs.get("arch"), "problem": attrs.get("problem"),
        "device": (attrs.get("device") or {}).get("name"), "kernel_fingerprint": attrs.get("kernel_fingerprint"),
        "configurations": distinct, "evaluated": distinct - counts.get("infeasible", 0),
        "repeats": repeats, "interrupted": interrupted, "over_budget": over_budget,
        "outcomes": {o: counts.get(o, 0) for o in OUTCOMES},
        "compile_s_median": round(sorted(compile_times)[len(compile_times) // 2], 3) if compile_times else None,
        # how the parallel compile pays off: compile seconds summed over trials vs the study's wall time
        "compile_s_total": round(sum(compile_times), 2),
        "gpu_s_total": round(sum(t.user_attrs.get("gpu_s") or 0.0 for t in trials
                                 if "repeat_of" not in t.user_attrs), 2),
        "default_us": attrs.get("default_us"),
        "peers": peers, "best": None, "speedup": {},
    }
    if best is not None:
        out["best"] = {"trial": best.number, "us": best.value, "tflops": best.user_attrs.get("tflops"),
                       "max_err": best.user_attrs.get("max_err"), "config": dict(best.params),
                       "is_default": bool(best.user_attrs.get("is_default"))}
        for peer, data in peers.items():
            if isinstance(data, dict) and data.get("us"):
                out["speedup"][peer] = round(data["us"] / best.value, 3)
        if out["default_us"]:
            out["speedup"]["default"] = round(out["default_us"] / best.value, 3)
    return out
