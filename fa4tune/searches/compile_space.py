"""Compile a search space without a GPU and hold the feasibility model to it: the one code path behind
`fa4tune compile-space` and `fa4tune search --compile-only` (the same function, `run`).

For each problem (both causal modes unless one is named), every configuration of the space is first
put to the kernel's `feasible`; the rejected ones are counted by reason. Then the feasible ones (all, or
up to `limit`: the default configuration first, then a seeded sample; `shard` i/n keeps those
`shard_of` puts in shard i) of
every problem are compiled in one pool of CPU worker processes, and each compile report is checked: no
register spills, no wgmma serialised for lack of registers, PTX with the architecture's MMA and TMA
instructions (every marker the family declares in `PTX_MARKERS`: one list, read by the compile report
and by this check), and shared memory equal to the model's figure. Any disagreement is a problem.

Exit status (flags, added): 0 all clean; 1 a feasible configuration failed to compile or its report
disagrees with the model; 4 the heuristic default configuration is infeasible for a problem.
(2 is a usage error, as for every command.)

On 2 cores a whole space takes hours; the H200 machine's 16 cores (no GPU needed) or more serve.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import random
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from fa4.config_text import display_label
from fa4.kernels import AttentionProblem, Config
from fa4tune.environment import kernel_api
from fa4tune.workers.outcomes import OK
from fa4tune.progress import Progress, format_duration
from fa4tune.inputs.space import SearchSpace
from fa4tune.workers.pool import DEFAULT_EVALUATOR, WorkerPool

EXIT_OK = 0
EXIT_COMPILE_PROBLEMS = 1
EXIT_DEFAULT_INFEASIBLE = 4


def required_ptx(arch: str, kernels=None) -> tuple[str, ...]:
    """The `ptx_markers` a right compile must show: every one the family declares (`PTX_MARKERS`,
    the list its compile report searches the PTX for). `kernels`: the kernel API (`fa4.kernels`)."""
    if kernels is None:
        import fa4.kernels as kernels
    return tuple(kernels.family(arch).PTX_MARKERS)


def check_report(arch: str, model_smem: Optional[int], entry: dict, kernels=None) -> list[str]:
    """What is wrong with one compiled configuration (empty: nothing)."""
    if entry.get("outcome") != OK:
        return [f"{entry.get('outcome')}: {entry.get('error', '')}".strip()]
    report = entry.get("report") or {}
    problems = list(entry.get("warnings", []))
    markers = report.get("ptx_markers") or {}
    missing = [m for m in required_ptx(arch, kernels) if not markers.get(m)]
    if missing:
        problems.append(f"PTX lacks {', '.join(missing)}")
    if report.get("smem_bytes") != model_smem:
        problems.append(f"shared memory {report.get('smem_bytes')} B compiled vs {model_smem} B modelled")
    return problems


# seconds per configuration per process: results/compile_space/sm100-shard-* (12,609 compiles, mean 2.67)
SECONDS_PER_COMPILE = 2.7


def reason_class(reason: str) -> str:
    """Group reasons that differ only in numbers ("needs 240000 B" ~ "needs 250000 B"); digits that are
    part of a name ("sm90") are kept."""
    return re.sub(r"(?<![A-Za-z0-9_])\d[\d,_.]*", "N", reason)


@dataclass
class _Plan:
    """One problem's share of a run: the feasibility census and the configurations to compile."""

    problem: AttentionProblem
    default: Config
    total: int = 0
    feasible: int = 0
    reasons: Counter = field(default_factory=Counter)
    examples: dict = field(default_factory=dict)  # reason class -> its first reason, numbers and all
    picked: list = field(default_factory=list)


def shard_of(config: dict, shard_count: int) -> int:
    """The shard a configuration belongs to: a hash of its knob values, so a configuration stays in its
    shard when the feasibility model or the space's other values change (shards compiled before a new
    measured corner still add up)."""
    return _shard_of_key(_key(config), shard_count)


def _key(config: dict) -> str:
    return json.dumps(config, sort_keys=True)


def _shard_of_key(key: str, shard_count: int) -> int:
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") % shard_count


def plan(arch: str, problem: AttentionProblem, space: SearchSpace, limit: int, kernels, seed: int = 0,
         shard: tuple[int, int] = (0, 1)) -> _Plan:
    """Feasibility of every configuration, and up to `limit` feasible ones of distinct compile keys to
    compile: the default first (where this shard has it), then a seeded sample of this shard's part."""
    shard_index, shard_count = shard
    if not 0 <= shard_index < shard_count:
        raise ValueError(f"shard {shard_index}/{shard_count}: the index must be in [0, count)")
    result = _Plan(problem, kernels.default_config(arch, problem))
    feasible_configs: list[Config] = []
    for config in space.configs():
        result.total += 1
        reasons = kernels.feasible(config, problem)
        for r in reasons:
            result.reasons[reason_class(r)] += 1
            result.examples.setdefault(reason_class(r), r)
        if not reasons:
            feasible_configs.append(config)
    result.feasible = len(feasible_configs)
    rng = random.Random(seed)
    mine = [c for c in feasible_configs if shard_of(c.to_dict(), shard_count) == shard_index]
    rest = [c for c in mine if c != result.default]
    candidates = ([result.default] if len(rest) < len(mine) else []) + rng.sample(rest, len(rest))
    keys = set()
    for config in candidates:
        if len(result.picked) >= limit:
            break
        if kernels.feasible(config, problem):
            continue
        key = kernels.compile_key(config, problem)
        if key not in keys:
            keys.add(key)
            result.picked.append(config)
    return result


