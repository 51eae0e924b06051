"""attn_implementation="fa4" on the H200: a small Llama-shaped model in bf16 runs our kernel (forward and
backward) and agrees with the same model on SDPA.

    python -m pytest -m gpu -q tests/gpu/test_transformers_gpu.py
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import fa4  # noqa: E402
import fa4.transformers_attention as fa4_attn  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("empty_database")]


def _model(implementation: str):
    fa4_attn.register()
    config = transformers.LlamaConfig(vocab_size=1000, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048)
    torch.manual_seed(0)
    with torch.device("cuda"):
        return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=implementation,
                                                             torch_dtype=torch.bfloat16)


def test_prefill_runs_our_kernel_and_agrees_with_sdpa():
    tokens = torch.randint(0, 1000, (2, 777), device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    with torch.no_grad():
        sdpa = _model("sdpa").eval()(tokens).logits.float()
        slow_calls = fa4.cache_info()["slow_calls"]
        ours = _model("fa4").eval()(tokens).logits.float()
    assert fa4.cache_info()["slow_calls"] > slow_calls   # fa4.attention ran (its first calls plan)
    assert (ours - sdpa).abs().max() <= 0.05 * sdpa.abs().max()
    assert (ours.argmax(-1) == sdpa.argmax(-1)).float().mean() > 0.98


def test_a_training_step_tracks_sdpa():
    tokens = torch.randint(0, 1000, (2, 512), device="cuda", generator=torch.Generator(device="cuda").manual_seed(2))
    losses = {}
    for name in ("sdpa", "fa4"):
        model = _model(name).train()
        loss = model(tokens, labels=tokens).loss
        loss.backward()
        losses[name] = loss.item()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)
    assert abs(losses["fa4"] - losses["sdpa"]) <= 0.01 * losses["sdpa"]


def test_a_padded_prefill_packs_into_varlen_and_agrees_with_sdpa():
    tokens = torch.randint(0, 1000, (3, 600), device="cuda", generator=torch.Generator(device="cuda").manual_seed(3))
    mask = torch.ones(3, 600, dtype=torch.long, device="cuda")
    mask[1, :250] = 0     # left padding
    mask[2, 411:] = 0     # right padding
    real = mask.bool()
    with torch.no_grad():
        sdpa = _model("sdpa").eval()(tokens, attention_mask=mask).logits.float()[real]
        ours = _model("fa4").eval()(tokens, attention_mask=mask).logits.float()[real]
    assert (ours - sdpa).abs().max() <= 0.05 * sdpa.abs().max()
    assert (ours.argmax(-1) == sdpa.argmax(-1)).float().mean() > 0.98
