"""Fixtures of the GPU tests that go through `fa4.attention` (the kernel suites call the compiled
kernels directly and need none)."""

from __future__ import annotations

import json

import pytest

import fa4
from fa4 import database


@pytest.fixture
def empty_database(tmp_path):
    """A fresh, empty best-config database for the runtime, and fresh runtime caches: what a test
    runs is the heuristic default unless it records or forces a configuration."""
    path = tmp_path / "best.json"
    path.write_text(json.dumps({"schema": database.SCHEMA_VERSION, "entries": []}))
    fa4.use_config_db(path)
    fa4.reset_caches()
    yield path
    fa4.use_config_db(None)
    fa4.reset_caches()
