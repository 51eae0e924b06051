"""`fa4.attention_varlen` reads the varlen entries on CPU: the configuration ours runs (exact, nearest,
default), what "auto" runs (ours only where measured or predicted at least as fast as the peer), and
`fa4.explain_varlen`; the machine is made to look like an H200 with flash-attn-4's varlen kernel."""

from __future__ import annotations

import pytest
import torch

import fa4
from fa4 import kernels, varlen
from fa4.database import Entry, record
from fa4.kernels import Config
from fa4.varlen_batch import VarlenProblem

DEVICE = "NVIDIA H200"
# the batch the calls below pack: one long sequence among short ones (4096 + 31 x 128 = 8064 tokens)
LENGTHS = [4096] + [128] * 31
BATCH = VarlenProblem.of(LENGTHS, heads_q=16, heads_kv=4, head_dim=128, dtype="bf16", causal=True)
TUNED = dict(scheduler="lpt", q_stages=2, tile_m=128, tile_n=128)


class _Peer:
    name, title = "flash_attn_4", "flash-attn-4"

    @staticmethod
    def varlen_unsupported(q):
        return None


@pytest.fixture
def runtime(tmp_path, monkeypatch):
    """fa4.attention_varlen as on an H200 with flash-attn-4's varlen kernel, reading a database of the
    test's; `use(*entries)` writes it. Ours is never launched: `_ours` records the configuration."""
    from fa4 import state
    from fa4.kernels import reference_device

    monkeypatch.setattr(varlen, "varlen_peers", lambda: (_Peer(),))
    monkeypatch.setattr(varlen, "ours_unsupported", lambda q, k=None, v=None: None)
    monkeypatch.setattr(state, "device_description", lambda device: reference_device("sm90"))
    ran = []

    def fake_ours(q, *args):
        ran.append(("ours", args[-1]))
        return torch.zeros_like(q)

    def fake_peer(name, q, *args):
        ran.append((name, None))
        return torch.zeros_like(q)

    monkeypatch.setattr(varlen, "_ours", fake_ours)
    monkeypatch.setattr(varlen, "_peer", fake_peer)
    path = tmp_path / "db.json"

    def use(*entries):
        ran.clear()
        path.write_text('{"schema": 2, "entries": []}')
        for entry in entries:
            record(entry, path)
        fa4.use_config_db(path)
        return ran

    yield use
    fa4.use_config_db(None)


def _entry(problem=BATCH, ours_us=40.0, peer_us=50.0, fingerprint=None, default_us=60.0, **knobs) -> Entry:
    config = (kernels.default_config("sm90", problem).replace(**knobs) if knobs
              else kernels.default_config("sm90", problem))
    return Entry.from_result(arch="sm90", device=DEVICE, problem=problem, config=config.to_dict(), us=ours_us,
                             tflops=1.0, default_us=default_us,
                             peers_us={"flash_attn_4": peer_us, "per_sequence": 300.0}, max_err=0.001,
                             kernel_fingerprint=fingerprint or kernels.kernel_fingerprint("sm90"), versions={},
                             study="sm90-varlen-study", trial=3)


def _call(lengths=LENGTHS, heads=(16, 4), **kw):
    total = sum(lengths)
    q = torch.zeros(total, heads[0], 128, dtype=torch.bfloat16)
    k = torch.zeros(total, heads[1], 128, dtype=torch.bfloat16)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    return (q, k, k.clone(), cu, cu, max(lengths), max(lengths)), {"causal": True, **kw}


def test_ours_runs_its_tuned_configuration_where_it_measured_at_least_as_fast(runtime):
    ran = runtime(_entry(**TUNED))
    args, kw = _call()
    fa4.attention_varlen(*args, **kw)
    tuned = kernels.default_config("sm90", BATCH).replace(**TUNED)
    assert ran == [("ours", tuned)]
    choice = fa4.explain_varlen(*args, **kw)
    assert (choice.implementation, choice.source, choice.config) == ("ours", "exact", tuned)
    text = str(choice)
    assert "runs: ours: our varlen kernel, measured at least as fast as flash-attn-4's at this bucket: 40 us against 50 us" in text
    assert "chosen by: tuned, exact entry sm90|NVIDIA H200|bf16|d128|gqa4|causal-varlen|sq4096|sk4096|w128|t8192" in text
    assert "flash_attn_4 50, ours 40, per_sequence 300" in text and "scheduler=lpt" in text
    # another batch of the same buckets (other lengths, about the same tokens) shares the entry
    other = [4000] + [130] * 31
    ran.clear()
    args, kw = _call(other)
    fa4.attention_varlen(*args, **kw)
    assert ran == [("ours", tuned)]
    # a tie within the timing noise keeps ours
    ran = runtime(_entry(ours_us=50.4, peer_us=50.0, **TUNED))
    args, kw = _call()
    fa4.attention_varlen(*args, **kw)
    assert ran == [("ours", tuned)]


