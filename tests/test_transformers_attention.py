"""attn_implementation="fa4" in a transformers model (CPU: fa4.attention falls back to SDPA there, so
this holds the plumbing: layouts, scaling, causality, GQA, padding, training, refusals; the GPU test
runs our kernel)."""

from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import fa4.transformers_attention as fa4_attn  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _registered():
    fa4_attn.register()


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*fallback='sdpa'")
        warnings.filterwarnings("ignore", message=".*padded batch")
        yield


def _llama(implementation: str, seed: int = 0):
    config = transformers.LlamaConfig(vocab_size=101, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=implementation).eval()


def test_logits_match_sdpa():
    tokens = torch.randint(0, 101, (2, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, sdpa = (_llama(name)(tokens).logits for name in ("fa4", "sdpa"))
    torch.testing.assert_close(ours, sdpa, rtol=1e-4, atol=1e-4)


def test_a_padded_batch_matches_sdpa_on_its_real_tokens():
    tokens = torch.randint(0, 101, (2, 20), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[1, :6] = 0   # left padding
    with torch.no_grad():
        ours, sdpa = (_llama(name)(tokens, attention_mask=mask).logits for name in ("fa4", "sdpa"))
    torch.testing.assert_close(ours[0], sdpa[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ours[1, 6:], sdpa[1, 6:], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("padding", ["left", "right", "holes"])
def test_padded_batches_pack_into_attention_varlen(padding, monkeypatch):
    """Left or right padding (one run of real tokens per row) runs as a packed varlen batch; a mask with
    holes runs on SDPA, saying so. Real tokens' logits match SDPA's either way."""
    import fa4

    calls = []
    real_varlen = fa4.attention_varlen
    monkeypatch.setattr(fa4, "attention_varlen", lambda *a, **kw: calls.append(a[3].tolist()) or real_varlen(*a, **kw))
    tokens = torch.randint(0, 101, (3, 16), generator=torch.Generator().manual_seed(5))
    mask = torch.ones(3, 16, dtype=torch.long)
    real = torch.ones(3, 16, dtype=torch.bool)
    if padding == "left":
        mask[1, :5] = 0
        mask[2, :15] = 0
    elif padding == "right":
        mask[1, 11:] = 0
    else:
        mask[1, 4:7] = 0
    real &= mask.bool()
    with torch.no_grad():
        ours, sdpa = (_llama(name)(tokens, attention_mask=mask).logits for name in ("fa4", "sdpa"))
    torch.testing.assert_close(ours[real], sdpa[real], rtol=1e-4, atol=1e-4)
    if padding == "holes":
        assert not calls
    else:
        assert calls and calls[0] == [0, 16, 16 + int(mask[1].sum()), 16 + int(mask[1].sum()) + int(mask[2].sum())]


def test_generation_with_a_cache_matches_sdpa():
    prompt = torch.randint(0, 101, (1, 9), generator=torch.Generator().manual_seed(3))
    ours, sdpa = (_llama(name).generate(prompt, max_new_tokens=6, do_sample=False) for name in ("fa4", "sdpa"))
    assert torch.equal(ours, sdpa)


def test_a_training_step_gives_sdpas_gradients():
    tokens = torch.randint(0, 101, (2, 33), generator=torch.Generator().manual_seed(4))
    grads = []
    for name in ("fa4", "sdpa"):
        model = _llama(name).train()
        model(tokens, labels=tokens).loss.backward()
        grads.append(model.model.layers[0].self_attn.q_proj.weight.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-3, atol=1e-5)


def test_what_it_cannot_do_is_refused():
    q = torch.randn(1, 4, 8, 64)
    module = torch.nn.Module()
    module.train()
    with pytest.raises(ValueError, match="dropout"):
        fa4_attn.attention_forward(module, q, q, q, None, dropout=0.1)


def test_a_sliding_window_and_a_softcap_reach_fa4_attention():
    from fa4.reference import attention_fp32

    q = torch.randn(1, 4, 12, 64, generator=torch.Generator().manual_seed(6))
    module = torch.nn.Module()
    module.is_causal = True
    out, _ = fa4_attn.attention_forward(module, q, q, q, None, sliding_window=5, softcap=3.0, scaling=0.5)
    qs = q.transpose(1, 2)   # a query sees itself and the 4 keys before it
    torch.testing.assert_close(out, attention_fp32(qs, qs, qs, True, 0.5, window=(4, 0), softcap=3.0)[0],
                               rtol=1e-5, atol=1e-5)
    wide, _ = fa4_attn.attention_forward(module, q, q, q, None, sliding_window=12)   # as wide as the keys
    torch.testing.assert_close(wide, attention_fp32(qs, qs, qs, True)[0], rtol=1e-5, atol=1e-5)


def test_deterministic_is_asked_as_transformers_asks_flash_attn(monkeypatch):
    """A layer's `deterministic` argument, else FLASH_ATTENTION_DETERMINISTIC=1, else torch's setting (None)."""
    seen = []
    monkeypatch.setattr(fa4_attn.fa4, "attention", lambda *a, **kw: seen.append(kw["deterministic"]) or a[0])
    q = torch.randn(1, 4, 12, 64)
    module = torch.nn.Module()
    monkeypatch.delenv("FLASH_ATTENTION_DETERMINISTIC", raising=False)
    fa4_attn.attention_forward(module, q, q, q, None)
    fa4_attn.attention_forward(module, q, q, q, None, deterministic=True)
    monkeypatch.setenv("FLASH_ATTENTION_DETERMINISTIC", "1")
    fa4_attn.attention_forward(module, q, q, q, None)
    fa4_attn.attention_forward(module, q, q, q, None, deterministic=False)
    assert seen == [None, True, True, False]


def _model(kind: str, implementation: str):
    if kind == "mistral":   # a sliding window on every layer
        config = transformers.MistralConfig(vocab_size=101, hidden_size=128, intermediate_size=256,
                                            num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                                            max_position_embeddings=256, sliding_window=8)
    else:                   # Gemma 2: a logit softcap, sliding and global layers in turn, head dim 64
        config = transformers.Gemma2Config(vocab_size=101, hidden_size=128, intermediate_size=256,
                                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                           head_dim=64, max_position_embeddings=256, sliding_window=8,
                                           attn_logit_softcapping=20.0, query_pre_attn_scalar=64)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=implementation).eval()


@pytest.mark.parametrize("kind", ["mistral", "gemma2"])
def test_sliding_window_and_softcap_models_match_eager(kind):
    def without_them(module, q, k, v, mask, **kwargs):   # what fa4 gave before windows and softcaps
        kwargs.pop("sliding_window", None)
        kwargs.pop("softcap", None)
        return fa4_attn.attention_forward(module, q, k, v, mask, **kwargs)

    transformers.AttentionInterface.register("fa4_without_window_or_softcap", without_them)
    transformers.masking_utils.AttentionMaskInterface.register(
        "fa4_without_window_or_softcap", transformers.masking_utils.flash_attention_mask)
    tokens = torch.randint(0, 101, (2, 29), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        ours, eager, ignored = (_model(kind, name)(tokens).logits
                                for name in ("fa4", "eager", "fa4_without_window_or_softcap"))
    torch.testing.assert_close(ours, eager, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(ignored, eager, rtol=1e-3, atol=1e-3)   # the window and cap change the answer


def test_the_layers_scaling_and_gqa_reach_the_kernel():
    gen = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(1, 8, 24, 64, generator=gen), torch.randn(1, 2, 30, 64, generator=gen), \
        torch.randn(1, 2, 30, 64, generator=gen)
    module = torch.nn.Module()
    module.is_causal = True
    out, weights = fa4_attn.attention_forward(module, q, k, v, None, scaling=0.3)
    # bottom-right causal over 24 queries and 30 keys, GQA 4, scale 0.3
    mask = torch.arange(30)[None, :] <= torch.arange(24)[:, None] + 6
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True)
    assert weights is None and out.shape == (1, 24, 8, 64)
    torch.testing.assert_close(out, want.transpose(1, 2), rtol=1e-5, atol=1e-5)
