"""`fa4tune search` of a variable-length batch on the H200, tiny: the real evaluator compiles our varlen
kernel in worker processes, validates O and LSE on the packed tensors by the one rule against the
per-sequence references, times it by CUDA-graph replay; flash-attn-4's varlen kernel and the
per-sequence path are timed in the same run; the entry is recorded under the varlen key; then
`fa4.attention_varlen` runs the tuned configuration (forced ours: correct; auto: the measured winner).

    python -m pytest -m gpu -q tests/gpu/test_varlen_search_gpu.py
"""

from __future__ import annotations

import pytest
import torch

import fa4
from fa4 import kernels, varlen
from fa4.database import BestConfigDB
from fa4.kernels import Config
from fa4.varlen_batch import VarlenProblem
from fa4tune.progress import Progress
from fa4tune.searches.runner import SearchSettings, run_search

pytestmark = pytest.mark.gpu

# one long sequence among short ones, with LSE: 2048 + 15 x 96 = 3488 query tokens
BATCH = VarlenProblem.of([2048] + [96] * 15, heads_q=16, heads_kv=4, head_dim=128, dtype="bf16", causal=True,
                         return_lse=True)


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    folder = tmp_path_factory.mktemp("varlen-search")
    settings = SearchSettings(trials=4, processes=4, storage=str(folder / "studies.journal"),
                              db_path=str(folder / "db.json"), retime_rounds=1, trial_timeout_s=60,
                              peers=("flash_attn_4", "sdpa_cudnn"))
    [summary] = run_search("sm90", [BATCH], settings, Progress(quiet=True))
    return folder, summary


def test_a_varlen_search_validates_times_and_records(searched):
    folder, summary = searched
    assert summary["outcomes"]["ok"] >= 1, summary["outcomes"]
    assert summary["default_us"] is not None   # the default passed the rule on the packed batch
    assert summary["outcomes"].get("mismatch", 0) == 0
    peers = summary["peers"]
    assert peers["per_sequence"]["us"] > 0 and "error" in peers["sdpa_cudnn"]   # SDPA has no varlen kernel
    [entry] = BestConfigDB.load(folder / "db.json").entries
    assert "causal-varlen" in entry.key and entry.key.endswith("|t4096") and entry.varlen["lengths_q"] == list(BATCH.lengths_q)
    assert entry.kernel_fingerprint == kernels.kernel_fingerprint("sm90")
    assert {"ours", "per_sequence"} <= set(entry.backend_us)
    if "us" in peers["flash_attn_4"]:
        assert entry.backend_us["flash_attn_4"] == peers["flash_attn_4"]["us"]


def test_the_runtime_runs_the_tuned_varlen_configuration(searched):
    folder, summary = searched
    fa4.use_config_db(folder / "db.json")
    fa4.reset_caches()
    try:
        gen = torch.Generator(device="cuda").manual_seed(1)
        q = torch.randn(BATCH.tokens_q, 16, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
        k, v = (torch.randn(BATCH.tokens_k, 4, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
        cu_q, cu_k = (torch.tensor(c, dtype=torch.int32, device="cuda") for c in BATCH.cu_seqlens())
        args = (q, k, v, cu_q, cu_k, BATCH.seqlen_q, BATCH.seqlen_k)
        choice = fa4.explain_varlen(*args, causal=True, return_lse=True)
        assert choice.source == "exact" and choice.config == Config.from_dict("sm90", summary["best"]["config"])
        assert "chosen by: tuned, exact entry" in str(choice)
        entry = BestConfigDB.load(folder / "db.json").entries[0]
        peer_us = entry.backend_us.get("flash_attn_4")
        if peer_us is not None and varlen.unsupported("flash_attn_4", q) is None:
            want = "ours" if entry.backend_us["ours"] <= peer_us * 1.01 else "flash_attn_4"
            assert choice.implementation == want, str(choice)
        out, lse = fa4.attention_varlen(*args, causal=True, return_lse=True, backend="ours")
        want_out, want_lse = varlen.reference_varlen(q, k, v, cu_q, cu_k, True)
        torch.testing.assert_close(out.float(), want_out, rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(lse, want_lse, rtol=1e-2, atol=1e-2)
    finally:
        fa4.use_config_db(None)
        fa4.reset_caches()
