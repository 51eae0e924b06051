#!/usr/bin/env bash
# The training pass and the new head dims on the H200 (with the project installed, `pip install -e '.[peer]'`
# and transformers), one step per call (each fits a 10-minute device call):
#   bash benchmarks/h200_training.sh tests    # GPU tests: the autograd path (auto and FA4_BACKWARD=ours),
#                                             # transformers, the forward's new head dims
#   bash benchmarks/h200_training.sh varlen   # GPU tests of attention_varlen (ours, the peer's, per sequence)
#   bash benchmarks/h200_training.sh grid     # fa4tune bench --backward over the 14-shape grid
#   bash benchmarks/h200_training.sh extras   # transformers prefill; attention_varlen's implementations
#   bash benchmarks/h200_training.sh features # GPU tests of sliding windows and softcaps (sm90 kernel)
#   bash benchmarks/h200_training.sh features-bench  # fa4tune bench over benchmarks/h200_features.toml
#   bash benchmarks/h200_training.sh bwd-configs  # our backward per configuration beside flash-attn-4's
#                                                 # (each checked by flash-attn's rule first; hangs time out)
#   bash benchmarks/h200_training.sh bwd-tests    # GPU tests of every backward knob value
#   bash benchmarks/h200_training.sh bwd-search   # fa4tune search --backward on two grid shapes (ours and
#                                                 # the peers' backward alone), the entries listed; then
#                                                 # the tiny GPU test of the backward search
#   bash benchmarks/h200_training.sh varlen-search  # fa4tune search over benchmarks/h200_varlen.toml (ours,
#                                                   # flash-attn-4's varlen kernel, per sequence), the entries
#                                                   # listed; then the tiny GPU test of the varlen search
# Output in $OUT (default /tmp/fa4-training-out); copy it into results/ afterwards.
set -uo pipefail
STEP=${1:?usage: h200_training.sh tests|varlen|grid|extras|features|features-bench|bwd-configs|bwd-tests|bwd-search|varlen-search}
OUT=${OUT:-/tmp/fa4-training-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
quiet() { grep -v -i "userwarning\|exe_args"; }
case "$STEP" in
  tests)
    # -v: a run cut by the call's limit still shows each test's outcome
    timeout 250 python3 -m pytest -v --tb=line -m gpu tests/gpu/test_backward_gpu.py tests/gpu/test_transformers_gpu.py \
        -p no:cacheprovider 2>&1 | quiet > "$OUT/tests_backward.txt"
    grep -E "FAILED|passed|failed" "$OUT/tests_backward.txt" | grep -v "%\]" | tail -n 15
    FA4_BACKWARD=ours timeout 120 python3 -m pytest -q -m gpu tests/gpu/test_backward_gpu.py -p no:cacheprovider \
        -k "gradients or strided" 2>&1 | quiet > "$OUT/tests_backward_ours.txt"
    tail -n 8 "$OUT/tests_backward_ours.txt"
    timeout 180 python3 -m pytest -q -m gpu tests/gpu/test_sm90_default.py tests/gpu/test_sm90_knobs.py \
        -k "d96 or d192 or d256 or new_head_dims" -p no:cacheprovider 2>&1 | quiet > "$OUT/tests_head_dims.txt"
    tail -n 8 "$OUT/tests_head_dims.txt"
    ;;
  varlen)
    # 98 tests, about 4 minutes alone (cut at 250 s beside the window suite on 2026-12-03)
    timeout 560 python3 -m pytest -v --tb=line -m gpu tests/gpu/test_varlen_gpu.py -p no:cacheprovider 2>&1 \
        | quiet > "$OUT/tests_varlen.txt"
    grep -E "FAILED|passed|failed" "$OUT/tests_varlen.txt" | grep -v "%\]" | tail -n 15
    ;;
  grid)
    timeout 560 python3 -m fa4tune.cli bench --shapes-file benchmarks/h200_grid.toml --rounds 2 \
        --db fa4/data/best_configs.json --backward --out "$OUT/bench_grid_training.json" --jobs 12 2>&1 \
        | quiet > "$OUT/bench_grid_training.log"
    tail -n 60 "$OUT/bench_grid_training.log"
    ;;
  extras)
    timeout 280 python3 benchmarks/varlen_bench.py --out "$OUT/varlen_bench.json" 2>&1 | quiet | tail -n 6
    timeout 280 python3 benchmarks/transformers_prefill.py --out "$OUT/prefill.json" --layers 4 \
        --seqlens 2048,4096,8192 2>&1 | quiet | tail -n 20
    ;;
  features)
    timeout 570 bash tests/gpu/run_sm90_suites.sh window 2>&1 | quiet > "$OUT/tests_window_softcap.txt"
    tail -n 15 "$OUT/tests_window_softcap.txt"
    ;;
  features-bench)
    timeout 560 python3 -m fa4tune.cli bench --shapes-file benchmarks/h200_features.toml --rounds 2 \
        --db fa4/data/best_configs.json --out "$OUT/bench_features.json" --jobs 12 2>&1 \
        | quiet > "$OUT/bench_features.log"
    tail -n 40 "$OUT/bench_features.log"
    ;;
  bwd-configs)
    timeout 570 python3 benchmarks/sm90_bwd_configs.py --jobs 8 --timeout 300 --json "$OUT/bwd_configs.json" \
        2> >(quiet > "$OUT/bwd_configs.log") | tee "$OUT/bwd_configs.txt"
    ;;
  bwd-tests)
    timeout 570 python3 -m pytest -q -m gpu tests/gpu/test_sm90_bwd_gpu.py -p no:cacheprovider 2>&1 \
        | quiet > "$OUT/tests_sm90_bwd.txt"
    tail -n 15 "$OUT/tests_sm90_bwd.txt"
    ;;
  bwd-search)
    # two of benchmarks/h200_grid.toml's shapes, 24 configurations each (of the 128 of
    # search_spaces/sm90_bwd.toml; the model refuses about half of them per head dim)
    for shape in "--batch 1 --seqlen 4096 --causal" "--batch 16 --seqlen 1024 --no-causal"; do
      timeout 240 python3 -m fa4tune.cli search --backward $shape --heads 32 --heads-kv 8 --head-dim 128 \
          --dtype fp16 --trials 24 --timeout 180 --storage "$OUT/bwd_studies.journal" --db "$OUT/bwd_best.json" \
          --format json >> "$OUT/bwd_search.json" 2> >(quiet >> "$OUT/bwd_search.log")
      tail -n 6 "$OUT/bwd_search.log"
    done
    python3 -m fa4tune.cli best --db "$OUT/bwd_best.json" | tee "$OUT/bwd_best.txt"
    timeout 90 python3 -m pytest -q -m gpu tests/gpu/test_backward_search_gpu.py -p no:cacheprovider 2>&1 \
        | quiet > "$OUT/tests_bwd_search.txt"
    tail -n 8 "$OUT/tests_bwd_search.txt"
    ;;
  varlen-search)
    # five batches, 24 configurations each, 90 s per study
    timeout 500 python3 -m fa4tune.cli search --shapes-file benchmarks/h200_varlen.toml --trials 24 --timeout 90 \
        --storage "$OUT/varlen_studies.journal" --db "$OUT/varlen_best.json" --format json \
        > "$OUT/varlen_search.json" 2> >(quiet > "$OUT/varlen_search.log")
    tail -n 12 "$OUT/varlen_search.log"
    python3 -m fa4tune.cli best --db "$OUT/varlen_best.json" | tee "$OUT/varlen_best.txt"
    timeout 90 python3 -m pytest -q -m gpu tests/gpu/test_varlen_search_gpu.py -p no:cacheprovider 2>&1 \
        | quiet > "$OUT/tests_varlen_search.txt"
    tail -n 8 "$OUT/tests_varlen_search.txt"
    ;;
  *)
    echo "unknown step $STEP (tests|varlen|grid|extras|features|features-bench|bwd-configs|bwd-tests|bwd-search|varlen-search)" >&2
    exit 2
    ;;
esac
