"""fa4.prediction: the implementation predicted for a shape without measured times, from its neighbours."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from fa4 import prediction
from fa4.kernels import AttentionProblem


def entry(key, seqlen, times, *, batch=1, hq=32, hkv=8, dtype="bf16", d=128, causal=True, device="H200"):
    problem = {"batch": batch, "seqlen_q": seqlen, "seqlen_k": seqlen, "heads_q": hq, "heads_kv": hkv}
    return SimpleNamespace(key=key, arch="sm90", device=device, dtype=dtype, head_dim=d, causal=causal,
                           problem=problem, backend_us=dict(times))


FA4_WINS = {"ours": 100.0, "flash_attn_4": 80.0, "sdpa_cudnn": 120.0}
OURS_WINS = {"ours": 100.0, "flash_attn_4": 110.0, "sdpa_cudnn": 120.0}
CALL = AttentionProblem(1, 3000, 3000, 32, 8, 128, "bf16", True)


def predict(entries, usable=lambda name: True):
    return prediction.predict(entries, CALL, "graph", {}, usable)


def test_features_are_log2_steps():
    a = {"batch": 1, "seqlen_q": 1024, "seqlen_k": 1024, "heads_q": 32, "heads_kv": 8}
    b = dict(a, seqlen_q=2048, seqlen_k=2048, batch=2)
    c = dict(a, heads_kv=4)  # GQA 4 -> 8
    assert prediction.distance(a, b) == pytest.approx(3.0)
    assert prediction.distance(a, c) == pytest.approx(1.0)


def test_confident_when_the_nearest_agree():
    got = predict([entry("a", 2048, FA4_WINS), entry("b", 4096, FA4_WINS), entry("far", 32768, OURS_WINS)])
    assert got.backend == "flash_attn_4" and got.confident
    assert [n.key for n in got.neighbours] == ["b", "a"]  # 3000 is nearer 4096 than 2048
    assert got.neighbours[1].ratio == pytest.approx(1.25)


def test_disagreement_falls_back_to_the_region_vote():
    # the vote is over the VOTERS nearest (3): a, b, c; the far d has no say
    entries = [entry("a", 2048, FA4_WINS), entry("b", 4096, OURS_WINS), entry("c", 512, FA4_WINS),
               entry("d", 32768, OURS_WINS), entry("e", 65536, OURS_WINS)]
    got = predict(entries)
    assert prediction.VOTERS == 3
    assert not got.confident and got.backend == "flash_attn_4" and got.votes == {"flash_attn_4": 2, "ours": 1}
    assert "disagree" in got.reason
    # a tie in the vote keeps ours
    tie = predict([entry("a", 2048, FA4_WINS), entry("b", 4096, OURS_WINS)])
    assert not tie.confident and tie.backend == "ours"


def test_one_neighbour_is_confident_only_when_close():
    assert predict([entry("a", 3000, FA4_WINS)]).confident
    far = predict([entry("a", 8192, FA4_WINS)])
    assert not far.confident and far.backend == "flash_attn_4"  # the region's only vote


def test_an_implementation_that_cannot_run_here_is_never_predicted():
    got = predict([entry("a", 2048, FA4_WINS), entry("b", 4096, FA4_WINS)], usable=lambda n: n != "flash_attn_4")
    assert got.backend == "ours" and got.confident


def test_region_keeps_only_the_same_kind_of_problem():
    same = entry("same", 2048, FA4_WINS)
    others = [entry("fp16", 2048, FA4_WINS, dtype="fp16"), entry("d64", 2048, FA4_WINS, d=64),
              entry("full", 2048, FA4_WINS, causal=False), entry("b200", 2048, FA4_WINS, device="B200"),
              entry("unmeasured", 2048, {"ours": 1.0})]
    assert prediction.region([same] + others, "sm90", "H200", CALL) == [same]
    assert predict([]) is None


def test_eager_weighs_host_time_against_gpu_time_scaled_to_the_shape():
    # flash-attn-4 is 1.25x faster on the GPU at a long neighbour, but at a shape 64x smaller its
    # 90 us of host time per eager call is more than either kernel: ours runs eager, flash-attn-4 graph
    big = [entry("a", 8192, FA4_WINS), entry("b", 16384, FA4_WINS)]
    host = {"ours": 10.0, "flash_attn_4": 90.0}
    small = AttentionProblem(1, 1024, 1024, 32, 8, 128, "bf16", True)
    graph = prediction.predict(big, small, "graph", host, lambda n: True)
    eager = prediction.predict(big, small, "eager", host, lambda n: True)
    assert graph.backend == "flash_attn_4"
    assert eager.backend == "ours"
