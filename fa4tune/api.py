"""The Python API: `fa4tune.search(...)` and `fa4tune.bench(...)`, each returning a pandas DataFrame.

    import fa4tune
    studies = fa4tune.search(model="llama-3-8b", trials=60, timeout=30)     # one row per study
    rows = fa4tune.bench("b1-s4096-bf16 b16-s1024", causal=True)             # one row per (shape, variant)

These are the commands themselves: `fa4tune search` and `fa4tune bench` parse their options and call
`run_search_set` and `run_bench_set` here, which do everything after option parsing (GPU detection,
architecture, settings, the run); the API adds turning the summaries into frames. Defaults are the
commands' defaults. Progress goes to stderr as in the CLI (`quiet=True` silences it).

Which problems: `shapes` (an `AttentionProblem`, a shape key such as "b1-s4096-bf16-causal" whose
missing tokens take the CLI's defaults, or a list of them), `model` (a preset, `fa4tune.inputs.shape_sets`) or
`shapes_file`; exactly one. `causal=None` keeps every mask (a shape key without a mask stands for
both), True or False keeps one.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Optional, Union

if TYPE_CHECKING:   # pandas and torch load on first use, not on `import fa4tune`
    import pandas

    from fa4.kernels import AttentionProblem

# the problem the command line tunes when no shape option is given (`fa4tune search` prints it)
DEFAULT_PROBLEM = {"batch": 1, "seqlen_q": 1024, "seqlen_k": 1024, "heads_q": 32, "heads_kv": 8,
                   "head_dim": 128, "dtype": "fp16", "causal": False, "return_lse": False}

NO_GPU_SEARCH = ("no CUDA GPU found. A search validates and times kernels on a GPU.\n"
                 "  --compile-only (or fa4tune compile-space) checks the search space and compiles it on "
                 "CPU (no GPU needed).")
NO_GPU_BENCH = "no CUDA GPU found; a benchmark needs one."


class NoGpuError(RuntimeError):
    """The run needs a CUDA GPU and none is visible."""


def detect_gpus() -> list[dict]:
    """Visible CUDA GPUs: [{"index", "name", "cc": (major, minor)}] (empty without CUDA)."""
    try:
        import torch
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    return [{"index": i, "name": torch.cuda.get_device_name(i), "cc": torch.cuda.get_device_capability(i)}
            for i in range(torch.cuda.device_count())]


def resolve_arch(arch: str, gpus: list[dict], need_gpu: bool) -> str:
    """"auto" -> the first GPU's kernel family (sm90 without a GPU when none is needed)."""
    if arch != "auto":
        return arch
    if gpus:
        from fa4.arch import arch_of_capability, describe_capabilities

        found = arch_of_capability(gpus[0]["cc"])
        if found is None:
            raise ValueError(f"GPU {gpus[0]['name']} (compute capability {gpus[0]['cc'][0]}."
                             f"{gpus[0]['cc'][1]}) runs no fa4 kernel: {describe_capabilities()}")
        return found
    if need_gpu:
        raise NoGpuError("no CUDA GPU found")
    return "sm90"


def describe_problems(problems: list) -> str:
    """One line naming the problems of a run (what `fa4tune search` prints first)."""
    p0 = problems[0]
    if len({(p.batch, p.seqlen_q, p.seqlen_k, p.heads_q, p.heads_kv, p.head_dim, p.dtype, p.return_lse)
            for p in problems}) > 1 or p0.varlen:   # a shape set or varlen batches: name each problem
        return f"{len(problems)} problems: " + "; ".join(p.label() for p in problems)
    # each mask as its label says it ("causal window (4095, 0) softcap 50"), "full" spelled "non-causal"
    masks = " and ".join(p.mask_label().replace("full", "non-causal", 1) for p in problems)
    return (f"batch {p0.batch}, {p0.heads_q} query heads, {p0.heads_kv} KV heads (gqa {p0.gqa_ratio}), "
            f"head dim {p0.head_dim}, seqlen_q {p0.seqlen_q}, seqlen_k {p0.seqlen_k}, {p0.dtype}, {masks}"
            + (", with LSE" if p0.return_lse else ""))


ShapeLike = Union["AttentionProblem", str]


def problems_of(shapes: Union[ShapeLike, Iterable[ShapeLike], None] = None, *, model: Optional[str] = None,
                shapes_file: Optional[str] = None, causal: Optional[bool] = None) -> list:
    """The problems named by exactly one of shapes, model, shapes_file (see the module docstring)."""
    from fa4.kernels import AttentionProblem
    from fa4tune.inputs.shape_sets import load_model, load_shapes_file
    from fa4tune.inputs.shapes import parse_shape_masks

    given = [x is not None for x in (shapes, model, shapes_file)]
    if sum(given) != 1:
        raise ValueError("name the problems with exactly one of shapes, model, shapes_file")
    if model is not None:
        problems = load_model(model)
    elif shapes_file is not None:
        problems = load_shapes_file(shapes_file)
    else:
        items = [shapes] if isinstance(shapes, (str, AttentionProblem)) else list(shapes)
        problems = []
        for item in items:
            if isinstance(item, AttentionProblem):
                problems.append(item)
                continue
            for text in str(item).replace(",", " ").split():
                problems += parse_shape_masks(text, DEFAULT_PROBLEM)
    if causal is not None:
        problems = [p for p in problems if p.causal == causal]
    if not problems:
        raise ValueError("no problem left to run" + (f" with causal={causal}" if causal is not None else ""))
    return list(dict.fromkeys(problems))


