"""Drawing edge cases without a browser: each partial input gives a report, never an exception."""

from __future__ import annotations

import json

import optuna

from fa4.kernels import Config, knobs_for
from fa4tune.report import data as rd
from fa4tune.report import draw as report_draw
from test_report_data import DEVICE, SHAPES, TIMING, study_name, write_synthetic_results


def _journal(folder):
    folder.mkdir(parents=True, exist_ok=True)
    return optuna.storages.journal.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(folder / "studies.journal")))


def test_studies_with_one_or_no_successful_trial(tmp_path):
    storage = _journal(tmp_path)
    dists = {k.name: optuna.distributions.CategoricalDistribution(k.choices) for k in knobs_for("sm90")}
    for i, outcomes in enumerate((["ok"], ["infeasible", "compile_error"])):
        study = optuna.create_study(study_name=study_name("sm90", SHAPES[i]), storage=storage)
        study.set_user_attr("arch", "sm90")
        study.set_user_attr("problem", SHAPES[i].to_dict())
        study.set_user_attr("device", DEVICE)
        study.set_user_attr("timing", TIMING)
        for outcome in outcomes:
            study.enqueue_trial(Config.make("sm90").to_dict())
            trial = study.ask(dists)
            trial.set_user_attr("outcome", outcome)
            if outcome == "ok":
                study.tell(trial, 20.0)
            else:
                study.tell(trial, state=optuna.trial.TrialState.PRUNED)
    data = rd.collect(tmp_path)
    one, none = sorted(data.studies, key=lambda s: -s.outcomes.get("ok", 0))
    assert one.best["us"] == 20.0 and one.importance is None and "at least" in one.importance_note
    assert none.best is None and none.ok_study is None and none.outcomes == {"infeasible": 1,
                                                                               "compile_error": 1}
    doc, ids = report_draw.render_html(data)
    # comparison (one tuned time; no baseline, so no heatmap), failures, no importance, 2 plots for one study
    assert len(ids) == 1 + 1 + 2
    assert "No shape has both a tuned and a baseline time" in doc
    assert "No successful trial to plot" in doc
    assert "Not computed:" in doc


def test_bench_only_and_database_only(tmp_path):
    write_synthetic_results(tmp_path / "full", n_trials=8)
    bench_only = tmp_path / "bench_only"
    bench_only.mkdir()
    (bench_only / "bench.json").write_text((tmp_path / "full" / "bench.json").read_text())
    data = rd.collect(bench_only)
    assert len(data.shape_rows) == 3 and all(r.source == "bench" for r in data.shape_rows)
    doc, ids = report_draw.render_html(data)
    assert len(ids) == 2  # comparison and heatmap
    assert doc.count('class="missing"') >= 2

    db_only = tmp_path / "db_only"
    db_only.mkdir()
    db = json.loads((tmp_path / "full" / "best_configs.json").read_text())
    db["entries"][0]["arch"] = "sm100"
    db["entries"][0]["config"] = Config.make("sm100").to_dict()
    (db_only / "best_configs.json").write_text(json.dumps(db))
    data = rd.collect(db_only)
    assert len(data.best_configs) == 3 and data.shape_rows == []
    doc, ids = report_draw.render_html(data)
    assert ids == []
    assert "never run on hardware" in doc  # an sm100 entry appears
    assert "tile_m=128" in doc


def test_several_devices_are_told_apart(tmp_path):
    records = []
    for device in ("NVIDIA H200", "NVIDIA H100 80GB HBM3"):
        for impl, us in (("tuned", 10.0), ("flash_attn_4", 12.0)):
            records.append({"problem": SHAPES[0].to_dict(), "arch": "sm90", "device": device, "impl": impl,
                            "us": us, "tflops": None, "status": "ok"})
    (tmp_path / "bench.json").write_text(json.dumps(records))
    data = rd.collect(tmp_path)
    assert len(data.shape_rows) == 2 and data.devices == ["NVIDIA H100 80GB HBM3", "NVIDIA H200"]
    fig = report_draw.comparison_figure(data.shape_rows)
    assert all("NVIDIA" in x for x in fig.data[0].x)  # the device is part of each x label
    (heatmap,) = data.heatmaps
    assert heatmap.y == ["NVIDIA H100 80GB HBM3: sm90 fp16 D128 H32/8 full", "NVIDIA H200: sm90 fp16 D128 H32/8 full"]
    assert heatmap.z == [[1.2], [1.2]]


def test_history_uses_the_searchs_trial_numbers(tmp_path):
    write_synthetic_results(tmp_path, n_trials=20)
    data = rd.collect(tmp_path)
    study = max(data.studies, key=lambda s: s.n_trials - s.outcomes.get("ok", 0))  # the most failures
    assert study.outcomes.get("ok", 0) < study.n_trials  # so successful numbers have gaps
    fig = report_draw.history_figure(study)
    points = next(t for t in fig.data if t.mode == "markers")
    assert list(points.x) == [n for n, _, _ in study.history]
    assert list(points.y) == [us for _, us, _ in study.history]
    assert study.best["number"] in points.x
