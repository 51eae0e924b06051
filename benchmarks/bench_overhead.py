"""Host overhead of one eager attention call: fa4.attention (kernel path and custom-op path) beside
flash-attn-4 and SDPA, in one run on one GPU; and each implementation called through
fa4.attention(backend=...) beside the same implementation called directly.

    python benchmarks/bench_overhead.py                       # B=1 S=1024 Hq=32 Hkv=8 D=128 fp16
    python benchmarks/bench_overhead.py --causal --json $OUT/overhead.json

Rows that split fa4's host cost, top down (each with a preallocated O, no checks above it):
fa4.attention's checked path (full signature key and pointer checks), CompiledAttention.run, the
DSL's compiled-function __call__, the raw tvm_ffi.Function call (lse None, and with an LSE tensor on
the return_lse kernel), the direct launcher the kernel path uses; then torch.empty_like plus the
direct launcher with nothing else (the floor of any Python path that allocates O), the same work in a
small C++ function (TVM-FFI load_inline, built here), torch.empty_like alone, one torch op launch
(fill_), torch.cuda.current_stream(), the device check, the kernel path's own Python (grad check and
short key), torch.compiler.is_compiling(), and an empty CuTe DSL kernel with the same host signature
compiled with --enable-tvm-ffi (TVM-FFI's per-call floor for these arguments). A row that fails
prints its error; the others still run.

Rows per implementation, twice: called directly (each peer's `direct_call` in `fa4.backends`:
flash_attn_func, SDPA with its backend pinned by the sdpa_kernel context manager), and through
`fa4.attention(q, k, v, causal=..., backend=name)` for every backend ("ours" and each peer of the
registry, `fa4.backends.implementations()`): the eager per-call host time a user pays when dispatch
runs that implementation (our input checks and plan lookup, then the peer's runner and our rule for
rows without keys). A forced backend that is not installed or
refuses the shape says why. The summary sets the two side by side (the difference is our wrapper);
`fa4tune.benchmark.host_overhead` derives the runtime's table from the fa4.attention rows where a run has them.

Three figures per implementation, all after warm-up (compile, then launches):
- host us/call: N back-to-back eager calls timed with time.perf_counter, no synchronisation inside
  (the GPU queue absorbs the launches; N is small enough that it never fills), median over repeats.
  This is the number the issue bounds (<= 8 us for fa4.attention's kernel path); the first row is
  measured again at the end, and the verdict takes the worse of the two.
- wall us/call: the same N calls followed by a synchronize: max(host, GPU) per call in steady state.
- GPU us/call: the call captured 20 times in a CUDA graph, replays timed with CUDA events, median.
Rows that cannot run here (flash-attn-4 not installed, an SDPA backend refusing the shape) say why.
"""

# no `from __future__ import annotations`: the DSL evaluates the trivial kernel's annotations

import argparse
import json
import statistics
import sys
import time

from fa4 import backends
from fa4.kernels.dsl_internals import tvm_ffi_function_of
from fa4tune.benchmark.host_overhead import direct_row, through_row


def through_vs_direct(rows: list[dict]) -> list[str]:
    """Summary lines: per implementation, host us per eager call through fa4.attention(backend=...)
    and called directly, and the difference (what our wrapper adds)."""
    by_name = {r["name"]: r for r in rows}
    lines = ["# host us per eager call, through fa4.attention(backend=...) vs called directly:"]
    for name in backends.implementations():
        through, direct = by_name.get(through_row(name), {}), by_name.get(direct_row(name), {})
        if "host_us" in through and "host_us" in direct:
            lines.append(f"#   {name:13s} {through['host_us']:8.2f} vs {direct['host_us']:8.2f} "
                         f"({through['host_us'] - direct['host_us']:+.2f} us)")
        else:
            lines.append(f"#   {name:13s} " + "; ".join(f"{what}: {row.get('error', 'not measured')}"
                                                      for what, row in (("through", through), ("direct", direct))
                                                      if "host_us" not in row))
    return lines


