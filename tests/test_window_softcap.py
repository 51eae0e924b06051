"""Sliding windows and softcaps (flash-attn's conventions) on CPU: the problem's form, the fp32 reference
against a textbook masked softmax, the SDPA fallback, input checks, the blockwise backward against fp32
autograd, the database key, dispatch and `fa4.explain`, shape files and the transformers integration.
The kernel's compile checks are tests/test_sm90_window_compile.py; its GPU correctness
tests/gpu/test_window_softcap_gpu.py."""

from __future__ import annotations

import json
import math
import types
import warnings

import pytest
import torch

import fa4
from fa4 import backends, backward, checks, database, fallback, kernels, state
from fa4.checks import InvalidInputError, UnsupportedInputError
from fa4.kernels import AttentionProblem, Config, compiling
from fa4.kernels.device import H200, reference_device
from fa4.kernels.problem import resolve_mask
from fa4.reference import attention_fp32, check_grads, rows_without_keys, softmax_scale


@pytest.fixture(autouse=True)
def _fresh():
    fa4.reset_caches()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*fallback='sdpa'")
        yield
    fa4.reset_caches()


def textbook(q, k, v, causal, scale, window=None, softcap=None):
    """Attention with the mask written out key by key, in fp64: (O (B, Sq, Hq, D), LSE (B, Hq, Sq))."""
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    qd, kd, vd = (t.double().transpose(1, 2) for t in (q, k, v))
    kd, vd = kd.repeat_interleave(hq // hkv, 1), vd.repeat_interleave(hq // hkv, 1)
    s = qd @ kd.transpose(-1, -2) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    left, right = window if window is not None else (-1, -1)
    visible = torch.zeros(sq, sk, dtype=torch.bool)
    for i in range(sq):
        diag = i + sk - sq
        for j in range(sk):
            visible[i, j] = ((not causal or j <= diag) and (left < 0 or j >= diag - left)
                             and (causal or right < 0 or j <= diag + right))
    s = s.masked_fill(~visible, -math.inf)
    return (torch.softmax(s, -1).nan_to_num(0.0) @ vd).transpose(1, 2), torch.logsumexp(s, -1)


def inputs(b, sq, sk, hq, hkv, d, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, s, h, d, generator=g).to(dtype) for s, h in ((sq, hq), (sk, hkv), (sk, hkv)))


# ---- the problem's form ----------------------------------------------------------------------------

def test_resolve_mask_follows_flash_attn():
    r = lambda *a: resolve_mask(*a, 100, 100)   # noqa: E731
    assert r(False, None, None) == (False, None, None)
    assert r(False, (-1, -1), 0) == (False, None, None)            # -1: unbounded; softcap 0: none
    assert r(True, (10, 5), None) == (True, (10, 0), None)         # causal makes the right side 0
    assert r(True, (10, -1), None) == (True, (10, 0), None)
    assert r(False, (10, 0), None) == (True, (10, 0), None)        # a right side 0 is causal
    assert r(False, (-1, 0), None) == (True, None, None)
    assert r(False, (None, 7), 30) == (False, (-1, 7), 30.0)       # flash-attn-4 spells unbounded None
    assert r(False, (99, 99), None) == (False, None, None)         # wider than the sequences: no window
    assert r(True, (99, 0), None) == (True, None, None)
    assert resolve_mask(False, (5, 120), None, 100, 300) == (False, (5, -1), None)  # right >= Sq - 1


@pytest.mark.parametrize("window,softcap,match", [
    ((-2, 0), None, "must be >= 0"), ((1.5, 0), None, "integer"), ("ab", None, "pair"),
    ((1, 2, 3), None, "pair"), ((True, 0), None, "integer"), (None, -1.0, "softcap"),
    (None, float("nan"), "softcap"), (None, float("inf"), "softcap"), (None, True, "softcap"),
    (None, "x", "softcap")])
def test_bad_window_or_softcap_is_an_invalid_call_whatever_the_fallback(window, softcap, match):
    q, k, v = inputs(1, 8, 8, 2, 2, 64, torch.float16)
    for call in (fa4.attention, fa4.explain):
        with pytest.raises(InvalidInputError, match=match):
            call(q, k, v, window_size=window, softcap=softcap, fallback="sdpa")