def _model_smem(kernels, arch: str, config: Config, problem: AttentionProblem) -> Optional[int]:
    return kernels.family(arch).resources(config, problem)["smem_bytes"]


def run(arch: str, problems: list[AttentionProblem], space: SearchSpace, limit: int, *, seed: int = 0,
        processes: int = 2, shard: tuple[int, int] = (0, 1), evaluator: str = DEFAULT_EVALUATOR,
        compile_timeout_s: float = 300.0, progress: Optional[Progress] = None,
        api: str = "fa4.kernels") -> list[dict]:
    """One result per problem: {"arch", "source_fingerprint", "toolchain", "problem", "space_size", "feasible", "infeasible",
    "infeasible_reasons", "infeasible_examples", "default", "default_feasible", "shard", "compiled": [entry], "failures"};
    an entry: {"config", "is_default", "outcome", "compile_s", "report", "error", "warnings",
    "model_smem_bytes", "problems"}."""
    progress = progress or Progress()
    kernels = kernel_api(api)
    plans = [plan(arch, p, space, limit, kernels, seed, shard) for p in problems]
    compiled: list[list] = [[] for _ in plans]  # (position in the plan, entry)
    total = sum(len(p.picked) for p in plans)
    if total:
        workers = max(1, min(processes, total))  # the estimate first: a whole space takes hours
        progress.message(f"compile-space: {total} configuration(s) on {workers} process(es): about "
                         f"{format_duration(total * SECONDS_PER_COMPILE / workers)} at ~{SECONDS_PER_COMPILE:g} s "
                         f"each{'' if limit else ' (no --limit: the whole space)'}")
        with WorkerPool(workers, [None], evaluator=evaluator, mode="cpu",
                        arch=arch, compile_timeout_s=compile_timeout_s) as pool:
            tasks = {}
            for index, p in enumerate(plans):
                for position, config in enumerate(p.picked):
                    payload = {"arch": arch, "config": config.to_dict(), "problem": p.problem.to_dict()}
                    tasks[pool.submit("report", payload)] = (index, position, config)
            done = 0
            while tasks:
                for task_id, result in pool.poll(timeout=1.0):
                    index, position, config = tasks.pop(task_id)
                    done += 1
                    p = plans[index]
                    entry = {"config": config.to_dict(), "is_default": config == p.default, **result}
                    entry["model_smem_bytes"] = _model_smem(kernels, arch, config, p.problem)
                    entry["problems"] = check_report(arch, entry["model_smem_bytes"], entry, kernels)
                    compiled[index].append((position, entry))
                    progress.detail(f"compiled {done}/{total}: {'ok' if not entry['problems'] else 'PROBLEM'} "
                                    f"{result.get('compile_s', '?')} s {p.problem.label()} {config.label()}")
                    progress.count(done, total, f"compiled ({len(plans)} problem(s))")
    # the plan's order (the default first), not the order in which the workers finished
    compiled = [[entry for _, entry in sorted(done_list, key=lambda pair: pair[0])] for done_list in compiled]
    # which kernel source compiled: shards of one space join only when they name the same one; and
    # with which DSL toolchain (recorded, so a check's result says what compiled it)
    fingerprint = kernels.source_fingerprint(arch)
    return [{"arch": arch, "source_fingerprint": fingerprint, "toolchain": kernels.toolchain(),
             "problem": p.problem.to_dict(),
             "space_size": p.total, "feasible": p.feasible,
             "infeasible": p.total - p.feasible, "infeasible_reasons": dict(p.reasons.most_common()),
             "infeasible_examples": {reason: p.examples[reason] for reason, _ in p.reasons.most_common()},
             "default": p.default.to_dict(), "default_feasible": not kernels.feasible(p.default, p.problem),
             "shard": list(shard), "compiled": entries, "failures": sum(bool(e["problems"]) for e in entries)}
            for p, entries in zip(plans, compiled)]


def exit_status(results: list[dict]) -> int:
    status = EXIT_OK
    if any(r["failures"] for r in results):
        status |= EXIT_COMPILE_PROBLEMS
    if not all(r["default_feasible"] for r in results):
        status |= EXIT_DEFAULT_INFEASIBLE
    return status


