"""`fa4tune search`: one optuna study per (architecture, problem), each run by a `TrialLoop` over a
`WorkerPool`, its best configuration recorded in the best-config database.

GPUs: a single problem runs one study over every GPU (one pool spread over them). A shape set on several
GPUs runs one study per GPU at a time: one pool per GPU (the processes split evenly), started once for
the set, each fed problems from a shared queue, largest first, by its own thread (`run_studies_per_gpu`). A
study has serial parts (the default first, the sampler's start-up, the re-time of its finalists, the
record), so splitting one study over two GPUs gained little (1.24x for the H200 grid, 14 problems x 40
trials, 251.9 s on one GPU, 203.3 s on two); studies side by side keep both GPUs busy.
A new study warm-starts from the entries recorded when it begins (`fa4tune.searches.warm_start`), so
side by side it may miss a neighbour of the set that a sequential run would have recorded before it.

Threads share the storage (optuna's `JournalStorage` serialises its methods with a lock, `RDBStorage`
opens a session per thread; `fa4tune.searches.journal.JournalFlock` adds a thread lock before its
`flock`), the database writes (`fa4.files.exclusive_file_lock` opens the database file on every call, and `flock`
locks belong to the open file, so two threads exclude each other as two processes do) and the `Progress`
(a lock, and each thread's study kept apart).

Where each step lives (in `fa4tune.searches` unless named in full):
    fa4tune.api                 the entry points (`fa4tune search`, `fa4tune.search(...)`): GPUs, settings
    fa4tune.inputs.shapes       the study name of a problem (shape key)
    fa4tune.inputs.shape_sets   the problems of a shapes file or a model preset
    storage                     the optuna storage (open to write, open to read)
    journal                     the journal file's lock and torn-line repair
    sampler                     the samplers, wrapped to propose each configuration once
    warm_start                  the seeds of a new study from tuned neighbours
    study                       a study's lifecycle and what is stored in it (the storage schema)
    liveness                    owners and heartbeats: which running trials a killed search left behind
    trial_loop                  ask, screen, submit, tell
    fa4tune.workers             the worker processes (`pool`, `worker`) and what they run (`evaluator`)
    fa4tune.progress            progress on stderr
    record                      the database write
    compile_space               the part that needs no GPU (`fa4tune compile-space`, `search --compile-only`)

`--trials N` means N distinct configurations that passed the feasibility model and went to a worker
(whatever their outcome); infeasible ones are recorded too but do not count, nor do repeats and
interrupted trials. A re-run with the same N resumes and stops there. A space smaller than that ends
the study when every configuration was seen.

On the H200 test machine (files come back only through $OUT), after
the bundle's setup, the mission search and its benchmark, writing straight into $OUT so that a run
cut short still returns its storage (copy the committed files there first to resume and to merge):

    gunzip -c results/studies.journal.gz > $OUT/studies.journal; cp fa4/data/best_configs.json $OUT/
    python3 -m fa4tune.cli search --seqlen 1024 --gqa 4 --timeout 200 --storage $OUT/studies.journal \
        --db $OUT/best_configs.json --format json > $OUT/search.json 2> $OUT/search.log
    python3 -m fa4tune.cli bench --db $OUT/best_configs.json --out $OUT/bench.json --csv $OUT/bench.csv
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from fa4.backends import peer_names
from fa4.kernels import AttentionProblem, DeviceDescription, arch_of, reference_device
from fa4tune.searches import liveness
from fa4tune.environment import kernel_api, kernel_fingerprint
from fa4tune.progress import Progress
from fa4tune.searches.record import record_best
from fa4tune.searches.retime import ROUNDS as RETIME_ROUNDS, TOP as RETIME_TOP, retime
from fa4tune.inputs.shapes import shape_key
from fa4tune.inputs.space import SearchSpace, load_space
from fa4tune.searches.storage import open_storage
from fa4tune.searches.study import (SAMPLERS, make_sampler, open_study, search_distributions, summarize,
                                    write_study_attrs)
from fa4tune.workers.timing import TimingSettings
from fa4tune.searches.trial_loop import TrialLoop
from fa4tune.searches.warm_start import warm_start_configs
from fa4tune.workers.pool import DEFAULT_EVALUATOR, WorkerPool


# `fa4tune search --effort`: configurations per study, declared with the runtime's autotune on first use
from fa4.autotuning import EFFORTS  # noqa: E402,F401


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
    peers: tuple = field(default_factory=peer_names)  # the peers to time (default: every one)
    storage: Optional[str] = None              # None: the results directory's studies.journal
    study_name: Optional[str] = None
    db_path: Optional[str] = None              # None: $FA4_CONFIG_DB, else the results directory's
    record_db: bool = True
    space_path: Optional[str] = None
    warm_start: bool = True                    # seed new studies from tuned neighbours (searches.warm_start)
    evaluator: str = DEFAULT_EVALUATOR
    kernel_api: str = "fa4.kernels"            # tests inject a CPU model of the kernel API here
    retime_rounds: int = RETIME_ROUNDS         # re-times of each finalist after the loop (0: none)
    retime_top: int = RETIME_TOP               # finalists: the fastest distinct configurations, and the default

    def __post_init__(self) -> None:
        if self.sampler not in SAMPLERS:
            raise ValueError(f"sampler must be one of {SAMPLERS}, got {self.sampler!r}")
        if self.trials < 1:
            raise ValueError("trials must be >= 1")

    def process_count(self) -> int:
        if self.processes:
            return self.processes
        # at most 12 compiling processes per GPU: a second GPU brings its own share (the two-GPU H200
        # measurements used 12 and 24), within the cores less two for the harness
        cores = os.cpu_count() or 2
        return max(len(self.gpus), min(cores - 2, 12 * len(self.gpus)))


def run_search(arch: str, problems: list[AttentionProblem], settings: SearchSettings,
               progress: Optional[Progress] = None, pool: Optional[WorkerPool] = None) -> list[dict]:
    """Run (or resume) one study per problem; returns one summary dict per study, in the problems' order.
    Several problems on several GPUs (and no pool given) run one study per GPU at a time."""
    progress = progress or Progress()
    space = load_space(arch, settings.space_path)
    storage = open_storage(settings.storage, say=progress.message)
    names = [study_name_of(arch, problem, problems, settings.study_name) for problem in problems]
    # the same study twice in a set would be run by two threads at once: keep such a set sequential
    if pool is None and len(settings.gpus) > 1 and len(problems) > 1 and len(set(names)) == len(names):
        return run_studies_per_gpu(arch, problems, names, space, storage, settings, progress)
    own_pool = pool is None
    if own_pool:
        pool = start_pool(new_pool(arch, settings, settings.gpus, settings.process_count()), progress)
    summaries = []
    progress.start_set(names)
    try:
        for problem, name in zip(problems, names):
            summary = run_study(arch, problem, space, storage, pool, settings, progress, name)
            progress.study_finished(summary["wall_s"], summary["evaluated_this_run"])
            summaries.append(summary)
    finally:
        if own_pool:
            pool.close()
    return summaries


def new_pool(arch: str, settings: SearchSettings, gpus: list, processes: int) -> WorkerPool:
    return WorkerPool(processes, gpus, evaluator=settings.evaluator, mode="gpu", arch=arch,
                      compile_timeout_s=settings.compile_timeout_s, trial_timeout_s=settings.trial_timeout_s)


def start_pool(pool: WorkerPool, progress: Progress) -> WorkerPool:
    """Start a pool and say when it is ready."""
    t0 = time.monotonic()
    pool.start()
    progress.message(f"{pool.size} worker processes on GPU(s) {pool.gpus} ready in "
                     f"{time.monotonic() - t0:.1f} s: {pool.device.get('name', '?')}")
    return pool


def run_studies_per_gpu(arch: str, problems: list[AttentionProblem], names: list[str], space: SearchSpace,
                        storage, settings: SearchSettings, progress: Progress) -> list[dict]:
    """One study per GPU at a time: a pool per GPU, each run by a thread that takes the next problem
    from the queue (the largest first) until it is empty. The first error stops the other threads
    taking new problems; it is raised once they finished their current study, and every pool is
    closed."""
    gpus = settings.gpus[:len(problems)]            # a GPU without a problem gets no pool
    processes = max(1, settings.process_count() // len(settings.gpus))
    pools = [new_pool(arch, settings, [gpu], processes) for gpu in gpus]
    # longest first (by FLOPs, what a trial's GPU phase scales with; stable for equal ones), so the
    # last study to start is a short one and no GPU idles long at the end of the set
    waiting = deque(sorted(range(len(problems)), key=lambda i: -problems[i].flops()))
    taken = threading.Lock()
    stop = threading.Event()
    summaries: list[Optional[dict]] = [None] * len(problems)
    errors: list[BaseException] = []

    def next_problem() -> Optional[int]:
        with taken:
            return None if stop.is_set() or not waiting else waiting.popleft()

    def run_lane(pool: WorkerPool) -> None:
        try:
            start_pool(pool, progress)
            while (index := next_problem()) is not None:
                summary = run_study(arch, problems[index], space, storage, pool, settings, progress, names[index])
                progress.study_finished(summary["wall_s"], summary["evaluated_this_run"])
                summaries[index] = summary
        except BaseException as exc:   # raised in the caller, after the other lanes stopped
            errors.append(exc)
            stop.set()

    progress.start_set(names, lanes=len(pools))
    threads = [threading.Thread(target=run_lane, args=(pool,), name=f"fa4tune-studies-gpu{gpu}", daemon=True)
               for gpu, pool in zip(gpus, pools)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        stop.set()
        for pool in pools:
            pool.close()
    if errors:
        raise errors[0]
    return summaries


def worker_device(arch: str, facts: dict) -> DeviceDescription:
    """`arch`: the knob set searched (a backward one runs on its kernel's architecture). The GPU the pool's workers run on, described from what their setup reported
    (`fa4tune.workers.evaluator.device_info`): the search judges feasibility and seeds its default for it, as
    the runtime would on that GPU. The family's reference device where the workers reported no
    description of a GPU of this family (CPU workers, stand-in evaluators)."""
    try:
        described = DeviceDescription(
            name=facts["name"], capability=tuple(int(x) for x in str(facts["cc"]).split(".")),
            sm_count=int(facts["sm_count"]), smem_per_block_bytes=int(facts["smem_per_block_bytes"]),
            l2_bytes=int(facts["l2_bytes"]))
    except (KeyError, TypeError, ValueError):
        return reference_device(arch_of(arch))
    return described if described.arch == arch_of(arch) else reference_device(arch_of(arch))


def study_name_of(arch: str, problem: AttentionProblem, problems: list[AttentionProblem],
                  given: Optional[str]) -> str:
    """The study of a problem: its shape key, or a given --study name (suffixed with the mask when two
    problems differ only by it, and with the shape key when a set holds more)."""
    if not given or len(problems) == 1:
        return given or shape_key(arch, problem)
    if len(problems) == 2 and {p.causal for p in problems} == {False, True}:
        return f"{given}-{'causal' if problem.causal else 'full'}"
    return f"{given}-{shape_key(arch, problem)}"


def seed_from_neighbours(study, arch: str, problem: AttentionProblem, device: Optional[str], fingerprint: str,
                         choices: dict, default, db_path: Optional[str], progress: Progress, name: str) -> None:
    """Enqueue the warm-start configurations of a new study (`fa4tune.searches.warm_start`)."""
    from fa4.database import BestConfigDB, DatabaseError
    from fa4tune.searches.record import database_for_writing

    try:
        db = BestConfigDB.load(database_for_writing(db_path))
    except DatabaseError as exc:
        progress.message(f"[{name}] no warm start: {exc}")
        return
    seeds = warm_start_configs(db, arch, device, problem, fingerprint, choices, default.to_dict())
    for config, key in seeds:
        study.enqueue_trial(config, user_attrs={"warm_start": key}, skip_if_exists=False)
    if seeds:
        progress.message(f"[{name}] warm start: {len(seeds)} configuration(s) of tuned neighbours: "
                         + ", ".join(key for _, key in seeds))


def run_study(arch: str, problem: AttentionProblem, space: SearchSpace, storage, pool: WorkerPool,
              settings: SearchSettings, progress: Progress, study_name: Optional[str] = None) -> dict:
    """Open (or resume) the study of one problem, seed it with the default, run its trial loop, record
    its best configuration; returns its summary."""
    import optuna
    from optuna.trial import TrialState

    kernels = kernel_api(settings.kernel_api)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    fingerprint = kernel_fingerprint(arch, settings.kernel_api)
    device = worker_device(arch, pool.device)
    default = kernels.default_config(arch, problem, device)
    distributions = search_distributions(space, default)
    choices = {k: list(d.choices) for k, d in distributions.items()}
    study = open_study(storage, study_name or shape_key(arch, problem), arch, problem, space, fingerprint,
                       lambda: make_sampler(settings.sampler, settings.seed, choices, settings.trials),
                       progress, pool.device.get("name"))
    name = study.study_name
    owner = liveness.this_process()
    swept = liveness.sweep_interrupted(storage, study, me=owner)
    liveness.register_run(storage, study, owner)
    if swept:
        progress.message(f"study {name}: marked {len(swept)} interrupted trial(s) failed: {swept}")
    write_study_attrs(study, arch, problem, pool.device, fingerprint, settings.timing, space)
    # seed with the heuristic default, so a search is never worse than it
    if not any(t.user_attrs.get("is_default") for t in study.get_trials(deepcopy=False)
               if t.state != TrialState.FAIL):
        study.enqueue_trial(default.to_dict(), user_attrs={"is_default": True}, skip_if_exists=False)
    if settings.warm_start and len(study.get_trials(deepcopy=False)) <= 1:   # new: only the default so far
        seed_from_neighbours(study, arch, problem, pool.device.get("name"), fingerprint, choices, default,
                             settings.db_path, progress, name)

    loop = TrialLoop(study=study, storage=storage, arch=arch, problem=problem, distributions=distributions,
                     kernels=kernels, pool=pool, settings=settings, progress=progress, owner=owner, name=name,
                     device=device)
    evaluated_before = loop.evaluated()
    wall_s = loop.run()
    summary = summarize(study)
    summary["evaluated_this_run"] = loop.evaluated() - evaluated_before
    summary["wall_s"] = round(wall_s, 2)
    summary["pool_events"] = dict(pool.events)
    summary["processes"] = pool.size
    progress.message(f"[{name}] {summary['evaluated']} evaluated in {wall_s:.1f} s wall: compile "
                     f"{summary['compile_s_total']:.1f} s summed over {pool.size} processes, GPU phase "
                     f"{summary['gpu_s_total']:.1f} s (these totals cover every run of the study)")
    retimed = None
    if settings.retime_rounds > 0:
        retimed = retime(study, pool, kernels, arch, problem, loop.timing, top=settings.retime_top,
                         rounds=settings.retime_rounds, progress=progress, name=name)
        summary["retime"] = retimed
    if settings.record_db:
        summary["db"] = record_best(study, settings.db_path, retimed)
    return summary