def test_a_problem_has_one_form_and_a_dense_one_reads_as_before():
    dense = AttentionProblem(1, 64, 64, 4, 2, 64, "fp16", True)
    assert dense.to_dict() == {"batch": 1, "seqlen_q": 64, "seqlen_k": 64, "heads_q": 4, "heads_kv": 2,
                               "head_dim": 64, "dtype": "fp16", "causal": True, "return_lse": False}
    assert dense.label() == "B1 Sq64 Sk64 H4/2 D64 fp16 causal"
    assert repr(dense).endswith("causal=True, return_lse=False)")
    local = AttentionProblem(1, 64, 64, 4, 2, 64, "fp16", True, window=[15, 0], softcap=30)
    assert local.window == (15, 0) and local.softcap == 30.0
    assert AttentionProblem(**local.to_dict()) == local
    assert local.label().endswith("causal window (15, 0) softcap 30")
    for bad in (dict(window=(-1, -1)), dict(window=(4, 0)), dict(causal=True, window=(4, 2)),
                dict(causal=True, window=(-1, 0)), dict(softcap=0.0)):
        with pytest.raises(ValueError):
            AttentionProblem(1, 64, 64, 4, 2, 64, "fp16", **{"causal": False, **bad})


@pytest.mark.parametrize("sq,sk", [(50, 50), (30, 70), (70, 30)])
def test_visible_pairs_are_counted_exactly(sq, sk):
    for causal, window in [(True, (5, 0)), (False, (3, 9)), (False, (-1, 4)), (False, (6, -1)), (True, (0, 0))]:
        p = AttentionProblem(1, sq, sk, 1, 1, 64, causal=causal, window=window)
        diag = [i + sk - sq for i in range(sq)]
        want = sum(1 for i in range(sq) for j in range(sk)
                   if (not causal or j <= diag[i]) and (window[0] < 0 or j >= diag[i] - window[0])
                   and (causal or window[1] < 0 or j <= diag[i] + window[1]))
        assert p.visible_pairs_per_head() == want
        assert p.flops() == 4 * 64 * want


# ---- the reference -----------------------------------------------------------------------------------

WINDOWS = [(0, 0), (3, 0), (10, 5), (-1, 7), (7, -1), (200, 200)]


@pytest.mark.parametrize("sq,sk", [(64, 64), (40, 100), (100, 40), (1, 33)])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_fp32_reference_against_the_textbook(sq, sk, window, causal, softcap):
    q, k, v = inputs(2, sq, sk, 8, 2, 32, seed=sq + sk)
    out, lse = attention_fp32(q, k, v, causal, 0.3, window=window, softcap=softcap)
    want_out, want_lse = textbook(q, k, v, causal, 0.3, window, softcap)
    torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)
    # rows without keys: exactly the leading block rows_without_keys names, O = 0 and LSE = -inf
    dead = rows_without_keys(sq, sk, causal, window)
    assert torch.isneginf(lse).all(dim=(0, 1)).tolist() == [i < dead for i in range(sq)]
    assert torch.all(out[:, :dead] == 0)


@pytest.mark.parametrize("window,causal,softcap", [((3, 0), True, None), ((10, 5), False, None),
                                                   ((-1, 7), False, 5.0), ((7, -1), False, None),
                                                   (None, True, 5.0), ((2, 0), True, 5.0)])
