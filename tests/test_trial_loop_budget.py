"""A study's budget shared by processes: when another process claims the study's last place between
this loop's recount and its next ask, the loop asks once more (recorded over budget), recounts and
stops asking until a trial in flight finishes.

The race was seen in tests/test_search_postgres.py: two processes, each with one trial in flight and
the other's claimed just after its recount, went on asking (every ask over budget, no result ever
polled) until the ask cap, 280 s, and CI's 300 s limit failed the test."""

from __future__ import annotations

import optuna
from optuna.trial import TrialState

import test_search_fakes as fakes
from fa4.kernels import AttentionProblem
from fa4tune.searches import liveness
from fa4tune.progress import Progress
from fa4tune.searches.runner import SearchSettings
from fa4tune.inputs.space import load_space
from fa4tune.searches.storage import trial_id
from fa4tune.searches.study import finish_trial, search_distributions
from fa4tune.searches.trial_loop import TrialLoop

optuna.logging.set_verbosity(optuna.logging.WARNING)
PROBLEM = AttentionProblem(1, 1024, 1024, 32, 8, 128, "fp16", True)
BUDGET = 4


class _IdlePool:
    """Takes trials and never returns a result: what a pool looks like while its trials run."""

    size = 2

    def __init__(self):
        self.submitted = []

    def idle_capacity(self) -> int:
        return self.size * 2 - len(self.submitted)

    def submit(self, kind, payload, compile_key=None) -> int:
        self.submitted.append(payload)
        return len(self.submitted)

    def poll(self, timeout):
        return []


def _study_and_loop(pool):
    storage = optuna.storages.InMemoryStorage()
    study = optuna.create_study(storage=storage, sampler=optuna.samplers.RandomSampler(seed=0))
    distributions = search_distributions(load_space("sm90"), fakes.default_config("sm90", PROBLEM))
    settings = SearchSettings(trials=BUDGET, peers=(), kernel_api="test_search_fakes")
    me = {"host": "this-host", "pid": 1, "start": "1"}
    return study, TrialLoop(study=study, storage=storage, arch="sm90", problem=PROBLEM,
                            distributions=distributions, kernels=fakes, pool=pool, settings=settings,
                            progress=Progress(quiet=True), owner=me, name="budget-test")


def _measured_elsewhere(study, loop, n):
    for _ in range(n):
        trial = study.ask(loop.distributions)
        finish_trial(study, trial, {"outcome": "ok", "us": 100.0 + trial.number}, False,
                     storage=loop.storage, trial_id=trial_id(loop.storage, study, trial.number))


def _claimed_elsewhere(study, loop):
    trial = study.ask(loop.distributions)
    liveness.claim_trial(loop.storage, study, trial.number, {"host": "other-host", "pid": 2, "start": "2"})
    return trial


def test_a_place_claimed_after_the_recount_stops_the_asking():
    pool = _IdlePool()
    study, loop = _study_and_loop(pool)
    _measured_elsewhere(study, loop, BUDGET - 2)
    loop.refresh()
    # one place left for this process's own trial in flight, one for another process's
    loop.ask_one()
    assert len(pool.submitted) == 1
    # the other process claims the last place after this loop's recount
    _claimed_elsewhere(study, loop)
    loop.fill_pool()

    over = [t for t in study.get_trials(deepcopy=False) if t.user_attrs.get("over_budget")]
    assert len(over) <= 1, f"{len(over)} asks over budget: the loop kept asking on stale counts"
    assert len(pool.submitted) == 1
    assert not loop.want_more()


def test_the_loop_asks_again_once_a_place_frees():
    pool = _IdlePool()
    study, loop = _study_and_loop(pool)
    _measured_elsewhere(study, loop, BUDGET - 1)
    other = _claimed_elsewhere(study, loop)
    loop.refresh()
    loop.fill_pool()
    assert pool.submitted == [] and not loop.want_more()
    # the other process's trial ended without counting (its process died, swept as interrupted)
    study.tell(other, state=TrialState.FAIL)
    loop.refresh()
    loop.fill_pool()
    assert len(pool.submitted) == 1
