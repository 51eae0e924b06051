#!/usr/bin/env bash
# The runtime's GPU checks in one run (about 3-6 minutes on the H200, most of it kernel and inductor
# compiles): the GPU tests of fa4.attention, then the host-overhead benchmark, non-causal and causal.
# Run from the repository root with the project installed (`pip install -e '.[peer]'`); results land in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/fa4-runtime-out}
mkdir -p "$OUT"
status=0
python3 -m pytest -m gpu -q -rA tests/gpu/test_runtime_gpu.py 2>&1 | tee "$OUT/runtime_gpu_tests.txt"
status=$(( status | PIPESTATUS[0] ))
python3 benchmarks/bench_overhead.py --json "$OUT/overhead_full.json" 2>&1 | tee "$OUT/overhead.txt"
status=$(( status | PIPESTATUS[0] ))
python3 benchmarks/bench_overhead.py --causal --json "$OUT/overhead_causal.json" 2>&1 | tee -a "$OUT/overhead.txt"
status=$(( status | PIPESTATUS[0] ))
exit $status
