"""Quick H200 check and timing of the sm90 kernel beside flash-attn-4 and SDPA (cuDNN).

    python -m fa4.kernels.sm90.bench_quick            # timing at B=1 S=1024 Hq=32 Hkv=8 D=128 fp16
    python -m fa4.kernels.sm90.bench_quick --check    # plus a few correctness cases first
    python -m fa4.kernels.sm90.bench_quick --config tile_n=176 --config scheduler=lpt

GPU time: ~20 launches captured in a CUDA graph, replayed; CUDA-event time per replay, median of
the replays, divided by the launches per graph. L2 warm (the same tensors every launch). Host
overhead: eager calls timed with perf_counter, no sync inside the loop.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def graph_time_us(fn, launches: int = 20, replays: int = 7) -> float:
    import torch
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(launches):
                fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / launches)
    return statistics.median(times)


def host_time_us(fn, calls: int = 200) -> float:
    import torch
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) * 1e6 / calls


def _parse_overrides(items):
    out = {}
    for item in items or []:
        name, value = item.split("=", 1)
        for cast in (int, float):
            try:
                value = cast(value)
                break
            except ValueError:
                pass
        if value in ("True", "true", "on"):
            value = True
        elif value in ("False", "false", "off"):
            value = False
        out[name] = value
    return out


def run_case(problem, config, seed=0, logit_scale=1.0):
    """Run once and check against the fp32 reference and SDPA (kernels/sm90/reference.py)."""
    from fa4.kernels.sm90.reference import run_and_check
    failures = run_and_check(config, problem, logit_scale=logit_scale)
    return {"ok": not failures, "failures": failures}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--config", action="append", help="knob=value override of the default")
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--no-peers", action="store_true")
    args = ap.parse_args(argv)

    import torch
    from fa4.kernels import AttentionProblem, compile_attention, default_config

    results = {"device": torch.cuda.get_device_name(), "cases": [], "timing": []}
    overrides = _parse_overrides(args.config)
    if args.check:
        shapes = [(1, 1024, 1024, 32, 8, 128), (2, 1000, 1000, 8, 2, 128), (1, 17, 17, 4, 2, 64),
                  (1, 1, 4099, 4, 4, 128), (1, 1000, 17, 8, 8, 64), (1, 2048, 1024, 14, 2, 128)]
        for shape in shapes:
            for causal in (False, True):
                for dtype in ("fp16", "bf16"):
                    prob = AttentionProblem(*shape, dtype=dtype, causal=causal, return_lse=True)
                    cfg = default_config("sm90", prob)
                    if overrides:
                        cfg = cfg.replace(**overrides)
                    try:
                        r = run_case(prob, cfg)
                    except Exception as exc:  # report and go on
                        r = {"error": f"{type(exc).__name__}: {exc}"[:500]}
                    r.update(problem=prob.label(), config=cfg.label())
                    print(json.dumps(r), flush=True)
                    results["cases"].append(r)

    b, s, hq, hkv, d = 1, 1024, 32, 8, 128
    q = torch.randn(b, s, hq, d, device="cuda", dtype=torch.float16)
    k = torch.randn(b, s, hkv, d, device="cuda", dtype=torch.float16)
    v = torch.randn(b, s, hkv, d, device="cuda", dtype=torch.float16)
    out = torch.empty_like(q)
    for causal in (False, True):
        prob = AttentionProblem(b, s, s, hq, hkv, d, "fp16", causal=causal)
        cfg = default_config("sm90", prob)
        if overrides:
            cfg = cfg.replace(**overrides)
        row = {"causal": causal, "config": cfg.label()}
        try:
            kern = compile_attention(cfg, prob)
            fn = lambda: kern.run(q, k, v, out)
            row["ours_us"] = graph_time_us(fn)
            row["ours_host_us"] = host_time_us(fn)
            row["ours_tflops"] = prob.flops() / row["ours_us"] / 1e6
        except Exception as exc:
            row["ours_error"] = f"{type(exc).__name__}: {exc}"[:500]
        if not args.no_peers:
            try:
                from flash_attn.cute import flash_attn_func
                fa = lambda: flash_attn_func(q, k, v, causal=causal)
                row["fa4_us"] = graph_time_us(fa)
            except Exception as exc:
                row["fa4_error"] = f"{type(exc).__name__}: {exc}"[:300]
            try:
                from torch.nn.attention import SDPBackend, sdpa_kernel
                import torch.nn.functional as F
                qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
                kt = kt.repeat_interleave(hq // hkv, 1).contiguous()
                vt = vt.repeat_interleave(hq // hkv, 1).contiguous()
                def cudnn():
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                row["cudnn_us"] = graph_time_us(cudnn)
            except Exception as exc:
                row["cudnn_error"] = f"{type(exc).__name__}: {exc}"[:300]
        if "ours_us" in row and "fa4_us" in row:
            row["ours_over_fa4"] = row["ours_us"] / row["fa4_us"]
        print(json.dumps(row), flush=True)
        results["timing"].append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
