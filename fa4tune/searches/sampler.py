"""The samplers of a search, wrapped so that a study does not ask for a configuration twice.

Optuna's TPE and random samplers draw from a categorical space with replacement: on a space of a few
thousand configurations a long study proposes many it has already seen (a quarter of the trials of
our H200 journal were such repeats). Each repeat used to become a trial of its own, its result copied
from the first (`repeat_of`): it counted as a trial in optuna-dashboard and drew a second point at the
same value. `UnseenFirst` asks its sampler again when a proposal was already tried, or is in flight in
any process sharing the storage, and after a few draws takes an untried configuration at random, so
a study holds one trial per configuration. Only a race between processes, or a space with nothing
left, can still produce a repeat; the trial loop records it as a FAIL trial with `repeat_of`, which
plots no point and teaches the sampler nothing new (`fa4tune.searches.trial_loop`).

The grid sampler is not wrapped: it visits each grid point once by itself.
"""

from __future__ import annotations

import random
from typing import Any

import optuna
from optuna.distributions import BaseDistribution
from optuna.samplers import BaseSampler
from optuna.trial import FrozenTrial, TrialState

# draws from the wrapped sampler before a random untried configuration is taken instead
SAMPLER_DRAWS = 8
# random draws to find an untried configuration (a space this crowded is nearly exhausted)
RANDOM_DRAWS = 2000
# trials that hold a configuration: measured, in flight, or queued
_TAKEN_STATES = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING, TrialState.WAITING)


def params_key(params: dict) -> tuple:
    return tuple(sorted((k, repr(v)) for k, v in params.items()))


class UnseenFirst(BaseSampler):
    """Wraps a sampler over a fixed space of categorical `distributions` (every knob); proposes each
    configuration at most once per study (see the module docstring)."""

    def __init__(self, inner: BaseSampler, distributions: dict[str, BaseDistribution], seed: int = 0):
        self.inner = inner
        self.distributions = dict(distributions)
        self._rng = random.Random(seed)

    # the whole space is sampled jointly here, so that a proposal can be checked before it is used
    def infer_relative_search_space(self, study, trial: FrozenTrial) -> dict[str, BaseDistribution]:
        return dict(self.distributions)

    def sample_relative(self, study, trial: FrozenTrial, search_space: dict[str, BaseDistribution]) -> dict[str, Any]:
        if not search_space:
            return {}
        taken = {params_key(t.params) for t in study.get_trials(deepcopy=False, states=_TAKEN_STATES)
                 if t.number != trial.number and t.params}
        params: dict[str, Any] = {}
        for _ in range(SAMPLER_DRAWS):
            params = self._draw(study, trial, search_space)
            if params_key(params) not in taken:
                return params
        for _ in range(RANDOM_DRAWS):
            candidate = {name: self._rng.choice(d.choices) for name, d in search_space.items()}
            if params_key(candidate) not in taken:
                return candidate
        return params   # (nearly) every configuration is taken: the trial loop records the repeat

    def _draw(self, study, trial: FrozenTrial, search_space: dict[str, BaseDistribution]) -> dict[str, Any]:
        inner_space = self.inner.infer_relative_search_space(study, trial)
        params = dict(self.inner.sample_relative(study, trial, inner_space)) if inner_space else {}
        for name, distribution in search_space.items():
            if name not in params:
                params[name] = self.inner.sample_independent(study, trial, name, distribution)
        return {name: params[name] for name in search_space}

    def sample_independent(self, study, trial: FrozenTrial, param_name: str, param_distribution: BaseDistribution) -> Any:
        return self.inner.sample_independent(study, trial, param_name, param_distribution)

    def before_trial(self, study, trial: FrozenTrial) -> None:
        self.inner.before_trial(study, trial)

    def after_trial(self, study, trial: FrozenTrial, state: TrialState, values) -> None:
        self.inner.after_trial(study, trial, state, values)

    def reseed_rng(self) -> None:
        self.inner.reseed_rng()
        self._rng = random.Random()


def unseen_first(inner: BaseSampler, distributions: dict, seed: int) -> BaseSampler:
    """`inner` wrapped (TPE, random), or as it is (grid)."""
    if isinstance(inner, optuna.samplers.GridSampler):
        return inner
    return UnseenFirst(inner, distributions, seed)
