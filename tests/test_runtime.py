"""fa4.attention's decisions and fast path on CPU, with a stand-in kernel family.

The stand-in (`FakeFamily`) answers the family protocol and "launches" by computing SDPA into the output
buffers, so everything between the user's call and the kernel's `run` is exercised here: the lookup
order, stale and broken databases, the signature cache, the compile cache, zero-length sequences, the
sm100 opt-in, the fallback and the torch.compile path through the custom op. The real families are
checked by their own tests and on the GPU (tests/gpu/test_runtime_gpu.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import warnings

import pytest
import torch

import fa4
from fa4 import checks, config_arg, database, fallback, kernels, planning, state
from fa4.checks import InvalidInputError, UnsupportedInputError
from fa4.kernels import AttentionProblem, Config
from fa4.kernels.device import B200, H200, reference_device
from fa4.kernels.family import family as real_family
from fa4.reference import attention_fp32 as reference, check

F16 = torch.float16
FINGERPRINT = "current0fingerprint"
A100 = dataclasses.replace(H200, name="NVIDIA A100-SXM4-80GB", capability=(8, 0), sm_count=108)


class FakeLauncher:
    def __init__(self, config, problem):
        self.config, self.problem, self.calls = config, problem, []

    def run(self, q, k, v, out, lse, softmax_scale):
        self.calls.append((tuple(q.shape), tuple(k.shape), softmax_scale, lse is not None))
        o, l = fallback.sdpa_attention(q, k, v, self.problem.causal, softmax_scale, lse is not None)
        out.copy_(o)
        if lse is not None:
            lse.copy_(l)


class FakeFamily(types.SimpleNamespace):
    """Head dims 64 and 128; tile_n=192 does not fit (a stand-in resource limit). The grid limits are
    the real family's (the grid is a fact of our kernels' schedulers)."""

    def __init__(self, arch):
        super().__init__(arch=arch, launchers=[], devices=[], REFERENCE_DEVICE=reference_device(arch))

    def can_implement(self, problem):
        return [] if problem.head_dim in (64, 128) else [f"head_dim {problem.head_dim} not in (64, 128)"]

    def resource_reasons(self, config, problem, device=None):
        return ["shared memory 250000 B > 232448 B"] if config.tile_n == 192 else []

    def launch_reasons(self, config, problem, device=None):
        return real_family(self.arch).launch_reasons(config, problem, device)

    def default_config(self, problem, device=None):
        return Config.make(self.arch)

    def problem_key(self, config, problem):
        return (problem.dtype, problem.head_dim, problem.gqa_ratio, problem.causal, problem.return_lse)

    def device_key(self, device):
        return (("num_sms", device.sm_count),)

    def compile_attention(self, config, problem, device=None):
        launcher = FakeLauncher(config, problem)
        self.launchers.append(launcher)
        self.devices.append(device)
        return launcher


@pytest.fixture
def fake(monkeypatch, tmp_path):
    """Stand-in kernels on a pretend H200 that runs CPU tensors; an empty database in tmp_path."""
    families = {arch: FakeFamily(arch) for arch in kernels.ARCHS}
    monkeypatch.setattr(kernels, "family", lambda arch: families[arch])
    monkeypatch.setattr(kernels, "kernel_fingerprint", lambda arch: FINGERPRINT)
    monkeypatch.setattr(state, "device_description", lambda device: H200)
    monkeypatch.setattr(checks, "device_reasons", lambda spec: [])
    db_path = tmp_path / "best.json"
    db_path.write_text(json.dumps({"schema": database.SCHEMA_VERSION, "entries": []}))
    fa4.use_config_db(db_path)
    fa4.reset_caches(compiled=True)
    ns = types.SimpleNamespace(families=families, db_path=db_path, sm90=families["sm90"])
    yield ns
    fa4.use_config_db(None)
    fa4.reset_caches(compiled=True)


@pytest.fixture(autouse=True)
def quiet_db(tmp_path):
    fa4.reset_caches()
    yield
    fa4.reset_caches()


def qkv(b=1, sq=64, sk=64, hq=4, hkv=2, d=64, dtype=F16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, s, h, d, dtype=dtype, generator=g)
                 for s, h in ((sq, hq), (sk, hkv), (sk, hkv)))


def add_entry(path, *, seqlen, tile_n=96, kv_stages=3, fingerprint=FINGERPRINT, device="NVIDIA H200",
              hq=4, hkv=2, d=64, causal=False, us=10.0):
    problem = AttentionProblem(1, seqlen, seqlen, hq, hkv, d, "fp16", causal)
    cfg = Config.make("sm90", tile_n=tile_n, kv_stages=kv_stages)
    entry = database.Entry.from_result(
        arch="sm90", device=device, problem=problem, config=cfg.to_dict(), us=us, tflops=100.0,
        default_us=12.0, peers_us={"flash-attn-4": 11.0}, max_err=1e-3, kernel_fingerprint=fingerprint,
        versions={}, study="s", trial=1)
    database.record(entry, path)
    return cfg


# --- lookup order ----------------------------------------------------------------------------------

def test_default_when_database_is_empty(fake):
    e = fa4.explain(*qkv())
    assert e.path == "kernel" and e.source == "default"
    assert e.config == kernels.default_config("sm90", AttentionProblem(1, 64, 64, 4, 2, 64))
    assert "heuristic default" in str(e)


def test_exact_hit_then_nearest_bucket(fake):
    tuned = add_entry(fake.db_path, seqlen=64)
    fa4.use_config_db(fake.db_path)
    e = fa4.explain(*qkv(sq=64, sk=64))
    assert (e.source, e.config) == ("exact", tuned)
    assert "exact database hit sm90|NVIDIA H200|fp16|d64|gqa2|full|sq64|sk64|w2" in str(e)
    assert "1.10x vs flash-attn-4" in str(e)
    e = fa4.explain(*qkv(sq=100, sk=100))
    assert (e.source, e.config) == ("nearest", tuned) and e.distance == pytest.approx(2.0)
    assert "nearest database bucket" in str(e)


def test_nearest_bucket_within_the_limit_only(fake, monkeypatch):
    add_entry(fake.db_path, seqlen=64)
    fa4.use_config_db(fake.db_path)
    e = fa4.explain(*qkv(sq=300, sk=300))  # bucket 512: 6 log2 steps from 64
    assert e.source == "default" and any("past the limit of 2" in n for n in e.notes)
    monkeypatch.setenv(database.MAX_DISTANCE_ENV_VAR, "6")
    assert fa4.explain(*qkv(sq=300, sk=300)).source == "nearest"
    monkeypatch.setenv(database.MAX_DISTANCE_ENV_VAR, "far")
    with pytest.warns(fa4.Fa4Warning, match="FA4_MAX_BUCKET_DISTANCE='far'.*default limit 2"):
        assert fa4.explain(*qkv(sq=300, sk=300)).source == "default"


def test_another_gpu_models_tuning_is_noted_not_used(fake):
    add_entry(fake.db_path, seqlen=64, device="NVIDIA H100 80GB HBM3")
    fa4.use_config_db(fake.db_path)
    e = fa4.explain(*qkv())
    assert e.source == "default"
    assert "note: entries tuned on NVIDIA H100 80GB HBM3 exist" in str(e) and "another GPU model" in str(e)


def test_default_layers_packaged_then_user(fake, monkeypatch, tmp_path):
    packaged, user = tmp_path / "packaged.json", tmp_path / "user.json"
    add_entry(packaged, seqlen=64, tile_n=64)
    add_entry(packaged, seqlen=1024, tile_n=112)
    mine = add_entry(user, seqlen=64, tile_n=80, us=11.0)  # slower than the packaged one, still wins its key
    monkeypatch.setattr(database, "default_layers", lambda: [("packaged", packaged), ("user", user)])
    fa4.use_config_db(None)
    e = fa4.explain(*qkv())
    assert (e.config, e.layer) == (mine, "user") and "in the user database" in str(e)
    assert f"packaged {packaged} (2 entries); user {user} (1 entries)" in e.database
    e = fa4.explain(*qkv(sq=1024, sk=1024))
    assert (e.source, e.layer, e.config.tile_n) == ("exact", "packaged", 112)


def test_a_broken_user_layer_warns_and_the_packaged_one_still_counts(fake, monkeypatch, tmp_path):
    packaged, user = tmp_path / "packaged.json", tmp_path / "user.json"
    tuned = add_entry(packaged, seqlen=64, tile_n=64)
    user.write_text("{")
    monkeypatch.setattr(database, "default_layers", lambda: [("packaged", packaged), ("user", user)])
    fa4.use_config_db(None)
    with pytest.warns(fa4.Fa4Warning, match="cannot use the user best-config database .*user.json"):
        e = fa4.explain(*qkv())
    assert e.config == tuned and "unusable" in e.database


def test_nearest_requires_same_head_dim_gqa_causal(fake):
    add_entry(fake.db_path, seqlen=64)
    fa4.use_config_db(fake.db_path)
    assert fa4.explain(*qkv(d=128)).source == "default"
    assert fa4.explain(*qkv(hq=4, hkv=4)).source == "default"
    assert fa4.explain(*qkv(), causal=True).source == "default"


def test_nearest_picks_the_closest_bucket(fake):
    add_entry(fake.db_path, seqlen=64, tile_n=64)
    near = add_entry(fake.db_path, seqlen=1024, tile_n=112)
    fa4.use_config_db(fake.db_path)
    assert fa4.explain(*qkv(sq=700, sk=700)).config == near


def test_stale_entries_are_not_used_and_warned_once(fake):
    add_entry(fake.db_path, seqlen=64, fingerprint="old0fingerprint")
    fa4.use_config_db(fake.db_path)
    q, k, v = qkv()
    with pytest.warns(fa4.Fa4Warning, match="1 tuned entry .* not used .*re-run fa4tune search"):
        out = fa4.attention(q, k, v)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fa4.attention(*qkv(sq=65, sk=65))  # another signature, same stale entry: no second warning
    assert fa4.explain(q, k, v).source == "default"
    assert not check(out, None, q, k, v, False)


def test_corrupt_database_warns_once_then_defaults(fake):
    fake.db_path.write_text("{ not json")
    fa4.use_config_db(fake.db_path)
    q, k, v = qkv()
    with pytest.warns(fa4.Fa4Warning, match="cannot use the best-config database"):
        out = fa4.attention(q, k, v)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fa4.attention(*qkv(sq=65, sk=65))
    assert not check(out, None, q, k, v, False)
    assert "unusable" in fa4.explain(q, k, v).database


def test_wrong_schema_database_warns_then_defaults(fake):
    fake.db_path.write_text(json.dumps({"schema": 99, "entries": []}))
    fa4.use_config_db(fake.db_path)
    with pytest.warns(fa4.Fa4Warning, match="schema 99"):
        fa4.attention(*qkv())


def test_failing_lookup_warns_then_defaults(fake, monkeypatch):
    def broken(*args, **kwargs):
        raise KeyError("a field this fa4 does not know")

    monkeypatch.setattr(database.BestConfigDB, "lookup", broken)
    q, k, v = qkv()
    with pytest.warns(fa4.Fa4Warning, match="lookup failed"):
        out = fa4.attention(q, k, v)
    assert not check(out, None, q, k, v, False)


@pytest.mark.parametrize("change,reason", [({"tile_q": 64}, "unknown knob"),           # renamed since the tuning
                                           ({"tile_n": 4096}, "tile_n"),              # out of range
                                           ({"tile_n": 192}, "infeasible for the problem it was tuned on")])
def test_an_unusable_entry_is_warned_by_name_and_skipped(fake, change, reason):
    add_entry(fake.db_path, seqlen=64)
    add_entry(fake.db_path, seqlen=128, tile_n=112)
    raw = json.loads(fake.db_path.read_text())
    [broken] = [e for e in raw["entries"] if e["seqlen_q_bucket"] == 64]
    broken["config"].update(change)
    fake.db_path.write_text(json.dumps(raw))
    fa4.use_config_db(fake.db_path)
    key = broken["key"]
    with pytest.warns(fa4.Fa4Warning, match=f"best-config entry {key.replace('|', '[|]')} in .* cannot be used .*{reason}"):
        e = fa4.explain(*qkv())
    assert e.source == "nearest" and e.config.tile_n == 112  # the broken entry is skipped, not the lookup
    assert "1 unusable entry skipped" in e.database


def test_a_second_broken_database_warns_too(fake, tmp_path):
    for name in ("first.json", "second.json"):
        path = tmp_path / name
        path.write_text("{ not json")
        fa4.use_config_db(path)
        with pytest.warns(fa4.Fa4Warning, match=f"cannot use the best-config database .*{name}"):
            fa4.attention(*qkv())


def test_missing_database_warns_once_then_defaults(fake, tmp_path):
    fa4.use_config_db(tmp_path / "nowhere.json")
    with pytest.warns(fa4.Fa4Warning, match="does not exist"):
        fa4.attention(*qkv())
    assert fa4.explain(*qkv()).source == "default"


def test_database_from_environment_variable(fake, monkeypatch):
    tuned = add_entry(fake.db_path, seqlen=64)
    monkeypatch.setenv(database.ENV_VAR, str(fake.db_path))
    fa4.use_config_db(None)
    assert fa4.explain(*qkv()).config == tuned


def test_entry_that_does_not_fit_falls_back_to_default_with_a_note(fake, monkeypatch):
    add_entry(fake.db_path, seqlen=64, tile_n=96)  # fits where it was tuned ...
    monkeypatch.setattr(fake.sm90, "resource_reasons",  # ... but not at longer sequences
                        lambda config, problem, device=None: ["too long"] if config.tile_n == 96 and problem.seqlen_q > 64 else [])
    fa4.use_config_db(fake.db_path)
    e = fa4.explain(*qkv(sq=100, sk=100))
    assert e.source == "default" and any("does not fit" in n for n in e.notes)


# --- config= -----------------------------------------------------------------------------------------

def test_forced_config_object_and_mapping(fake):
    add_entry(fake.db_path, seqlen=64)
    fa4.use_config_db(fake.db_path)
    forced = Config.make("sm90", tile_n=64, kv_stages=4)
    e = fa4.explain(*qkv(), config=forced)
    assert (e.source, e.config) == ("forced", forced)
    e = fa4.explain(*qkv(), config={"tile_n": 80})
    assert e.config == Config.make("sm90").replace(tile_n=80)
    q, k, v = qkv()
    fa4.attention(q, k, v, config=forced)
    assert fake.sm90.launchers[-1].config == forced


def test_forced_config_is_never_adjusted(fake):
    with pytest.raises(InvalidInputError, match="cannot run .*shared memory"):
        fa4.attention(*qkv(), config=Config.make("sm90", tile_n=192))
    with pytest.raises(InvalidInputError, match="is an sm100 configuration, but the device runs the sm90"):
        fa4.attention(*qkv(), config=Config.make("sm100"))
    with pytest.raises(InvalidInputError, match="unknown knob"):
        fa4.attention(*qkv(), config={"tile_q": 64})


def test_a_forced_config_is_checked_where_sdpa_runs_instead(fake, monkeypatch):
    """What the kernel path refuses is refused where SDPA runs (fallback='sdpa'), not ignored: on the
    device's architecture (here fp32 inputs on the H200), or on each where the GPU has no kernel."""
    q, k, v = (t.float() for t in qkv())
    with pytest.raises(InvalidInputError, match="config= .*tile_n=192.* cannot run .*shared memory"):
        fa4.attention(q, k, v, config={"tile_n": 192}, fallback="sdpa")
    with pytest.raises(InvalidInputError, match="is an sm100 configuration, but the device runs the sm90"):
        fa4.attention(q, k, v, config=Config.make("sm100"), fallback="sdpa")
    monkeypatch.setattr(state, "device_description", lambda device: A100)
    fa4.reset_caches()
    with pytest.raises(InvalidInputError, match="fits none of fa4's kernels .*sm90: .*shared memory.*; "
                                                "sm100: .*tile_n=192 is not one of"):
        fa4.attention(*qkv(), config={"tile_n": 192}, fallback="sdpa")
    with pytest.warns(fa4.Fa4Warning, match="config= is ignored"):
        fa4.attention(*qkv(), config={"tile_n": 80}, fallback="sdpa")
    assert fake.sm90.launchers == []


