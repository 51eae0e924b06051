"""Several search processes share one PostgreSQL storage (the fake kernel and evaluator): the study's
budget is global, every trial is accounted for, and a process killed with SIGKILL loses nothing but
its trials in flight, which the others run instead.

Needs a PostgreSQL server: $FA4TUNE_TEST_POSTGRES (an SQLAlchemy URL), default
postgresql://fa4tune:fa4tune@localhost/fa4tune (what .ci/run creates), and psycopg2
(`pip install "fa4tune[postgres]"`). Skipped, with the reason, where either is missing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

import test_search_fakes as fakes
from fa4tune.searches import liveness
from fa4tune.searches.liveness import sweep_interrupted
from fa4tune.searches.storage import open_storage

TESTS = Path(__file__).resolve().parent
URL = os.environ.get("FA4TUNE_TEST_POSTGRES", "postgresql://fa4tune:fa4tune@localhost/fa4tune")
BUDGET = 30
PROCESSES = 3

_RUN = """
import sys
import time
from pathlib import Path
sys.path.insert(0, {tests!r})
from fa4.kernels import AttentionProblem
from fa4tune.progress import Progress
from fa4tune.searches.runner import SearchSettings, run_search
if __name__ == "__main__":
    # start together: on a loaded machine one process's imports can take longer than the others need
    # to spend the whole budget, and then the test could not tell a shared budget from a lone one
    ready, go = Path(sys.argv[3]), Path(sys.argv[4])
    ready.touch()
    while not go.exists():
        time.sleep(0.05)
    s = SearchSettings(trials={budget}, processes=2, storage={url!r}, study_name={study!r}, db_path=sys.argv[1],
                       evaluator="test_search_fakes:FakeEvaluator", kernel_api="test_search_fakes", peers=(),
                       seed=int(sys.argv[2]))
    run_search("sm90", [AttentionProblem(1, 1024, 1024, 32, 8, 128, "fp16", True)], s, Progress(quiet=True))