def test_the_peer_runs_where_it_measured_faster_or_nothing_was_measured(runtime):
    ran = runtime(_entry(ours_us=60.0, peer_us=50.0, **TUNED))
    args, kw = _call()
    fa4.attention_varlen(*args, **kw)
    assert ran == [("flash_attn_4", None)]
    choice = fa4.explain_varlen(*args, **kw)
    assert choice.why == "flash-attn-4's varlen kernel, measured faster at this bucket: 50 us against ours 60 us"
    assert choice.config == kernels.default_config("sm90", BATCH).replace(**TUNED)   # if ours were forced
    fa4.attention_varlen(*args, **kw, backend="ours")
    assert ran[-1] == ("ours", choice.config)
    # an empty database: the default configuration, and the peer (ours not known to be as fast)
    ran = runtime()
    fa4.attention_varlen(*args, **kw)
    assert ran == [("flash_attn_4", None)]
    choice = fa4.explain_varlen(*args, **kw)
    assert choice.source == "default" and choice.config == kernels.default_config("sm90", BATCH)
    assert "no varlen batch near this one was measured" in choice.why
    assert "the heuristic default" in str(choice)
    # a stale entry (other kernel sources) is not used
    runtime(_entry(fingerprint="edited-since", **TUNED))
    choice = fa4.explain_varlen(*args, **kw)
    assert choice.source == "default" and choice.implementation == "flash_attn_4"
    assert any("other kernel sources" in note for note in choice.notes)


def test_inside_a_capture_the_peer_is_charged_its_pass_over_o(runtime):
    """With the offsets on the GPU inside a capture, the peer's path clears its rows without keys by a
    pass over O, which ours needs only with a persistent scheduler (one CTA per task takes the tail as a
    sequence): a measured comparison adds each side's pass to its time."""
    from fa4 import varlen_dispatch

    one_cta_per_task = {**TUNED, "scheduler": "single_lpt", "q_stages": 1}

    args, kw = _call()
    q, v = args[0], args[2]
    clear_us = varlen_dispatch.device_clear_us(q, v, return_lse=False)
    # 8064 tokens x 16 heads x 128 x 2 bytes of O, read and written
    assert clear_us == pytest.approx(varlen_dispatch.DEVICE_CLEAR_US_PER_MB * 8064 * 16 * 128 * 2 / 1e6)
    assert varlen_dispatch.device_clear_us(q, v, return_lse=True) > clear_us
    # the peer measured 5 % faster: it runs eagerly, ours (one CTA per task) inside a capture
    ran = runtime(_entry(ours_us=52.5, peer_us=50.0, **one_cta_per_task))
    fa4.attention_varlen(*args, **kw)
    assert ran == [("flash_attn_4", None)]
    captured = fa4.explain_varlen(*args, **kw, captured=True)
    assert captured.implementation == "ours"
    assert captured.why == ("our varlen kernel, measured at least as fast as flash-attn-4's at this bucket: 52.5 us "
                            f"against 50 us plus about {clear_us:.0f} us clearing its rows without keys inside a "
                            "capture")
    assert fa4.explain_varlen(*args, **kw).implementation == "flash_attn_4"
    # ours persistent (lpt) pays the same pass: the peer's 5 % lead stands, each side charged its pass
    runtime(_entry(ours_us=52.5, peer_us=50.0, **TUNED))
    captured = fa4.explain_varlen(*args, **kw, captured=True)
    assert captured.implementation == "flash_attn_4"
    assert captured.why == (f"flash-attn-4's varlen kernel, measured faster at this bucket: 50 us plus about "
                            f"{clear_us:.0f} us clearing its rows without keys inside a capture against ours 52.5 "
                            f"us plus about {clear_us:.0f} us clearing its rows without keys inside a capture")
    # faster by more than the pass: the peer runs there too, and says what it was charged
    runtime(_entry(ours_us=50.0 + clear_us + 20.0, peer_us=50.0, **one_cta_per_task))
    captured = fa4.explain_varlen(*args, **kw, captured=True)
    assert captured.implementation == "flash_attn_4"
    assert f"50 us plus about {clear_us:.0f} us clearing its rows without keys" in captured.why
    # nothing measured: the peer, with a note that its pass was not counted
    runtime()
    captured = fa4.explain_varlen(*args, **kw, captured=True)
    assert captured.implementation == "flash_attn_4"
    assert any("pass over O" in note and "not counted" in note for note in captured.notes)
    assert not any("pass over O" in note for note in fa4.explain_varlen(*args, **kw).notes)