# --- caches and the fast path --------------------------------------------------------------------

def test_other_seqlens_reuse_the_compiled_kernel(fake):
    for seqlen in (64, 200, 1000, 64):
        q, k, v = qkv(sq=seqlen, sk=seqlen + 3, seed=seqlen)
        out = fa4.attention(q, k, v, causal=True)
        assert not check(out, None, q, k, v, True)
    info = fa4.cache_info()
    assert info["compiles"] == 1 and len(fake.sm90.launchers) == 1
    assert info["signatures"] == 3 and info["slow_calls"] == 3
    fa4.attention(*qkv(sq=64, sk=64))  # causal=False changes the code: a second compile
    assert fa4.cache_info()["compiles"] == 2


def test_the_gpus_description_is_passed_down_and_keys_the_compile(fake, monkeypatch):
    """The runtime describes the tensors' GPU once and gives that description to the feasibility, the
    default and the compile; a GPU with other compiled-in facts (78 SMs) gets its own kernel."""
    h20 = dataclasses.replace(H200, name="NVIDIA H20", sm_count=78)
    q, k, v = qkv()
    fa4.attention(q, k, v)
    seen = []
    monkeypatch.setattr(fake.sm90, "default_config", lambda problem, device=None: seen.append(device) or Config.make("sm90"))
    monkeypatch.setattr(state, "device_description", lambda device: h20)
    fa4.reset_caches()   # the decisions, not the compiled kernels
    e = fa4.explain(q, k, v)
    assert e.device_name == "NVIDIA H20" and ("num_sms", 78) in e.compile_key[-1] and not e.compiled
    fa4.attention(q, k, v)
    assert seen[-1] is h20 and fake.sm90.devices == [H200, h20]
    assert fa4.cache_info()["compiled_kernels"] == 2


