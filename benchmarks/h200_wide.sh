#!/usr/bin/env bash
# The second H200 run (with the project installed, `pip install -e '.[peer]'`): host overhead split by layer, the
# benchmark over more shapes (tuned entries come from the nearest bucket of fa4/data/best_configs.json),
# and compile-space samples of both families on the machine's 16 cores (no GPU needed for those).
set -uo pipefail
OUT=${OUT:-/tmp/fa4-wide-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
timeout 150 python3 benchmarks/bench_overhead.py --json "$OUT/overhead_full.json" 2>&1 | grep -v Warning | tail -n 25
SHAPES="s1024-full s1024-causal s4096-full s4096-causal bf16-s8192-full bf16-s8192-causal d64-s2048-full d64-s2048-causal"
timeout 240 python3 -m fa4tune.cli bench --shapes "$SHAPES" --db fa4/data/best_configs.json \
    --out "$OUT/bench.json" --csv "$OUT/bench.csv" 2>&1 | grep -v -i "warning\|exe_args" | tail -n 50
for arch in sm90 sm100; do
  timeout 100 python3 -m fa4tune.cli compile-space --arch $arch --no-causal --limit ${COMPILE_LIMIT:-160} --jobs 16 \
      --out "$OUT/compile_space_$arch.json" > "$OUT/compile_space_$arch.txt" 2>&1
  echo "compile-space $arch exit $?"; tail -n 2 "$OUT/compile_space_$arch.txt"
done
