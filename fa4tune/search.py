"""The search: one optuna study per (architecture, problem), trials run by `fa4tune.worker.WorkerPool`.

Storage (the report reads exactly this)
---------------------------------------
One optuna storage for all studies, by default `results/studies.journal`: an optuna `JournalStorage`
over a `JournalFileBackend` (append-only JSON lines, one fsync per operation, a lock file for several
processes). A `sqlite:///...` URL selects an `RDBStorage` instead. Open it for reading with
`open_storage(path)`.

Study name: the shape key, `shape_key(arch, problem)`, e.g.
`sm90-fp16-b1-hq32-hkv8-d128-sq1024-sk1024-causal` (`-full` when not causal, `-lse` appended when the
log-sum-exp is returned). When a study of that name was made with another kernel fingerprint,
another search space or on another device, its trials do not describe the current kernel: the search continues in
`<name>~2` (then `~3`, ...) and records `"previous_study"`; so does a study timed on another device. The current study of a shape is the one
with the highest suffix.

Study user_attrs:
    arch, problem (AttentionProblem fields), device {"name", "sm_count", "driver", "cc"},
    versions {"torch", "cutlass_dsl", "optuna", "cuda", "flash_attn_4"}, kernel_fingerprint,
    timing {"method": "cuda_graph", "launches_per_graph", "replays", "l2": "warm"|"flushed"},
    peers {"sdpa_flash"|"sdpa_cudnn"|"flash_attn_4": {"us", "tflops", "max_err"[, "kv_expanded"]}
           or {"error": str}}   (timed again by every run; "peers_date" says when),
    default_us (the seeded default configuration, null until it ran ok),
    space {knob: [choices]}, space_fingerprint, previous_study (only on a "~n" study).

Trials:
    params: the knob values; optuna CategoricalDistributions whose names are the knob names.
    user_attrs: outcome (ok | infeasible | compile_error | launch_error | fault | timeout | mismatch,
      or "interrupted" on a trial swept after the harness died), us, tflops, compile_s, max_err (vs
      fp32 reference), max_err_sdpa, error (short text), reasons (list, infeasible only), is_default
      (bool), and when they apply: gpu_s, compile_cached, replay_spread, repeat_of (a configuration
      already evaluated in this study: its result is copied, not measured again).
    state and value:
      COMPLETE, value = GPU µs (minimise)   outcome "ok"
      PRUNED, no value                       every other measured outcome. The TPE sampler gets a
                                             constraint (violated for these), so it treats them as
                                             worse than any working configuration and steers away.
      FAIL                                    interrupted: the harness died while the trial ran. On the
                                             next run, a RUNNING trial whose owner process is gone
                                             (same host) or whose heartbeat (system attr
                                             "fa4tune:heartbeat", renewed every 10 s) is older than
                                             60 s is marked FAIL with outcome "interrupted" (see
                                             `sweep_interrupted`).

`--trials N` means N distinct configurations that passed the feasibility model and went to a worker
(whatever their outcome); infeasible ones are recorded too but do not count, nor do repeats and
interrupted trials. A re-run with the same N resumes and stops there. A space smaller than that ends
the study when every configuration was seen.

On the H200 test machine (see ../shared/device/README.md; files come back only through $OUT), after
the bundle's setup, the mission search and its benchmark, writing straight into $OUT so that a run
cut short still returns its storage (copy the packaged files there first to resume and to merge):

    cp results/studies.journal results/best_configs.json $OUT/ 2>/dev/null
    python3 -m fa4tune.cli search --seqlen 1024 --gqa 4 --timeout 200 --storage $OUT/studies.journal \
        --db $OUT/best_configs.json --format json > $OUT/search.json 2> $OUT/search.log
    python3 -m fa4tune.cli bench --db $OUT/best_configs.json --out $OUT/bench.json --csv $OUT/bench.csv
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import socket
import sys
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field, replace
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Optional

from fa4.kernels import AttentionProblem, Config
from fa4tune.peers import PEER_NAMES
from fa4tune.space import SearchSpace, load_space
from fa4tune.timing import TimingSettings
from fa4tune.outcomes import FAILED, OUTCOMES
from fa4tune.worker import DEFAULT_EVALUATOR, PoolError, WorkerPool, short_error

SAMPLERS = ("tpe", "grid", "random")
HEARTBEAT_ATTR = "fa4tune:heartbeat"
OWNER_ATTR = "fa4tune:owner"
RUN_ATTR_PREFIX = "fa4tune:run:"
HEARTBEAT_INTERVAL_S = 10.0
STALE_AFTER_S = 60.0
MAX_CONSECUTIVE_REPEATS = 200


# ------------------------------------------------------------------------------------------------
# names and shapes

def shape_key(arch: str, problem: AttentionProblem) -> str:
    mask = "causal" if problem.causal else "full"
    key = (f"{arch}-{problem.dtype}-b{problem.batch}-hq{problem.heads_q}-hkv{problem.heads_kv}"
           f"-d{problem.head_dim}-sq{problem.seqlen_q}-sk{problem.seqlen_k}-{mask}")
    return key + ("-lse" if problem.return_lse else "")


_TOKEN = re.compile(r"^(b|hq|hkv|d|sq|sk|s|gqa)(\d+)$")


def parse_shape(text: str, defaults: dict) -> tuple[Optional[str], AttentionProblem]:
    """A shape from dash-separated tokens in any order, the rest from `defaults`:
    `[sm90|sm100] [fp16|bf16] b<batch> hq<heads> hkv<kv heads> gqa<ratio> d<head dim> s<seqlen>
    sq<seqlen_q> sk<seqlen_k> [causal|full] [lse]`. Returns (arch or None, problem)."""
    values = dict(defaults)
    arch = None
    gqa = None
    for token in text.strip().split("-"):
        token = token.strip().lower()
        if not token:
            continue
        if token in ("sm90", "sm100"):
            arch = token
        elif token in ("fp16", "bf16"):
            values["dtype"] = token
        elif token in ("causal", "full"):
            values["causal"] = token == "causal"
        elif token == "lse":
            values["return_lse"] = True
        else:
            m = _TOKEN.match(token)
            if not m:
                raise ValueError(f"shape {text!r}: cannot read {token!r}")
            name, number = m.group(1), int(m.group(2))
            if name == "s":
                values["seqlen_q"] = values["seqlen_k"] = number
            elif name == "gqa":
                gqa = number
            else:
                values[{"b": "batch", "hq": "heads_q", "hkv": "heads_kv", "d": "head_dim",
                        "sq": "seqlen_q", "sk": "seqlen_k"}[name]] = number
    if gqa is not None:
        if values["heads_q"] % gqa:
            raise ValueError(f"shape {text!r}: {values['heads_q']} query heads are not divisible by gqa {gqa}")
        values["heads_kv"] = values["heads_q"] // gqa
    return arch, AttentionProblem(**values)


# ------------------------------------------------------------------------------------------------
# environment facts

def versions() -> dict:
    def dist(name: str) -> Optional[str]:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    import optuna
    import torch

    return {"torch": torch.__version__, "cutlass_dsl": dist("nvidia-cutlass-dsl"),
            "optuna": optuna.__version__, "cuda": torch.version.cuda,
            "flash_attn_4": dist("flash-attn-4")}


def kernel_api(name: str = "fa4.kernels"):
    """The module giving feasible/default_config/compile_key/source_fingerprint (tests inject one)."""
    import importlib

    return importlib.import_module(name)


def kernel_fingerprint(arch: str, api: str = "fa4.kernels") -> str:
    try:
        return kernel_api(api).source_fingerprint(arch)
    except Exception as exc:  # the family is not importable (yet): say so, do not guess
        return f"unavailable ({short_error(exc, 80)})"


def default_results_dir() -> Path:
    import fa4.results

    return Path(fa4.results.__file__).resolve().parent


def default_storage_path() -> Path:
    return default_results_dir() / "studies.journal"


def open_storage(spec: str | os.PathLike | None = None):
    """The optuna storage: a journal file path (default results/studies.journal) or an RDB URL."""
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    text = str(spec) if spec is not None else str(default_storage_path())
    if "://" in text:
        return optuna.storages.RDBStorage(text)
    Path(text).parent.mkdir(parents=True, exist_ok=True)
    return JournalStorage(JournalFileBackend(text))


# ------------------------------------------------------------------------------------------------
# settings and progress

@dataclass
class SearchSettings:
    trials: int = 100
    sampler: str = "tpe"
    seed: int = 0
    timeout_s: Optional[float] = None          # wall budget per study (None: none)
    trial_timeout_s: float = 20.0              # GPU phase of one trial (normally well under 1 s)
    compile_timeout_s: float = 300.0           # compile phase of one trial
    gpus: list = field(default_factory=lambda: [0])
    processes: Optional[int] = None            # worker processes in all (compile in parallel)
    timing: TimingSettings = field(default_factory=TimingSettings)
    validate: bool = True
    peers: tuple = PEER_NAMES
    storage: Optional[str] = None
    study_name: Optional[str] = None
    db_path: Optional[str] = None              # None: $FA4_CONFIG_DB or the packaged database
    record_db: bool = True
    space_path: Optional[str] = None
    evaluator: str = DEFAULT_EVALUATOR
    kernel_api: str = "fa4.kernels"            # tests inject a CPU model of the kernel API here

    def __post_init__(self) -> None:
        if self.sampler not in SAMPLERS:
            raise ValueError(f"sampler must be one of {SAMPLERS}, got {self.sampler!r}")
        if self.trials < 1:
            raise ValueError("trials must be >= 1")

    def process_count(self) -> int:
        if self.processes:
            return self.processes
        cores = os.cpu_count() or 2
        return max(len(self.gpus), min(cores - 2, 12))


class Progress:
    """Progress on stderr: a rich bar on a terminal, a plain line every few seconds elsewhere."""

    def __init__(self, stream=None, quiet: bool = False, every_s: float = 5.0):
        self.stream = stream or sys.stderr
        self.quiet = quiet
        self.every_s = every_s
        self._bar = None
        self._task = None
        self._last = 0.0
        self._name = ""

    def message(self, text: str) -> None:
        if not self.quiet:
            print(text, file=self.stream, flush=True)

    def start(self, name: str, total: int, done: int) -> None:
        self._name = name
        if self.quiet:
            return
        if getattr(self.stream, "isatty", lambda: False)():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn, TimeElapsedColumn

            self._bar = RichProgress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                     TimeElapsedColumn(), console=Console(file=self.stream))
            self._bar.start()
            self._task = self._bar.add_task(name, total=total, completed=done)
        else:
            self.message(f"[{name}] starting: {done}/{total} configurations done")

    def update(self, done: int, total: int, counts: Counter, best_us, default_us, final=False) -> None:
        fails = " ".join(f"{k}={v}" for k, v in sorted(counts.items()) if k != "ok" and v)
        best = f"best {best_us:.2f} us" if best_us is not None else "best -"
        dflt = f" (default {default_us:.2f} us)" if default_us is not None else ""
        text = f"{done}/{total} ok={counts.get('ok', 0)} {fails} | {best}{dflt}".replace("  ", " ")
        if self.quiet:
            return
        if self._bar is not None:
            self._bar.update(self._task, completed=done, description=f"{self._name} {text}")
            if final:
                self._bar.stop()
                self._bar = None
            return
        now = time.monotonic()
        if final or now - self._last >= self.every_s:
            self._last = now
            self.message(f"[{self._name}] {text}")


# ------------------------------------------------------------------------------------------------
# the study

def _params_key(params: dict) -> tuple:
    return tuple(sorted((k, repr(v)) for k, v in params.items()))


def make_sampler(name: str, seed: int, space: dict, trials: int):
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
        # failed outcomes carry a violated constraint (set in _finish_trial): TPE ranks them below
        # every working configuration instead of ignoring them
        return optuna.samplers.TPESampler(seed=seed, multivariate=True, constant_liar=True,
                                          n_startup_trials=max(8, min(24, trials // 5)))


def _process_start_token(pid: int) -> Optional[str]:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _owner() -> dict:
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


def _run_attr(owner: dict) -> str:
    return f"{RUN_ATTR_PREFIX}{owner['host']}:{owner['pid']}:{owner['start']}"


def register_run(study, owner: dict) -> None:
    """Record (and renew) this process as a live run of the study: a study system attribute."""
    study._storage.set_study_system_attr(study._study_id, _run_attr(owner), {"owner": owner, "beat": time.time()})


def _alive(owner: Optional[dict], beat: Optional[float], now: float) -> bool:
    checked = _owner_alive(owner)
    if checked is not None:
        return checked
    return beat is not None and now - float(beat) < STALE_AFTER_S


def sweep_interrupted(study, now: Optional[float] = None, me: Optional[dict] = None) -> list[int]:
    """Mark FAIL (outcome "interrupted") every RUNNING trial whose owner is gone. Returns numbers.

    A trial's owner is its system attribute "fa4tune:owner" (host, pid, process start time): checked
    directly on the same host, by the trial's heartbeat elsewhere. A trial killed before its owner was
    written belongs to no one: it is stale when no other run of the study is alive (runs register
    themselves as study system attributes "fa4tune:run:<host>:<pid>:<start>").
    """
    from optuna.trial import TrialState

    now = time.time() if now is None else now
    storage = study._storage
    runs = storage.get_study_system_attrs(study._study_id)
    my_key = _run_attr(me) if me else None
    other_run_alive = any(_alive(v.get("owner"), v.get("beat"), now) for k, v in runs.items()
                          if k.startswith(RUN_ATTR_PREFIX) and k != my_key and isinstance(v, dict))
    swept = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        owner = t.system_attrs.get(OWNER_ATTR)
        if owner is None:
            alive = other_run_alive
        else:
            alive = _alive(owner, t.system_attrs.get(HEARTBEAT_ATTR), now)
        if alive:
            continue
        with contextlib.suppress(Exception):
            storage.set_trial_user_attr(t._trial_id, "outcome", "interrupted")
            storage.set_trial_user_attr(t._trial_id, "error", "the search process ended while this trial ran")
            storage.set_trial_state_values(t._trial_id, state=TrialState.FAIL)
            swept.append(t.number)
    return swept


@dataclass
class _StudyContext:
    study: Any
    arch: str
    problem: AttentionProblem
    space: SearchSpace
    default: Config
    settings: SearchSettings
    fingerprint: str


def _open_study(storage, name: str, arch: str, problem: AttentionProblem, space: SearchSpace,
                fingerprint: str, settings: SearchSettings, distributions: dict, progress: Progress,
                device_name: Optional[str] = None):
    import optuna

    space_fp = space.fingerprint()
    base, n = name, 1
    previous = None
    while True:
        sampler = make_sampler(settings.sampler, settings.seed, {k: list(d.choices) for k, d in distributions.items()},
                               settings.trials)
        study = optuna.create_study(study_name=name, storage=storage, sampler=sampler,
                                    direction="minimize", load_if_exists=True)
        attrs = study.user_attrs
        stored_device = (attrs.get("device") or {}).get("name")
        same_device = not device_name or not stored_device or stored_device == device_name
        if not attrs or (attrs.get("kernel_fingerprint") == fingerprint
                         and attrs.get("space_fingerprint") == space_fp and same_device
                         and attrs.get("problem") == problem.to_dict() and attrs.get("arch") == arch):
            break
        if attrs.get("problem") != problem.to_dict() or attrs.get("arch") != arch:
            raise ValueError(f"study {name!r} holds another problem ({attrs.get('problem')}); choose another --study")
        why = ("kernel fingerprint" if attrs.get("kernel_fingerprint") != fingerprint
               else "search space" if attrs.get("space_fingerprint") != space_fp else "device")
        progress.message(f"study {name}: its {why} differs from the current one; continuing in a new study")
        previous = name
        n += 1
        name = f"{base}~{n}"
    if previous:
        study.set_user_attr("previous_study", previous)
    return study


def _study_attrs(study, arch, problem, device, fingerprint, settings, space: SearchSpace) -> None:
    study.set_user_attr("arch", arch)
    study.set_user_attr("problem", problem.to_dict())
    study.set_user_attr("device", device)
    study.set_user_attr("versions", versions())
    study.set_user_attr("kernel_fingerprint", fingerprint)
    study.set_user_attr("timing", settings.timing.describe())
    study.set_user_attr("space", space.to_dict())
    study.set_user_attr("space_fingerprint", space.fingerprint())
    if "default_us" not in study.user_attrs:
        study.set_user_attr("default_us", None)


def _widen(space: SearchSpace, config: Config) -> dict:
    """Categorical distributions of the space, widened by the default configuration's values (the
    default is always enqueued, so it must be a legal point)."""
    import optuna

    from fa4.kernels.knobs import _in_choices

    out = {}
    for name, choices in space.choices:
        value = getattr(config, name)
        values = list(choices) if _in_choices(value, choices) else list(choices) + [value]
        out[name] = optuna.distributions.CategoricalDistribution(values)
    return out


def _finish_trial(study, trial, result: dict, is_default: bool) -> None:
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
    trial.set_constraint("works", 0.0 if result["outcome"] == "ok" else 1.0)
    if result["outcome"] == "ok":
        study.tell(trial, float(result["us"]))
    else:
        study.tell(trial, state=TrialState.PRUNED)


def _counts(study) -> tuple[Counter, int]:
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


def run_search(arch: str, problems: list[AttentionProblem], settings: SearchSettings,
               progress: Optional[Progress] = None, pool: Optional[WorkerPool] = None) -> list[dict]:
    """Run (or resume) one study per problem; returns one summary dict per study."""
    progress = progress or Progress()
    space = load_space(arch, settings.space_path)
    storage = open_storage(settings.storage)
    own_pool = pool is None
    if own_pool:
        pool = WorkerPool(settings.process_count(), settings.gpus, evaluator=settings.evaluator,
                          mode="gpu", arch=arch, compile_timeout_s=settings.compile_timeout_s,
                          trial_timeout_s=settings.trial_timeout_s)
        t0 = time.monotonic()
        pool.start()
        progress.message(f"{pool.size} worker processes on GPU(s) {settings.gpus} ready in "
                         f"{time.monotonic() - t0:.1f} s: {pool.device.get('name', '?')}")
    summaries = []
    try:
        for problem in problems:
            name = settings.study_name
            if name and len(problems) > 1:  # one --study name for several problems: suffix the mask
                name = f"{name}-{'causal' if problem.causal else 'full'}"
            summaries.append(_run_one(arch, problem, space, storage, pool, settings, progress, name))
    finally:
        if own_pool:
            pool.close()
    return summaries


def _run_one(arch, problem, space, storage, pool: WorkerPool, settings: SearchSettings,
             progress: Progress, study_name: Optional[str]) -> dict:
    import optuna
    from optuna.trial import TrialState

    kernels = kernel_api(settings.kernel_api)
    compile_key, default_config, feasible = kernels.compile_key, kernels.default_config, kernels.feasible
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    fingerprint = kernel_fingerprint(arch, settings.kernel_api)
    default = default_config(arch, problem)
    distributions = _widen(space, default)
    name = study_name or shape_key(arch, problem)
    study = _open_study(storage, name, arch, problem, space, fingerprint, settings, distributions, progress,
                        pool.device.get("name"))
    name = study.study_name
    owner = _owner()
    swept = sweep_interrupted(study, me=owner)
    register_run(study, owner)
    if swept:
        progress.message(f"study {name}: marked {len(swept)} interrupted trial(s) failed: {swept}")
    _study_attrs(study, arch, problem, pool.device, fingerprint, settings, space)
    if not any(t.user_attrs.get("is_default") for t in study.get_trials(deepcopy=False)
               if t.state != TrialState.FAIL):
        study.enqueue_trial(default.to_dict(), user_attrs={"is_default": True}, skip_if_exists=False)

    started = time.monotonic()
    timing = settings.timing.to_dict()
    peers_task = None
    if settings.peers:
        peers_task = pool.submit("peers", {"problem": problem.to_dict(), "timing": timing,
                                           "names": list(settings.peers)})
    seen: dict[tuple, int] = {}
    finished: dict[int, tuple[dict, bool]] = {}
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)):
        seen.setdefault(_params_key(t.params), t.number)
        finished[t.number] = ({k: v for k, v in t.user_attrs.items()}, bool(t.user_attrs.get("is_default")))
    failed_keys: dict[Any, str] = {}
    in_flight: dict[int, tuple] = {}          # task id -> (trial, is_default, config)
    waiting_repeats: dict[int, list] = {}     # trial number -> repeats waiting for its result
    counts, distinct = _counts(study)
    space_size = math.prod(len(d.choices) for d in distributions.values())
    # infeasible configurations are recorded but do not count: --trials N means N that ran
    ask_cap = distinct + 20 * settings.trials + 100
    repeats_in_a_row = 0
    last_beat = 0.0
    best = best_ok_trial(study)
    best_us = best.value if best else None
    default_us = study.user_attrs.get("default_us")

    def evaluated() -> int:
        return distinct - counts.get("infeasible", 0)

    progress.start(name, settings.trials, evaluated())

    def finish(trial, result, is_default):
        nonlocal best_us, default_us
        _finish_trial(study, trial, result, is_default)
        finished[trial.number] = (result, is_default)
        if "repeat_of" not in result:
            counts[result["outcome"]] += 1
        if result["outcome"] == "ok" and (best_us is None or result["us"] < best_us):
            best_us = result["us"]
        if is_default and result["outcome"] == "ok" and "repeat_of" not in result:
            default_us = result["us"]
            study.set_user_attr("default_us", default_us)
        for waiting in waiting_repeats.pop(trial.number, []):
            finish(waiting, {**_copyable(result), "repeat_of": trial.number}, False)

    def time_left() -> bool:
        return settings.timeout_s is None or time.monotonic() - started < settings.timeout_s

    def want_more() -> bool:
        return (evaluated() < settings.trials and distinct < space_size and distinct < ask_cap
                and time_left() and repeats_in_a_row < MAX_CONSECUTIVE_REPEATS)

    try:
        while True:
            asking = want_more()
            while asking and pool.idle_capacity() > 0 and len(in_flight) < 2 * pool.size:
                trial = study.ask(distributions)
                # who runs it, so that a later run can tell a live trial from one of a dead process
                study._storage.set_trial_system_attr(trial._trial_id, OWNER_ATTR, owner)
                study._storage.set_trial_system_attr(trial._trial_id, HEARTBEAT_ATTR, time.time())
                is_default = bool(trial.user_attrs.get("is_default"))
                pk = _params_key(trial.params)
                if pk in seen and not is_default:
                    repeats_in_a_row += 1
                    original = seen[pk]
                    if original in finished:
                        finish(trial, {**_copyable(finished[original][0]), "repeat_of": original}, False)
                    else:
                        waiting_repeats.setdefault(original, []).append(trial)
                    asking = want_more()
                    continue
                repeats_in_a_row = 0
                seen[pk] = trial.number
                distinct += 1
                config = Config.from_dict(arch, trial.params)
                try:
                    reasons = list(feasible(config, problem))
                    key = compile_key(config, problem)
                except Exception as exc:  # the kernel's own model failed on this config: a result
                    finish(trial, {"outcome": "compile_error", "error": short_error(exc)}, is_default)
                    asking = want_more()
                    continue
                if reasons:
                    finish(trial, {"outcome": "infeasible", "reasons": reasons,
                                   "error": "; ".join(reasons)[:400]}, is_default)
                elif key in failed_keys:
                    finish(trial, {"outcome": "compile_error", "error": failed_keys[key],
                                   "compile_cached": True}, is_default)
                else:
                    payload = {"arch": arch, "config": config.to_dict(), "problem": problem.to_dict(),
                               "timing": timing, "validate": settings.validate}
                    task_id = pool.submit("trial", payload, compile_key=key)
                    in_flight[task_id] = (trial, is_default, key)
                asking = want_more()
                progress.update(evaluated(), settings.trials, counts, best_us, default_us)
            if not in_flight and peers_task is None and not want_more():
                break
            for task_id, result in pool.poll(timeout=1.0):
                if task_id == peers_task:
                    peers_task = None
                    peers = result.get("peers") or {n: {"error": result.get("error", "peers task failed")}
                                                    for n in settings.peers}
                    study.set_user_attr("peers", peers)
                    study.set_user_attr("peers_date", _utc_now())
                    continue
                trial, is_default, key = in_flight.pop(task_id)
                if result.get("outcome") == "compile_error" and not result.get("compile_cached"):
                    failed_keys[key] = result.get("error", "compile error")
                finish(trial, result, is_default)
                progress.update(evaluated(), settings.trials, counts, best_us, default_us)
            if time.monotonic() - last_beat > HEARTBEAT_INTERVAL_S:
                last_beat = time.monotonic()
                register_run(study, owner)
                alive = [t for t, _, _ in in_flight.values()] + [t for ts in waiting_repeats.values() for t in ts]
                for trial in alive:
                    study._storage.set_trial_system_attr(trial._trial_id, HEARTBEAT_ATTR, time.time())
    except BaseException:
        for trial in [t for t, _, _ in in_flight.values()] + [t for ts in waiting_repeats.values() for t in ts]:
            with contextlib.suppress(Exception):
                trial.set_user_attr("outcome", "interrupted")
                study.tell(trial, state=TrialState.FAIL)
        raise
    progress.update(evaluated(), settings.trials, counts, best_us, default_us, final=True)
    wall_s = time.monotonic() - started
    summary = summarize(study)
    summary["wall_s"] = round(wall_s, 2)
    summary["pool_events"] = dict(pool.events)
    summary["processes"] = pool.size
    progress.message(f"[{name}] {summary['evaluated']} evaluated in {wall_s:.1f} s wall: compile "
                     f"{summary['compile_s_total']:.1f} s summed over {pool.size} processes, GPU phase "
                     f"{summary['gpu_s_total']:.1f} s (these totals cover every run of the study)")
    if settings.record_db:
        summary["db"] = _record_best(study, summary, settings)
    return summary


def _copyable(result: dict) -> dict:
    return {k: v for k, v in result.items() if k not in ("repeat_of", "is_default", "compile_s", "gpu_s")}


def _utc_now() -> str:
    from fa4.database import utc_now

    return utc_now()


def summarize(study) -> dict:
    """A plain summary of one study (what `fa4tune search` prints)."""
    from optuna.trial import TrialState

    attrs = study.user_attrs
    counts, distinct = _counts(study)
    trials = study.get_trials(deepcopy=False)
    interrupted = sum(1 for t in trials if t.state == TrialState.FAIL)
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
        "repeats": repeats, "interrupted": interrupted,
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


def _record_best(study, summary: dict, settings: SearchSettings) -> Optional[dict]:
    from fa4.database import Entry, default_path, record

    best = best_ok_trial(study)
    attrs = study.user_attrs
    device = (attrs.get("device") or {}).get("name")
    if best is None or not device:
        return None
    problem = AttentionProblem(**attrs["problem"])
    peers_us = {n: d.get("us") for n, d in (attrs.get("peers") or {}).items() if isinstance(d, dict)}
    entry = Entry.from_result(
        arch=attrs["arch"], device=device, problem=problem, config=dict(best.params), us=best.value,
        tflops=best.user_attrs.get("tflops") or 0.0, default_us=attrs.get("default_us"),
        peers_us=peers_us, max_err=best.user_attrs.get("max_err"),
        kernel_fingerprint=attrs.get("kernel_fingerprint", ""), versions=attrs.get("versions") or {},
        study=study.study_name, trial=best.number)
    path = settings.db_path or default_path()
    changed = record(entry, path)
    return {"path": str(path), "key": entry.key, "written": changed}


# ------------------------------------------------------------------------------------------------
# compile-only: the part of a search that needs no GPU

def compile_space(arch: str, problem: AttentionProblem, space: SearchSpace, limit: int, seed: int = 0,
                  processes: int = 2, evaluator: str = DEFAULT_EVALUATOR, compile_timeout_s: float = 300.0,
                  progress: Optional[Progress] = None, api: str = "fa4.kernels",
                  shard: tuple[int, int] = (0, 1)) -> dict:
    """Feasibility of every configuration of the space, and a compile report of up to `limit` feasible
    ones (the default first, then a seeded sample), on CPU worker processes. `shard` (index, count)
    compiles only the feasible configurations whose position in the space's order is index mod count
    (the default belongs to shard 0), so a whole space can be split over several runs."""
    shard_index, shard_count = shard
    if not 0 <= shard_index < shard_count:
        raise ValueError(f"shard {shard_index}/{shard_count}: the index must be in [0, count)")
    import random

    kernels = kernel_api(api)
    compile_key, default_config, feasible = kernels.compile_key, kernels.default_config, kernels.feasible
    progress = progress or Progress()
    default = default_config(arch, problem)
    reasons_count: Counter = Counter()
    feasible_configs: list[Config] = []
    total = 0
    for config in space.configs():
        total += 1
        reasons = feasible(config, problem)
        if reasons:
            for r in reasons:
                reasons_count[_reason_class(r)] += 1
        else:
            feasible_configs.append(config)
    rng = random.Random(seed)
    picked: list[Config] = []
    keys = set()
    mine = [c for c in feasible_configs[shard_index::shard_count] if c != default]  # shard 0 has it
    candidates = ([default] if shard_index == 0 else []) + rng.sample(mine, len(mine))
    for config in candidates:
        if len(picked) >= limit:
            break
        if feasible(config, problem):
            continue
        key = compile_key(config, problem)
        if key in keys:
            continue
        keys.add(key)
        picked.append(config)
    compiled = []
    if picked:
        with WorkerPool(max(1, min(processes, len(picked))), [None], evaluator=evaluator, mode="cpu",
                        arch=arch, compile_timeout_s=compile_timeout_s) as pool:
            ids = {pool.submit("report", {"arch": arch, "config": c.to_dict(), "problem": problem.to_dict()}): c
                   for c in picked}
            done = 0
            while ids:
                for task_id, result in pool.poll(timeout=1.0):
                    config = ids.pop(task_id)
                    done += 1
                    compiled.append({"config": config.to_dict(), "is_default": config == default, **result})
                    progress.message(f"compiled {done}/{len(picked)}: {result['outcome']} "
                                     f"{result.get('compile_s', '?')} s {config.label()}")
    return {"arch": arch, "problem": problem.to_dict(), "space_size": total,
            "feasible": len(feasible_configs), "infeasible": total - len(feasible_configs),
            "infeasible_reasons": dict(reasons_count.most_common()),
            "default": default.to_dict(), "default_feasible": not feasible(default, problem),
            "shard": [shard_index, shard_count], "compiled": compiled}


def _reason_class(reason: str) -> str:
    """Group reasons that differ only in numbers ("needs 240000 B" ~ "needs 250000 B")."""
    return re.sub(r"\d[\d,_.]*", "N", reason)
