"""Two processes that draw the same configuration at once measure it once: the lower trial number
holds it (`fa4tune.searches.trial_loop.held_by_earlier`), even while that trial is still being asked and
only some of its knobs are in the storage (optuna writes them one call at a time).

The race was seen in tests/test_search_postgres.py (41 configurations measured, 40 distinct)."""

from __future__ import annotations

import threading
import time

import optuna
from optuna.distributions import CategoricalDistribution

from fa4tune.searches.trial_loop import held_by_earlier

KNOBS = {"tile_n": CategoricalDistribution([64, 128]), "kv_stages": CategoricalDistribution([2, 3])}
CONFIG = {"tile_n": 128, "kv_stages": 3}

optuna.logging.set_verbosity(optuna.logging.WARNING)


def _study():
    return optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))


def _asked(study, params):
    study.enqueue_trial(params)
    return study.ask(KNOBS)


def test_a_half_written_earlier_trial_is_waited_for_and_wins():
    study = _study()
    earlier = study.ask()  # asked elsewhere: no knob written yet
    mine = _asked(study, CONFIG)

    # the other process writes the same configuration's knobs a moment later
    def write_knobs():
        time.sleep(0.2)
        for name, value in CONFIG.items():
            study._storage.set_trial_param(earlier._trial_id, name, KNOBS[name].to_internal_repr(value),
                                           KNOBS[name])

    writer = threading.Thread(target=write_knobs)
    writer.start()
    start = time.monotonic()
    holder = held_by_earlier(study, mine, settle_s=5.0)
    writer.join()
    assert holder is not None and holder.number == earlier.number
    assert time.monotonic() - start < 2.0


def test_an_earlier_trial_that_never_finishes_asking_is_given_up_on():
    study = _study()
    study.ask()  # a process that died mid-ask
    mine = _asked(study, CONFIG)
    start = time.monotonic()
    assert held_by_earlier(study, mine, settle_s=0.3) is None
    assert 0.3 <= time.monotonic() - start < 2.0


def test_other_configurations_and_later_trials_hold_nothing():
    study = _study()
    _asked(study, {"tile_n": 64, "kv_stages": 3})
    mine = _asked(study, CONFIG)
    later = _asked(study, CONFIG)
    start = time.monotonic()
    assert held_by_earlier(study, mine, settle_s=5.0) is None  # nothing half-written: no wait
    assert time.monotonic() - start < 1.0
    assert held_by_earlier(study, later).number == mine.number
