"""Prefill of transformers models on fa4, SDPA and flash-attn-4 (H200; random weights, no hub):

    python benchmarks/transformers_prefill.py --out prefill.json [--layers 4] [--seqlens 2048,8192]

Models: a Llama-3-8B-shaped and a Mistral-7B-shaped decoder (the real widths, heads and vocabularies,
`--layers` layers), bf16, batch 1. Per model, length and attention implementation ("fa4" through
`fa4.transformers_attention`, "sdpa", and transformers' "flash_attention_4" where it loads): the
forward's wall time (median of `--repeats` after two warm-up calls, CUDA-synchronised: end to end,
attention and everything else) and the logits' agreement with the SDPA run (largest absolute
difference over the largest logit, and the share of positions whose argmax agrees). The Mistral
window (4096) hides no key at lengths up to 4096; beyond, every implementation runs it (fa4 through
`window_size`, SDPA through transformers' sliding-window mask).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

MODELS = {
    "llama-3-8b": dict(kind="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                       num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0),
    "mistral-7b": dict(kind="mistral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                       num_attention_heads=32, num_key_value_heads=8, sliding_window=4096),
}
IMPLEMENTATIONS = ("sdpa", "fa4", "flash_attention_4")


def build(name: str, layers: int, implementation: str, seqlen: int):
    import transformers

    spec = dict(MODELS[name])
    kind = spec.pop("kind")
    config_class = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig}[kind]
    config = config_class(num_hidden_layers=layers, max_position_embeddings=max(seqlen, 8192), **spec)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=implementation,
                                                              torch_dtype=torch.bfloat16)
    return model.eval()


def time_forward(model, tokens, repeats: int) -> tuple[float, torch.Tensor]:
    with torch.no_grad():
        for _ in range(2):
            logits = model(tokens).logits
        torch.cuda.synchronize()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            logits = model(tokens).logits
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), logits.float()


def main() -> None:
    import fa4.transformers_attention

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seqlens", default="2048,4096,8192")
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    fa4.transformers_attention.register()
    rows = []
    for name in MODELS:
        for seqlen in (int(s) for s in args.seqlens.split(",")):
            tokens = torch.randint(0, MODELS[name]["vocab_size"], (1, seqlen), device="cuda",
                                   generator=torch.Generator(device="cuda").manual_seed(seqlen))
            reference = None
            for implementation in IMPLEMENTATIONS:
                row = {"model": name, "layers": args.layers, "seqlen": seqlen, "implementation": implementation}
                try:
                    model = build(name, args.layers, implementation, seqlen)
                    row["ms"], logits = time_forward(model, tokens, args.repeats)
                    if reference is None:
                        reference = logits
                    else:
                        row["max_diff_over_max_logit"] = float((logits - reference).abs().max() / reference.abs().max())
                        row["argmax_agreement"] = float((logits.argmax(-1) == reference.argmax(-1)).float().mean())
                    del model, logits
                except Exception as exc:  # an implementation that does not load or run here is a row
                    row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                torch.cuda.empty_cache()
                rows.append(row)
                print(json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
