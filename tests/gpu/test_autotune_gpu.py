"""Autotune on first use on the H200: FA4_AUTOTUNE=quick tunes a shape nobody tuned on its first call,
within the stated budget, records it in the user's database, and runs the tuned configuration.

    python -m pytest -m gpu -q tests/gpu/test_autotune_gpu.py

Needs the harness installed (`pip install -e .`: its tuner is found through the entry point group
`fa4.tuners`)."""

from __future__ import annotations

import time

import pytest
import torch

import fa4
from fa4 import autotuning, database
from fa4.reference import check

pytestmark = pytest.mark.gpu

# the call compiles the winner in this process after the tune, as any first call does (~5 s cold)
COMPILE_SLACK_S = 30.0


def test_quick_autotune_tunes_an_unseen_shape_within_its_budget(tmp_path, monkeypatch):
    monkeypatch.setenv("FA4TUNE_HOME", str(tmp_path))
    monkeypatch.delenv("FA4_CONFIG_DB", raising=False)
    monkeypatch.setenv(autotuning.ENV_VAR, "quick")
    fa4.use_config_db(None)
    fa4.reset_caches()
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 640, 8, 64, device="cuda", dtype=torch.float16, generator=gen) for _ in range(3))
    assert fa4.explain(q, k, v).source in ("nearest", "default")
    try:
        t0 = time.monotonic()
        out = fa4.attention(q, k, v)
        torch.cuda.synchronize()
        took = time.monotonic() - t0
        assert not check(out, None, q, k, v, False, None)
        entries = [e for e in database.BestConfigDB.load(database.user_path()).entries
                   if e.study == "autotune-quick"]
        assert len(entries) == 1, entries
        explained = fa4.explain(q, k, v)
        assert explained.source == "exact" and explained.config.to_dict() == entries[0].config
        assert took < autotuning.BUDGET_S["quick"] + COMPILE_SLACK_S, took
        print(f"autotuned in {took:.1f} s: {entries[0].us:.2f} us, default {entries[0].default_us} us")
        slow_calls = fa4.cache_info()["slow_calls"]
        fa4.attention(q, k, v)
        assert fa4.cache_info()["slow_calls"] == slow_calls   # tuned once: later calls take the kernel path
    finally:
        fa4.reset_caches()
