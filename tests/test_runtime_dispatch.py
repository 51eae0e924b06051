"""fa4.attention's fastest-backend dispatch and fa4.warmup on CPU: stand-in kernels (test_runtime's
`fake` fixture) and stand-in peers that record their calls and compute SDPA, on a pretend H200 whose
host times per call are the shipped ones (`fa4/data/host_overhead.json`).

The real peers run on the GPU: tests/gpu/test_dispatch_gpu.py.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import fa4
from fa4 import backends, checks, database, fallback, runtime
from fa4.checks import InvalidInputError, UnsupportedInputError, device_reasons as real_device_reasons
from fa4.kernels import AttentionProblem
from fa4.reference import attention_fp32 as reference
from test_runtime import add_entry, fake, qkv  # noqa: F401  (fake: the fixture)


class FakePeers:
    """`fa4.backends.runner` stand-in: each peer computes SDPA and records (name, q shape) per call,
    writing NaN in rows that see no key (the runtime must apply our rule there); a peer in `refuse`
    raises as a peer does for inputs it does not take."""

    def __init__(self):
        self.calls: list[tuple[str, tuple]] = []
        self.refuse: set[str] = set()

    def runner(self, name, causal):
        def run(q, k, v, scale, return_lse):
            if name in self.refuse:
                raise RuntimeError(f"{name}: no kernel for these inputs")
            self.calls.append((name, tuple(q.shape)))
            out, lse = fallback.sdpa_attention(q, k, v, causal, scale, return_lse)
            if causal and q.shape[1] > k.shape[1]:  # no defined answer where no key is visible
                out[:, : q.shape[1] - k.shape[1]] = math.nan
            return out, lse

        return run

    def names(self):
        return [name for name, _ in self.calls]


@pytest.fixture
def peers(monkeypatch):
    fake_peers = FakePeers()
    monkeypatch.setattr(backends, "runner", fake_peers.runner)
    monkeypatch.setattr(backends, "unavailable", lambda name: None)
    return fake_peers


def measured(path, times, **shape):
    """A database entry at the qkv() shape whose implementations were timed as `times` (GPU us)."""
    add_entry(path, seqlen=64, us=times["ours"], **shape)
    db = database.BestConfigDB.load(path)
    [entry] = db.entries
    db.put(dataclasses.replace(entry, backend_us=dict(times), backend_source="bench test"))
    db.save(path)
    fa4.use_config_db(path)


def ours_calls(fake):
    return sum(len(launcher.calls) for launcher in fake.sm90.launchers)


def test_auto_runs_the_implementation_measured_fastest_in_both_modes(fake, peers):
    # a long kernel: GPU time decides eager calls too (cuDNN's 50.8 us host time is hidden)
    measured(fake.db_path, {"ours": 1000.0, "sdpa_cudnn": 500.0, "flash_attn_4": 990.0})
    q, k, v = qkv()
    e = fa4.explain(q, k, v)
    assert e.runs == {"eager": "sdpa_cudnn", "graph": "sdpa_cudnn"}
    assert "runs: SDPA cuDNN (eager: max(GPU, host) time 500.0 us vs ours 1000.0 us: 2.000x faster" in str(e)
    for _ in range(2):
        out = fa4.attention(q, k, v)
        torch.testing.assert_close(out.float(), reference(q, k, v, False)[0], rtol=1e-2, atol=1e-2)
    assert peers.names() == ["sdpa_cudnn", "sdpa_cudnn"]
    assert fake.sm90.launchers == []  # ours was not even compiled


def test_a_graph_only_winner_runs_under_capture_and_torch_compile_only(fake, peers, monkeypatch):
    # B1 S1024 causal on the H200: flash-attn-4's kernel 2 % faster, its host time 4x our whole call
    measured(fake.db_path, {"ours": 22.03, "flash_attn_4": 21.56, "sdpa_cudnn": 31.04})
    q, k, v = qkv()
    assert fa4.explain(q, k, v).runs == {"eager": "ours", "graph": "flash_attn_4"}
    fa4.attention(q, k, v)
    # the first eager call also ran flash-attn-4 once (it compiles on first use), so a capture can
    assert peers.names() == ["flash_attn_4"] and ours_calls(fake) == 1
    fa4.attention(q, k, v)
    assert peers.names() == ["flash_attn_4"] and ours_calls(fake) == 2
    out, lse = torch.ops.fa4.attention(q, k, v, False, None, True, None, "error", False)  # graph mode
    assert peers.names() == ["flash_attn_4"] * 2
    monkeypatch.setattr(runtime, "_capturing", lambda: True)
    fa4.attention(q, k, v)  # the cached launch, under a capture
    assert peers.names() == ["flash_attn_4"] * 3 and ours_calls(fake) == 2


def test_ours_where_nothing_says_otherwise(fake, peers):
    q, k, v = qkv()
    # no entry
    assert fa4.explain(q, k, v).runs == {"eager": "ours", "graph": "ours"}
    # a tie within 1 % keeps ours
    measured(fake.db_path, {"ours": 100.0, "flash_attn_4": 99.5})
    assert fa4.explain(q, k, v).runs == {"eager": "ours", "graph": "ours"}
    # at a shape nobody measured, the neighbours' times predict (fa4.prediction): one neighbour 1.3
    # log2 steps away is not confident, so the region votes (its only entry: flash-attn-4 in graph mode)
    measured(fake.db_path, {"ours": 10.0, "flash_attn_4": 5.0})
    assert fa4.explain(q, k, v).runs == {"eager": "ours", "graph": "flash_attn_4"}
    near = fa4.explain(*qkv(sq=100, sk=100))
    assert near.source == "nearest" and near.runs == {"eager": "ours", "graph": "flash_attn_4"}
    assert [(p.mode, p.confident) for p in near.predictions] == [("eager", False), ("graph", False)]
    assert "predicted from the nearest measured shapes" in str(near) and "neighbour sm90|" in str(near)
    # config= forces our kernel's configuration: ours
    assert fa4.explain(q, k, v, config={"tile_n": 96}).runs == {"eager": "ours", "graph": "ours"}
    fa4.attention(q, k, v, config={"tile_n": 96})
    assert peers.calls == []


def test_backend_argument(fake, peers, monkeypatch):
    measured(fake.db_path, {"ours": 1000.0, "sdpa_cudnn": 500.0})
    q, k, v = qkv()
    e = fa4.explain(q, k, v, backend="ours")
    assert e.runs == {"eager": "ours", "graph": "ours"} and "forced: backend='ours'" in str(e)
    fa4.attention(q, k, v, backend="ours")
    assert peers.calls == [] and ours_calls(fake) == 1
    out = fa4.attention(q, k, v, backend="sdpa_flash")  # no measurement needed
    assert peers.names() == ["sdpa_flash"]
    torch.testing.assert_close(out.float(), reference(q, k, v, False)[0], rtol=1e-2, atol=1e-2)
    assert "runs: SDPA flash (FA2) (forced: backend='sdpa_flash')" in str(fa4.explain(q, k, v, backend="sdpa_flash"))
    with pytest.raises(UnsupportedInputError, match="backend='sdpa_cudnn' cannot run.*returns no LSE"):
        fa4.attention(q, k, v, return_lse=True, backend="sdpa_cudnn")
    with pytest.raises(InvalidInputError, match="backend must be one of"):
        fa4.attention(q, k, v, backend="xformers")
    with pytest.raises(InvalidInputError, match="config= configures our kernel"):
        fa4.attention(q, k, v, backend="flash_attn_4", config={"tile_n": 96})
    monkeypatch.setattr(backends, "unavailable", lambda name: f"{name} is not installed here")
    with pytest.raises(UnsupportedInputError, match="flash_attn_4 is not installed here"):
        fa4.attention(q, k, v, backend="flash_attn_4")
    monkeypatch.setattr(backends, "unavailable", lambda name: None)
    monkeypatch.setattr(checks, "device_reasons", real_device_reasons)  # CPU tensors again
    with pytest.raises(UnsupportedInputError, match="backend='sdpa_flash' cannot run.*CUDA GPUs only"):
        fa4.attention(*qkv(sq=32, sk=32), backend="sdpa_flash")  # a new signature: planned again


def test_lse_calls_are_served_only_by_a_peer_that_returns_lse(fake, peers):
    measured(fake.db_path, {"ours": 1000.0, "sdpa_cudnn": 500.0, "flash_attn_4": 700.0})
    q, k, v = qkv()
    assert fa4.explain(q, k, v, return_lse=True).runs == {"eager": "flash_attn_4", "graph": "flash_attn_4"}
    out, lse = fa4.attention(q, k, v, return_lse=True)
    assert peers.names() == ["flash_attn_4"] and lse.shape == (1, 4, 64)


def test_cudnn_is_no_candidate_where_torch_would_run_another_kernel_for_it(fake, peers):
    # a bottom-right causal mask with Sq != Sk reaches SDPA as causal_lower_right, which torch computes
    # with its own flash or memory-efficient kernel whatever backend is pinned
    q, k, v = qkv(sq=48, sk=64)
    with pytest.raises(UnsupportedInputError, match="SDPA cuDNN with a bottom-right causal mask and Sq != Sk"):
        fa4.attention(q, k, v, causal=True, backend="sdpa_cudnn")
    fa4.attention(q, k, v, causal=False, backend="sdpa_cudnn")  # no mask: cuDNN's own
    fa4.attention(q, k, v, causal=True, backend="sdpa_flash")
    assert peers.names() == ["sdpa_cudnn", "sdpa_flash"]


def test_rows_without_keys_follow_our_rule_after_a_peer(fake, peers):
    q, k, v = qkv(sq=80, sk=64)  # causal: the first 16 query rows see no key
    out, lse = fa4.attention(q, k, v, causal=True, return_lse=True, backend="flash_attn_4")
    assert peers.names() == ["flash_attn_4"]
    assert (out[:, :16] == 0).all() and torch.isinf(lse[:, :, :16]).all() and (lse[:, :, :16] < 0).all()
    ref, ref_lse = reference(q, k, v, True)
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)


def test_a_peer_that_refuses_is_replaced_by_ours_under_auto_and_raises_when_forced(fake, peers):
    measured(fake.db_path, {"ours": 1000.0, "sdpa_cudnn": 500.0})
    peers.refuse.add("sdpa_cudnn")
    q, k, v = qkv()
    with pytest.warns(fa4.Fa4Warning, match="SDPA cuDNN, measured fastest for .* refused the call"):
        out = fa4.attention(q, k, v)
    torch.testing.assert_close(out.float(), reference(q, k, v, False)[0], rtol=1e-2, atol=1e-2)
    assert ours_calls(fake) == 1
    fa4.attention(q, k, v)
    assert ours_calls(fake) == 2  # remembered: the peer is not tried again
    e = fa4.explain(q, k, v)
    assert e.runs == {"eager": "ours", "graph": "ours"} and any("refused this call earlier" in n for n in e.notes)
    with pytest.raises(UnsupportedInputError, match="backend='sdpa_cudnn' cannot run these inputs: SDPA cuDNN raised"):
        fa4.attention(q, k, v, backend="sdpa_cudnn")


def test_a_peer_that_cannot_be_imported(fake, monkeypatch):
    def broken(name, causal):
        raise ImportError("libcuda.so.1: cannot open shared object file")

    monkeypatch.setattr(backends, "runner", broken)
    monkeypatch.setattr(backends, "unavailable", lambda name: None)
    measured(fake.db_path, {"ours": 1000.0, "flash_attn_4": 500.0})
    q, k, v = qkv()
    with pytest.warns(fa4.Fa4Warning, match="flash-attn-4 cannot be imported"):
        fa4.attention(q, k, v)
    assert ours_calls(fake) == 1
    with pytest.raises(UnsupportedInputError, match="flash-attn-4 cannot be imported"):
        fa4.attention(q, k, v, backend="flash_attn_4")


# --- warmup, and captures of shapes never seen ------------------------------------------------------

def test_a_capture_of_a_never_seen_shape_says_what_to_warm_up(fake, monkeypatch):
    monkeypatch.setattr(runtime, "_capturing", lambda: True)
    q, k, v = qkv(sq=48, sk=48)
    with pytest.raises(fa4.NotWarmedUpError) as info:
        fa4.attention(q, k, v, causal=True)
    text = str(info.value)
    assert "first called while a CUDA graph was being captured" in text
    assert ("fa4.warmup(fa4.kernels.AttentionProblem(batch=1, seqlen_q=48, seqlen_k=48, heads_q=4, "
            "heads_kv=2, head_dim=64, dtype='fp16', causal=True, return_lse=False))") in text
    monkeypatch.setattr(runtime, "_capturing", lambda: False)
    [e] = fa4.warmup(AttentionProblem(1, 48, 48, 4, 2, 64, "fp16", True), device="cpu")
    assert e.compiled and e.runs == {"eager": "ours", "graph": "ours"}
    monkeypatch.setattr(runtime, "_capturing", lambda: True)
    compiles = fa4.cache_info()["compiles"]
    fa4.attention(q, k, v, causal=True)                 # warmed: no compile inside the capture
    fa4.attention(*qkv(sq=40, sk=40), causal=True)      # another length, the same compiled kernel
    assert fa4.cache_info()["compiles"] == compiles


def test_warmup_runs_a_graph_only_peer_so_a_capture_can_call_it(fake, peers, monkeypatch):
    measured(fake.db_path, {"ours": 22.03, "flash_attn_4": 21.56})
    q, k, v = qkv()
    fa4.attention(q, k, v, backend="ours")  # our kernel compiled: what is missing is flash-attn-4's
    monkeypatch.setattr(runtime, "_capturing", lambda: True)
    with pytest.raises(fa4.NotWarmedUpError, match="flash-attn-4's first call .it compiles. cannot"):
        fa4.attention(q, k, v)
    monkeypatch.setattr(runtime, "_capturing", lambda: False)
    [e] = fa4.warmup([(q, k, v)])
    assert e.runs == {"eager": "ours", "graph": "flash_attn_4"} and peers.names() == ["flash_attn_4"]
    monkeypatch.setattr(runtime, "_capturing", lambda: True)
    fa4.attention(q, k, v)
    # another signature of the same problem (strides): flash-attn-4 already ran it in this process
    fa4.attention(q, k.transpose(1, 2).contiguous().transpose(1, 2), v)
    assert peers.names() == ["flash_attn_4"] * 3


def test_warmup_arguments(fake):
    with pytest.raises(InvalidInputError, match="fa4.warmup takes"):
        fa4.warmup("b1-s1024")
    with pytest.raises(InvalidInputError, match="fa4.warmup takes"):
        fa4.warmup([])
    explained = fa4.warmup([AttentionProblem(1, 64, 64, 4, 2, 64, "bf16", return_lse=True), qkv()],
                           device="cpu", causal=True)
    assert [e.problem for e in explained] == ["B1 Sq64 Sk64 H4/2 D64 bf16 full", "B1 Sq64 Sk64 H4/2 D64 fp16 causal"]
    assert fa4.cache_info()["compiles"] == 2


def test_explain_a_forced_peer_for_another_gpu(peers):
    meta = tuple(torch.empty(1, 128, h, 64, dtype=torch.float16, device="meta") for h in (4, 2, 2))
    e = fa4.explain(*meta, backend="flash_attn_4", arch="sm90", device_name="NVIDIA H200")
    assert e.runs == {"eager": "flash_attn_4", "graph": "flash_attn_4"}
    assert "runs: flash-attn-4 (forced: backend='flash_attn_4')" in str(e)


def test_an_unmeasured_shape_runs_what_its_neighbours_measured_fastest(fake, peers):
    # two measured shapes near the call's (S=64 and S=128; the call is S=96) agree: flash-attn-4 runs
    for seqlen in (64, 128):
        add_entry(fake.db_path, seqlen=seqlen, us=10.0)
    db = database.BestConfigDB.load(fake.db_path)
    for entry in db.entries:
        db.put(dataclasses.replace(entry, backend_us={"ours": 100.0, "flash_attn_4": 60.0}, backend_source="t"))
    db.save(fake.db_path)
    fa4.use_config_db(fake.db_path)
    q, k, v = qkv(sq=96, sk=96)
    e = fa4.explain(q, k, v)
    assert e.runs == {"eager": "flash_attn_4", "graph": "flash_attn_4"}
    assert all(p.confident and len(p.neighbours) == 2 for p in e.predictions)
    fa4.attention(q, k, v)
    assert peers.names() == ["flash_attn_4"]
    # flash-attn-4 cannot run here: ours (the only other implementation measured)
    peers.calls.clear()
    backends_unavailable = backends.unavailable
    try:
        backends.unavailable = lambda name: "not installed" if name == "flash_attn_4" else None
        fa4.use_config_db(fake.db_path)
        assert fa4.explain(q, k, v).runs == {"eager": "ours", "graph": "ours"}
    finally:
        backends.unavailable = backends_unavailable
