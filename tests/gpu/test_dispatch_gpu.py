"""Fastest-backend dispatch and warmup on a Hopper GPU: each backend forced and chosen by the database,
on real tensors, checked against `fa4.reference` (rtol = atol = 1e-2) and spied on to show that the
chosen implementation is the one that ran; a CUDA-graph capture of a never-seen shape; fa4.warmup.

    python -m pytest -m gpu -q tests/gpu/test_dispatch_gpu.py

Self-contained: every test uses its own best-config database (written here, with made-up measured
times that make a given implementation the winner: what is tested is that the runtime follows the
database, not which implementation is fastest). About 5 compiles of flash-attn-4 and 2 of ours.
"""

from __future__ import annotations

import dataclasses
import pytest
import torch

import fa4
from fa4 import backends, database, dispatch, kernels
from fa4.kernels import AttentionProblem
from fa4.reference import check

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("empty_database")]

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


@pytest.fixture
def ran(monkeypatch):
    """The names of the peers that ran, in order (a spy around `fa4.backends.runner`)."""
    names: list[str] = []
    real = backends.runner

    def spying_runner(name, causal):
        run = real(name, causal)

        def spy(q, k, v, scale, return_lse):
            names.append(name)
            return run(q, k, v, scale, return_lse)

        return spy

    monkeypatch.setattr(backends, "runner", spying_runner)
    return names