def test_repeated_calls_take_the_fast_path(fake):
    q, k, v = qkv()
    first = fa4.attention(q, k, v)
    for _ in range(3):
        again = fa4.attention(q, k, v)
    assert fa4.cache_info()["slow_calls"] == 1
    assert torch.equal(first, again) and again.data_ptr() != first.data_ptr()
    assert len(fake.sm90.launchers[0].calls) == 4


def test_lse_and_scale(fake):
    q, k, v = qkv(sq=48, sk=96)
    out, lse = fa4.attention(q, k, v, causal=True, return_lse=True, softmax_scale=0.3)
    assert lse.dtype == torch.float32 and lse.shape == (1, 4, 48)
    assert not check(out, lse, q, k, v, True, scale=0.3)
    assert fake.sm90.launchers[0].calls[-1][2] == 0.3
    fa4.attention(q, k, v, causal=True, return_lse=True)
    assert fake.sm90.launchers[0].calls[-1][2] == pytest.approx(1 / 8)


def test_misaligned_pointer_is_caught_even_for_a_cached_signature(fake):
    q, k, v = qkv()
    fa4.attention(q, k, v)
    shifted = torch.empty(q.numel() + 8, dtype=F16)[1:1 + q.numel()].view(q.shape)
    assert shifted.stride() == q.stride()  # same signature as the cached call
    with pytest.raises(UnsupportedInputError, match="not 16-byte aligned"):
        fa4.attention(shifted, k, v)
    with pytest.warns(fa4.Fa4Warning, match="SDPA"):
        out = fa4.attention(shifted.copy_(q), k, v, fallback="sdpa")
    assert not check(out, None, q, k, v, False)