# ------------------------------------------------------------------------------------------------
# search

def run_search_set(problems: list, *, gpus: list[dict], arch: str = "auto", trials: int = 100,
                   sampler: str = "tpe", seed: int = 0, timeout: Optional[float] = None,
                   trial_timeout: float = 20.0, compile_timeout: float = 300.0, storage: Optional[str] = None,
                   study: Optional[str] = None, workers: int = 1, jobs: Optional[int] = None,
                   db: Optional[str] = None, record_db: bool = True, space: Optional[str] = None,
                   l2: str = "warm", peers: bool = True, warm_start: bool = True,
                   retime_rounds: Optional[int] = None, backward: bool = False, progress=None) -> list[dict]:
    """`fa4tune search` after option parsing: one study per problem on `gpus` (from `detect_gpus`);
    returns one summary dict per study (`fa4tune.searches.study.summarize`). `retime_rounds` None: the
    search's default (`fa4tune.searches.retime.ROUNDS`). `backward`: search the architecture's backward
    knob set (`fa4.kernels.backward_knob_set`): the same search, another knob set, its own studies and
    database keys."""
    from fa4tune import paths
    from fa4tune.searches import runner as search_runner
    from fa4.backends import peer_names
    from fa4tune.progress import Progress
    from fa4tune.searches.retime import ROUNDS as RETIME_ROUNDS
    from fa4tune.inputs.space import load_space
    from fa4tune.workers.timing import TimingSettings

    progress = progress or Progress()
    if not gpus:
        raise NoGpuError(NO_GPU_SEARCH)
    arch = resolve_arch(arch, gpus, need_gpu=True)
    if backward:
        from fa4.kernels import backward_knob_set

        if any(p.varlen for p in problems):
            raise ValueError("our varlen kernel has no backward: a backward search takes dense problems only")
        arch = backward_knob_set(arch)   # ValueError where the architecture has no backward of ours
    progress.message(f"fa4tune search: arch {arch} (detected: {gpus[0]['name']}); {describe_problems(problems)}")
    load_space(arch, space)   # a bad space file fails here, before any worker starts
    if workers > len(gpus):
        raise ValueError(f"--workers {workers} but only {len(gpus)} GPU(s) are visible")
    settings = search_runner.SearchSettings(
        trials=trials, sampler=sampler, seed=seed, timeout_s=timeout, trial_timeout_s=trial_timeout,
        compile_timeout_s=compile_timeout, gpus=[g["index"] for g in gpus[:workers]], processes=jobs,
        timing=TimingSettings(l2=l2), peers=peer_names() if peers else (), storage=storage, study_name=study,
        db_path=db, record_db=record_db, space_path=space, warm_start=warm_start,
        retime_rounds=RETIME_ROUNDS if retime_rounds is None else retime_rounds)
    progress.message(f"{trials} configurations per study, sampler {sampler}, seed {seed}, "
                     f"{settings.process_count()} worker processes on {workers} GPU(s), L2 {l2}; storage "
                     f"{storage or paths.storage_path()}")
    return search_runner.run_search(arch, problems, settings, progress)


def search_frame(summaries: list[dict]) -> "pandas.DataFrame":
    """One row per study: its problem, counts per outcome, best and default times, peers, speedups, the
    best configuration (label and knob values). `frame.attrs["summaries"]` keeps the summaries."""
    import pandas as pd

    from fa4.config_text import display_label

    rows = []
    for s in summaries:
        best = s.get("best") or {}
        row: dict[str, Any] = {"study": s["study"], "arch": s["arch"], "device": s.get("device")}
        row.update(s.get("problem") or {})
        row.update({"configurations": s["configurations"], "evaluated": s["evaluated"],
                    "repeats": s["repeats"], "interrupted": s["interrupted"]})
        row.update({f"n_{outcome}": n for outcome, n in s["outcomes"].items()})
        row.update({"best_us": best.get("us"), "best_tflops": best.get("tflops"), "best_trial": best.get("trial"),
                    "best_is_default": best.get("is_default"), "default_us": s.get("default_us"),
                    "best_label": display_label(s["arch"], best["config"]) if best else None,
                    "best_config": best.get("config")})
        for peer, data in (s.get("peers") or {}).items():
            row[f"{peer}_us"] = data.get("us") if isinstance(data, dict) else None
        row.update({f"speedup_over_{k}": v for k, v in (s.get("speedup") or {}).items()})
        row["wall_s"] = s.get("wall_s")
        rows.append(row)
    frame = pd.DataFrame(rows)
    frame.attrs["summaries"] = summaries
    return frame


