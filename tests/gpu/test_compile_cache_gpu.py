"""The on-disk kernel cache on a Hopper GPU: a kernel loaded from disk gives the compiled kernel's
result, and a fresh process's first call is timed cold (compile) and warm (load).

    python -m pytest -m gpu -q -s tests/gpu/test_compile_cache_gpu.py

The measured first-call times print with -s (docs/runtime.md quotes them).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import fa4
from fa4 import compile_cache, database
from fa4.reference import check

pytestmark = pytest.mark.gpu

FIRST_CALL = textwrap.dedent("""
    import json, sys, time, torch, fa4
    fa4.use_config_db(sys.argv[1])
    q = torch.randn(1, 1024, 32, 128, device="cuda", dtype=torch.float16)
    k = torch.randn(1, 1024, 8, 128, device="cuda", dtype=torch.float16)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fa4.attention(q, k, k, causal=True)
    torch.cuda.synchronize()
    print(json.dumps({"first_call_s": time.perf_counter() - t0}))
""")


@pytest.fixture
def cache_env(tmp_path, monkeypatch):
    db = tmp_path / "best.json"
    db.write_text(json.dumps({"schema": database.SCHEMA_VERSION, "entries": []}))
    monkeypatch.setenv("FA4TUNE_DISK_CACHE", "1")
    monkeypatch.setenv("FA4TUNE_CACHE_DIR", str(tmp_path / "kernels"))
    fa4.use_config_db(db)
    fa4.reset_caches()
    yield db, tmp_path / "kernels"
    fa4.use_config_db(None)
    fa4.reset_caches()


def test_a_kernel_loaded_from_disk_matches(cache_env):
    _, folder = cache_env
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 777, 16, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(2, 777, 4, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(2, 777, 4, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    compiled_out, _ = fa4.attention(q, k, v, causal=True, return_lse=True)
    assert len(compile_cache.entries(folder)) == 1
    fa4.reset_caches(compiled=True)  # the one cache's in-process layer: the next call must load
    loaded_out, lse = fa4.attention(q, k, v, causal=True, return_lse=True)
    assert not check(loaded_out, lse, q, k, v, True)
    assert torch.equal(loaded_out, compiled_out)
    assert len(compile_cache.entries(folder)) == 1  # loaded, not compiled and stored again


def test_first_call_of_a_fresh_process_cold_and_warm(cache_env):
    db, folder = cache_env
    env = dict(os.environ)
    times = []
    for _ in range(2):  # cold (compiles and stores), then warm (loads)
        run = subprocess.run([sys.executable, "-c", FIRST_CALL, str(db)], env=env, capture_output=True,
                             text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        times.append(json.loads(run.stdout.strip().splitlines()[-1])["first_call_s"])
    print(f"\nfirst call in a fresh process: cold {times[0]:.2f} s, warm {times[1]:.3f} s")
    assert len(compile_cache.entries(folder)) == 1
    assert times[1] < times[0]