def test_size_one_dim_restride_runs(fake):
    q, k, v = qkv(b=1)
    odd = q.as_strided(q.shape, (3, *q.stride()[1:]))
    for _ in range(2):
        out = fa4.attention(odd, k, v)
        assert not check(out, None, q, k, v, False)


def test_non_contiguous_q_gives_contiguous_output(fake):
    packed = torch.randn(1, 64, 3, 4, 64, dtype=F16)  # (B, S, q/k/v, H, D), as a fused projection gives
    q, k, v = packed[:, :, 0], packed[:, :, 1, :2], packed[:, :, 2, :2]
    out = fa4.attention(q, k, v)
    assert out.is_contiguous() and out.shape == q.shape
    assert not check(out, None, q, k, v, False)


def test_same_shape_other_strides_is_another_signature(fake):
    q, k, v = qkv(sq=64, sk=64, hq=4, hkv=4)
    fa4.attention(q, k, v)
    k_view = torch.randn(1, 4, 64, 64, dtype=F16).transpose(1, 2)  # same shape as k, other strides
    out = fa4.attention(q, k_view, v)
    assert fa4.cache_info()["signatures"] == 2
    assert not check(out, None, q, k_view, v, False)


def test_switching_database_forgets_cached_choices(fake, tmp_path):
    q, k, v = qkv()
    fa4.attention(q, k, v)
    assert fake.sm90.launchers[-1].config == Config.make("sm90")
    other = tmp_path / "other.json"
    tuned = add_entry(other, seqlen=64, tile_n=64)
    fa4.use_config_db(other)
    fa4.attention(q, k, v)
    assert fake.sm90.launchers[-1].config == tuned