def host_and_wall_us(fn, calls: int, repeats: int):
    import torch

    host, wall = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        host.append((t1 - t0) / calls * 1e6)
        wall.append((t2 - t0) / calls * 1e6)
    return statistics.median(host), statistics.median(wall)


def graph_gpu_us(fn) -> float:
    """GPU µs per call by CUDA-graph replay: the harness's own timing (fa4tune.workers.timing), L2 warm."""
    from fa4tune.workers.timing import TimingSettings, time_cuda

    return time_cuda(fn, TimingSettings(l2="warm")).us


_CPP_LAUNCHER = r"""
#include <tvm/ffi/tvm_ffi.h>
#include <tvm/ffi/extra/c_env_api.h>
namespace ffi = tvm::ffi;
// O like Q from the environment's allocator (torch's, through DLPack), then the compiled kernel
ffi::Tensor launch(ffi::TensorView q, ffi::TensorView k, ffi::TensorView v, ffi::Function kernel,
                   double scale) {
  ffi::Tensor out = ffi::Tensor::FromEnvAlloc(TVMFFIEnvTensorAlloc, q.shape(), q.dtype(), q.device());
  kernel(q, k, v, out, nullptr, scale);
  return out;
}
"""


def _cpp_launcher():
    """A C++ function (built here with the system compiler) that allocates O and calls the kernel."""
    import tvm_ffi.cpp

    return tvm_ffi.cpp.load_inline("fa4_bench_launcher", cpp_sources=_CPP_LAUNCHER, functions=["launch"]).launch


