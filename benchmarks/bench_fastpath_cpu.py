"""Host cost of fa4.attention's fast path on a CPU-only machine, with a stand-in kernel.

    python benchmarks/bench_fastpath_cpu.py                  # B=1 S=1024 Hq=32 Hkv=8 D=128 fp16
    python benchmarks/bench_fastpath_cpu.py --number 5000 --repeat 60

The stand-in keeps every host layer of a real launch except the GPU: the sm90 `CompiledAttention`
(its per-call checks), the DSL's `TVMFFIJitCompiledFunctionWithKwargs.__call__` (the class DSL 4.8
returns for our kernels, used unmodified), TVM-FFI's generated keyword wrapper, and a C TVM-FFI
function (`testing.nop`) that receives the same six arguments, so the DLPack conversion of five CPU
tensors is paid. What it cannot show: CUDA tensors' conversion, the stream query and cuLaunchKernel
(benchmarks/bench_overhead.py measures those on the GPU). Rows, each min and median of `--repeat`
timeit batches of `--number` calls, in microseconds per call:
- fa4.attention as shipped (after the first call of a signature: the kernel path, short key and the
  direct TVM-FFI launcher)
- fa4.attention's checked path (full signature key, pointer checks), which every call took before
- the pieces: checked `run`, the direct launcher, the bare C call, allocation, both keys.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import timeit
import types


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--number", type=int, default=2000, help="calls per timed batch")
    parser.add_argument("--repeat", type=int, default=40, help="timed batches")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    # the stand-in family compiles; the disk cache would ask the (absent) GPU for its SM count first
    os.environ["FA4TUNE_DISK_CACHE"] = "0"

    import torch
    import tvm_ffi

    import fa4
    from fa4 import checks, database, kernels, runtime, state
    from fa4.kernels import Config
    from fa4.kernels.compiling import CompiledAttention
    from fa4.kernels.dsl_internals import stand_in_compiled_function

    nop = tvm_ffi.get_global_func("testing.nop")
    names = ["mQ", "mK", "mV", "mO", "mLSE", "softmax_scale"]

    def stand_in_compiled():
        """A DSL compiled-function object around `nop`, built without compiling."""
        return stand_in_compiled_function(nop, names)

    class StandInFamily(types.SimpleNamespace):
        def can_implement(self, problem):
            return []

        def resource_reasons(self, config, problem, device=None):
            return []

        def launch_reasons(self, config, problem, device=None):
            return []

        def default_config(self, problem, device=None):
            return Config.make(self.arch)

        def problem_key(self, config, problem):
            return (problem.dtype, problem.head_dim, problem.gqa_ratio, problem.causal, problem.return_lse)

        def device_key(self, device):
            return (("num_sms", device.sm_count),)

        def compile_attention(self, config, problem, device=None):
            return CompiledAttention(stand_in_compiled(), config, problem, 0, 0.0)

    families = {arch: StandInFamily(arch=arch, REFERENCE_DEVICE=kernels.reference_device(arch))
                for arch in kernels.ARCHS}
    kernels.family = lambda arch: families[arch]
    state.device_description = lambda device: kernels.reference_device("sm90")
    checks.device_reasons = lambda spec: []
    tmp = tempfile.mkdtemp(prefix="fa4-fastpath-")
    db_path = os.path.join(tmp, "best.json")
    with open(db_path, "w") as handle:
        json.dump({"schema": database.SCHEMA_VERSION, "entries": []}, handle)
    fa4.use_config_db(db_path)

    q = torch.randn(1, 1024, 32, 128, dtype=torch.float16)
    k = torch.randn(1, 1024, 8, 128, dtype=torch.float16)
    v = torch.randn(1, 1024, 8, 128, dtype=torch.float16)
    out_buf = torch.empty_like(q)

    rows = []

    def row(name, fn, note=""):
        try:
            for _ in range(100):
                fn()
            times = [t / args.number * 1e6 for t in timeit.repeat(fn, number=args.number, repeat=args.repeat)]
            rows.append({"name": name, "min_us": round(min(times), 3),
                         "median_us": round(statistics.median(times), 3), "note": note})
        except Exception as exc:  # a row that cannot run says why; the others still run
            rows.append({"name": name, "error": f"{type(exc).__name__}: {exc}"[:300]})

    fa4.reset_caches(compiled=True)
    fa4.attention(q, k, v)
    launch = state.STATE.last[1]
    direct = launch is not None and launch.fast_run is not launch.run
    row("fa4.attention (kernel path)", lambda: fa4.attention(q, k, v),
        "as shipped" if direct and state.STATE.last_kernel[1] is launch else "the kernel path was NOT taken")
    row("fa4.attention's checked path", lambda: runtime._checked_call(q, k, v, False, None, False, None,
                                                                      "error", False, "auto", None),
        "full signature key and pointer checks, as every call went before the kernel path")
    launch = state.STATE.last[1]
    scale = launch.default_scale
    row("CompiledAttention.run (checks + DSL __call__ + wrapper + C)",
        lambda: launch.run(q, k, v, out_buf, None, scale))
    row("direct launcher (plain tvm_ffi.Function)", lambda: launch.fast_run(q, k, v, out_buf, None, scale))
    row("tvm_ffi.Function.__call__(nop, ...) bare C", lambda: nop(q, k, v, out_buf, None, scale),
        "the CPU floor for 5 tensors + a float")
    row("torch.empty_like(q)", lambda: torch.empty_like(q))
    row("kernel path: grad check + short key",
        lambda: (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad),
                 (q.shape, k.shape, q.stride(), k.stride(), v.stride(), q.dtype, q.get_device(),
                  False, False, None, "error", False)))
    row("checked path: full signature key",
        lambda: (q.size(), q.stride(), k.size(), k.stride(), v.size(), v.stride(), q.dtype, k.dtype,
                 v.dtype, q.device, k.device, v.device, False, False, None, "error", False))
    row("torch.compiler.is_compiling()", torch.compiler.is_compiling)

    print(f"# CPU stand-in, torch {torch.__version__}, tvm_ffi {tvm_ffi.__version__}, python "
          f"{sys.version.split()[0]}; number={args.number} repeat={args.repeat}")
    print(f"{'row':60s} {'min us':>8s} {'median us':>10s}  note")
    for r in rows:
        if "error" in r:
            print(f"{r['name']:60s} {'-':>8s} {'-':>10s}  {r['error']}")
        else:
            print(f"{r['name']:60s} {r['min_us']:8.3f} {r['median_us']:10.3f}  {r['note']}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"rows": rows, "torch": torch.__version__}, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