def test_explain_refuses_what_attention_refuses(fake):
    q, k, v = qkv()
    with pytest.raises(InvalidInputError, match="finite"):
        fa4.explain(q, k, v, softmax_scale=float("nan"))


# --- zero lengths ----------------------------------------------------------------------------------

def test_empty_query_returns_empty_without_a_launch(fake):
    q, k, v = qkv(sq=0, sk=64)
    out, lse = fa4.attention(q, k, v, return_lse=True)
    assert out.shape == (1, 0, 4, 64) and lse.shape == (1, 4, 0)
    assert fake.sm90.launchers == [] and fa4.explain(q, k, v).path == "empty"
    assert fa4.attention(*qkv(b=0)).shape == (0, 64, 4, 64)


def test_empty_keys_give_zero_output_and_minus_inf_lse(fake):
    q, k, v = qkv(sq=16, sk=0)
    for _ in range(2):  # first and cached call
        out, lse = fa4.attention(q, k, v, causal=True, return_lse=True)
        assert torch.equal(out, torch.zeros_like(q)) and out.dtype == F16
        assert lse.shape == (1, 4, 16) and torch.all(lse == -math.inf)
    assert fake.sm90.launchers == []


# --- architectures ---------------------------------------------------------------------------------

def test_sm100_needs_an_opt_in(fake, monkeypatch):
    q, k, v = qkv()
    # attention refuses without the opt-in; explain explains what runs once opted in, and says so
    gated = fa4.explain(q, k, v, arch="sm100")
    assert gated.path == "kernel" and gated.config.arch == "sm100"
    assert "fa4.attention raises on sm100 unless allow_untested_sm100=True" in str(gated)
    e = fa4.explain(q, k, v, arch="sm100", allow_untested_sm100=True)
    assert "raises on sm100" not in str(e)
    assert e.path == "kernel" and e.config.arch == "sm100"
    assert "has not yet run on hardware" in str(e)
    monkeypatch.setenv(planning.ALLOW_SM100_ENV, "1")
    assert fa4.explain(q, k, v, arch="sm100").path == "kernel"


