"""The report's data layer on synthetic searches built with optuna itself (no GPU, no browser).

`write_synthetic_results` is also used by the browser test: it writes an optuna journal, a best-config
database and a bench file with the schemas the search and bench commands write.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import optuna
import pytest

from fa4.kernels import AttentionProblem, Config, knobs_for
from fa4tune.report import data as rd
from fa4tune.searches import storage as fa4storage

optuna.logging.set_verbosity(optuna.logging.WARNING)

SHAPES = (
    AttentionProblem(1, 1024, 1024, 32, 8, 128, "fp16", causal=False),
    AttentionProblem(1, 1024, 1024, 32, 8, 128, "fp16", causal=True),
    AttentionProblem(2, 4096, 4096, 16, 16, 64, "bf16", causal=False),
)
DEVICE = {"name": "NVIDIA H200", "sm_count": 132, "driver": "580.00", "cc": "9.0"}
VERSIONS = {"torch": "2.11.0", "cutlass_dsl": "4.8.1", "optuna": "5.0.0", "cuda": "13.0",
            "flash_attn_4": "4.0.0b36"}
TIMING = {"method": "cuda_graph", "launches_per_graph": 20, "replays": 7, "l2": "warm"}
PEERS_US = {"flash_attn_4": 30.0, "sdpa_cudnn": 31.6, "sdpa_flash": 53.0}


def study_name(arch: str, p: AttentionProblem) -> str:
    mask = "causal" if p.causal else "full"
    return (f"{arch}-{p.dtype}-b{p.batch}-hq{p.heads_q}-hkv{p.heads_kv}-d{p.head_dim}-sq{p.seqlen_q}"
            f"-sk{p.seqlen_k}-{mask}")


def _synthetic_us(cfg: dict, base: float, rng: random.Random) -> float:
    """A made-up cost model in which tile_n matters most and kv_stages a little, plus 1 % noise."""
    us = base * (1.0 + abs(cfg["tile_n"] - 128) / 64.0)
    us *= 1.08 if cfg["kv_stages"] == 2 else 1.0
    return us * (1.0 + 0.01 * rng.random())


def _outcome(cfg: dict, rng: random.Random) -> str:
    if cfg["tile_n"] >= 160 and cfg.get("pv_operand", "ss") == "ss":
        return "infeasible"
    r = rng.random()
    return ("compile_error" if r < 0.06 else "mismatch" if r < 0.10 else "launch_error" if r < 0.13
            else "timeout" if r < 0.15 else "ok")


def add_synthetic_study(storage, arch: str, problem: AttentionProblem, n_trials: int, seed: int,
                        fingerprint: str = "f" * 16, suffix: str = "") -> dict:
    """One search as `fa4tune search` records it. Returns what a reader must find: outcome counts,
    the best and the default time. Failures are recorded three ways (FAIL, PRUNED, and COMPLETE with a
    penalty value) because the report must count by the "outcome" attribute, not by state. One extra
    trial repeats the best configuration ("repeat_of"), which the report must not count again."""
    rng = random.Random(seed)
    study = optuna.create_study(study_name=study_name(arch, problem) + suffix, storage=storage,
                                direction="minimize", sampler=optuna.samplers.RandomSampler(seed=seed))
    base = problem.flops() / 600e12 * 1e6  # µs at 600 TFLOP/s
    default = Config.make(arch).to_dict()
    default_us = _synthetic_us(default, base, random.Random(seed + 1))
    study.set_user_attr("arch", arch)
    study.set_user_attr("problem", problem.to_dict())
    study.set_user_attr("device", DEVICE)
    study.set_user_attr("versions", VERSIONS)
    study.set_user_attr("kernel_fingerprint", fingerprint)
    study.set_user_attr("timing", TIMING)
    study.set_user_attr("peers", {"flash_attn_4": {"us": base * 1.1, "tflops": 545.0},
                                  "sdpa_cudnn": {"us": base * 1.15, "tflops": 520.0},
                                  "sdpa_flash": {"error": "sdpa flash backend rejected the shape"}})
    study.set_user_attr("default_us", default_us)
    study.enqueue_trial(default, user_attrs={"is_default": True})
    counts: dict[str, int] = {}
    ok_us = []
    dists = {k.name: optuna.distributions.CategoricalDistribution(k.choices) for k in knobs_for(arch)}
    for _ in range(n_trials):
        trial = study.ask(dists)
        cfg = trial.params
        outcome = "ok" if trial.user_attrs.get("is_default") else _outcome(cfg, rng)
        counts[outcome] = counts.get(outcome, 0) + 1
        trial.set_user_attr("outcome", outcome)
        if outcome == "ok":
            us = default_us if trial.user_attrs.get("is_default") else _synthetic_us(cfg, base, rng)
            ok_us.append(us)
            trial.set_user_attr("us", us)
            trial.set_user_attr("tflops", problem.flops() / us / 1e6)
            trial.set_user_attr("compile_s", 2.0)
            trial.set_user_attr("max_err", 1e-3)
            study.tell(trial, us)
        elif outcome == "mismatch":
            trial.set_user_attr("max_err", 0.5)
            study.tell(trial, 1e9)  # a penalty value: must not reach any plot or best
        elif outcome == "compile_error":
            trial.set_user_attr("error", "synthetic compile failure")
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        else:
            trial.set_user_attr("reasons", ["synthetic"])
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
    best = study.best_trial
    study.enqueue_trial(best.params, user_attrs={"repeat_of": best.number, "outcome": "ok",
                                                 "us": best.value})
    study.tell(study.ask(dists), best.value)
    return {"name": study.study_name, "counts": counts, "best_us": min(ok_us), "default_us": default_us,
            "n_ok": len(ok_us), "peer_base": base}


def write_synthetic_results(folder: Path, n_trials: int = 40, seed: int = 0,
                            fingerprint: str = "f" * 16, archs=("sm90",)) -> dict:
    """A results folder: journal storage, best_configs.json (schema 1) and bench.json."""
    folder.mkdir(parents=True, exist_ok=True)
    storage = optuna.storages.journal.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(folder / "studies.journal")))
    expected = {}
    entries, bench = [], []
    for arch in archs:
        for i, p in enumerate(SHAPES):
            info = add_synthetic_study(storage, arch, p, n_trials, seed + 10 * i, fingerprint)
            expected[info["name"]] = info
            entries.append({
                "arch": arch, "device": DEVICE["name"], "dtype": p.dtype, "head_dim": p.head_dim,
                "gqa_ratio": p.gqa_ratio, "causal": p.causal, "seqlen_q_bucket": p.seqlen_q,
                "seqlen_k_bucket": p.seqlen_k, "work_bucket": p.batch * p.heads_kv, "problem": p.to_dict(),
                "config": Config.make(arch).to_dict(), "us": info["best_us"],
                "tflops": p.flops() / info["best_us"] / 1e6, "default_us": info["default_us"],
                "speedup": {"default": info["default_us"] / info["best_us"]}, "max_err": 1e-3,
                "kernel_fingerprint": fingerprint if i else "0" * 16, "versions": VERSIONS,
                "date": "2026-11-30T05:00:00+00:00", "study": info["name"], "trial": 3})
            if i < 2:  # the bench covers two of the three shapes
                for variant, factor in (("tuned", 1.0), ("default", 1.25), ("flash_attn_4", 1.1),
                                        ("sdpa_cudnn", 1.2), ("sdpa_flash", 1.9)):
                    us = info["best_us"] * factor
                    bench.append({"shape": info["name"], "problem": p.to_dict(), "variant": variant,
                                  "outcome": "ok", "us": us, "tflops": p.flops() / us / 1e6,
                                  "speedup_of_tuned": factor, "error": None})
                # fa4.attention itself: ran ours in both modes, a little slower than the tuned row
                us = info["best_us"] * 1.01
                bench.append({"shape": info["name"], "problem": p.to_dict(), "variant": "dispatched",
                              "outcome": "ok", "us": us, "tflops": p.flops() / us / 1e6, "eager_us": us + 9.5,
                              "backend": {"eager": "ours", "graph": "ours"}, "speedup_of_tuned": 1.01,
                              "error": None})
            elif i == 2:  # a shape whose tuned row has no database entry: the rest still measured
                bench.append({"shape": info["name"], "problem": p.to_dict(), "variant": "tuned",
                              "outcome": "missing", "us": None, "tflops": None,
                              "error": "no usable database entry"})
                bench.append({"shape": info["name"], "problem": p.to_dict(), "variant": "flash_attn_4",
                              "outcome": "ok", "us": 100.0, "tflops": None, "error": None})
    (folder / "best_configs.json").write_text(json.dumps({"schema": 1, "entries": entries}, indent=2))
    # the layout `fa4tune bench` writes: the run's facts at the top, one row per (shape, variant)
    (folder / "bench.json").write_text(json.dumps({
        "schema": 1, "date": "2026-11-30T05:10:00+00:00", "arch": archs[0], "device": DEVICE,
        "versions": VERSIONS, "kernel_fingerprint": fingerprint, "timing": TIMING, "rows": bench,
        "dispatch": {r["shape"]: {mode: {"backend": "ours", "ratio": 1.0, "reason": "fastest"}
                                  for mode in ("eager", "graph")} for r in bench if r["variant"] == "dispatched"}},
        indent=2))
    return expected


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    folder = tmp_path_factory.mktemp("results")
    expected = write_synthetic_results(folder)
    return folder, expected


# ------------------------------------------------------------------------------------------------

def test_storage_detection(tmp_path, synthetic):
    folder, expected = synthetic
    journal = folder / "studies.journal"
    assert fa4storage.storage_kind(str(journal)) == "journal"
    assert fa4storage.find_storages(folder) == [journal]
    # a study copied into SQLite is found by content, whatever the file is called, and reads the same
    sqlite = tmp_path / "studies.bin"
    name = sorted(expected)[0]
    optuna.copy_study(from_study_name=name, from_storage=fa4storage.open_for_reading(str(journal)),
                      to_storage=f"sqlite:///{sqlite}")
    assert fa4storage.storage_kind(str(sqlite)) == "sqlite"
    (copied,) = rd.load_studies(fa4storage.open_for_reading(str(sqlite)))
    assert copied.study_name == name
    assert rd.summarize_study(copied).outcomes == expected[name]["counts"]
    assert fa4storage.storage_kind(f"sqlite:///{sqlite}") == "url"
    garbage = tmp_path / "notes.txt"
    garbage.write_text("hello\n")
    with pytest.raises(ValueError):
        fa4storage.storage_kind(str(garbage))
    with pytest.raises(FileNotFoundError):
        fa4storage.storage_kind(str(tmp_path / "absent.db"))
    assert fa4storage.find_storages(tmp_path) == [sqlite]


def test_study_summary_counts_by_outcome_not_state(synthetic):
    folder, expected = synthetic
    studies = rd.load_studies(fa4storage.open_for_reading(str(folder / "studies.journal")))
    for study in studies:
        want = expected[study.study_name]
        info = rd.summarize_study(study, {"sm90": "f" * 16})
        assert info.outcomes == want["counts"]
        assert sum(info.outcomes.values()) == info.n_trials == 40  # the repeat is not counted
        assert info.best["us"] == pytest.approx(want["best_us"])
        assert info.default_us == pytest.approx(want["default_us"])
        # penalty values of mismatching trials reach neither the history nor the plotted study
        assert len(info.history) == want["n_ok"] == len(info.ok_study.trials)
        assert max(us for _, us, _ in info.history) < 1e6
        assert [b for _, _, b in info.history] == sorted((b for _, _, b in info.history), reverse=True)
        assert info.fingerprint_state == "current"
        assert info.knob_names == [k.name for k in knobs_for("sm90")]
        assert info.label.startswith("B")


def test_importance_finds_the_knob_that_matters(synthetic):
    folder, expected = synthetic
    studies = rd.load_studies(fa4storage.open_for_reading(str(folder / "studies.journal")))
    for study in studies:
        info = rd.summarize_study(study, {})
        assert info.importance is not None, info.importance_note
        assert set(info.importance) <= set(info.knob_names)
        assert sum(info.importance.values()) == pytest.approx(1.0)
        # tile_n decides the synthetic time by up to 2x; every other knob but kv_stages is noise.
        # PED-ANOVA over ~30 random trials is itself noisy (a noise knob can come first), so the
        # claim is only that the deciding knob ranks in the top half.
        ranked = sorted(info.importance, key=info.importance.get, reverse=True)
        assert ranked.index("tile_n") < len(ranked) / 2, ranked


def test_importance_refuses_too_few_trials():
    study = optuna.create_study()
    study.add_trial(optuna.trial.create_trial(
        value=1.0, params={"a": 1}, distributions={"a": optuna.distributions.CategoricalDistribution((1, 2))}))
    importance, note = rd.knob_importance(study, ["a"], min_trials=8)
    assert importance is None and "at least 8" in note


def _bench_row(problem, impl, us=None, status="ok", error=None):
    return {"problem": problem.to_dict(), "arch": "sm90", "device": "NVIDIA H200", "impl": impl, "us": us,
            "tflops": None, "config": None, "status": status, "error": error}


def test_bench_rows_and_speedups():
    p = SHAPES[0]
    rows = rd.rows_from_bench([
        _bench_row(p, "tuned", 20.0), _bench_row(p, "default", 25.0), _bench_row(p, "flash_attn_4", 30.0),
        _bench_row(p, "sdpa_flash", None, "error", "not supported"),
        _bench_row(SHAPES[1], "flash_attn_4", 21.0),
    ])
    assert len(rows) == 2
    row = next(r for r in rows if r.problem == p.to_dict())
    assert row.speedup == pytest.approx({"default": 1.25, "flash_attn_4": 1.5})
    assert row.impls["sdpa_flash"] == {"error": "not supported"}
    # TFLOP/s derived from the problem when the record has none
    assert row.impls["tuned"]["tflops"] == pytest.approx(p.flops() / 20.0 / 1e6)
    lone = next(r for r in rows if r.problem == SHAPES[1].to_dict())
    assert lone.speedup == {}  # no tuned time: nothing to compare


def test_bench_rows_read_tolerantly():
    assert rd.bench_records([{"a": 1}]) == [{"a": 1}]
    assert rd.bench_records({"results": [{"a": 1}]}) == [{"a": 1}]
    with pytest.raises(ValueError):
        rd.bench_records({"nothing": 1})


def test_bench_wins_over_study_rows_and_heatmap_places_cells():
    p0, p1 = SHAPES[0], SHAPES[2]
    bench = rd.rows_from_bench([_bench_row(p0, "tuned", 20.0), _bench_row(p0, "default", 30.0)])
    study_row = rd.ShapeRow("sm90", "NVIDIA H200", p0.to_dict(), rd.problem_label(p0.to_dict()), "study",
                            {"tuned": {"us": 10.0}, "default": {"us": 11.0}})
    other = rd.ShapeRow("sm90", "NVIDIA H200", p1.to_dict(), rd.problem_label(p1.to_dict()), "study",
                        {"tuned": {"us": 10.0}, "flash_attn_4": {"us": 12.0}})
    for r in (study_row, other):
        r.compute_speedups()
    rows = rd.merge_rows(bench, [study_row, other])
    assert [r.source for r in rows] == ["study", "bench"]  # sorted: bf16 D64 before fp16 D128
    # a bench that measured nothing for a shape leaves that shape to the study's own numbers
    failed = rd.rows_from_bench([_bench_row(p1, "tuned", None, "missing", "no usable database entry")])
    assert [r.source for r in rd.merge_rows(failed, [other])] == ["study"]
    assert [r.source for r in rd.merge_rows(failed, [])] == ["bench"]
    maps = {m.baseline: m for m in rd.speedup_heatmaps(rows)}
    assert set(maps) == {"default", "flash_attn_4"}
    d = maps["default"]
    i = d.y.index("sm90 fp16 D128 H32/8 full")
    j = d.x.index("B1 S1024")
    assert d.z[i][j] == pytest.approx(1.5)
    assert d.z[d.y.index("sm90 bf16 D64 H16/16 full")][d.x.index("B2 S4096")] is None
    assert maps["flash_attn_4"].z[d.y.index("sm90 bf16 D64 H16/16 full")][d.x.index("B2 S4096")] == \
        pytest.approx(1.2)


def test_best_config_rows_flag_stale_entries():
    entry = {"arch": "sm90", "device": "NVIDIA H200", "dtype": "fp16", "head_dim": 128, "gqa_ratio": 4,
             "causal": True, "seqlen_q_bucket": 1024, "seqlen_k_bucket": 1024, "work_bucket": 8,
             "config": {"tile_n": 128}, "us": 20.0, "tflops": 400.0, "speedup": {"flash_attn_4": 1.05},
             "max_err": 2e-3, "kernel_fingerprint": "abc", "versions": VERSIONS, "date": "2026-11-30",
             "study": "s", "trial": 4, "problem": SHAPES[1].to_dict()}
    sm100 = dict(entry, arch="sm100")
    rows = rd.best_config_rows({"schema": 1, "entries": [entry, sm100]}, {"sm90": "abc", "sm100": None})
    assert [(r.arch, r.fingerprint_state) for r in rows] == [("sm100", "unknown"), ("sm90", "current")]
    rows = rd.best_config_rows([entry], {"sm90": "def"})
    assert rows[0].fingerprint_state == "stale"
    assert rows[0].shape == "fp16 D128 GQA4 causal Sq 1024 Sk 1024 work 8"
    assert rows[0].tuned_on == "B1 S1024 H32/8 D128 fp16 causal"
    assert rows[0].speedup == {"flash_attn_4": 1.05}
    with pytest.raises(ValueError):
        rd.best_config_rows({"entries": "nope"}, {})


def test_describe_timing_states_l2():
    assert rd.describe_timing(TIMING) == ("CUDA-graph replay, 20 launches per graph, median of 7 replays, "
                                          "L2 warm")
    assert "L2 state not recorded" in rd.describe_timing({"method": "events"})
    assert rd.describe_timing({}) == "not recorded"
    assert rd.describe_timing({**TIMING, "rounds": 2}).endswith("L2 warm, lowest of 2 rounds")


def test_collect_with_nothing_says_what_is_missing(tmp_path):
    data = rd.collect(tmp_path / "empty")
    assert data.studies == [] and data.shape_rows == [] and data.best_configs == []
    text = " ".join(data.missing)
    assert "optuna storage" in text and "best-config database" in text and "bench results" in text


def test_collect_reports_unreadable_inputs(tmp_path):
    (tmp_path / "best_configs.json").write_text("{not json")
    (tmp_path / "bench.json").write_text("[]")
    journal = tmp_path / "broken.journal"
    journal.write_text('{"op_code": 99}\n')
    data = rd.collect(tmp_path)
    assert any("best-config database" in m and "could not be read" in m for m in data.missing)
    assert data.sources[f"bench {rd.shown(tmp_path / 'bench.json')}"] == "0 rows"


def test_collect_end_to_end(synthetic, monkeypatch):
    folder, expected = synthetic
    import fa4.kernels
    monkeypatch.setattr(fa4.kernels, "kernel_fingerprint", lambda arch: "f" * 16)
    data = rd.collect(folder)
    assert not data.missing
    assert sorted(s.name for s in data.studies) == sorted(expected)
    # the third shape has only a failed tuned row in the bench: its bench row wins, with the error shown
    assert [r.source for r in data.shape_rows] == ["bench"] * 3
    third = next(r for r in data.shape_rows if r.problem == SHAPES[2].to_dict())
    assert third.impls["tuned"] == {"error": "missing: no usable database entry"}
    assert third.impls["flash_attn_4"]["us"] == 100.0 and third.speedup == {}
    assert all(r.device == DEVICE["name"] and r.arch == "sm90" for r in data.shape_rows)
    assert {m.baseline for m in data.heatmaps} == {"default", "flash_attn_4", "sdpa_cudnn", "sdpa_flash"}
    assert data.heatmaps[0].z[data.heatmaps[0].y.index("sm90 fp16 D128 H32/8 causal")] == \
        pytest.approx([1.25, None])
    # one database entry carries an old fingerprint
    assert [r.fingerprint_state for r in data.best_configs].count("stale") == 1
    assert any("stale" in w for w in data.warnings)
    assert not any("sm100" in w for w in data.warnings)
    assert data.timing == sorted({rd.describe_timing(TIMING), rd.describe_timing(TIMING) + " (bench)"})
    names, classes, counts = data.failure_table
    assert classes[0] == "ok" and "infeasible" in classes
    for j, name in enumerate(names):
        assert {c: counts[i][j] for i, c in enumerate(classes) if counts[i][j]} == expected[name]["counts"]
    studies, knobs, z = data.importance_table
    assert len(studies) == 3 and "tile_n" in knobs


def test_sm100_data_carries_the_not_run_on_hardware_warning(tmp_path):
    write_synthetic_results(tmp_path, n_trials=10, archs=("sm100",))
    data = rd.collect(tmp_path)
    assert any("sm100" in w and "never run on hardware" in w for w in data.warnings)
    assert all(s.arch == "sm100" for s in data.studies)
    assert all(math.isfinite(s.best["us"]) for s in data.studies)


def test_superseded_studies_are_left_out(tmp_path):
    write_synthetic_results(tmp_path, n_trials=12)
    storage = fa4storage.open_storage(str(tmp_path / "studies.journal"))
    info = add_synthetic_study(storage, "sm90", SHAPES[0], 12, seed=99, fingerprint="e" * 16, suffix="~2")
    data = rd.collect(tmp_path)
    names = [s.name for s in data.studies]
    assert info["name"] in names and study_name("sm90", SHAPES[0]) not in names
    assert data.superseded == [study_name("sm90", SHAPES[0])]
    assert len(data.studies) == len(SHAPES)
    assert rd.split_study_name("a-b~12") == ("a-b", 12) and rd.split_study_name("a~b") == ("a~b", 1)


def _bench_doc(rows, dispatch=None):
    """A bench.json as `fa4tune bench` writes it (the run's facts at the top)."""
    return {"schema": 1, "date": "2026-12-01T00:00:00+00:00", "arch": "sm90", "device": DEVICE,
            "versions": VERSIONS, "timing": TIMING, "rows": rows, "dispatch": dispatch or {}}


def test_the_dispatched_row_beside_the_fastest_of_its_run(tmp_path):
    p, q, r = SHAPES

    def row(problem, variant, us, **extra):
        return {"shape": study_name("sm90", problem), "problem": problem.to_dict(), "variant": variant,
                "outcome": "ok" if us else "launch_error", "us": us, "tflops": None,
                "error": None if us else "refused", **extra}

    rows = [
        # p: flash-attn-4's kernel is fastest captured; SDPA cuDNN is faster still but only on expanded
        # K/V (not what the runtime runs); fa4.attention ran flash-attn-4 captured and ours in eager mode.
        # Eager, flash-attn-4's host time makes it slow and ours (the tuned row, timed as fa4.attention
        # forced to it) is fastest at 28.0 us per call: fa4.attention's 29.5 misses the bar by 5 %
        row(p, "tuned", 20.0, eager_us=28.0), row(p, "default", 24.0), row(p, "flash_attn_4", 18.0, eager_us=95.0),
        row(p, "sdpa_cudnn", 15.0, kv_expanded=True, eager_us=20.0), row(p, "sdpa_flash", None, eager_us=1.0),
        row(p, "dispatched", 18.2, eager_us=29.5, backend={"eager": "ours", "graph": "flash_attn_4"}),
        # q: no tuned entry (the default is what runs), and dispatch ran ours while this run's own times
        # pick SDPA cuDNN captured: 5 % slower than the fastest; eager it is within 2 % (31.0 vs 30.6)
        row(q, "default", 30.0, eager_us=31.2), row(q, "sdpa_cudnn", 28.0, eager_us=30.6),
        row(q, "dispatched", 29.4, eager_us=31.0, backend={"eager": "ours", "graph": "ours", "x": 1}),
        # r: a bench without eager times of the implementations: judged by GPU time alone
        row(r, "tuned", 40.0), row(r, "sdpa_cudnn", 41.0),
        row(r, "dispatched", 40.2, eager_us=45.0, backend={"eager": "ours", "graph": "ours"}),
    ]
    picks = {study_name("sm90", q): {"graph": {"backend": "sdpa_cudnn", "ratio": 1.07, "reason": "faster"},
                                     "eager": {"backend": "ours", "ratio": 1.0, "reason": "host time"}}}
    (tmp_path / "bench.json").write_text(json.dumps(_bench_doc(rows, picks)))
    data = rd.collect(tmp_path)
    by_label = {d.label: d for d in data.dispatch}
    assert set(by_label) == {rd.problem_label(x.to_dict()) for x in (p, q, r)}
    d = by_label[rd.problem_label(p.to_dict())]
    assert (d.us, d.eager_us, d.ran, d.picked) == (18.2, 29.5, {"eager": "ours", "graph": "flash_attn_4"}, {})
    assert (d.fastest, d.fastest_us) == ("flash_attn_4", 18.0)
    assert d.ratio == pytest.approx(18.2 / 18.0) and d.graph_within_tolerance
    # eager: the expanded-K/V SDPA row and the failed one are left out, as in graph mode
    assert (d.eager_fastest, d.eager_fastest_us) == ("tuned", 28.0)
    assert d.eager_ratio == pytest.approx(29.5 / 28.0) and d.eager_within_tolerance is False
    assert d.within_tolerance is False  # within 2 % captured, not eager: the bar is missed
    e = by_label[rd.problem_label(q.to_dict())]
    assert e.ran == {"eager": "ours", "graph": "ours"}  # an unknown mode is left out
    assert e.picked == {"graph": "sdpa_cudnn", "eager": "ours"}
    assert (e.fastest, e.fastest_us) == ("sdpa_cudnn", 28.0)
    assert e.ratio == pytest.approx(29.4 / 28.0) and e.graph_within_tolerance is False
    assert (e.eager_fastest, e.eager_fastest_us) == ("sdpa_cudnn", 30.6)
    assert e.eager_ratio == pytest.approx(31.0 / 30.6) and e.eager_within_tolerance
    assert e.within_tolerance is False
    f = by_label[rd.problem_label(r.to_dict())]
    assert (f.eager_fastest, f.eager_fastest_us, f.eager_ratio, f.eager_within_tolerance) == (None, None, None, None)
    assert f.ratio == pytest.approx(40.2 / 40.0) and f.within_tolerance  # the one mode measured decides
    # the dispatched row is one of the per-shape implementations, labelled against tuned like the rest,
    # but no baseline of the tuned kernel (no heatmap, no speedup summary for it)
    shape = next(r for r in data.shape_rows if r.problem == p.to_dict())
    assert shape.impls["dispatched"]["us"] == 18.2 and shape.speedup["dispatched"] == pytest.approx(0.91)
    assert shape.impls["sdpa_cudnn"]["kv_expanded"] is True
    # every row's eager time is kept with its GPU time, but not on a row that failed
    assert shape.impls["tuned"]["eager_us"] == 28.0 and shape.impls["flash_attn_4"]["eager_us"] == 95.0
    assert "eager_us" not in shape.impls["default"] and "eager_us" not in shape.impls["sdpa_flash"]
    assert "dispatched" not in {m.baseline for m in data.heatmaps} and "dispatched" not in data.speedups
    assert json.loads(json.dumps(data.to_dict()))["dispatch"][0]["ran"]
    # drawn: a bar beside the others (hover names what ran) and the table of the dispatch section
    from fa4tune.report import draw as report_draw
    fig = report_draw.comparison_figure(data.shape_rows)
    bars = [t for t in fig.data if t.name == report_draw.impl_names()["dispatched"] and t.yaxis == "y"]
    assert len(bars) == 1 and "ran: graph: flash-attn-4, eager: ours" in "".join(bars[0].customdata)
    doc, _ = report_draw.render_html(data)
    assert "What fa4.attention ran, per shape" in doc
    assert "1.011× ✓" in doc and "1.050× ✗" in doc and "graph: SDPA cuDNN" in doc
    assert "29.50" in doc  # the eager time per call


def test_a_bench_without_the_dispatched_row_draws_no_dispatch_section(tmp_path):
    p = SHAPES[0]
    rows = [{"shape": "s", "problem": p.to_dict(), "variant": v, "outcome": "ok", "us": us}
            for v, us in (("tuned", 20.0), ("flash_attn_4", 25.0))]
    (tmp_path / "bench.json").write_text(json.dumps(_bench_doc(rows)))
    data = rd.collect(tmp_path)
    assert data.dispatch == []
    from fa4tune.report import draw as report_draw
    assert "What fa4.attention ran" not in report_draw.render_html(data)[0]


def test_speedup_summary():
    rows = []
    for tuned, peer in ((10.0, 20.0), (10.0, 5.0), (10.0, 10.0)):
        r = rd.ShapeRow("sm90", "d", {}, "", "bench", {"tuned": {"us": tuned}, "flash_attn_4": {"us": peer}})
        r.compute_speedups()
        rows.append(r)
    summary = rd.speedup_summary(rows)
    assert list(summary) == ["flash_attn_4"]
    s = summary["flash_attn_4"]
    assert (s["n"], s["wins"], s["min"], s["max"]) == (3, 1, 0.5, 2.0)
    assert s["geomean"] == pytest.approx(1.0)


def _training(problem, name, fwdbwd, bwd, **extra):
    """A training row as `fa4tune bench --backward` writes it (`fa4tune.benchmark.runner`)."""
    ok = bwd is not None
    return {"shape": study_name("sm90", problem), "problem": problem.to_dict(), "implementation": name,
            "outcome": "ok" if ok else "launch_error", "fwdbwd_us": fwdbwd, "bwd_us": bwd,
            "bwd_us_rounds": [bwd, bwd], "bwd_peak_extra_mib": 12.5 if ok else None, "validated": ok or None,
            "backward": None, "kv_expanded": None, "error": None if ok else "cannot train this shape", **extra}


def test_the_training_pass_beside_the_forward(tmp_path):
    p, q = SHAPES[0], SHAPES[2]
    forward = [{"shape": study_name("sm90", x), "problem": x.to_dict(), "variant": "tuned", "outcome": "ok",
                "us": 20.0} for x in (p, q)]
    training = [
        # p: fa4.attention 100/70 us; cuDNN is faster in both passes, FA-4 slower (on expanded K and V),
        # SDPA flash refuses the shape
        _training(p, "fa4", 100.0, 70.0, backward="blockwise"),
        _training(p, "sdpa_cudnn", 90.0, 60.0),
        _training(p, "flash_attn_4", 120.0, 80.0, kv_expanded=True, validated=False),
        _training(p, "sdpa_flash", None, None),
        # q: fa4.attention is faster than its only peer; its backward ran one implementation
        _training(q, "sdpa_cudnn", 50.0, 40.0),
        _training(q, "fa4", 45.0, 30.0, backward="ours"),
        # a malformed record is skipped with a note, never the report
        {"shape": "broken", "problem": {"batch": "one"}, "implementation": "fa4"},
    ]
    doc = {**_bench_doc(forward), "training_rows": training}
    (tmp_path / "bench.json").write_text(json.dumps(doc))
    data = rd.collect(tmp_path)
    assert [(rd.problem_label(r.problem) == rd.problem_label(q.to_dict()), r.implementation)
            for r in data.training] == [(True, "fa4"), (True, "sdpa_cudnn"),  # bf16 D64 sorts first
                                       (False, "fa4"), (False, "flash_attn_4"), (False, "sdpa_cudnn"),
                                       (False, "sdpa_flash")]
    rows = {(r.label, r.implementation): r for r in data.training}
    fa4_p = rows[(rd.problem_label(p.to_dict()), "fa4")]
    assert (fa4_p.fwdbwd_us, fa4_p.bwd_us, fa4_p.backward, fa4_p.peak_extra_mib) == (100.0, 70.0, "blockwise", 12.5)
    assert fa4_p.fastest_peer == {"fwdbwd": "sdpa_cudnn", "bwd": "sdpa_cudnn"}
    assert fa4_p.fwdbwd_ratio == pytest.approx(100 / 90) and fa4_p.bwd_ratio == pytest.approx(70 / 60)
    expanded = rows[(rd.problem_label(p.to_dict()), "flash_attn_4")]
    assert expanded.kv_expanded and expanded.validated is False and expanded.bwd_ratio == pytest.approx(80 / 60)
    refused = rows[(rd.problem_label(p.to_dict()), "sdpa_flash")]
    assert refused.outcome == "launch_error" and refused.bwd_us is None and refused.bwd_ratio is None
    assert "cannot train" in refused.error
    fa4_q = rows[(rd.problem_label(q.to_dict()), "fa4")]
    assert fa4_q.bwd_ratio == pytest.approx(0.75) and fa4_q.fwdbwd_ratio == pytest.approx(0.9)
    assert any("training row broken: skipped" in line for line in data.missing)
    assert "7 training rows" in "".join(data.sources.values())  # as the file holds them
    assert json.loads(json.dumps(data.to_dict()))["training"][0]["implementation"] == "fa4"

    from fa4tune.report import draw as report_draw
    fig = report_draw.training_figure(data.training)
    bars = {(t.name, t.yaxis): t for t in fig.data}
    fa4_bwd = bars[("fa4.attention", "y")]
    assert list(fa4_bwd.y) == [30.0, 70.0] and list(fa4_bwd.text) == ["0.75×", "1.17×"]
    assert fa4_bwd.marker.color == report_draw.impl_colors()["dispatched"]
    assert "backward: blockwise" in fa4_bwd.customdata[1]
    assert list(bars[("fa4.attention", "y2")].y) == [45.0, 100.0]
    cudnn = bars[(report_draw.impl_names()["sdpa_cudnn"], "y")]
    assert list(cudnn.y) == [40.0, 60.0] and cudnn.marker.color == report_draw.impl_colors()["sdpa_cudnn"]
    assert "expanded" in bars[(report_draw.impl_names()["flash_attn_4"], "y")].customdata[1]
    assert (report_draw.impl_names()["sdpa_flash"], "y") not in bars  # it trained no shape
    doc_html, ids = report_draw.render_html(data)
    section = doc_html.split("Training pass (forward + backward)</h2>", 1)[1].split("<h2>", 1)[0]
    assert section.count('class="plotly-graph-div"') == 1
    table = section.split("<table", 1)[1]
    assert ("<td>fa4.attention</td><td>100.00</td><td>70.00</td><td>1.11× / 1.17×</td><td>12.5</td>"
            "<td>yes</td><td>blockwise</td>") in table
    assert "<td>45.00</td><td>30.00</td><td>0.90× / 0.75×</td>" in table
    assert "K, V expanded" in table and "<td>no</td>" in table
    assert "launch_error: cannot train this shape" in table


def test_a_bench_without_training_rows_draws_no_training_section(tmp_path):
    rows = [{"shape": "s", "problem": SHAPES[0].to_dict(), "variant": "tuned", "outcome": "ok", "us": 20.0}]
    (tmp_path / "bench.json").write_text(json.dumps(_bench_doc(rows)))
    data = rd.collect(tmp_path)
    assert data.training == [] and not any("training row" in line for line in data.missing)
    from fa4tune.report import draw as report_draw
    doc, ids = report_draw.render_html(data)
    assert "Training pass" not in doc and len(ids) == 1  # the comparison figure only
    assert rd.training_rows(None) == [] and rd.training_rows([]) == [] and rd.training_rows({"training_rows": 3}) == []