def summary_lines(results: list[dict]) -> list[str]:
    """What a run ends with on stderr: per problem the census, then what failed and the exit status."""
    lines = []
    for r in results:
        label = AttentionProblem(**r["problem"]).label()
        shard = "/".join(str(x) for x in r["shard"])
        lines.append(f"{label}: {r['space_size']} configurations, {r['infeasible']} rejected by the model, "
                     f"{r['feasible']} feasible, {len(r['compiled'])} compiled (shard {shard}), "
                     f"{r['failures']} with problems")
        for entry in r["compiled"]:
            if entry["problems"]:
                config = display_label(r["arch"], entry["config"])
                lines.append(f"  PROBLEM {config}: {'; '.join(entry['problems'])}")
        if not r["default_feasible"]:
            lines.append(f"  the default configuration is infeasible for {label}")
    status = exit_status(results)
    what = [w for flag, w in ((EXIT_COMPILE_PROBLEMS, "configurations the model accepts failed the compile check"),
                              (EXIT_DEFAULT_INFEASIBLE, "the default configuration is infeasible"))
            if status & flag]
    lines.append(f"exit status {status}: " + ("; ".join(what) if what else "every compiled configuration is clean"))
    return lines


def compact(result: dict) -> dict:
    """The result without what each compile report repeats (its config and problem are the entry's and
    the run's), so a whole space's results stay small enough to keep in the repository, and with the
    checkout's own location cut from the compiler's messages (committed files carry no machine paths)."""
    entries = []
    for entry in result["compiled"]:
        # a clean compile's ptxas remarks say nothing its parsed registers and spills do not
        repeated = ("config", "problem") + (() if entry.get("problems") else ("remarks_excerpt",))
        report = {k: v for k, v in (entry.get("report") or {}).items() if k not in repeated}
        entries.append(_relative({**entry, "report": report}))
    return {**result, "compiled": entries}


def _relative(value):
    """Strings with this checkout's absolute location removed (the DSL names source files by it)."""
    from pathlib import Path

    import fa4

    root = str(Path(fa4.__file__).resolve().parent.parent) + "/"
    if isinstance(value, str):
        return value.replace(root, "")
    if isinstance(value, dict):
        return {k: _relative(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_relative(v) for v in value]
    return value


def write_json(results: list[dict], path: str) -> None:
    """The results, compacted, as JSON; gzip-compressed where `path` ends in .gz (a whole-space shard:
    about 700 B a configuration as text, a tenth of that compressed)."""
    from fa4.files import atomic_write

    compacted = [compact(r) for r in results]
    if str(path).endswith(".gz"):
        text = json.dumps(compacted, sort_keys=True, separators=(",", ":"))
        atomic_write(path, gzip.compress(text.encode(), mtime=0))
    else:
        atomic_write(path, json.dumps(compacted, indent=1, sort_keys=True) + "\n")


def read_json(path) -> list[dict]:
    """What `write_json` wrote (gzip-compressed where the name ends in .gz)."""
    data = Path(path).read_bytes()
    return json.loads(gzip.decompress(data) if str(path).endswith(".gz") else data)


def shard_census(results: list[dict], space: SearchSpace, kernels=None) -> list[dict]:
    """Shard results of one space (as `write_json` writes them) held to the feasibility model as it is
    now, per problem: {"problem", "source_fingerprint", "shard_count", "shards" (the indices present),
    "feasible" (now), "compiled" (of those), "missing" (feasible now, in a present shard, not compiled:
    a --limit run, or a shard compiled when the model rejected them), "problems": [(shard, config
    label, problems)] of configurations the model still accepts, "resolved" (problems of ones it now
    rejects), "complete"}. Raises ValueError where results cannot add up: two kernel sources or shard
    counts for one problem, or a shard twice."""
    if kernels is None:
        import fa4.kernels as kernels
    by_problem: dict[str, list[dict]] = {}
    for r in results:
        by_problem.setdefault(json.dumps(r["problem"], sort_keys=True), []).append(r)
    censuses = []
    for problem_json, shard_results in by_problem.items():
        problem = AttentionProblem(**json.loads(problem_json))
        label = problem.label()
        for what, values in (("kernel source", {r.get("source_fingerprint") for r in shard_results}),
                             ("shard count", {r["shard"][1] for r in shard_results})):
            if len(values) > 1:
                raise ValueError(f"{label}: the shards differ in {what}: {sorted(map(str, values))}")
        count = shard_results[0]["shard"][1]
        present = sorted(r["shard"][0] for r in shard_results)
        if len(set(present)) < len(present):
            raise ValueError(f"{label}: a shard given twice ({present})")
        feasible_now = {_key(c.to_dict()) for c in space.configs() if not kernels.feasible(c, problem)}
        entries = {_key(e["config"]): (r["shard"][0], e) for r in shard_results for e in r["compiled"]}
        expected = {k for k in feasible_now if _shard_of_key(k, count) in present}
        problems, resolved = [], 0
        for key, (index, entry) in sorted(entries.items()):
            if not entry["problems"]:
                continue
            if key in feasible_now:
                problems.append((index, display_label(shard_results[0]["arch"], entry["config"]),
                                 entry["problems"]))
            else:
                resolved += 1  # the model rejects it now
        censuses.append({
            "problem": label, "source_fingerprint": shard_results[0].get("source_fingerprint"),
            "shard_count": count, "shards": present, "feasible": len(feasible_now),
            "compiled": len(expected & entries.keys()), "missing": len(expected - entries.keys()),
            "problems": problems, "resolved": resolved,
            "complete": present == list(range(count)) and not expected - entries.keys()})
    return censuses