@pytest.mark.parametrize("sq,sk", [(64, 64), (100, 40), (40, 100)])
def test_the_sdpa_fallback_and_fa4_attention_on_cpu_follow_the_reference(window, causal, softcap, sq, sk):
    q, k, v = inputs(1, sq, sk, 4, 2, 64, seed=7)
    want_out, want_lse = attention_fp32(q, k, v, causal, None, window=window, softcap=softcap)
    out, lse = fallback.sdpa_attention(q, k, v, causal, None, True, window=window, softcap=softcap)
    torch.testing.assert_close(out, want_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lse, want_lse, rtol=1e-4, atol=1e-4)
    for dtype in (torch.float32, torch.float16):
        q16, k16, v16 = (t.to(dtype) for t in (q, k, v))
        got, got_lse = fa4.attention(q16, k16, v16, causal=causal, window_size=window, softcap=softcap,
                                     return_lse=True, fallback="sdpa")
        ref = attention_fp32(q16, k16, v16, causal, None, window=window, softcap=softcap)
        torch.testing.assert_close(got.float(), ref[0], rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(got_lse, ref[1], rtol=1e-2, atol=1e-2)


# ---- gradients ----------------------------------------------------------------------------------------

GRAD_CASES = [  # (B, Sq, Sk, Hq, Hkv, D, causal, window, softcap)
    (1, 77, 77, 4, 1, 64, True, (9, 0), None),        # MQA, causal window
    (1, 130, 90, 8, 2, 64, False, (20, 13), None),    # two-sided window, Sq > Sk: rows without keys
    (1, 90, 130, 4, 2, 64, False, None, 4.0),         # softcap, full mask
    (2, 65, 65, 4, 4, 128, True, (30, 0), 10.0),      # both
    (1, 100, 60, 4, 2, 64, False, (-1, 3), 2.0),      # right side only, a strong cap
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", GRAD_CASES, ids=str)
def test_gradients_with_window_and_softcap_match_fp32_autograd(case, dtype):
    b, sq, sk, hq, hkv, d, causal, window, softcap = case
    q, k, v = inputs(b, sq, sk, hq, hkv, d, dtype, seed=3)
    dout = torch.randn(b, sq, hq, d, generator=torch.Generator().manual_seed(4)).to(dtype)
    scale = softmax_scale(d)
    # the blockwise backward on the forward's saved tensors, in small query blocks
    out, lse = attention_fp32(q, k, v, causal, scale, window=window, softcap=softcap)
    grads = backward.blockwise_backward(dout, q, k, v, out.to(dtype), lse, causal, scale, block_bytes=1 << 14,
                                        window=window, softcap=softcap)
    assert not check_grads(grads, q, k, v, dout, causal, scale, window=window, softcap=softcap)
    # and through fa4.attention's custom op and its registered backward
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    fa4.attention(*leaves, causal=causal, window_size=window, softcap=softcap, fallback="sdpa").backward(dout)
    assert not check_grads([t.grad for t in leaves], q, k, v, dout, causal, scale, window=window,
                           softcap=softcap)


def test_a_window_and_softcap_gradient_compiles_without_a_graph_break():
    q, k, v = inputs(1, 48, 48, 4, 2, 64, torch.float16, seed=5)
    dout = torch.randn(q.shape).to(torch.float16)

    def step(q, k, v):
        return fa4.attention(q, k, v, causal=True, window_size=(7, 7), softcap=3.0, fallback="sdpa")

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    compiled(*leaves).backward(dout)
    assert not check_grads([t.grad for t in leaves], q, k, v, dout, True, window=(7, 0), softcap=3.0)


def test_our_backward_kernels_are_not_picked_for_a_window_or_softcap(monkeypatch):
    monkeypatch.delenv(backward.ENV_VAR, raising=False)
    monkeypatch.setattr(backward, "peers_with_backward", lambda: ())
    q = torch.empty(1, 8, 2, 64)
    for masks in ({"window": (4, 0)}, {"softcap": 30.0}):
        assert "no sliding window or softcap" in backward.ours_unsupported(q, **masks)
        name, why = backward.choose(q, **masks)
        assert name == "blockwise" and "no sliding window or softcap" in why


# ---- the database key, dispatch and explain ---------------------------------------------------------

def test_the_database_key_tells_windows_and_softcaps_apart():
    dense = AttentionProblem(1, 8192, 8192, 32, 8, 128, "bf16", True)
    assert database.entry_key("sm90", "H200", dense) == "sm90|H200|bf16|d128|gqa4|causal|sq8192|sk8192|w8"
    mistral = AttentionProblem(1, 8192, 8192, 32, 8, 128, "bf16", True, window=(4095, 0))
    assert database.mask_key(mistral.to_dict()) == "causal-wl4096"
    assert database.mask_key(AttentionProblem(1, 64, 64, 1, 1, 64, window=(-1, 3), softcap=5).to_dict()) == \
        "full-wr4-softcap"
    # widths of one power-of-two bucket share a key; the next bucket is another kind
    wider = AttentionProblem(1, 8192, 8192, 32, 8, 128, "bf16", True, window=(4096, 0))
    assert database.entry_key("sm90", "H", wider) == database.entry_key("sm90", "H", mistral)
    next_bucket = AttentionProblem(1, 8192, 8192, 32, 8, 128, "bf16", True, window=(4097, 0))
    assert database.entry_key("sm90", "H", next_bucket) != database.entry_key("sm90", "H", mistral)


def _entry(problem, us=10.0, backend_us=None, fingerprint="f"):
    entry = database.Entry.from_result(
        arch="sm90", device="NVIDIA H200", problem=problem, config=Config.make("sm90", tile_n=96).to_dict(), us=us,
        tflops=1.0, default_us=20.0, peers_us={}, max_err=1e-3, kernel_fingerprint=fingerprint, versions={},
        study="s", trial=1)
    if backend_us:
        import dataclasses
        entry = dataclasses.replace(entry, backend_us=backend_us, backend_source="search")
    return entry


def test_an_entry_of_a_window_problem_round_trips_and_is_looked_up_only_for_its_kind(tmp_path):
    local = AttentionProblem(1, 8192, 8192, 32, 8, 128, "bf16", True, window=(4095, 0), softcap=50.0)
    entry = _entry(local)
    assert database.field_error(entry.to_dict()) is None
    assert database.Entry.from_dict(entry.to_dict()) == entry
    bad = entry.to_dict()
    bad["problem"] = dict(bad["problem"], window=[4095, "x"])
    assert "window" in database.field_error(bad)
    path = tmp_path / "db.json"
    database.record(entry, path)
    db = database.BestConfigDB.load(path)
    assert db.lookup("sm90", "NVIDIA H200", local, "f").kind == "exact"
    near = AttentionProblem(1, 16384, 16384, 32, 8, 128, "bf16", True, window=(4000, 0), softcap=20.0)
    assert db.lookup("sm90", "NVIDIA H200", near, "f").kind == "nearest"
    for other in (AttentionProblem(1, 8192, 8192, 32, 8, 128, "bf16", True),                     # dense
                  AttentionProblem(1, 8192, 8192, 32, 8, 128, "bf16", True, window=(4095, 0)),    # no cap
                  AttentionProblem(1, 8192, 8192, 32, 8, 128, "bf16", True, window=(1023, 0), softcap=50)):
        assert db.lookup("sm90", "NVIDIA H200", other, "f").kind == "default"


class _Launcher:
    """Our kernel stood in by the fp32 reference: it applies the mask values the runtime passes."""

    def __init__(self, problem):
        self.problem, self.masks = problem, []

    def run(self, q, k, v, out, lse, softmax_scale, masks=None):
        self.masks.append(masks)
        left, right, softcap = masks if masks is not None else (None, None, None)
        window = None if left is None and right is None else (-1 if left is None else left,
                                                              -1 if right is None else right)
        o, l = attention_fp32(q, k, v, self.problem.causal, softmax_scale, window=window, softcap=softcap)
        out.copy_(o)
        if lse is not None:
            lse.copy_(l)


@pytest.fixture
def fake_sm90(monkeypatch, tmp_path):
    """The real sm90 family's decisions on a pretend H200 that runs CPU tensors; its compile stood in."""
    sm90 = kernels.family("sm90")
    launchers = []

    def compile_attention(config, problem, device=None):
        launchers.append(_Launcher(problem))
        return launchers[-1]

    fam = types.SimpleNamespace(**{name: getattr(sm90, name) for name in dir(sm90) if not name.startswith("_")})
    fam.compile_attention = compile_attention
    real = kernels.family
    monkeypatch.setattr(kernels, "family", lambda arch: fam if arch == "sm90" else real(arch))
    monkeypatch.setattr(kernels, "kernel_fingerprint", lambda arch: "f")
    monkeypatch.setattr(state, "device_description", lambda device: H200)
    monkeypatch.setattr(checks, "device_reasons", lambda spec: [])
    path = tmp_path / "db.json"
    path.write_text(json.dumps({"schema": database.SCHEMA_VERSION, "entries": []}))
    fa4.use_config_db(path)
    fa4.reset_caches(compiled=True)
    yield types.SimpleNamespace(launchers=launchers, db_path=path)
    fa4.use_config_db(None)
    fa4.reset_caches(compiled=True)


def test_our_kernel_gets_the_window_and_cap_as_runtime_values(fake_sm90):
    q, k, v = inputs(1, 64, 64, 4, 2, 64, torch.float16, seed=1)
    for window, causal, softcap, masks in [((15, 3), True, None, (15, None, None)),
                                           ((15, 3), False, 2.0, (15, 3, 2.0)),
                                           ((-1, 5), False, None, (None, 5, None))]:
        for _ in range(2):   # the second call takes the cached launch
            out = fa4.attention(q, k, v, causal=causal, window_size=window, softcap=softcap)
        launcher = fake_sm90.launchers[-1]
        assert launcher.masks == [masks, masks]
        want = attention_fp32(q, k, v, causal, window=window, softcap=softcap)[0]
        torch.testing.assert_close(out.float(), want, rtol=1e-2, atol=1e-2)
        e = fa4.explain(q, k, v, causal=causal, window_size=window, softcap=softcap)
        assert dict(e.compile_key[2])["bounded_left"] == (window[0] >= 0)
    # a window as wide as the sequences is the dense problem: the dense kernel, no mask values
    fa4.attention(q, k, v, causal=True, window_size=(63, 0))
    assert fake_sm90.launchers[-1].masks == [None]
    e = fa4.explain(q, k, v, causal=True, window_size=(63, 0))
    assert e.problem.endswith("fp16 causal") and any("bounds nothing" in n for n in e.notes)


def test_dispatch_leaves_out_peers_without_windows_and_softcaps(fake_sm90):
    q, k, v = inputs(1, 64, 64, 4, 2, 64, torch.float16)
    problem = AttentionProblem(1, 64, 64, 4, 2, 64, "fp16", True, window=(15, 0))
    database.record(_entry(problem, backend_us={"ours": 10.0, "sdpa_cudnn": 5.0}), fake_sm90.db_path)
    fa4.reset_caches()
    e = fa4.explain(q, k, v, causal=True, window_size=(15, 0))
    assert e.source == "exact" and e.runs == {"eager": "ours", "graph": "ours"}
    assert any("has no sliding window" in n for n in e.notes)
    assert backends.unsupported("sdpa_flash", AttentionProblem(1, 8, 8, 1, 1, 64, softcap=1.0))
    assert backends.unsupported("flash_attn_4", problem) is None


def test_explain_spells_out_the_mask_and_what_dispatch_chooses_among(fake_sm90, monkeypatch):
    """The window's keys and the cap in words; the implementations dispatch judges (flash-attn-4 among
    them, SDPA's left out with its reason); why ours runs where nothing was measured; and flash-attn-4
    running where it was measured fastest, SDPA cuDNN's faster time ignored."""
    monkeypatch.setattr(backends, "unavailable", lambda name: None)   # every peer installed
    q, k, v = inputs(1, 64, 64, 4, 2, 64, torch.float16)
    masks = dict(causal=True, window_size=(15, 3), softcap=30.0)
    e = fa4.explain(q, k, v, **masks)
    text = str(e)
    assert e.candidates == ["ours", "flash_attn_4"] and set(e.left_out) == {"sdpa_cudnn", "sdpa_flash"}
    assert "window: query i sees keys diag - 15 .. diag (diag = i + Sk - Sq), at most 16 keys" in text
    assert "softcap: each scaled score s becomes 30 * tanh(s / 30) before the softmax" in text
    assert "dispatch among: ours, flash-attn-4 (left out: SDPA cuDNN has no sliding window" in text
    assert e.runs == {"eager": "ours", "graph": "ours"}
    assert f"runs: our sm90 kernel (nothing measured at this shape, nor at a shape of its kind on {H200.name}" in text
    two_sided = str(fa4.explain(q, k, v, window_size=(-1, 7)))
    assert "window: query i sees keys 0 .. diag + 7 (diag = i + Sk - Sq)\n" in two_sided
    dense = fa4.explain(q, k, v, causal=True)
    assert dense.mask == [] and "window:" not in str(dense) and "softcap:" not in str(dense)

    problem = AttentionProblem(1, 64, 64, 4, 2, 64, "fp16", True, window=(15, 0), softcap=30.0)
    database.record(_entry(problem, backend_us={"ours": 1000.0, "flash_attn_4": 500.0, "sdpa_cudnn": 100.0}),
                    fake_sm90.db_path)
    fa4.reset_caches()
    e = fa4.explain(q, k, v, **masks)
    assert e.source == "exact" and e.runs == {"eager": "flash_attn_4", "graph": "flash_attn_4"}
    assert "runs: flash-attn-4 (eager: max(GPU, host) time 500.0 us vs ours 1000.0 us: 2.000x faster" in str(e)
    assert any("SDPA cuDNN measured fastest" in n and "has no sliding window" in n for n in e.notes)


def test_explain_says_what_runs_and_sm100_refuses_loudly():
    q, k, v = inputs(1, 4096, 4096, 32, 8, 128, torch.bfloat16)
    e = fa4.explain(q, k, v, causal=True, window_size=(1023, 0), softcap=50.0, arch="sm90",
                    device_name="NVIDIA H200")
    assert e.problem.endswith("bf16 causal window (1023, 0) softcap 50")
    compiled_in = dict(e.compile_key[2])
    assert compiled_in["bounded_left"] and not compiled_in["bounded_right"] and compiled_in["softcap"]
    assert e.backward[0] == "blockwise" and "no sliding window or softcap" in e.backward[1]
    assert "window (1023, 0)" in str(e)
    for masks in ({"window_size": (1023, 0)}, {"softcap": 30.0}):
        with pytest.raises(UnsupportedInputError, match="sm100 kernel has no"):
            fa4.explain(q, k, v, causal=True, arch="sm100", allow_untested_sm100=True, **masks)


def test_the_sm100_kernel_refuses_to_compile_a_window_or_softcap():
    problem = AttentionProblem(1, 1024, 1024, 32, 8, 128, "bf16", True, window=(255, 0))
    config = kernels.default_config("sm100", AttentionProblem(1, 1024, 1024, 32, 8, 128, "bf16", True))
    assert any("no sliding window" in r for r in kernels.feasible(config, problem))
    with pytest.raises(ValueError, match="sm100 kernel has no sliding window"):
        kernels.compile_report(config, problem)


def test_compiled_kernels_take_mask_values_exactly_where_compiled_with_them():
    assert compiling.mask_values(AttentionProblem(1, 8, 8, 1, 1, 64, "fp16", True)) is None
    assert compiling.mask_values(AttentionProblem(1, 8, 8, 1, 1, 64, "fp16", True, window=(3, 0), softcap=2)) == \
        (3, None, 2.0)
    assert compiling.kernel_mask_values((2**31 - 1, 5, None), 100, 50) == (150, 5, None)
    calls = []
    problem = AttentionProblem(1, 8, 8, 1, 1, 64, "fp16", False, window=(3, 4))
    compiled = compiling.CompiledAttention(lambda *a: calls.append(a), Config.make("sm90"), problem, 0, 0.0)
    assert compiled.positionals == 9
    q = torch.empty(1, 8, 1, 64)
    compiled.run(q, q, q, q, None, 0.5, masks=(3, 4, None))
    assert calls[-1][5:] == (0.5, 3, 4, None)
    for wrong in (None, (3, None, None), (3, 4, 1.0)):
        with pytest.raises(ValueError, match="do not fit this kernel"):
            compiled.run(q, q, q, q, None, 0.5, masks=wrong)


def test_compile_keys_hold_the_flags_not_the_values():
    base = AttentionProblem(1, 1024, 1024, 32, 8, 128, "fp16", True)
    cfg = kernels.default_config("sm90", base)
    assert kernels.compile_key(cfg, base)[2] == (("dtype", "fp16"), ("head_dim", 128), ("causal", True),
                                                 ("return_lse", False), ("gqa_ratio", 4))
    a = AttentionProblem(1, 1024, 1024, 32, 8, 128, "fp16", True, window=(255, 0), softcap=3.0)
    b = AttentionProblem(1, 4096, 4096, 32, 8, 128, "fp16", True, window=(1023, 0), softcap=50.0)
    assert kernels.compile_key(cfg, a) == kernels.compile_key(cfg, b) != kernels.compile_key(cfg, base)


# ---- shapes files and keys ---------------------------------------------------------------------------

def test_shapes_files_and_shape_keys_carry_windows_and_softcaps():
    from fa4tune.inputs.shape_sets import parse_shapes
    from fa4tune.inputs.shapes import parse_shape, shape_key

    problems = parse_shapes("""
[[problem]]
batch = 1
seqlen = [4096, 16384]
heads_q = 32
gqa = 4
head_dim = 128
dtype = "bf16"
causal = true
window = [[255, 0], [4095, 0]]
softcap = 50.0
""")
    # at S4096 the 4095 window reaches every key: that problem is the unwindowed one
    assert [(p.seqlen_q, p.window) for p in problems] == [(4096, (255, 0)), (4096, None), (16384, (255, 0)),
                                                          (16384, (4095, 0))]
    assert all(p.softcap == 50.0 and p.causal for p in problems)
    one = parse_shapes('[[problem]]\nbatch = 1\nseqlen = 64\nheads_q = 2\ngqa = 1\nhead_dim = 64\n'
                       'causal = false\nwindow = [8, 4]\n')
    assert [p.window for p in one] == [(8, 4)]
    for p in problems + one:
        key = shape_key("sm90", p)
        assert parse_shape(key, {}) == ("sm90", p), key
    assert shape_key("sm90", problems[0]).endswith("-causal-wl255-cap50")


def test_recorded_shapes_read_back_with_their_window(tmp_path):
    from fa4.record_shapes import problem_table
    from fa4tune.inputs.shape_sets import parse_shapes

    p = AttentionProblem(2, 300, 300, 8, 2, 64, "fp16", False, window=(16, 32), softcap=7.5)
    assert parse_shapes(problem_table(p)) == [p]


# ---- transformers ------------------------------------------------------------------------------------

def test_transformers_layers_with_a_sliding_window_and_softcap_run_on_fa4():
    from fa4.transformers_attention import _padded_sdpa, attention_forward

    q, k, v = inputs(2, 40, 40, 4, 2, 64, torch.float32, seed=9)
    module = types.SimpleNamespace(is_causal=True, training=False)
    as_hf = [t.transpose(1, 2) for t in (q, k, v)]   # transformers hands (B, H, S, D)
    out, _ = attention_forward(module, *as_hf, None, scaling=0.2, sliding_window=8, softcap=20.0)
    want = attention_fp32(q, k, v, True, 0.2, window=(7, 0), softcap=20.0)[0]
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    # a padded batch runs SDPA (and the written-out softcap) with the same window
    keys = torch.ones(2, 40, dtype=torch.bool)
    torch.testing.assert_close(_padded_sdpa(q, k, v, keys, True, 0.2, (7, 7), 20.0), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(_padded_sdpa(q, k, v, keys, True, 0.2, (7, 7), None),
                               attention_fp32(q, k, v, True, 0.2, window=(7, 0))[0], rtol=1e-4, atol=1e-4)


def test_the_feature_grid_benches_with_its_windows_and_softcaps(tmp_path, monkeypatch):
    """`fa4tune bench --shapes-file benchmarks/h200_features.toml` (the fake evaluator of the search
    tests): every problem of the grid, with its window and softcap, gets its rows."""
    from pathlib import Path

    import test_search_fakes as fakes  # noqa: F401  (the fake kernel API and evaluator)
    from fa4tune.benchmark import runner as bench_mod
    from fa4tune.inputs.shape_sets import load_shapes_file
    from fa4tune.searches.runner import Progress

    problems = load_shapes_file(Path(__file__).resolve().parents[1] / "benchmarks" / "h200_features.toml")
    assert len(problems) >= 12
    assert {p.head_dim for p in problems if p.softcap == 50.0} == {256}
    assert {p.window for p in problems if p.seqlen_q == 16384 and p.head_dim == 128} == \
        {(255, 0), (1023, 0), (4095, 0), None}
    monkeypatch.setattr(bench_mod, "kernel_fingerprint", lambda arch, api="fa4.kernels": "fake-fingerprint-1")
    doc = bench_mod.run_bench("sm90", problems[:4], db_path=str(tmp_path / "db.json"), peers=(), processes=1,
                              evaluator="test_search_fakes:FakeEvaluator", api="test_search_fakes",
                              progress=Progress(quiet=True), rounds=1)
    shapes = {r["shape"]: r["problem"] for r in doc["rows"]}
    assert len(shapes) == 4
    assert all(AttentionProblem(**p) in problems[:4] for p in shapes.values())
    assert any(key.endswith("-causal-wl4095") for key in shapes)