def test_a_dense_entry_is_never_a_varlen_calls_and_the_reverse(runtime):
    dense = BATCH.base()
    dense_problem = kernels.AttentionProblem(32, 4096, 4096, 16, 4, 128, "bf16", causal=True)
    runtime(_entry(problem=dense_problem, ours_us=10.0, peer_us=50.0, **TUNED))
    args, kw = _call()
    choice = fa4.explain_varlen(*args, **kw)
    assert choice.source == "default" and choice.implementation == "flash_attn_4"
    assert dense.varlen and not dense_problem.varlen


def test_a_neighbour_lends_its_configuration_and_predicts_the_winner(runtime):
    # measured at 8064 tokens; the call has 16000, as many sequences (one doubling of the tokens bucket)
    runtime(_entry(**TUNED))
    lengths = [4096] + [384] * 31
    args, kw = _call(lengths)
    choice = fa4.explain_varlen(*args, **kw)
    tuned = kernels.default_config("sm90", BATCH).replace(**TUNED)
    assert choice.source == "nearest" and choice.config == tuned and choice.implementation == "ours"
    assert not choice.measured and choice.predicted is not None and choice.predicted.backend == "ours"
    assert "predicted at least as fast" in choice.why and "neighbour sm90|NVIDIA H200|" in str(choice)
    # a neighbour where the peer won predicts the peer
    runtime(_entry(ours_us=70.0, peer_us=50.0, **TUNED))
    choice = fa4.explain_varlen(*args, **kw)
    assert choice.implementation == "flash_attn_4" and "predicted faster" in choice.why
    # a neighbour whose configuration did not beat the default lends no configuration
    runtime(_entry(default_us=40.2, **TUNED))
    choice = fa4.explain_varlen(*args, **kw)
    assert choice.source == "default" and any("did not beat the default" in n for n in choice.notes)


def test_without_a_peer_ours_runs_and_without_ours_the_peer_or_per_sequence(runtime, monkeypatch):
    runtime(_entry(ours_us=90.0, peer_us=50.0, **TUNED))
    args, kw = _call()
    monkeypatch.setattr(varlen, "varlen_peers", lambda: ())
    assert fa4.explain_varlen(*args, **kw).implementation == "ours"
    monkeypatch.setattr(varlen, "ours_unsupported", lambda q, k=None, v=None: "our varlen kernel has no backward")
    choice = fa4.explain_varlen(*args, **kw)
    assert choice.implementation == "per_sequence" and "no backward" in choice.why and choice.config is None
    monkeypatch.setattr(varlen, "varlen_peers", lambda: (_Peer(),))
    choice = fa4.explain_varlen(*args, **kw)
    assert choice.implementation == "flash_attn_4" and "ours cannot run here: our varlen kernel has no backward" in choice.why


def test_an_empty_batch_launches_nothing_and_bad_input_is_named(runtime):
    ran = runtime(_entry(ours_us=90.0, peer_us=50.0, **TUNED))
    args, kw = _call([0, 0])
    q = torch.zeros(0, 16, 128, dtype=torch.bfloat16)
    args = (q, q[:, :4], q[:, :4], args[3], args[4], 0, 0)
    assert fa4.explain_varlen(*args, **kw).implementation == "ours"   # nothing to launch: zeros
    fa4.attention_varlen(*args, **kw)
    assert ran == [("ours", None)]
    args, kw = _call()
    with pytest.raises(fa4.InvalidInputError, match="backend='cudnn' is not one of auto, ours"):
        fa4.explain_varlen(*args, **kw, backend="cudnn")
    with pytest.raises(fa4.InvalidInputError, match="window_size"):
        fa4.explain_varlen(*args, **kw, window_size=(3,))


def test_explain_on_this_cpu_reads_no_database_for_ours():
    args, kw = _call()
    choice = fa4.explain_varlen(*args, **kw)
    assert choice.implementation == "per_sequence" and choice.config is None
    assert "the tensors are on cpu" in choice.why


def test_choose_without_the_batch_reads_no_entry(runtime):
    runtime(_entry(**TUNED))   # ours measured faster at the bucket, but the call's batch is not given
    args, _ = _call()
    q, k, v = args[:3]
    assert varlen.choose(q) == "flash_attn_4" and varlen.choose(q, "auto", k, v) == "flash_attn_4"
    assert varlen.choose(q, "ours") == "ours"
    problem = varlen.varlen_problem(q, k, args[3], args[5], args[6], True, False, None, None)
    assert varlen.choose(q, "auto", k, v, problem=problem) == "ours"
