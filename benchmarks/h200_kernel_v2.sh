#!/usr/bin/env bash
# The sm90 kernel v2 runs on the H200 (with the project installed, `pip install -e '.[peer]'`); everything lands in $OUT.
#   bash benchmarks/h200_kernel_v2.sh check        register sweep (CPU cores), GPU suites, runtime tests
#   bash benchmarks/h200_kernel_v2.sh tune A|B     re-tune half of the bench grid (30 s a study)
#   bash benchmarks/h200_kernel_v2.sh bench        one `fa4tune bench` over the whole grid
# `tune` writes a fresh $OUT/studies.journal (v2 kernel) and updates $OUT/best_configs.json (from fa4/data/).
set -uo pipefail
OUT=${OUT:-/tmp/fa4-v2-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
STUDY_TIMEOUT=${STUDY_TIMEOUT:-30}
GRID_A=("--batch 1 --seqlen 1024" "--batch 16 --seqlen 1024" "--batch 1 --seqlen 4096"
        "--batch 1 --seqlen 8192 --dtype bf16")
GRID_B=("--batch 1 --seqlen 2048 --head-dim 64" "--batch 2 --seqlen 16384 --heads 8 --heads-kv 1 --dtype bf16 --causal"
        "--batch 8 --seqlen 512 --heads 16 --heads-kv 16 --head-dim 64 --dtype bf16"
        "--batch 4 --seqlen 2048 --heads 64 --heads-kv 8 --dtype bf16 --causal")
BENCH_SHAPES="b1-s1024-full b1-s1024-causal b16-s1024-full b16-s1024-causal b1-s4096-full b1-s4096-causal \
bf16-s8192-full bf16-s8192-causal d64-s2048-full d64-s2048-causal b2-s16384-hq8-hkv1-bf16-causal \
b8-s512-hq16-hkv16-d64-bf16-full b8-s512-hq16-hkv16-d64-bf16-causal b4-s2048-hq64-hkv8-bf16-causal"
case ${1:-} in
  check)
    python3 benchmarks/sm90_register_sweep.py --jobs 15 --out "$OUT/sm90_register_table.json" 2>&1 | tail -n 2
    bash tests/gpu/run_sm90_suites.sh all 8
    python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_runtime_gpu.py tests/test_search_gpu.py \
      > "$OUT/gpu_runtime.txt" 2>&1
    tail -n 3 "$OUT/gpu_runtime.txt" ;;
  tune)
    [ -f "$OUT/best_configs.json" ] || cp fa4/data/best_configs.json "$OUT"/
    [ -f "$OUT/studies.journal" ] || gunzip -c results/studies.journal.gz > "$OUT/studies.journal"
    if [ "${2:-A}" = A ]; then grid=("${GRID_A[@]}"); else grid=("${GRID_B[@]}"); fi
    start=$(date +%s)
    for args in "${grid[@]}"; do
      python3 -m fa4tune.cli search $args --timeout "$STUDY_TIMEOUT" --no-peers \
          --storage "$OUT/studies.journal" --db "$OUT/best_configs.json" --format json \
          >> "$OUT/search.json" 2>> "$OUT/search.log"
      echo "search $args: exit $? at $(( $(date +%s) - start )) s" | tee -a "$OUT/search.log"
    done ;;
  bench)
    python3 -m fa4tune.cli bench --shapes "$BENCH_SHAPES" --db "$OUT/best_configs.json" \
        --out "$OUT/bench.json" --csv "$OUT/bench.csv" 2>&1 | grep -v -i "warning\|exe_args" | tail -n 70 ;;
  *) echo "usage: $0 check | tune A|B | bench" >&2; exit 2 ;;
esac