def search(shapes=None, *, model: Optional[str] = None, shapes_file: Optional[str] = None,
           causal: Optional[bool] = None, quiet: bool = False, **options) -> "pandas.DataFrame":
    """Run (or resume) one study per problem, as `fa4tune search`; returns `search_frame`. Options are
    the command's, as keywords: arch, trials, sampler, seed, timeout, trial_timeout, compile_timeout,
    storage, study, workers, jobs, db, record_db, space, l2, peers, warm_start, retime_rounds, backward."""
    from fa4tune.progress import Progress

    problems = problems_of(shapes, model=model, shapes_file=shapes_file, causal=causal)
    summaries = run_search_set(problems, gpus=detect_gpus(), progress=Progress(quiet=quiet), **options)
    return search_frame(summaries)


# ------------------------------------------------------------------------------------------------
# bench

def run_bench_set(problems: list, *, gpus: list[dict], arch: str = "auto", db: Optional[str] = None,
                  out: Optional[str] = None, csv: Optional[str] = None, jobs: int = 4, l2: str = "warm",
                  peers: bool = True, rounds: Optional[int] = None, backward: bool = False,
                  progress=None, shapes_per_part: int = 0, resume: bool = False) -> dict:
    """`fa4tune bench` after option parsing: time every variant of every problem `rounds` times
    (interleaved; each row keeps its lowest, `fa4tune.benchmark.runner`), write the bench file (`out`,
    default the results directory's bench.json; `csv` too when given); returns its document.
    `rounds` None: `fa4tune.benchmark.runner.ROUNDS`. `backward`: the training pass too (forward +
    backward and backward alone, the document's `training_rows`). `shapes_per_part` > 0: the shapes
    that many at a time, the file written after each part; `resume`: keep the shapes the file already
    holds from a run of the same settings (another run's file is refused, naming the difference)."""
    from fa4tune import paths
    from fa4tune.benchmark import runner as bench_runner
    from fa4.backends import peer_names
    from fa4tune.progress import Progress
    from fa4tune.workers.timing import TimingSettings

    progress = progress or Progress()
    rounds = bench_runner.ROUNDS if rounds is None else rounds
    if not gpus:
        raise NoGpuError(NO_GPU_BENCH)
    arch = resolve_arch(arch, gpus, need_gpu=True)
    progress.message(f"fa4tune bench: arch {arch} ({gpus[0]['name']}); {len(problems)} shape(s), "
                     f"{rounds} round{'s' if rounds != 1 else ''}")
    path = out or paths.bench_path()
    previous = None
    if resume and Path(path).exists():
        previous = bench_runner.read_bench(path)   # a file that is not a bench output: refused, untouched
        why = bench_runner.resumable(previous, arch, gpus[0]["name"], rounds, backward, l2)
        if why:
            raise ValueError(f"--resume: {path} is another run's ({'; '.join(why)})")
    doc = bench_runner.run_bench(arch, problems, db_path=db, timing=TimingSettings(l2=l2),
                                 peers=peer_names() if peers else (), gpus=[gpus[0]["index"]], processes=jobs,
                                 progress=progress, rounds=rounds, backward=backward,
                                 shapes_per_part=shapes_per_part, previous=previous,
                                 partial=lambda part: bench_runner.write_bench(part, path))
    bench_runner.write_bench(doc, path, csv)
    progress.message(f"wrote {path}" + (f" and {csv}" if csv else ""))
    return doc


def bench_frame(doc: dict) -> "pandas.DataFrame":
    """One row per (shape, variant), the problem's fields as columns; `frame.attrs` holds the run's
    facts (arch, device, timing, versions, kernel fingerprint, date)."""
    import pandas as pd

    rows = [{**{k: v for k, v in r.items() if k != "problem"}, **(r.get("problem") or {})} for r in doc["rows"]]
    frame = pd.DataFrame(rows)
    frame.attrs.update({k: v for k, v in doc.items() if k != "rows"})
    return frame


def bench(shapes=None, *, model: Optional[str] = None, shapes_file: Optional[str] = None,
          causal: Optional[bool] = None, quiet: bool = False, **options) -> "pandas.DataFrame":
    """Tuned vs default vs peers, as `fa4tune bench` (which writes bench.json the same way); returns
    `bench_frame`. Options as keywords: arch, db, out, csv, jobs, l2, peers, rounds."""
    from fa4tune.progress import Progress

    problems = problems_of(shapes, model=model, shapes_file=shapes_file, causal=causal)
    return bench_frame(run_bench_set(problems, gpus=detect_gpus(), progress=Progress(quiet=quiet), **options))


__all__ = ["search", "bench", "search_frame", "bench_frame", "problems_of", "run_search_set", "run_bench_set",
           "detect_gpus", "resolve_arch", "describe_problems", "NoGpuError"]
