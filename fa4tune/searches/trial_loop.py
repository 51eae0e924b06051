"""The trial loop of one study: ask optuna for configurations, screen them, hand them to the worker pool,
tell optuna what happened.

Each configuration asked for is, in order:
- a repeat of one already in this study (the sampler avoids them, `fa4tune.searches.sampler`; a race between
  processes or an exhausted space can still yield one): recorded as a FAIL trial with `repeat_of`,
  neither measured nor counted;
- rejected by the kernel's feasibility model: recorded as "infeasible" with its reasons;
- a compile key that already failed to compile: recorded as that compile error without compiling;
- otherwise submitted to the pool, at most two per worker in flight.

`--trials N` counts the configurations that went to a worker (whatever their outcome), so infeasible
ones, repeats and interrupted trials do not count. The loop ends when N were evaluated, the space is
exhausted, the study's time budget is spent, or the sampler keeps proposing repeats.

Several processes may share a study (one storage, e.g. PostgreSQL on several hosts): the budget is the
study's, counted from the storage (`refresh`); a feasible trial goes to a worker only if the finished
trials and the claimed lower-numbered trials in flight leave it a place (`within_budget`), else it is
recorded `over_budget`; a configuration held by a lower-numbered trial of any process is a repeat
(`held_by_earlier`). A process whose budget is met only with other processes' trials in flight waits
for them, sweeping those of processes that died (`fa4tune.searches.liveness`), so a killed process's share
is run by the others.

The loop's state lives in one object (`TrialLoop`), its steps are methods; a crash of the loop marks
every trial still in flight "interrupted" before it propagates.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Any, Optional

from fa4.kernels import BACKWARD_KERNELS, AttentionProblem, Config, DeviceDescription
from fa4tune.searches import liveness
from fa4tune.environment import utc_now
from fa4tune.workers.outcomes import INFEASIBLE, INTERRUPTED, OK
from fa4tune.progress import Progress
from fa4tune.searches.study import best_ok_trial, finish_trial, outcome_counts, params_key
from fa4tune.workers.outcomes import portable_error
from fa4tune.workers.pool import WorkerPool

# a sampler that proposes only configurations already seen this many times in a row has converged
MAX_CONSECUTIVE_REPEATS = 200
POLL_S = 1.0


@dataclass
class _InFlight:
    trial: Any                 # optuna.Trial
    trial_id: int              # its storage id (heartbeats)
    is_default: bool
    compile_key: Any = None


class TrialLoop:
    """Runs one study to its end. `run()` returns the wall seconds it took."""

    def __init__(self, *, study, storage, arch: str, problem: AttentionProblem, distributions: dict,
                 kernels, pool: WorkerPool, settings, progress: Progress, owner: dict, name: str,
                 device: Optional[DeviceDescription] = None):
        self.study, self.storage = study, storage
        self.arch, self.problem, self.distributions = arch, problem, distributions
        # the GPU the workers run on (None: the family's reference device): feasibility is judged for it
        self.device = device
        self.kernels, self.pool, self.settings, self.progress = kernels, pool, settings, progress
        self.owner, self.name = owner, name
        self.timing = settings.timing.to_dict()
        self.failed_keys: dict[Any, str] = {}               # compile key -> its compile error
        self.in_flight: dict[int, _InFlight] = {}           # pool task id -> trial
        self.peers_task: Optional[int] = None
        self.counts, self.distinct = outcome_counts(study)  # finished trials, every process's
        self.running_elsewhere = 0                          # claimed trials in flight in other processes
        self.space_size = math.prod(len(d.choices) for d in distributions.values())
        # infeasible configurations are recorded but do not count: --trials N means N that ran
        self.ask_cap = 20 * settings.trials + 100
        self.asked = 0
        self.repeats_in_a_row = 0
        best = best_ok_trial(study)
        self.best_us = best.value if best else None
        self.default_us = study.user_attrs.get("default_us")
        self.started = 0.0
        self.last_beat = 0.0

    # -- the loop --
    def run(self) -> float:
        self.started = time.monotonic()
        if self.settings.peers:
            # a backward search times the peers' backward alone through autograd (the training task)
            kind = "training" if self.arch in BACKWARD_KERNELS else "peers"
            self.peers_task = self.pool.submit(kind, {"problem": self.problem.to_dict(), "timing": self.timing,
                                                      "names": list(self.settings.peers)})
        self.progress.start(self.name, self.settings.trials, self.evaluated(), self.settings.timeout_s)
        try:
            while True:
                self.refresh()
                self.fill_pool()
                if not self.in_flight and self.peers_task is None and not self.want_more():
                    # another process's trials may still end without counting (killed, swept):
                    # wait for them while the budget is not met by finished trials alone
                    if (not self.running_elsewhere or self.evaluated() >= self.settings.trials
                            or not self.time_left()):
                        break
                for task_id, result in self.pool.poll(timeout=POLL_S):
                    self.on_result(task_id, result)
                self.heartbeat()
        except BaseException:
            self.abandon()
            raise
        self.report_progress(final=True)
        return time.monotonic() - self.started

    def refresh(self) -> None:
        """Counts from the storage: several processes may share the study, and its budget."""
        from optuna.trial import TrialState

        self.counts, self.distinct = outcome_counts(self.study)
        mine = {entry.trial.number for entry in self.in_flight.values()}
        self.running_elsewhere = sum(
            1 for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
            if t.number not in mine and liveness.OWNER_ATTR in t.system_attrs)

    def evaluated(self) -> int:
        """Configurations that finished on a worker, in every process (the budget counts these)."""
        return self.distinct - self.counts.get(INFEASIBLE, 0)

    def pending(self) -> int:
        return len(self.in_flight) + self.running_elsewhere

    def time_left(self) -> bool:
        timeout = self.settings.timeout_s
        return timeout is None or time.monotonic() - self.started < timeout

    def want_more(self) -> bool:
        return (self.evaluated() + self.pending() < self.settings.trials
                and self.distinct + self.pending() < self.space_size
                and self.asked < self.ask_cap and self.time_left()
                and self.repeats_in_a_row < MAX_CONSECUTIVE_REPEATS)

    def report_progress(self, final: bool = False) -> None:
        self.progress.update(self.evaluated(), self.settings.trials, self.counts, self.best_us,
                             self.default_us, final=final)

    # -- asking --
    def fill_pool(self) -> None:
        while (self.want_more() and self.pool.idle_capacity() > 0
               and len(self.in_flight) < 2 * self.pool.size):
            self.ask_one()

    def ask_one(self) -> None:
        trial = self.study.ask(self.distributions)
        self.asked += 1
        # who runs it, so that a later run can tell a live trial from one of a dead process
        tid = liveness.claim_trial(self.storage, self.study, trial.number, self.owner)
        entry = _InFlight(trial, tid, bool(trial.user_attrs.get("is_default")))
        holder = held_by_earlier(self.study, trial)
        # the seeded default runs even when a sampled trial happened to hold its configuration
        if holder is not None and not (entry.is_default and not holder.user_attrs.get("is_default")):
            self.repeats_in_a_row += 1
            self.record_repeat(entry, holder.number)
            return
        self.repeats_in_a_row = 0
        self.screen_and_submit(entry, Config.from_dict(self.arch, trial.params))
        self.report_progress()

    def within_budget(self, number: int) -> bool:
        """Whether trial `number` (feasible, about to go to a worker) fits the study's budget, shared by
        every process: finished trials that count, and claimed trials in flight with a lower number
        (whatever they turn out to be), take the places before it."""
        from optuna.trial import TrialState

        taken = 0
        for t in self.study.get_trials(deepcopy=False):
            if t.number == number:
                continue
            if t.state in (TrialState.COMPLETE, TrialState.PRUNED):
                taken += "repeat_of" not in t.user_attrs and t.user_attrs.get("outcome") != INFEASIBLE
            elif t.state == TrialState.RUNNING and t.number < number and liveness.OWNER_ATTR in t.system_attrs:
                taken += 1
        return taken < self.settings.trials

    def record_repeat(self, entry: _InFlight, original: int) -> None:
        """A configuration the study already holds: no measurement, no value (FAIL plots no point and
        leaves the sampler's model as it was), not counted."""
        from optuna.trial import TrialState

        entry.trial.set_user_attr("repeat_of", original)
        self.study.tell(entry.trial, state=TrialState.FAIL)

    def record_over_budget(self, entry: _InFlight) -> None:
        """Another process took the study's last places while this trial was asked: not run, not
        counted (FAIL, user_attr over_budget); its configuration stays free for a later run."""
        from optuna.trial import TrialState

        entry.trial.set_user_attr("over_budget", True)
        self.study.tell(entry.trial, state=TrialState.FAIL)

    def screen_and_submit(self, entry: _InFlight, config: Config) -> None:
        try:
            reasons = list(self.kernels.feasible(config, self.problem, self.device))
            key = self.kernels.compile_key(config, self.problem, self.device)
        except Exception as exc:  # the kernel's own model failed on this config: a result
            self.finish(entry, {"outcome": "compile_error", "error": portable_error(exc)})
            return
        if reasons:
            self.finish(entry, {"outcome": INFEASIBLE, "reasons": reasons, "error": "; ".join(reasons)[:400]})
        elif key in self.failed_keys:
            self.finish(entry, {"outcome": "compile_error", "error": self.failed_keys[key], "compile_cached": True})
        elif not self.within_budget(entry.trial.number):
            self.record_over_budget(entry)
            # the counts this ask went by are stale: another process claimed a place since the last
            # refresh. Without a recount `fill_pool` would go on asking (every ask over budget, no
            # result polled, so no place ever freed) until the ask cap: processes sharing a study
            # spun for minutes each other's trials in flight
            self.refresh()
        else:
            payload = {"arch": self.arch, "config": config.to_dict(), "problem": self.problem.to_dict(),
                       "timing": self.timing, "validate": self.settings.validate}
            entry.compile_key = key
            self.in_flight[self.pool.submit("trial", payload, compile_key=key)] = entry

    # -- results --
    def on_result(self, task_id: int, result: dict) -> None:
        if task_id == self.peers_task:
            self.peers_task = None
            peers = (result.get("peers") or peers_backward(result.get("training"))
                     or {n: {"error": result.get("error", "peers task failed")} for n in self.settings.peers})
            self.study.set_user_attr("peers", peers)
            self.study.set_user_attr("peers_date", utc_now())
            return
        entry = self.in_flight.pop(task_id)
        if result.get("outcome") == "compile_error" and not result.get("compile_cached"):
            self.failed_keys[entry.compile_key] = result.get("error", "compile error")
        self.finish(entry, result)
        self.report_progress()

    def finish(self, entry: _InFlight, result: dict) -> None:
        is_default = entry.is_default
        finish_trial(self.study, entry.trial, result, is_default, storage=self.storage, trial_id=entry.trial_id)
        self.counts[result["outcome"]] += 1   # until the next refresh() recounts from the storage
        self.distinct += 1
        if result["outcome"] == OK and (self.best_us is None or result["us"] < self.best_us):
            self.best_us = result["us"]
        if is_default and result["outcome"] == OK:
            self.default_us = result["us"]
            self.study.set_user_attr("default_us", self.default_us)

    # -- liveness --
    def _alive_entries(self) -> list[_InFlight]:
        return list(self.in_flight.values())

    def heartbeat(self) -> None:
        if time.monotonic() - self.last_beat <= liveness.HEARTBEAT_INTERVAL_S:
            return
        self.last_beat = time.monotonic()
        liveness.register_run(self.storage, self.study, self.owner)
        liveness.beat(self.storage, [e.trial_id for e in self._alive_entries()])
        # trials of a process that died meanwhile (sharing the study) go back to the budget
        swept = liveness.sweep_interrupted(self.storage, self.study, me=self.owner)
        if swept:
            self.progress.message(f"[{self.name}] marked {len(swept)} trial(s) of ended processes interrupted: {swept}")

    def abandon(self) -> None:
        """The loop is ending abnormally: its trials in flight will never finish."""
        from optuna.trial import TrialState

        for entry in self._alive_entries():
            with contextlib.suppress(Exception):
                entry.trial.set_user_attr("outcome", INTERRUPTED)
                self.study.tell(entry.trial, state=TrialState.FAIL)


# How long a lower-numbered trial may show only some of its knobs: optuna's `ask` writes a trial's
# parameters one storage call at a time, so another process can read it half-written (milliseconds;
# longer only for a process that died mid-ask, whose trial the sweep then fails).
ASK_SETTLE_S = 2.0


def held_by_earlier(study, trial, settle_s: float = ASK_SETTLE_S):
    """The lower-numbered trial of any process that holds (or ran) this configuration, else None.
    The lower number wins, so two processes that drew the same configuration at once agree; a
    lower-numbered trial still being asked elsewhere (some knobs not yet written) is waited for,
    up to `settle_s`, or both processes would measure the configuration."""
    from optuna.trial import TrialState

    key, knobs = params_key(trial.params), set(trial.params)
    deadline = time.monotonic() + settle_s
    while True:
        earlier = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED,
                                                                         TrialState.RUNNING))
                   if t.number < trial.number and "repeat_of" not in t.user_attrs]
        for t in earlier:
            if params_key(t.params) == key:
                return t
        half_written = [t for t in earlier if t.state == TrialState.RUNNING and set(t.params) != knobs]
        if not half_written or time.monotonic() > deadline:
            return None
        time.sleep(0.02)


def peers_backward(training: Optional[dict]) -> dict:
    """The peers' times of a backward search, from the training task (`fa4tune.workers.training`): per
    peer its backward alone as "us" (what the database's `backend_us` and the speedups read), beside
    its forward + backward and its validation, or its error."""
    out = {}
    for name, measured in (training or {}).items():
        if "error" in measured or "bwd_us" not in measured:
            out[name] = {"error": measured.get("error", "no backward time")}
            continue
        out[name] = {"us": measured["bwd_us"], **{k: v for k, v in measured.items() if k != "bwd_us"}}
    return out
