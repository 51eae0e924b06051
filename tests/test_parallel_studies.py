"""A shape set on several GPUs: one study per GPU at a time (fa4tune.searches.runner.run_studies_per_gpu),
on CPU with the fake kernel API and evaluator of tests/test_search_fakes.py and fake GPU ids."""

from __future__ import annotations

from dataclasses import replace

import optuna
import pytest
from optuna.trial import TrialState

import fa4tune.searches.runner as search_runner
from fa4.database import BestConfigDB
from fa4tune.progress import Progress
from fa4tune.searches.runner import run_search
from fa4tune.inputs.shapes import shape_key
from fa4tune.searches.storage import open_storage
from test_search import MISSION, settings
from test_search_fakes import FAKE_COMPILE_S_ENV

PROBLEMS = [replace(MISSION, seqlen_q=s, seqlen_k=s, causal=c) for s in (512, 1024) for c in (False, True)]
TRIALS = 5


def _interval(study) -> tuple:
    trials = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE]
    return min(t.datetime_start for t in trials), max(t.datetime_complete for t in trials)


def _overlap(a: tuple, b: tuple) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def test_a_shape_set_on_two_gpus_runs_one_study_per_gpu_at_once(tmp_path, monkeypatch):
    monkeypatch.setenv(FAKE_COMPILE_S_ENV, "0.2")   # studies long enough to be seen side by side
    s = settings(tmp_path, trials=TRIALS, gpus=[0, 1], processes=2, peers=())
    summaries = run_search("sm90", PROBLEMS, s, Progress(quiet=True))

    names = [shape_key("sm90", p) for p in PROBLEMS]
    assert [summary["study"] for summary in summaries] == names          # the problems' order
    assert all(summary["evaluated"] == TRIALS == summary["evaluated_this_run"] for summary in summaries)
    assert all(summary["processes"] == 1 for summary in summaries)      # 2 processes split over 2 GPUs
    storage = open_storage(tmp_path / "studies.journal")
    intervals = [_interval(optuna.load_study(study_name=n, storage=storage)) for n in names]
    assert any(_overlap(intervals[i], intervals[j]) for i in range(4) for j in range(i + 1, 4))
    assert sorted(e.study for e in BestConfigDB.load(tmp_path / "db.json").entries) == sorted(names)
    # the queue hands out the largest problems first (S=1024 full and causal, one per GPU), the
    # S=512 ones after them; which of those two starts its first trial first is a race between the
    # GPUs that free up (seen under load), so only the halves are compared
    starts = sorted(range(4), key=lambda i: intervals[i][0])
    assert set(starts[:2]) == {2, 3} and set(starts[2:]) == {0, 1}


def test_a_single_problem_runs_one_study_over_every_gpu(tmp_path):
    [summary] = run_search("sm90", [MISSION], settings(tmp_path, trials=3, gpus=[0, 1], processes=2, peers=()),
                           Progress(quiet=True))
    assert summary["processes"] == 2 and summary["evaluated"] == 3


def test_an_error_in_one_study_is_raised_and_every_pool_closed(tmp_path, monkeypatch):
    closed = []

    class RecordingPool(search_runner.WorkerPool):
        def close(self) -> None:
            closed.append(self)
            super().close()

    run_study = search_runner.run_study

    def failing_run_study(arch, problem, *args, **kw):
        if problem == PROBLEMS[1]:
            raise RuntimeError("boom in one study")
        return run_study(arch, problem, *args, **kw)

    monkeypatch.setattr(search_runner, "WorkerPool", RecordingPool)
    monkeypatch.setattr(search_runner, "run_study", failing_run_study)
    with pytest.raises(RuntimeError, match="boom in one study"):
        run_search("sm90", PROBLEMS, settings(tmp_path, trials=2, gpus=[0, 1], processes=2, peers=()),
                   Progress(quiet=True))
    assert len(closed) == 2
    assert all(w.proc is None for pool in closed for w in pool._workers)


def test_default_process_count_is_twelve_per_gpu_within_the_cores(monkeypatch):
    from fa4tune.searches.runner import SearchSettings

    monkeypatch.setattr("os.cpu_count", lambda: 32)
    assert SearchSettings(gpus=[0]).process_count() == 12
    assert SearchSettings(gpus=[0, 1]).process_count() == 24     # each GPU's studies compile on 12
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    assert SearchSettings(gpus=[0, 1]).process_count() == 14     # the cores less two for the harness
    assert SearchSettings(gpus=[0, 1], processes=3).process_count() == 3
