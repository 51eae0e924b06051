"""Which running trials still have a live search behind them, so a killed search loses only its trials
in flight and a re-run resumes.

A search process is an *owner*: (host, pid, process start time). It writes itself on every trial it asks
for (trial system attribute "fa4tune:owner"), renews a heartbeat on its trials in flight
("fa4tune:heartbeat", every HEARTBEAT_INTERVAL_S) and registers itself on the study (study system
attribute "fa4tune:run:<host>:<pid>:<start>", renewed as often). On the next run, `sweep_interrupted`
marks FAIL, outcome "interrupted", every RUNNING trial whose owner is gone: checked directly on the same
host (the pid with the same start time), by heartbeat age elsewhere. A trial killed before its owner was
written belongs to no one: it is stale when no other run of the study is alive, or when it started
more than STALE_AFTER_S ago (a live run claims its trials right after asking).

Everything goes through the storage's public API (`fa4tune.searches.storage.trial_id`).
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from typing import Optional

from optuna.trial import TrialState

from fa4tune.workers.outcomes import INTERRUPTED
from fa4tune.searches.storage import study_id, trial_id

HEARTBEAT_ATTR = "fa4tune:heartbeat"
OWNER_ATTR = "fa4tune:owner"
RUN_ATTR_PREFIX = "fa4tune:run:"
HEARTBEAT_INTERVAL_S = 10.0
STALE_AFTER_S = 60.0


def _process_start_token(pid: int) -> Optional[str]:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def this_process() -> dict:
    """This process as an owner: {"host", "pid", "start"}."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "start": _process_start_token(os.getpid())}


def _owner_alive(owner: Optional[dict]) -> Optional[bool]:
    """True/False when the owner ran on this host (checked), None when unknown (another host)."""
    if not owner or owner.get("host") != socket.gethostname():
        return None
    pid = owner.get("pid")
    if pid == os.getpid():
        return owner.get("start") == _process_start_token(pid)
    token = _process_start_token(pid) if isinstance(pid, int) else None
    return token is not None and token == owner.get("start")


def _alive(owner: Optional[dict], beat: Optional[float], now: float) -> bool:
    checked = _owner_alive(owner)
    if checked is not None:
        return checked
    return beat is not None and now - float(beat) < STALE_AFTER_S


def run_attr(owner: dict) -> str:
    """The study system attribute under which a run registers itself."""
    return f"{RUN_ATTR_PREFIX}{owner['host']}:{owner['pid']}:{owner['start']}"


def register_run(storage, study, owner: dict) -> None:
    """Record (and renew) a process as a live run of the study."""
    storage.set_study_system_attr(study_id(storage, study), run_attr(owner), {"owner": owner, "beat": time.time()})


def claim_trial(storage, study, number: int, owner: dict) -> int:
    """Write who runs a trial just asked for, with a first heartbeat; returns the trial's storage id."""
    tid = trial_id(storage, study, number)
    storage.set_trial_system_attr(tid, OWNER_ATTR, owner)
    storage.set_trial_system_attr(tid, HEARTBEAT_ATTR, time.time())
    return tid


def beat(storage, trial_ids) -> None:
    """Renew the heartbeat of trials in flight (by storage id)."""
    now = time.time()
    for tid in trial_ids:
        storage.set_trial_system_attr(tid, HEARTBEAT_ATTR, now)


def sweep_interrupted(storage, study, now: Optional[float] = None, me: Optional[dict] = None) -> list[int]:
    """Mark FAIL (outcome "interrupted") every RUNNING trial whose owner is gone. Returns their numbers.
    `me`: the calling run, which does not count as another live run."""
    now = time.time() if now is None else now
    runs = storage.get_study_system_attrs(study_id(storage, study))
    my_key = run_attr(me) if me else None
    other_run_alive = any(_alive(v.get("owner"), v.get("beat"), now) for k, v in runs.items()
                          if k.startswith(RUN_ATTR_PREFIX) and k != my_key and isinstance(v, dict))
    swept = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        owner = t.system_attrs.get(OWNER_ATTR)
        if owner is None:
            # claimed milliseconds after it is asked: one unclaimed for long was asked by a dead process
            started = t.datetime_start.timestamp() if t.datetime_start else now
            alive = other_run_alive and now - started < STALE_AFTER_S
        else:
            alive = _alive(owner, t.system_attrs.get(HEARTBEAT_ATTR), now)
        if alive:
            continue
        with contextlib.suppress(Exception):
            tid = trial_id(storage, study, t.number)
            storage.set_trial_user_attr(tid, "outcome", INTERRUPTED)
            storage.set_trial_user_attr(tid, "error", "the search process ended while this trial ran")
            storage.set_trial_state_values(tid, state=TrialState.FAIL)
            swept.append(t.number)
    return swept