def compile_trivial_kernel(head_dim: int, dtype_name: str, with_lse: bool):
    """An empty CuTe DSL kernel with the attention kernel's host signature (Q, K, V, O, optional LSE,
    a Float32 scale, TVM-FFI's environment stream), compiled with --enable-tvm-ffi for this GPU."""
    from typing import Optional

    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    @cute.kernel
    def touch(mO: cute.Tensor, scale: cutlass.Float32):
        tidx, _, _ = cute.arch.thread_idx()
        if scale < 0.0:  # never true here: a launch that does no work but is not optimised away
            mO[0, 0, 0, tidx] = mO[0, 0, 0, tidx]

    @cute.jit
    def host(mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
             mLSE: Optional[cute.Tensor], scale: cutlass.Float32, stream: cuda.CUstream):
        touch(mO, scale).launch(grid=[1, 1, 1], block=[32, 1, 1], stream=stream)

    dtype = {"fp16": cutlass.Float16, "bf16": cutlass.BFloat16}[dtype_name]
    batch, seq_q, seq_k, heads_q, heads_kv = (cute.sym_int() for _ in range(5))

    def bshd(seq, heads):
        stride = tuple(cute.sym_int64(divisibility=8) for _ in range(3)) + (1,)
        return make_fake_tensor(dtype, (batch, seq, heads, head_dim), stride=stride, assumed_align=16)

    lse = None
    if with_lse:
        lse = make_fake_tensor(cutlass.Float32, (batch, heads_q, seq_q),
                               stride=(cute.sym_int64(), cute.sym_int64(), 1), assumed_align=4)
    return cute.compile(host, bshd(seq_q, heads_q), bshd(seq_k, heads_kv), bshd(seq_k, heads_kv),
                        bshd(seq_q, heads_q), lse, cutlass.Float32(1.0),
                        make_fake_stream(use_tvm_ffi_env_stream=True), options="--enable-tvm-ffi")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seqlen", type=int, default=1024)
    parser.add_argument("--heads-q", type=int, default=32)
    parser.add_argument("--heads-kv", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--calls", type=int, default=50, help="eager calls per timed batch")
    parser.add_argument("--repeats", type=int, default=40, help="timed batches (median)")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)

    import torch
    import torch.nn.functional as F

    import fa4
    from fa4 import runtime, state

    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    gen = torch.Generator(device="cuda").manual_seed(0)
    b, s, hq, hkv, d = args.batch, args.seqlen, args.heads_q, args.heads_kv, args.head_dim
    q = torch.randn(b, s, hq, d, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(b, s, hkv, d, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(b, s, hkv, d, device="cuda", dtype=dtype, generator=gen)
    causal = args.causal
    flops = 4 * b * hq * s * s * d / (2 if causal else 1)

    rows = []
    ref = None

    def add(name, fn, note=""):
        nonlocal ref
        try:
            with torch.no_grad():
                for _ in range(10):  # compile, clocks up
                    out = fn()
                torch.cuda.synchronize()
                out = out[0] if isinstance(out, tuple) else out
                if ref is None:
                    ref = out.float()
                err = (out.float() - ref).abs().max().item()
                host, wall = host_and_wall_us(fn, args.calls, args.repeats)
                try:
                    gpu = graph_gpu_us(fn)
                except Exception as exc:  # not capturable: keep the host figures
                    gpu, note = None, f"{note} [CUDA graph capture failed: {type(exc).__name__}: {exc}]"[:300]
            rows.append({"name": name, "host_us": round(host, 2), "wall_us": round(wall, 2),
                         "gpu_us": None if gpu is None else round(gpu, 2),
                         "tflops": None if gpu is None else round(flops / gpu / 1e6, 1),
                         "max_abs_diff_vs_first_row": err, "note": note})
        except Exception as exc:  # a row that cannot run says why; the others still run
            rows.append({"name": name, "error": f"{type(exc).__name__}: {exc}"[:300]})

    def add_host(name, fn, note=""):
        """Host figures only: for calls without an attention output (streams, an empty kernel)."""
        try:
            for _ in range(10):
                fn()
            torch.cuda.synchronize()
            host, wall = host_and_wall_us(fn, args.calls, args.repeats)
            rows.append({"name": name, "host_us": round(host, 2), "wall_us": round(wall, 2),
                         "gpu_us": None, "tflops": None, "max_abs_diff_vs_first_row": None, "note": note})
        except Exception as exc:
            rows.append({"name": name, "error": f"{type(exc).__name__}: {exc}"[:300]})

    add("fa4.attention (kernel path)", lambda: fa4.attention(q, k, v, causal=causal))
    add("fa4 custom op torch.ops.fa4.attention",
        lambda: torch.ops.fa4.attention(q, k, v, causal, None, False, None, "error", False)[0],
        "torch.library dispatch, as torch.compile calls it")
    try:
        fa4.attention(q, k, v, causal=causal)
        launch = state.STATE.last[1]  # the signature just called
    except Exception:  # the first row already says why
        launch = None
    if launch is not None and launch.run is not None:
        out_buf = torch.empty_like(q)
        scale = launch.default_scale
        shipped = launch.fast_run
        add("fa4.attention's checked path",
            lambda: runtime._checked_call(q, k, v, causal, None, False, None, "error", False, "auto", None),
            "full signature key and pointer checks, as every call went before the kernel path")
        if shipped is launch.run:
            rows.append({"name": "direct launcher", "error": "not taken: fa4.kernels.dsl_internals.direct_launcher "
                         "refused this compiled function (the fast path calls the checked run)"})
        add("compiled kernel .run only (preallocated O)",
            lambda: (launch.run(q, k, v, out_buf, None, scale), out_buf)[1],
            "CompiledAttention.run: its checks, the DSL's __call__ and keyword wrapper, TVM-FFI")
        dsl_fn = launch.compiled.compiled  # CompiledAttention's DSL function
        add("DSL compiled function __call__ (prealloc O)",
            lambda: (dsl_fn(q, k, v, out_buf, None, scale), out_buf)[1],
            f"{type(dsl_fn).__name__}.__call__: no CompiledAttention checks")
        try:
            raw = tvm_ffi_function_of(dsl_fn)
        except Exception as exc:
            rows.append({"name": "raw tvm_ffi.Function.__call__, lse None", "error": f"{type(exc).__name__}: {exc}"[:300]})
        else:
            add("raw tvm_ffi.Function.__call__, lse None",
                lambda: (raw(q, k, v, out_buf, None, scale), out_buf)[1],
                "no Python between the call and TVM-FFI's C: DLPack of 4 tensors, stream, launch")
        add("direct launcher (launch.fast_run, prealloc O)",
            lambda: (launch.fast_run(q, k, v, out_buf, None, scale), out_buf)[1],
            "what fa4.attention's fast path calls")
        fast_run = launch.fast_run

        def allocate_and_launch():
            out = torch.empty_like(q)
            fast_run(q, k, v, out, None, scale)
            return out
        add(direct_row(backends.OURS), allocate_and_launch,
            "the floor of any Python path that allocates O: no key, no checks")
        try:
            cpp_launch = _cpp_launcher()
            add("C++ launcher (TVM-FFI load_inline): O allocated and kernel called in C++",
                lambda: cpp_launch(q, k, v, fast_run, scale),
                "would a compiled dispatcher beat the Python one? same work as the row above")
        except Exception as exc:
            rows.append({"name": "C++ launcher (TVM-FFI load_inline)", "error": f"{type(exc).__name__}: {exc}"[:300]})
    try:  # the same with an LSE tensor: another compiled kernel (return_lse=True)
        fa4.attention(q, k, v, causal=causal, return_lse=True)
        launch_lse = state.STATE.last[1]
        raw_lse = tvm_ffi_function_of(launch_lse.compiled.compiled)
        lse_buf = torch.empty((b, hq, s), device="cuda", dtype=torch.float32)
        out_lse = torch.empty_like(q)
        scale_lse = launch_lse.default_scale
        add("raw tvm_ffi.Function.__call__, with LSE",
            lambda: (raw_lse(q, k, v, out_lse, lse_buf, scale_lse), out_lse)[1],
            "the return_lse kernel: DLPack of 5 tensors")
    except Exception as exc:
        rows.append({"name": "raw tvm_ffi.Function.__call__, with LSE", "error": f"{type(exc).__name__}: {exc}"[:300]})
    add("torch.empty_like(q) only", lambda: torch.empty_like(q),
        "allocation floor (output is garbage; diff meaningless)")
    add_host("torch.cuda.current_stream()", torch.cuda.current_stream, "a Stream object per call")
    add_host("torch._C._cuda_getDevice()", torch._C._cuda_getDevice, "the fast path's device check")
    fill_target = torch.empty_like(q)
    add_host("one torch kernel launch (out.fill_(0))", lambda: fill_target.fill_(0),
             "what launching any small torch op costs on this host")
    add_host("kernel path: grad check + short key",
             lambda: (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad),
                      (q.shape, k.shape, q.stride(), k.stride(), v.stride(), q.dtype, q.get_device(),
                       causal, False, None, "error", False)),
             "the Python the kernel path runs before the allocation (with torch.compiler.is_compiling())")
    add_host("torch.compiler.is_compiling()", torch.compiler.is_compiling)
    try:
        trivial = {with_lse: compile_trivial_kernel(d, args.dtype, with_lse) for with_lse in (True, False)}
        lse_t = torch.empty((b, hq, s), device="cuda", dtype=torch.float32)
        o_t = torch.empty_like(q)
        for with_lse, fn in trivial.items():
            lse_arg = lse_t if with_lse else None
            raw_t = tvm_ffi_function_of(fn)
            what = "5 tensors" if with_lse else "4 tensors + None"
            add_host(f"trivial CuTe kernel, raw TVM-FFI, {what}",
                     lambda raw_t=raw_t, lse_arg=lse_arg: raw_t(q, k, v, o_t, lse_arg, 0.5),
                     "an empty kernel with the same arguments: TVM-FFI's per-call floor")
            add_host(f"trivial CuTe kernel, DSL __call__, {what}",
                     lambda fn=fn, lse_arg=lse_arg: fn(q, k, v, o_t, lse_arg, 0.5))
    except Exception as exc:
        rows.append({"name": "trivial CuTe kernel", "error": f"{type(exc).__name__}: {exc}"[:300]})
    # every peer called directly, with nothing of fa4 around it (`Backend.direct_call`); one that refuses
    # GQA inputs and may (`Backend.expand_kv_if_refused`) on K and V expanded to the query heads once
    k_x, v_x = (t.repeat_interleave(hq // hkv, dim=2) for t in (k, v))
    for peer in backends.peers():
        if peer.direct_row is None:
            continue
        try:
            call, note = peer.direct_call(q, k, v, causal)
        except ImportError as exc:
            rows.append({"name": peer.direct_row, "error": f"not importable: {exc}"})
            continue
        if peer.expand_kv_if_refused and hq != hkv:
            try:
                with torch.no_grad():
                    call()
            except RuntimeError:
                call, note = peer.direct_call(q, k_x, v_x, causal)
                note += "; K/V expanded to Hq heads before timing (the backend refused enable_gqa)"
        add(peer.direct_row, call, note)

    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    add("SDPA (torch's choice of backend)",
        lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=hq != hkv).transpose(1, 2))

    # every implementation again, through fa4.attention with that backend forced: what a user pays per
    # eager call when dispatch runs it (the rows `fa4tune.benchmark.host_overhead` prefers)
    for name in backends.implementations():
        add(through_row(name), lambda name=name: fa4.attention(q, k, v, causal=causal, backend=name),
            f"{backends.title(name)} through fa4.attention: input checks, plan lookup, "
            + ("our kernel's launch" if name == backends.OURS else "the peer's runner, rows without keys"))

    add("fa4.attention (kernel path), again at the end", lambda: fa4.attention(q, k, v, causal=causal),
        "the first row measured again after all others: how much the host figures drift in a run")

    print(f"# B={b} S={s} Hq={hq} Hkv={hkv} D={d} {args.dtype} {'causal' if causal else 'non-causal'} "
          f"on {torch.cuda.get_device_name()}; torch {torch.__version__}; calls={args.calls} "
          f"repeats={args.repeats}")
    print(f"# fa4 decision: {fa4.explain(q, k, v, causal=causal)}".replace("\n", "\n#   "))
    print(f"{'implementation':52s} {'host us':>9s} {'wall us':>9s} {'GPU us':>9s} {'TFLOP/s':>8s}  note")
    for r in rows:
        if "error" in r:
            print(f"{r['name']:52s} {'-':>9s} {'-':>9s} {'-':>9s} {'-':>8s}  {r['error']}")
        else:
            gpu = "-" if r["gpu_us"] is None else f"{r['gpu_us']:.2f}"
            rate = "-" if r["tflops"] is None else f"{r['tflops']:.1f}"
            diff = r["max_abs_diff_vs_first_row"]
            print(f"{r['name']:52s} {r['host_us']:9.2f} {r['wall_us']:9.2f} {gpu:>9s} "
                  f"{rate:>8s}  {r['note']}" + ("" if diff is None else f" (max|diff| {diff:.3g})"))
    for line in through_vs_direct(rows):
        print(line)
    headline = [r["host_us"] for r in (rows[0], rows[-1]) if "host_us" in r]
    if headline:
        worst = max(headline)
        verdict = "meets" if worst <= 8.0 else "MISSES"
        floor = [r["host_us"] for r in rows if r["name"] == direct_row(backends.OURS) and "host_us" in r]
        print(f"# fa4.attention kernel path: {' and '.join(f'{h:.2f}' for h in headline)} us host per call "
              f"(first and last row), {verdict} the 8 us target"
              + (f"; allocation + launch alone: {floor[0]:.2f} us" if floor else ""))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"shape": vars(args), "device": torch.cuda.get_device_name(),
                       "torch": torch.__version__, "rows": rows}, handle, indent=2, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
