"""The report reads exactly what `fa4tune search` and `fa4tune bench` write.

Runs the real search and bench code on CPU with the search tests' fake kernel API and evaluator
(tests/test_search_fakes.py), then checks that the report's numbers are the search's own.
"""

from __future__ import annotations

import pytest

from fa4.kernels import AttentionProblem
from fa4tune.report import data as rd
from fa4tune.report import draw as report_draw
from fa4tune.benchmark.runner import run_bench, write_bench
from fa4tune.searches.runner import Progress, SearchSettings, run_search, shape_key

FAKES = dict(evaluator="test_search_fakes:FakeEvaluator")
PROBLEMS = [AttentionProblem(1, 1024, 1024, 32, 8, 128, "fp16", causal) for causal in (False, True)]


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    folder = tmp_path_factory.mktemp("results")
    settings = SearchSettings(trials=16, processes=2, storage=str(folder / "studies.journal"),
                              db_path=str(folder / "best_configs.json"), kernel_api="test_search_fakes",
                              seed=1, **FAKES)
    summaries = run_search("sm90", PROBLEMS, settings, Progress(quiet=True))
    doc = run_bench("sm90", PROBLEMS, db_path=str(folder / "best_configs.json"), processes=2,
                    api="test_search_fakes", progress=Progress(quiet=True), **FAKES)
    write_bench(doc, folder / "bench.json", None)
    assert sorted(s["study"] for s in summaries) == sorted(shape_key("sm90", p) for p in PROBLEMS)
    return folder, {s["study"]: s for s in summaries}, doc


def test_report_numbers_are_the_searchs(searched):
    folder, summaries, bench = searched
    data = rd.collect(folder)
    assert not data.missing
    assert sorted(s.name for s in data.studies) == sorted(summaries)
    for study in data.studies:
        summary = summaries[study.name]
        assert {o: n for o, n in study.outcomes.items() if n} == {
            o: n for o, n in summary["outcomes"].items() if n}
        assert study.best["us"] == pytest.approx(summary["best"]["us"])
        assert study.best["params"] == summary["best"]["config"]
        assert study.default_us == pytest.approx(summary["default_us"])
        assert study.device["name"] == "Fake H200"
        assert study.fingerprint_state == "stale"  # the fake kernel's fingerprint is not ours
    # one bench row per shape, each variant's time as the bench measured it
    assert [r.source for r in data.shape_rows] == ["bench", "bench"]
    for row in data.shape_rows:
        for rec in (r for r in bench["rows"] if r["problem"] == row.problem):
            entry = row.impls[rec["variant"]]
            if rec["outcome"] == "ok":
                assert entry["us"] == pytest.approx(rec["us"])
                # the report labels every implementation, the bench's "dispatched" included, against tuned
                if rec["variant"] in rd.impls()[1:] and rec.get("speedup_of_tuned"):
                    assert row.speedup[rec["variant"]] == pytest.approx(rec["speedup_of_tuned"], rel=1e-2)
            else:
                assert "error" in entry
    assert len(data.best_configs) == 2 and all(r.device == "Fake H200" for r in data.best_configs)
    assert all(r.config == summaries[r.study]["best"]["config"] for r in data.best_configs)
    doc, ids = report_draw.render_html(data)
    assert len(ids) == 4 + 2 * 2
