"""Warm start (fake kernel and evaluator): a new study is seeded with the nearest tuned configurations
of its architecture, dtype and head dim, its own mask first, then the other."""

from __future__ import annotations

from dataclasses import replace

import optuna

import test_search_fakes as fakes
from fa4.database import Entry, record
from fa4.kernels import AttentionProblem, Config
from fa4tune.progress import Progress
from fa4tune.searches.runner import SearchSettings, run_search
from fa4tune.inputs.shapes import shape_key
from fa4tune.searches.storage import open_storage

CAUSAL = AttentionProblem(1, 1024, 1024, 32, 8, 128, "fp16", causal=True)
FAST = Config.make("sm90", tile_n=112, scheduler="lpt", kv_stages=3, rescale_threshold=0.0)  # the fake optimum
NEAR = Config.make("sm90", tile_n=96, scheduler="static")
OTHER_MASK = Config.make("sm90", tile_n=128, kv_stages=4)
EVALUATOR = "test_search_fakes:FakeEvaluator"


def _entry(problem: AttentionProblem, config: Config, fingerprint="fake-fingerprint-1", device="Fake H200") -> Entry:
    return Entry.from_result(arch="sm90", device=device, problem=problem, config=config.to_dict(), us=1.0,
                             tflops=1.0, default_us=None, peers_us={}, max_err=None,
                             kernel_fingerprint=fingerprint, versions={}, study="s", trial=0)


def _settings(tmp_path, **kw) -> SearchSettings:
    base = dict(trials=3, processes=2, storage=str(tmp_path / "studies.journal"), db_path=str(tmp_path / "db.json"),
                evaluator=EVALUATOR, kernel_api="test_search_fakes", peers=(), sampler="random", seed=3,
                record_db=False)
    base.update(kw)
    return SearchSettings(**base)


def test_a_new_study_is_seeded_with_its_nearest_tuned_neighbours(tmp_path):
    db = tmp_path / "db.json"
    far = replace(CAUSAL, seqlen_q=16384, seqlen_k=16384)
    record(_entry(replace(CAUSAL, seqlen_q=2048, seqlen_k=2048), NEAR), db)             # same mask, one bucket off
    record(_entry(far, FAST), db)                                                         # same mask, far
    record(_entry(replace(CAUSAL, causal=False), OTHER_MASK), db)                        # the other mask
    record(_entry(replace(CAUSAL, seqlen_q=4096, seqlen_k=4096), Config.make("sm90", tile_n=64),
                  fingerprint="old"), db)                                                 # stale: never
    record(_entry(replace(CAUSAL, head_dim=64, seqlen_q=2048, seqlen_k=2048), Config.make("sm90", tile_n=80)), db)
    record(_entry(replace(CAUSAL, dtype="bf16"), Config.make("sm90", tile_n=144)), db)  # other dtype: never
    record(_entry(replace(CAUSAL, seqlen_q=512, seqlen_k=512), Config.make("sm90", tile_m=192, tile_n=192)), db)
    [summary] = run_search("sm90", [CAUSAL], _settings(tmp_path, trials=6), Progress(quiet=True))
    study = optuna.load_study(study_name=shape_key("sm90", CAUSAL), storage=open_storage(tmp_path / "studies.journal"))
    first = study.trials[:5]
    assert first[0].user_attrs["is_default"] and first[0].params == Config.make("sm90").to_dict()
    seeds = [(t.params, t.user_attrs.get("warm_start")) for t in first[1:4]]
    # own mask, nearest first (the 192x192 entry is infeasible here but is still a configuration to try),
    # then the other mask; at most two per mask
    assert [p for p, _ in seeds] == [NEAR.to_dict(), Config.make("sm90", tile_m=192, tile_n=192).to_dict(),
                                     OTHER_MASK.to_dict()]
    assert all(key and key.startswith("sm90|Fake H200|fp16|d128|") for _, key in seeds)
    assert first[4].user_attrs.get("warm_start") is None
    assert summary["evaluated"] == 6


def test_warm_start_finds_a_neighbours_optimum_at_once_and_seeds_only_new_studies(tmp_path):
    db = tmp_path / "db.json"
    record(_entry(replace(CAUSAL, seqlen_q=2048, seqlen_k=2048), FAST), db)
    [warm] = run_search("sm90", [CAUSAL], _settings(tmp_path), Progress(quiet=True))
    assert warm["best"]["config"] == FAST.to_dict() and warm["best"]["us"] == fakes.fake_us(FAST.to_dict())
    [cold] = run_search("sm90", [CAUSAL], _settings(tmp_path / "cold", warm_start=False, db_path=str(db)),
                        Progress(quiet=True))
    assert cold["best"]["us"] > warm["best"]["us"]
    # a resumed study is not seeded again
    run_search("sm90", [CAUSAL], _settings(tmp_path, trials=4), Progress(quiet=True))
    study = optuna.load_study(study_name=shape_key("sm90", CAUSAL), storage=open_storage(tmp_path / "studies.journal"))
    assert sum(1 for t in study.trials if t.user_attrs.get("warm_start")) == 1


def test_a_retune_after_a_kernel_change_starts_from_its_own_stale_winner(tmp_path):
    """The stale entry of the study's own bucket (tuned before a kernel change) is the first seed;
    a stale neighbour is still never one."""
    db = tmp_path / "db.json"
    record(_entry(CAUSAL, FAST, fingerprint="old"), db)                                   # own bucket, stale
    record(_entry(replace(CAUSAL, seqlen_q=4096, seqlen_k=4096), Config.make("sm90", tile_n=64),
                  fingerprint="old"), db)                                                 # stale neighbour
    record(_entry(replace(CAUSAL, seqlen_q=2048, seqlen_k=2048), NEAR), db)
    run_search("sm90", [CAUSAL], _settings(tmp_path, trials=4), Progress(quiet=True))
    study = optuna.load_study(study_name=shape_key("sm90", CAUSAL), storage=open_storage(tmp_path / "studies.journal"))
    seeds = [t.params for t in study.trials[1:4] if t.user_attrs.get("warm_start")]
    assert seeds == [FAST.to_dict(), NEAR.to_dict()]
