"""fa4.explain with the real kernel families, on meta tensors (no GPU, no compile): what the runtime
would run on an H200 or a B200, and that sequence lengths do not change the compile key."""

from __future__ import annotations

import json

import pytest
import torch

import fa4
from fa4 import database, kernels
from fa4.kernels import AttentionProblem


@pytest.fixture(autouse=True)
def empty_database(tmp_path):
    path = tmp_path / "best.json"
    path.write_text(json.dumps({"schema": database.SCHEMA_VERSION, "entries": []}))
    fa4.use_config_db(path)
    yield path
    fa4.use_config_db(None)
    fa4.reset_caches()


def meta_qkv(b=1, sq=1024, sk=1024, hq=32, hkv=8, d=128, dtype=torch.float16):
    return tuple(torch.empty(b, s, h, d, dtype=dtype, device="meta")
                 for s, h in ((sq, hq), (sk, hkv), (sk, hkv)))


def test_h200_default_is_the_family_default():
    e = fa4.explain(*meta_qkv(), causal=True, arch="sm90", device_name="NVIDIA H200")
    problem = AttentionProblem(1, 1024, 1024, 32, 8, 128, "fp16", causal=True)
    assert e.path == "kernel" and e.source == "default"
    assert e.config == kernels.default_config("sm90", problem)
    assert not kernels.feasible(e.config, problem)


def test_compile_key_ignores_sequence_lengths_and_batch():
    # one configuration for all sizes (the default's rules pick different ones for some of them)
    config = kernels.default_config("sm90", AttentionProblem(1, 1024, 1024, 32, 8, 128, "fp16"))
    keys = {fa4.explain(*meta_qkv(b=b, sq=s, sk=s + 7), arch="sm90", config=config).compile_key
            for b, s in ((1, 128), (2, 1000), (4, 8192))}
    assert len(keys) == 1
    causal = fa4.explain(*meta_qkv(), causal=True, arch="sm90", config=config).compile_key
    assert causal not in keys


def test_head_dim_the_kernel_lacks():
    with pytest.raises(fa4.UnsupportedInputError, match="head dim 80 is not supported"):
        fa4.explain(*meta_qkv(d=80), arch="sm90")
    assert fa4.explain(*meta_qkv(d=80), arch="sm90", fallback="sdpa").path == "sdpa"


def test_tuned_entry_is_used_on_a_matching_device(empty_database):
    problem = AttentionProblem(1, 1024, 1024, 32, 8, 128, "fp16", causal=False)
    tuned = kernels.default_config("sm90", problem).replace(tile_n=112, kv_stages=3)
    assert not kernels.feasible(tuned, problem)
    database.record(database.Entry.from_result(
        arch="sm90", device="NVIDIA H200", problem=problem, config=tuned.to_dict(), us=28.0,
        tflops=600.0, default_us=30.0, peers_us={"flash_attn_4": 30.0}, max_err=1e-3,
        kernel_fingerprint=kernels.kernel_fingerprint("sm90"), versions={}, study="s", trial=3),
        empty_database)
    fa4.use_config_db(empty_database)
    e = fa4.explain(*meta_qkv(), arch="sm90", device_name="NVIDIA H200")
    assert (e.source, e.config) == ("exact", tuned)
    e = fa4.explain(*meta_qkv(sq=2000, sk=2000), arch="sm90", device_name="NVIDIA H200")
    assert (e.source, e.config) == ("nearest", tuned)
    e = fa4.explain(*meta_qkv(sq=3000, sk=3000), arch="sm90", device_name="NVIDIA H200")
    assert e.source == "default"  # 4 log2 bucket steps away: past the default limit
    assert fa4.explain(*meta_qkv(), arch="sm90", device_name="NVIDIA H100 80GB HBM3").source == "default"


def test_b200_needs_opt_in_and_says_untested():
    gated = fa4.explain(*meta_qkv(), arch="sm100", device_name="NVIDIA B200")  # explained, not raised
    assert gated.config.arch == "sm100" and "raises on sm100 unless allow_untested_sm100=True" in str(gated)
    e = fa4.explain(*meta_qkv(), arch="sm100", device_name="NVIDIA B200", allow_untested_sm100=True)
    assert e.config.arch == "sm100" and "not yet run on hardware" in str(e)


def test_the_real_default_past_the_grid_limits_launches_a_1d_grid():
    e = fa4.explain(*meta_qkv(sq=8192, sk=8192, hq=70_000, hkv=70_000, d=64), arch="sm90",
                    device_name="NVIDIA H200")
    assert e.source == "default" and e.config.scheduler == "single_lpt"
    assert any("70000 heads" in n and "y (70000) > 65535, the limit of the grid's y on NVIDIA H200" in n
               for n in e.notes)
    assert not kernels.feasible(e.config, AttentionProblem(1, 8192, 8192, 70_000, 70_000, 64))