def test_sm100_device_without_opt_in_falls_back_only_when_asked(fake, monkeypatch):
    monkeypatch.setattr(state, "device_description", lambda device: B200)
    q, k, v = qkv()
    with pytest.raises(UnsupportedInputError, match="not yet run on hardware"):
        fa4.attention(q, k, v)
    with pytest.warns(fa4.Fa4Warning, match="SDPA"):
        out = fa4.attention(q, k, v, fallback="sdpa")
    assert not check(out, None, q, k, v, False)
    fa4.attention(q, k, v, allow_untested_sm100=True)
    assert fake.families["sm100"].launchers and not fake.sm90.launchers


def test_unsupported_gpu(fake, monkeypatch):
    monkeypatch.setattr(state, "device_description", lambda device: A100)
    q, k, v = qkv()
    with pytest.raises(UnsupportedInputError, match=r"A100.*compute capability 8\.0.*no fa4 kernel.*fallback='sdpa'"):
        fa4.attention(q, k, v)
    with pytest.warns(fa4.Fa4Warning, match="compute capability 8.0"):
        out = fa4.attention(q, k, v, causal=True, fallback="sdpa")
    assert not check(out, None, q, k, v, True)
    assert "torch SDPA" in str(fa4.explain(q, k, v, fallback="sdpa"))


def test_head_dim_no_kernel_supports(fake):
    q, k, v = qkv(d=96)
    with pytest.raises(UnsupportedInputError, match="head_dim 96 not in"):
        fa4.attention(q, k, v)
    with pytest.warns(fa4.Fa4Warning):
        assert fa4.attention(q, k, v, fallback="sdpa").shape == q.shape


def test_default_that_does_not_fit(fake, monkeypatch):
    monkeypatch.setattr(fake.sm90, "default_config", lambda problem, device=None: Config.make("sm90", tile_n=192))
    with pytest.raises(UnsupportedInputError, match="heuristic default .* cannot run"):
        fa4.attention(*qkv())
    assert fa4.explain(*qkv(), fallback="sdpa").path == "sdpa"


# --- torch.compile through the custom op -------------------------------------------------------------

def test_torch_compile_fullgraph_through_the_custom_op(fake):
    q, k, v = qkv(sq=40, sk=72)

    def block(q, k, v):
        out, lse = fa4.attention(q * 1.0, k, v, causal=True, return_lse=True)
        return out + 1, lse

    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    out, lse = compiled(q, k, v)
    ref_out, ref_lse = reference(q, k, v, True)
    torch.testing.assert_close(out.float(), ref_out + 1, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-3, atol=1e-3)
    assert fake.sm90.launchers, "the compiled graph must launch our kernel"


def test_torch_compile_with_a_forced_config(fake):
    forced = Config.make("sm90", tile_n=64)
    compiled = torch.compile(lambda q, k, v: fa4.attention(q, k, v, config=forced), fullgraph=True,
                             backend="aot_eager")
    q, k, v = qkv()
    assert not check(compiled(q, k, v), None, q, k, v, False)
    assert fake.sm90.launchers[-1].config == forced


