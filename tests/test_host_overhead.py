"""The host time per eager call: `benchmarks/bench_overhead.py` rows through fa4.attention(backend=...)
beside the direct calls, and `fa4tune.benchmark.host_overhead`, which derives the runtime's table from them."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from fa4.backends import implementations, peers
from fa4tune.benchmark import host_overhead

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_overhead.py"
DIRECT = {"fa4.attention (kernel path)": 9.0, "fa4.attention (kernel path), again at the end": 10.0,
          "torch.empty_like + direct launcher, nothing else": 7.5, "flash-attn-4 flash_attn_func": 80.0,
          "SDPA cuDNN backend": 50.0, "SDPA flash (FA2) backend": 52.0}
THROUGH = {"fa4.attention(backend='ours')": 9.4, "fa4.attention(backend='flash_attn_4')": 90.0,
           "fa4.attention(backend='sdpa_cudnn')": 56.0}  # sdpa_flash: refused here (an error row)


def _run(tmp_path, name, rows, device="NVIDIA H200"):
    path = tmp_path / name
    doc = {"device": device, "rows": [{"name": n, "host_us": us} for n, us in rows.items()]
           + [{"name": "fa4.attention(backend='sdpa_flash')", "error": "UnsupportedInputError: refused"}]}
    path.write_text(json.dumps(doc))
    return str(path)


def test_the_table_prefers_the_calls_through_fa4_attention(tmp_path):
    old = _run(tmp_path, "old.json", DIRECT)                   # a run made before the through rows
    new = _run(tmp_path, "new.json", {**DIRECT, **THROUGH})
    [h200] = host_overhead.derive([old, new])["devices"].values()
    assert h200["measured"] == {"ours": "through fa4.attention", "flash_attn_4": "through fa4.attention",
                                "sdpa_cudnn": "through fa4.attention", "sdpa_flash": "called directly"}
    assert h200["host_us"] == {"ours": 9.4, "flash_attn_4": 90.0, "sdpa_cudnn": 56.0, "sdpa_flash": 52.0}
    # only old runs: the direct calls, ours from fa4.attention's kernel path (the median of its rows)
    [h200] = host_overhead.derive([old])["devices"].values()
    assert h200["host_us"] == {"ours": 9.5, "flash_attn_4": 80.0, "sdpa_cudnn": 50.0, "sdpa_flash": 52.0}
    assert set(h200["measured"]) == set(implementations()) and h200["measured"]["flash_attn_4"] == "called directly"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_overhead", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_bench_times_every_backend_under_the_names_the_table_reads(bench):
    source = SCRIPT.read_text()
    # every implementation through fa4.attention, every peer directly: both from the registry
    assert "for name in backends.implementations():" in source
    assert "add(through_row(name), lambda name=name: fa4.attention(q, k, v, causal=causal, backend=name)" in source
    assert "for peer in backends.peers():" in source and "add(peer.direct_row, call, note)" in source
    assert "add(direct_row(backends.OURS), allocate_and_launch," in source
    assert all(f'"{row}"' in source for row in host_overhead.KERNEL_PATH_ROWS)
    # the direct rows of the runs already made (results/*/overhead_*.json) keep their names
    assert [p.direct_row for p in peers()] == ["flash-attn-4 flash_attn_func", "SDPA cuDNN backend",
                                               "SDPA flash (FA2) backend"]


def test_the_bench_sets_through_beside_direct(bench):
    rows = [{"name": n, "host_us": us} for n, us in {**DIRECT, **THROUGH}.items()]
    rows.append({"name": "fa4.attention(backend='sdpa_flash')", "error": "UnsupportedInputError: refused"})
    lines = bench.through_vs_direct(rows)
    assert lines[0].startswith("# host us per eager call, through fa4.attention")
    by_impl = {line.split()[1]: line for line in lines[1:]}
    assert "90.00 vs    80.00 (+10.00 us)" in by_impl["flash_attn_4"]
    assert "9.40 vs     7.50 (+1.90 us)" in by_impl["ours"]
    assert "through: UnsupportedInputError: refused" in by_impl["sdpa_flash"]