def make_qkv(problem: AttentionProblem, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dtype = DTYPES[problem.dtype]
    return tuple(torch.randn(problem.batch, s, h, problem.head_dim, device="cuda", dtype=dtype, generator=gen)
                 for s, h in ((problem.seqlen_q, problem.heads_q), (problem.seqlen_k, problem.heads_kv),
                              (problem.seqlen_k, problem.heads_kv)))


def assert_correct(result, q, k, v, causal, return_lse):
    out, lse = result if return_lse else (result, None)
    failures = check(out, lse, q, k, v, causal)
    assert not failures, failures
    assert out.shape == q.shape and out.dtype == q.dtype


def record_times(path, problem: AttentionProblem, times: dict) -> None:
    """An entry for `problem` on this GPU, tuned on the current kernel sources, whose implementations
    were measured as `times` (GPU us)."""
    config = kernels.default_config("sm90", problem)
    entry = database.Entry.from_result(
        arch="sm90", device=torch.cuda.get_device_name(), problem=problem, config=config.to_dict(),
        us=times["ours"], tflops=1.0, default_us=times["ours"], peers_us={}, max_err=0.0,
        kernel_fingerprint=kernels.kernel_fingerprint("sm90"), versions={}, study="test", trial=0)
    database.record(dataclasses.replace(entry, backend_us=dict(times), backend_source="test"), path)
    fa4.use_config_db(path)


def needs(name):
    why = backends.import_error(name)
    if why:
        pytest.skip(why)


# the shapes: GQA with Sq != Sk both ways (bottom-right causal, rows without keys), and MHA
GQA_SHORT_Q = AttentionProblem(1, 200, 517, 8, 2, 64, "fp16")
GQA_LONG_Q = AttentionProblem(1, 517, 200, 8, 2, 128, "bf16")
MHA = AttentionProblem(2, 256, 256, 8, 8, 128, "bf16")


# (problem, causal, return_lse): few cases, since flash-attn-4 compiles each (a few seconds)
FLASH_ATTN_4_CASES = [(GQA_SHORT_Q, False, False), (GQA_SHORT_Q, True, True), (GQA_LONG_Q, True, True)]


@pytest.mark.parametrize("problem,causal,return_lse", FLASH_ATTN_4_CASES,
                         ids=["sq200_sk517_full", "sq200_sk517_causal_lse", "sq517_sk200_causal_lse"])
def test_flash_attn_4_forced(problem, causal, return_lse, ran):
    needs("flash_attn_4")
    q, k, v = make_qkv(problem)
    result = fa4.attention(q, k, v, causal=causal, return_lse=return_lse, backend="flash_attn_4")
    assert_correct(result, q, k, v, causal, return_lse)
    assert ran == ["flash_attn_4"]


@pytest.mark.parametrize("name", ["sdpa_flash", "sdpa_cudnn"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sdpa_backend_forced(name, causal, ran):
    q, k, v = make_qkv(MHA)
    # the backend is pinned (sdpa_kernel): it ran, or the call would have raised
    assert_correct(fa4.attention(q, k, v, causal=causal, backend=name), q, k, v, causal, False)
    assert ran == [name]
    with pytest.raises(fa4.UnsupportedInputError, match="returns no LSE"):
        fa4.attention(q, k, v, causal=causal, return_lse=True, backend=name)


def test_sdpa_flash_forced_with_gqa_and_bottom_right_causal(ran):
    q, k, v = make_qkv(GQA_SHORT_Q)
    assert_correct(fa4.attention(q, k, v, causal=True, backend="sdpa_flash"), q, k, v, True, False)
    assert ran == ["sdpa_flash"]


def test_sdpa_cudnn_with_gqa_runs_or_says_it_cannot(ran):
    """cuDNN may refuse enable_gqa (it depends on the torch and cuDNN versions); the runtime never
    expands K and V per call, so a refusal is an error naming cuDNN, never a wrong or slow result."""
    problem = AttentionProblem(1, 256, 256, 8, 2, 128, "fp16")
    q, k, v = make_qkv(problem)
    try:
        out = fa4.attention(q, k, v, causal=True, backend="sdpa_cudnn")
    except fa4.UnsupportedInputError as exc:
        assert "backend='sdpa_cudnn' cannot run these inputs: SDPA cuDNN raised" in str(exc)
        print(f"cuDNN refused GQA here: {exc}")
        return
    assert_correct(out, q, k, v, True, False)
    assert ran == ["sdpa_cudnn"]


@pytest.mark.parametrize("name", ["flash_attn_4", "sdpa_flash", "sdpa_cudnn"])
def test_auto_runs_the_implementation_the_database_measured_fastest(name, empty_database, ran):
    if name == "flash_attn_4":
        needs(name)
    problem = dataclasses.replace(MHA, causal=True)
    # far apart: the peer wins eagerly (whatever the host times) and under graphs
    record_times(empty_database, problem, {"ours": 5000.0, name: 100.0})
    q, k, v = make_qkv(problem)
    plan = fa4.explain(q, k, v, causal=True)
    assert plan.runs == {"eager": name, "graph": name}, str(plan)
    assert "50.000x faster" in str(plan)
    compiles = fa4.cache_info()["compiles"]
    for _ in range(2):
        assert_correct(fa4.attention(q, k, v, causal=True), q, k, v, True, False)
    assert ran == [name, name]
    assert fa4.cache_info()["compiles"] == compiles  # ours was not needed
    # (backend="ours" overriding the database: tests/test_runtime_dispatch.py, without a compile here)
    assert fa4.explain(q, k, v, causal=True, backend="ours").runs == {"eager": "ours", "graph": "ours"}


def test_graph_only_winner_runs_under_cuda_graph_capture(empty_database, ran):
    """The bench's B1 S1024 causal (docs/measurements.md): flash-attn-4's kernel 2 % faster, so it runs under a capture and
    through the custom op; eagerly ours runs where this GPU's host times say so (the H200's do)."""
    needs("flash_attn_4")
    problem = AttentionProblem(1, 1024, 1024, 32, 8, 128, "fp16", True)
    record_times(empty_database, problem, {"ours": 22.03, "flash_attn_4": 21.56})
    q, k, v = make_qkv(problem)
    plan = fa4.explain(q, k, v, causal=True)
    assert plan.runs["graph"] == "flash_attn_4", str(plan)
    eager = plan.runs["eager"]
    fa4.attention(q, k, v, causal=True)  # first call: decides, compiles, runs flash-attn-4 once too
    ran.clear()
    assert_correct(fa4.attention(q, k, v, causal=True), q, k, v, True, False)
    assert ran == ([] if eager == dispatch.OURS else ["flash_attn_4"])
    # the custom op (what torch.compile calls) runs graph mode's choice
    op_out, _ = torch.ops.fa4.attention(q, k, v, True, None, False, None, "error", False)
    assert ran[-1] == "flash_attn_4"
    assert_correct(op_out, q, k, v, True, False)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fa4.attention(q, k, v, causal=True)
    assert ran[-1] == "flash_attn_4"
    q2, k2, v2 = make_qkv(problem, seed=1)
    q.copy_(q2), k.copy_(k2), v.copy_(v2)
    graph.replay()
    torch.cuda.synchronize()
    assert_correct(out, q2, k2, v2, True, False)


def test_capture_of_a_never_seen_shape_names_the_warmup(empty_database):
    problem = AttentionProblem(1, 384, 384, 16, 4, 128, "fp16", True)
    q, k, v = make_qkv(problem)
    # a configuration no other test of this process compiles (the default here is 192 x 80): this
    # shape's kernel is truly unseen
    forced = {"tile_m": 128, "tile_n": 96, "kv_stages": 3}
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(fa4.NotWarmedUpError) as info:
        with torch.cuda.graph(graph):
            fa4.attention(q, k, v, causal=True, config=forced)
    assert f"fa4.warmup(fa4.kernels.{problem!r})" in str(info.value)
    del graph
    [plan] = fa4.warmup((q, k, v), causal=True, config=forced)
    assert plan.compiled and plan.runs == {"eager": "ours", "graph": "ours"}
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fa4.attention(q, k, v, causal=True, config=forced)
    graph.replay()
    torch.cuda.synchronize()
    assert_correct(out, q, k, v, True, False)


def test_warmup_of_a_problem_then_other_lengths_compile_nothing():
    problem = AttentionProblem(1, 1024, 1024, 32, 8, 128, "fp16", True)
    [plan] = fa4.warmup(problem)
    compiles = fa4.cache_info()["compiles"]
    for seqlen in (1000, 1024):
        p = dataclasses.replace(problem, seqlen_q=seqlen, seqlen_k=seqlen)
        q, k, v = make_qkv(p, seed=seqlen)
        assert_correct(fa4.attention(q, k, v, causal=True), q, k, v, True, False)
    assert fa4.cache_info()["compiles"] == compiles and plan.compiled