def test_torch_compile_with_a_knob_mapping(fake):
    compiled = torch.compile(lambda q, k, v: fa4.attention(q, k, v, config={"tile_n": 80}),
                             fullgraph=True, backend="aot_eager")
    q, k, v = qkv()
    assert not check(compiled(q, k, v), None, q, k, v, False)
    assert fake.sm90.launchers[-1].config == Config.make("sm90").replace(tile_n=80)


def test_custom_op_fake_impl_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(2, 33, 8, 128, dtype=F16)
        k = torch.empty(2, 70, 2, 128, dtype=F16)
        out, lse = torch.ops.fa4.attention(q, k, k, True, None, True, None, "error", False)
        assert out.shape == q.shape and out.dtype == F16 and out.is_contiguous()
        assert lse.shape == (2, 8, 33) and lse.dtype == torch.float32
        _, no_lse = torch.ops.fa4.attention(q, k, k, True, None, False, None, "error", False)
        assert no_lse.shape == (0,)


def test_custom_op_opcheck(fake):
    q, k, v = qkv()
    torch.library.opcheck(torch.ops.fa4.attention.default, (q, k, v, False, None, True, None, "error", False),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


def test_config_crosses_the_custom_op_as_a_label():
    problem = AttentionProblem(1, 128, 128, 8, 2, 64)
    cfg = Config.make("sm90", tile_n=80, rescale_threshold=4.0, softmax_overlap=False)
    assert config_arg.for_op(cfg) == cfg.label()
    assert config_arg.coerce_config(config_arg.for_op(cfg), "sm90", problem) == cfg
    sent = config_arg.for_op({"tile_n": 80, "pv_operand": "ss"})
    assert sent == "pv_operand=ss tile_n=80"
    assert config_arg.coerce_config(sent, "sm90", problem) == kernels.default_config("sm90", problem).replace(
        tile_n=80, pv_operand="ss")
    # a Config of another architecture says so on the way back
    with pytest.raises(InvalidInputError, match="knobs of sm100: a configuration for another architecture"):
        config_arg.coerce_config(config_arg.for_op(Config.make("sm100")), "sm90", problem)


# --- the SDPA fallback itself ------------------------------------------------------------------------

@pytest.mark.parametrize("sq,sk", [(64, 64), (40, 100), (100, 40), (1, 33)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2)])
def test_sdpa_fallback_matches_fp32_reference(sq, sk, causal, hq, hkv):
    q, k, v = qkv(sq=sq, sk=sk, hq=hq, hkv=hkv, dtype=torch.float32)
    out, lse = fallback.sdpa_attention(q, k, v, causal, None, True)
    ref_out, ref_lse = reference(q, k, v, causal)
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-4, atol=1e-4)
    if causal and sq > sk:  # rows that see no key
        assert torch.all(out[:, : sq - sk] == 0) and torch.all(lse[:, :, : sq - sk] == -math.inf)


def _with(t, index, value):
    t = t.clone()
    t[index] = value
    return t


@pytest.mark.parametrize("case", [
    "inf in a key", "a key of infs", "nan in a key", "inf in a query", "inf in a value", "a hidden inf key"])
@pytest.mark.parametrize("dtype", [torch.float32, F16])
def test_the_sdpa_fallback_gives_the_references_answer_for_inf_and_nan(case, dtype):
    """Inputs holding inf or NaN get the fp32 reference's answer: NaN in every row that sees a NaN or
    +inf score (as our kernels give it), none for a hidden key's inf. SDPA on the CPU gives finite
    numbers in such rows, and NaN for a hidden key's inf."""
    causal, sq, sk = (True, 32, 64) if case == "a hidden inf key" else (case == "inf in a value", 64, 64)
    q, k, v = qkv(sq=sq, sk=sk, dtype=dtype)
    if case in ("inf in a key", "a hidden inf key"):
        k = _with(k, (0, sk - 1, 0, 5), math.inf)  # the last key: hidden from every causal row but one
    elif case == "a key of infs":
        k = _with(k, (0, 3, 1), math.inf)
    elif case == "nan in a key":
        k = _with(k, (0, 3, 0, 0), math.nan)
    elif case == "inf in a query":
        q = _with(q, (0, 7, 2, 9), -math.inf)
    else:
        v = _with(v, (0, 40, 1, 3), math.inf)
    want_out, want_lse = reference(q, k, v, causal)
    with pytest.warns(fa4.Fa4Warning, match="SDPA"):
        out, lse = fa4.attention(q, k, v, causal=causal, return_lse=True, fallback="sdpa")
    assert torch.equal(out.isnan(), want_out.isnan()) and bool(want_out.isnan().any()) != (case == "a hidden inf key")
    torch.testing.assert_close(out.float(), want_out, rtol=1e-2, atol=1e-2, equal_nan=True)
    torch.testing.assert_close(lse, want_lse, rtol=1e-3, atol=1e-3, equal_nan=True)