"""


@pytest.fixture(scope="module")
def postgres_url() -> str:
    psycopg2 = pytest.importorskip("psycopg2", reason='psycopg2 missing: pip install "fa4tune[postgres]"')
    try:
        psycopg2.connect(_libpq_url(URL), connect_timeout=3).close()
    except psycopg2.OperationalError as exc:
        pytest.skip(f"no PostgreSQL server at {URL}: {str(exc).strip()}")
    return URL


def _libpq_url(url: str) -> str:
    """The URL as psycopg2 itself takes it (without SQLAlchemy's driver name)."""
    return url.replace("postgresql+psycopg2://", "postgresql://")


def _trials(url: str, study: str):
    return optuna.load_study(study_name=study, storage=open_storage(url)).get_trials(deepcopy=False)


def test_three_processes_share_one_budget_and_survive_a_sigkill(tmp_path, postgres_url):
    study = f"pg-test-{uuid.uuid4().hex[:12]}"
    script = tmp_path / "run.py"
    script.write_text(_RUN.format(tests=str(TESTS), budget=BUDGET, url=postgres_url, study=study))
    env = {**os.environ, fakes.FAKE_COMPILE_S_ENV: "0.5"}
    ready = [tmp_path / f"ready{i}" for i in range(PROCESSES)]
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path / f"db{i}.json"), str(i),
                               str(ready[i]), str(go)], env=env,
                              start_new_session=True, stderr=subprocess.PIPE, text=True)
             for i in range(PROCESSES)]
    victim, finished_before, killed_running = procs[0], {}, []
    try:
        deadline = time.time() + 240
        while not all(r.exists() for r in ready):
            assert time.time() < deadline, "the search processes did not start"
            assert all(proc.poll() is None for proc in procs), "a search process ended before it started"
            time.sleep(0.1)
        go.touch()
        deadline = time.time() + 240
        while time.time() < deadline:
            time.sleep(0.5)
            try:
                trials = _trials(postgres_url, study)
            except KeyError:
                continue
            victims = [t for t in trials if (t.system_attrs.get("fa4tune:owner") or {}).get("pid") == victim.pid]
            mine = [t for t in victims if t.state == TrialState.RUNNING]
            # the victim must have measured a trial of its own first, or the check below that all
            # three processes took part in the budget is a race
            victim_measured = any(t.state in (TrialState.COMPLETE, TrialState.PRUNED)
                                  and t.user_attrs.get("outcome") != "infeasible" for t in victims)
            if sum(t.state.is_finished() for t in trials) >= 6 and mine and victim_measured:
                os.killpg(victim.pid, signal.SIGKILL)   # the search and its workers, mid-trial
                victim.wait(30)
                killed_running = [t.number for t in mine]
                break
        else:
            pytest.fail("the searches did not get going")
        finished_before = {t.number: (t.state, t.value, t.params) for t in _trials(postgres_url, study)
                           if t.state.is_finished()}
        for proc in procs[1:]:
            _, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, err[-3000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)

    # a trial the victim asked for but had not claimed yet belongs to no one: the next run sweeps it
    # once it is older than a claim can take (here: as if that run came STALE_AFTER_S later)
    storage = open_storage(postgres_url)
    loaded = optuna.load_study(study_name=study, storage=storage)
    sweep_interrupted(storage, loaded, now=time.time() + liveness.STALE_AFTER_S)
    trials = _trials(postgres_url, study)
    by_number = {t.number: t for t in trials}
    # nothing finished was lost or changed; the victim's trials in flight were marked interrupted
    for number, (state, value, params) in finished_before.items():
        t = by_number[number]
        assert (t.state, t.value, t.params) == (state, value, params)
    # (one may have finished between the look and the kill)
    states = [(by_number[n].state, by_number[n].user_attrs.get("outcome")) for n in killed_running]
    assert (TrialState.FAIL, "interrupted") in states
    assert all(state != TrialState.FAIL or outcome == "interrupted" for state, outcome in states)
    # every trial accounted for: measured, infeasible, or a FAIL that says why
    assert not [t.number for t in trials if not t.state.is_finished()]
    for t in trials:
        if t.state == TrialState.FAIL:
            attrs = t.user_attrs
            assert attrs.get("outcome") == "interrupted" or "repeat_of" in attrs or attrs.get("over_budget"), t
    measured = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    ran = [t for t in measured if t.user_attrs["outcome"] != "infeasible"]
    # the budget is the study's: met exactly, by the three processes together
    assert len(ran) == BUDGET
    owners = {(t.system_attrs.get("fa4tune:owner") or {}).get("pid") for t in ran}
    assert len(owners) == PROCESSES
    # no configuration measured twice
    keys = [json.dumps(t.params, sort_keys=True) for t in measured]
    assert len(keys) == len(set(keys))
    assert sum(1 for t in measured if t.user_attrs.get("is_default")) == 1


_OPEN = """
import sys
import time
from pathlib import Path
from fa4tune.searches.storage import open_storage
if __name__ == "__main__":
    go = Path(sys.argv[2])
    while not go.exists():
        time.sleep(0.005)
    open_storage(sys.argv[1])
"""
OPENERS = 6


def test_processes_that_open_a_new_database_at_once_all_get_it(tmp_path, postgres_url):
    # a new schema stands for a new database: optuna creates its tables and stamps its version there
    psycopg2 = pytest.importorskip("psycopg2")

    def execute(sql):
        conn = psycopg2.connect(_libpq_url(postgres_url))
        try:
            conn.autocommit = True
            conn.cursor().execute(sql)
        finally:
            conn.close()

    schema = f"fa4tune_new_{uuid.uuid4().hex[:12]}"
    execute(f"CREATE SCHEMA {schema}")
    url = f"{postgres_url}?options=-csearch_path%3D{schema}"
    script, go = tmp_path / "open.py", tmp_path / "go"
    script.write_text(_OPEN)
    try:
        procs = [subprocess.Popen([sys.executable, str(script), url, str(go)], stderr=subprocess.PIPE, text=True)
                 for _ in range(OPENERS)]
        time.sleep(3)   # every process imported and waiting
        go.touch()
        errors = [proc.communicate(timeout=120)[1] for proc in procs]
        failed = [err[-1500:] for proc, err in zip(procs, errors) if proc.returncode != 0]
        assert not failed, f"{len(failed)} of {OPENERS} processes could not open the new database:\n{failed[0]}"
    finally:
        execute(f"DROP SCHEMA {schema} CASCADE")