# --- CUDA's launch limits ---------------------------------------------------------------------------

def test_shapes_past_the_grid_limits_are_refused_or_handled_before_launch(fake):
    q, k, v = (torch.empty(70_000, 1, 1, 64, dtype=F16) for _ in range(3))  # batch > 65,535
    single = Config.make("sm90", scheduler="single", pack_gqa=False)
    with pytest.raises(InvalidInputError, match=r"70000 batch: its z \(70000\) > 65535, the limit of the grid's z on NVIDIA H200"):
        fa4.explain(q, k, v, config=single)
    # a tuned entry that cannot launch here: noted, and the default runs
    add_entry(fake.db_path, seqlen=1, hq=1, hkv=1, tile_n=96)
    raw = json.loads(fake.db_path.read_text())
    raw["entries"][0]["work_bucket"] = database.bucket(70_000)
    raw["entries"][0]["key"] = raw["entries"][0]["key"].replace("|w1", f"|w{database.bucket(70_000)}")
    fake.db_path.write_text(json.dumps(raw))
    fa4.use_config_db(fake.db_path)
    e = fa4.explain(q, k, v)
    assert e.source == "default" and any("does not fit" in n and "65535" in n for n in e.notes)
    # the heuristic default (scheduler=single here) is ours to adjust: the same tiles on a 1-D grid
    assert e.config == Config.make("sm90").replace(scheduler="single_lpt")
    assert any("scheduler=single_lpt runs the same tiles instead" in n for n in e.notes)
    out = fa4.attention(q[:2].normal_(), k[:2].normal_(), v[:2].normal_())  # a small batch keeps `single`
    assert fake.sm90.launchers[-1].config.scheduler == "single" and out.shape == (2, 1, 1, 64)


def test_a_fifo_as_the_database_warns_instead_of_hanging(fake, tmp_path):
    import os

    fifo = tmp_path / "db.fifo"
    os.mkfifo(fifo)  # nobody writes to it: reading it would block forever
    fa4.use_config_db(fifo)
    with pytest.warns(fa4.Fa4Warning, match="is not a regular file"):
        assert fa4.explain(*qkv()).source == "default"


def test_torch_compile_with_a_softmax_scale(fake):
    q, k, v = qkv()
    compiled = torch.compile(lambda q, k, v: fa4.attention(q, k, v, softmax_scale=0.3), fullgraph=True,
                             backend="aot_eager")
    assert not check(compiled(q, k, v), None, q, k, v, False, scale=0.3)
    refused = torch.compile(lambda q, k, v: fa4.attention(q, k, v, softmax_scale=-0.3), backend="aot_eager")
    with pytest.raises(InvalidInputError, match="softmax_scale must be positive"):
        refused(q, k, v)


def test_inputs_on_no_gpu_are_explained_for_the_card_with_the_most_entries(monkeypatch):
    """On a machine without a GPU `fa4.explain` assumes the card the database was mostly tuned on (the
    packaged one holds H200 entries and a few H100 ones): not the first name in sort order."""
    from types import SimpleNamespace

    from fa4 import runtime

    entries = [SimpleNamespace(arch="sm90", device="NVIDIA H100 80GB HBM3")] * 2 + \
              [SimpleNamespace(arch="sm90", device="NVIDIA H200")] * 3 + \
              [SimpleNamespace(arch="sm90_bwd", device="NVIDIA H100 80GB HBM3")] * 5   # not a forward family
    monkeypatch.setattr(runtime.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(runtime, "database", lambda: SimpleNamespace(entries=entries))
    arch, device_name, note = runtime._assumed_target(None)
    assert (arch, device_name) == ("sm90", "NVIDIA H200") and "NVIDIA H200, where the tuned database" in note
    # a named card is taken as named
    assert runtime._assumed_target("NVIDIA H100 80GB HBM3")[1] == "NVIDIA H100 80GB HBM3"
