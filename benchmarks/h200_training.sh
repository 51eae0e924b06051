#!/usr/bin/env bash
# The training pass and the new head dims on the H200 (with the project installed, `pip install -e '.[peer]'`
# and transformers), one step per call (each fits a 10-minute device call):
#   bash benchmarks/h200_training.sh tests    # GPU tests: the autograd path (auto and FA4_BACKWARD=ours),
#                                             # transformers, the forward's new head dims
#   bash benchmarks/h200_training.sh varlen   # GPU tests of attention_varlen (ours, the peer's, per sequence)
#   bash benchmarks/h200_training.sh grid     # fa4tune bench --backward over the 14-shape grid, in parts
#                                             # of 4 shapes: run it again until the table has all 14
#   bash benchmarks/h200_training.sh bar      # the grid's GQA-8 shape B2 S16384 H8/1 searched (45 s), its
#                                             # entry merged, then `grid`: the backward's bar in one call
#   bash benchmarks/h200_training.sh extras   # transformers prefill; attention_varlen's implementations
#   bash benchmarks/h200_training.sh head-dims # GPU tests of the default at head dims 96, 192, 256 (336
#                                              # tests in 8 shards, a whole call: 250 s was too short)
#   bash benchmarks/h200_training.sh head-dims-variants # knob variants at those head dims and q/k 192
#                                              # with v 128, in 8 shards each
#   bash benchmarks/h200_training.sh features # GPU tests of sliding windows and softcaps (sm90 kernel)
#   bash benchmarks/h200_training.sh features-search PART [PARTS] # fa4tune search over a PARTS-th of
#                                             # benchmarks/h200_features.toml (default 1 of 2; a part a call)
#   bash benchmarks/h200_training.sh features-bench  # fa4tune bench over benchmarks/h200_features.toml, after
#                                             # merging the parts' entries a warm machine kept (or the
#                                             # packaged database's, merged and carried)
#   bash benchmarks/h200_training.sh bwd-configs  # our backward per configuration beside flash-attn-4's
#                                                 # (each checked by flash-attn's rule first; hangs time out)
#   bash benchmarks/h200_training.sh bwd-tests    # GPU tests of every backward knob value
#   bash benchmarks/h200_training.sh bwd-modes    # GPU tests of deterministic gradients (bit for bit equal
#                                                 # runs, flash-attn's rule, no deadlock) and of the programmatic
#                                                 # launch (its A/B: `training-pass` with
#                                                 # FA4_BWD_PROGRAMMATIC_LAUNCH=1 beside a plain one, ~3 min each)
#   bash benchmarks/h200_training.sh bwd-split    # the default rule (its group_split model), each
#                                                 # group_split forced and tile_m 80, on the 14 grid
#                                                 # shapes beside flash-attn-4; then the GPU tests of
#                                                 # the default (split) and of tile_m 80
#   bash benchmarks/h200_training.sh bwd-space    # every fast-space configuration on the grid and 12
#                                                 # other shapes beside flash-attn-4 (rule refits)
#   bash benchmarks/h200_training.sh training-pass [KNOB=VALUE ...|deterministic]  # our default backward
#                                                 # (FA4_BWD_DETERMINISTIC_ORDER=descending ... deterministic:
#                                                 # the other order of the dQ adds, plan.DESCENDING_TURNS)
#                                                 # (FA4_BACKWARD=ours; with KNOB=VALUE changed) beside
#                                                 # every peer's on the 14 grid shapes,
#                                                 # CUDA-graph replay (benchmarks/training_pass.py, ~3 min)
#   bash benchmarks/h200_training.sh bwd-fragment # GPU tests of dq_accum=fragment, then the default with
#                                                 # it beside the default on the grid and 12 other shapes
#   bash benchmarks/h200_training.sh bwd-ncu      # Nsight Compute: our default backward beside flash-attn-4's
#                                                 # on the three grid shapes furthest behind
#   bash benchmarks/h200_training.sh bwd-stalls   # the same beside warp-stall samples per SASS instruction of
#                                                 # both main kernels at B8 S512 D64 and B1 S8192 D128 (full),
#                                                 # summed by part of the kernel (benchmarks/ncu_stall_regions.py)
#   bash benchmarks/h200_training.sh bwd-search 1|2|3|4  # fa4tune search --backward over a quarter of the grid (ours
#                                                 # and the peers' backward alone), the entries listed
#   bash benchmarks/h200_training.sh bwd-retune PART [PARTS]  # after a kernel change that left the block
#                                                 # loops alone: a quick re-tune of a PARTS-th of the grid, each
#                                                 # study seeded with its own stale winner
#   bash benchmarks/h200_training.sh bwd-search-test  # the tiny GPU test of the backward search
#   bash benchmarks/h200_training.sh bwd-dq-vector # dq_accum=fragment_atomic: each packaged entry's
#                                                 # configuration as tuned and with it, on 7 grid shapes beside
#                                                 # flash-attn-4; then that path's GPU tests
#   bash benchmarks/h200_training.sh bwd-pdl-ab   # the programmatic launch against the plain one (plain,
#                                                 # programmatic, plain), the rule on those 7 shapes
#   bash benchmarks/h200_training.sh bwd-path-gap # one default backward timed as the search and as autograd
#                                                 # times it (B4 S2048 H64/8 D128 causal; benchmarks/bwd_path_gap.py)
#   bash benchmarks/h200_training.sh varlen-search  # fa4tune search over benchmarks/h200_varlen.toml (ours,
#                                                   # flash-attn-4's varlen kernel, per sequence), the entries
#                                                   # listed; then the tiny GPU test of the varlen search
# Output in $OUT (default /tmp/fa4-training-out); copy it into results/ afterwards.
set -uo pipefail
STEPS="tests|varlen|grid|bar|bwd-dq-vector|bwd-pdl-ab|extras|head-dims|head-dims-variants|features|features-search|features-bench|bwd-configs|bwd-tests|bwd-modes|bwd-split|bwd-space|training-pass|bwd-fragment|bwd-ncu|bwd-stalls|bwd-search|bwd-retune|bwd-search-test|bwd-path-gap|varlen-search"
STEP=${1:?usage: h200_training.sh $STEPS}
OUT=${OUT:-/tmp/fa4-training-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# the device bundle has no platformdirs (fa4.places' default folders): name the folders instead
export FA4TUNE_HOME=${FA4TUNE_HOME:-/tmp/fa4tune-home} FA4TUNE_CACHE_DIR=${FA4TUNE_CACHE_DIR:-/tmp/fa4tune-cache}
# line by line: grep into a pipe holds its lines back otherwise (the grid log's time stamps were a
# whole run's, 2026-12-07)
quiet() { grep --line-buffered -v -i "userwarning\|exe_args"; }
# benchmarks/h200_grid.toml's 14 problems (B,S,HQ,HKV,D,mask) for sm90_bwd_configs.py, timed in bf16 (the
# fp16 ones too); and 12 training shapes outside it (results/h100/training/2026-12-06/bwd_heldout.txt)
grid_shapes=""
for s in 1,1024,32,8,128 16,1024,32,8,128 1,4096,32,8,128 1,8192,32,8,128 1,2048,32,8,64 8,512,16,16,64; do
  grid_shapes="$grid_shapes --shape $s,full --shape $s,causal"
done
grid_shapes="$grid_shapes --shape 2,16384,8,1,128,causal --shape 4,2048,64,8,128,causal"
other_shapes=""
for s in 2,8192,32,8,128,causal 1,16384,16,2,128,causal 4,4096,16,4,128,causal 8,2048,32,8,128,causal \
         2,2048,32,4,128,causal 3,3000,24,8,128,causal 6,1536,32,8,128,causal 4,4096,32,8,64,causal \
         16,2048,16,16,64,causal 2,8192,32,8,128,full 3,3000,24,8,128,full 4,2048,16,4,128,full; do
  other_shapes="$other_shapes --shape $s"
done
# the seven grid shapes of the kernel A/Bs (bwd-dq-vector, bwd-pdl-ab): the five our backward trails
# flash-attn-4 on and two it leads; B,S,HQ,HKV,D,mask as --shape takes them
AB_SHAPES="1,8192,32,8,128,full 1,8192,32,8,128,causal 1,4096,32,8,128,full 4,2048,64,8,128,causal
16,1024,32,8,128,full 8,512,16,16,64,full 8,512,16,16,64,causal"
ab_shapes=""
for s in $AB_SHAPES; do ab_shapes="$ab_shapes --shape $s"; done
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
    # 98 tests, about 4 minutes alone (cut at 250 s beside the window suite on 2026-12-03); VARLEN_SECONDS
    # shortens it to share a call; VARLEN_TESTS picks cases (pytest's -k)
    timeout "${VARLEN_SECONDS:-560}" python3 -m pytest -v --tb=line -m gpu tests/gpu/test_varlen_gpu.py -p no:cacheprovider \
        ${VARLEN_TESTS:+-k "$VARLEN_TESTS"} 2>&1 \
        | quiet > "$OUT/tests_varlen.txt"
    grep -E "FAILED|passed|failed" "$OUT/tests_varlen.txt" | grep -v "%\]" | tail -n 15
    ;;
  grid)
    # on a fresh H200 (2026-12-07) the whole grid printed nothing in 560 s: the bench runs in parts of
    # 4 shapes, writing its file after each, and `grid` again on the same warm machine resumes it
    # (--resume keeps the shapes the file holds); carry the file back (BENCH_RESUME=path) to resume on
    # another machine of the same model. -v and a time stamp a line show how far a cut run got.
    if [ -n "${BENCH_RESUME:-}" ]; then cp "$BENCH_RESUME" "$OUT/bench_grid_training.json"; fi
    if [ -f /tmp/bench_grid_training.json ] && [ ! -f "$OUT/bench_grid_training.json" ]; then
      cp /tmp/bench_grid_training.json "$OUT/bench_grid_training.json"
    fi
    # flash-attn-4 compiles its kernels on first call, in the GPU lock: its own disk cache (off by
    # default) lets the other worker processes and the next call here load them instead
    FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 COLUMNS=250 timeout "${GRID_SECONDS:-560}" python3 -m fa4tune.cli -v bench --shapes-file benchmarks/h200_grid.toml --rounds 2 \
        --db fa4/data/best_configs.json --backward --out "$OUT/bench_grid_training.json" --jobs 12 \
        --shapes-per-part 4 --resume 2>&1 \
        | quiet | while IFS= read -r line; do printf '%s %s\n' "$(date +%T)" "$line"; done \
        >> "$OUT/bench_grid_training.log"
    cp "$OUT/bench_grid_training.json" /tmp/bench_grid_training.json 2>/dev/null   # for the next call here
    tail -n 60 "$OUT/bench_grid_training.log"
    ;;
  bar)
    # the backward's bar in one call: the grid's one never-searched shape (B2 S16384 H8/1 causal, its
    # problem 10: the gradient reference ran out of memory before it was chunked) tuned for this GPU
    # model, merged into the packaged database here (merge $OUT/bwd_retune_db_1.json locally too), then
    # `grid` in what is left of the call (it took 325-383 s on an H100; run `grid` again to finish it)
    start=$SECONDS
    RETUNE_START=10 RETUNE_STOP=11 STUDY_SECONDS=${STUDY_SECONDS:-45} bash "$0" bwd-retune 1 1
    python3 -m fa4tune.cli db merge -o fa4/data/best_configs.json "$OUT/bwd_retune_db_1.json" | tail -n 1
    GRID_SECONDS=$((585 - (SECONDS - start))) bash "$0" grid
    ;;
  extras)
    timeout 280 python3 benchmarks/varlen_bench.py --out "$OUT/varlen_bench.json" 2>&1 | quiet | tail -n 6
    timeout 280 python3 benchmarks/transformers_prefill.py --out "$OUT/prefill.json" --layers 4 \
        --seqlens 2048,4096,8192 2>&1 | quiet | tail -n 20
    ;;
  head-dims)
    # -k picks the new head dims' cases of the default suite; a shard still running at 530 s is cut and
    # reported with the outcomes it had (run_sm90_suites.sh)
    SUITE_SECONDS=530 timeout 570 bash tests/gpu/run_sm90_suites.sh default 8 -k "d96 or d192 or d256" 2>&1 \
        | quiet > "$OUT/tests_head_dims_default.txt"
    tail -n 30 "$OUT/tests_head_dims_default.txt"
    ;;
  head-dims-variants)
    # the knob suite's new-head-dim cases; the third suite is all Dv != D
    SUITE_SECONDS=150 timeout 180 bash tests/gpu/run_sm90_suites.sh knobs 8 -k "new_head_dims" 2>&1 | quiet \
        > "$OUT/tests_head_dims_knobs.txt"
    SUITE_SECONDS=200 timeout 230 bash tests/gpu/run_sm90_suites.sh head-dim-v 2>&1 | quiet \
        > "$OUT/tests_head_dim_v.txt"
    tail -n 30 "$OUT/tests_head_dims_knobs.txt" "$OUT/tests_head_dim_v.txt"
    ;;
  features)
    timeout 570 bash tests/gpu/run_sm90_suites.sh window 2>&1 | quiet > "$OUT/tests_window_softcap.txt"
    tail -n 15 "$OUT/tests_window_softcap.txt"
    ;;
  features-search)
    # tune a PARTS-th of the 17 problems (every PARTS-th from PART; 30 configurations or STUDY_SECONDS (45) a
    # study, as the wide set was tuned, peers timed); the part's entries also stay in /tmp/fa4-features, which
    # features-bench merges into the packaged database on the same warm machine (merge
    # $OUT/features_best_PART.json into fa4/data/best_configs.json here too: `python -m fa4tune.cli db merge -o
    # fa4/data/best_configs.json ...`). A part must fit the 540 s limit: 17 studies of 25 s did not; `17 17`
    # tunes the last problem alone
    part=${2:-1}; parts=${3:-2}
    python3 benchmarks/shapes_subset.py benchmarks/h200_features.toml /tmp/features_part.toml --start $((part - 1)) \
        --step "$parts"
    timeout 540 python3 -m fa4tune.cli search --shapes-file /tmp/features_part.toml --trials 30 \
        --timeout "${STUDY_SECONDS:-45}" --storage "$OUT/features_$part.journal" \
        --db "$OUT/features_best_$part.json" 2>&1 | quiet > "$OUT/features_search_$part.log"
    tail -n 6 "$OUT/features_search_$part.log"
    mkdir -p /tmp/fa4-features && cp "$OUT/features_best_$part.json" /tmp/fa4-features/
    COLUMNS=250 python3 -m fa4tune.cli best --db "$OUT/features_best_$part.json" | tee "$OUT/features_best_$part.txt"
    ;;
  features-bench)
    if ls /tmp/fa4-features/features_best_*.json > /dev/null 2>&1; then
      python3 -m fa4tune.cli db merge -o fa4/data/best_configs.json /tmp/fa4-features/features_best_*.json | tail -n 3
    fi
    COLUMNS=250 timeout 560 python3 -m fa4tune.cli bench --shapes-file benchmarks/h200_features.toml --rounds 2 \
        --db fa4/data/best_configs.json --out "$OUT/bench_features.json" --jobs 12 2>&1 \
        | quiet > "$OUT/bench_features.log"
    tail -n 40 "$OUT/bench_features.log"
    # a window's time against the same shape without one, per visible (query, key) pair
    python3 benchmarks/window_cost.py "$OUT/bench_features.json" | tee "$OUT/window_cost.txt"
    # the bar: tuned (and the untuned default) ÷ flash-attn-4, problem by problem
    python3 benchmarks/peer_ratio.py "$OUT/bench_features.json" | tee "$OUT/features_bar.txt" | tail -n 4
    python3 benchmarks/peer_ratio.py "$OUT/bench_features.json" --variant default > "$OUT/features_default.txt"
    tail -n 3 "$OUT/features_default.txt"
    ;;
  bwd-configs)
    timeout 570 python3 benchmarks/sm90_bwd_configs.py --jobs 8 --timeout 300 --json "$OUT/bwd_configs.json" \
        2> >(quiet > "$OUT/bwd_configs.log") | tee "$OUT/bwd_configs.txt"
    ;;
  bwd-dq-vector)
    # dq_accum="fragment_atomic" (each block's dQ added from the MMA warpgroups' registers, one 128-bit
    # red a 4 values, no shared-memory tile): the packaged backward entries' configurations for this GPU
    # model at seven grid shapes (the five it trails flash-attn-4 on and two it leads), as tuned and with
    # dq_accum=fragment_atomic, and the default rule's both ways, on those shapes beside flash-attn-4
    # (each configuration's gradients checked first); then its GPU tests (about 7 minutes in all)
    AB_SHAPES="$AB_SHAPES" python3 - > "$OUT/dq_vector_configs.txt" <<'PY'
import json, os, torch
from fa4.kernels import Config
device = torch.cuda.get_device_name()
shapes = {(*map(int, s.split(",")[:5]), s.endswith("causal")) for s in os.environ["AB_SHAPES"].split()}
labels = {}
for e in json.load(open("fa4/data/best_configs.json"))["entries"]:
    p = e["problem"]
    shape = (p["batch"], p["seqlen_q"], p["heads_q"], p["heads_kv"], p["head_dim"], p["causal"])
    if e["arch"] == "sm90_bwd" and e["device"] == device and shape in shapes:
        config = Config.from_dict("sm90_bwd", e["config"])
        labels[config.label()] = labels[config.replace(dq_accum="fragment_atomic").label()] = None
print("rule\nrule dq_accum=fragment_atomic\n" + "\n".join(labels))
PY
    # AB_CONFIGS=N: the first N lines only (2: the default rule's pair), for a short call
    if [ -n "${AB_CONFIGS:-}" ]; then head -n "$AB_CONFIGS" "$OUT/dq_vector_configs.txt" > "$OUT/ab.txt" \
        && mv "$OUT/ab.txt" "$OUT/dq_vector_configs.txt"; fi
    # shellcheck disable=SC2086
    FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 timeout "${AB_SECONDS:-330}" python3 benchmarks/sm90_bwd_configs.py \
        --jobs 8 --timeout 300 $ab_shapes --config-file "$OUT/dq_vector_configs.txt" --json "$OUT/bwd_dq_vector.json" \
        2> >(quiet > "$OUT/bwd_dq_vector.log") | tee "$OUT/bwd_dq_vector.txt" | tail -n 45
    timeout "${TESTS_SECONDS:-150}" python3 -m pytest -q -m gpu tests/gpu/test_sm90_bwd_gpu.py \
        tests/gpu/test_sm90_bwd_deterministic_gpu.py -k fragment_atomic -p no:cacheprovider 2>&1 \
        | quiet > "$OUT/tests_dq_vector.txt"
    tail -n 4 "$OUT/tests_dq_vector.txt"
    ;;
  bwd-pdl-ab)
    # the programmatic launch (FA4_BWD_PROGRAMMATIC_LAUNCH=1: the main kernel a dependent of the
    # preprocess, each postprocess of the kernel before it) against the plain launch, the default rule on
    # the seven shapes of bwd-dq-vector beside flash-attn-4: plain, programmatic, plain again (the
    # drift between the two plain runs is the noise), about 100 s each
    for side in 0 1 0; do
      # flash-attn-4's disk cache: its kernels compile in the first run only
      # shellcheck disable=SC2086
      FA4_BWD_PROGRAMMATIC_LAUNCH=$side FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 timeout "${AB_SECONDS:-150}" \
          python3 benchmarks/sm90_bwd_configs.py \
          --jobs 2 --timeout 140 --config rule $ab_shapes --json "$OUT/bwd_pdl_$side.json" \
          2> >(quiet >> "$OUT/bwd_pdl.log") | tee -a "$OUT/bwd_pdl.txt" | tail -n 12
      if [ -f "$OUT/bwd_pdl_$side.json" ]; then mv "$OUT/bwd_pdl_$side.json" "$OUT/bwd_pdl_${side}_$SECONDS.json"; fi
    done
    ;;
  bwd-path-gap)
    FA4_BACKWARD=ours timeout 300 python3 benchmarks/bwd_path_gap.py 2>&1 | quiet | tee "$OUT/bwd_path_gap.txt" | tail -n 20
    ;;
  bwd-tests)
    timeout 570 python3 -m pytest -q -m gpu tests/gpu/test_sm90_bwd_gpu.py -p no:cacheprovider 2>&1 \
        | quiet > "$OUT/tests_sm90_bwd.txt"
    tail -n 15 "$OUT/tests_sm90_bwd.txt"
    ;;
  bwd-modes)
    timeout 520 python3 -m pytest -q -m gpu tests/gpu/test_sm90_bwd_deterministic_gpu.py \
        tests/gpu/test_sm90_bwd_programmatic_gpu.py -p no:cacheprovider 2>&1 | quiet > "$OUT/tests_bwd_modes.txt"
    tail -n 8 "$OUT/tests_bwd_modes.txt"
    ;;
  bwd-split)
    # shellcheck disable=SC2086
    timeout 330 python3 benchmarks/sm90_bwd_configs.py --jobs 6 --timeout 300 $grid_shapes --config rule \
        --config "rule group_split=1" --config "rule group_split=2" --config "rule group_split=4" \
        --config "rule group_split=8" --config "rule tile_m=80" --config "rule tile_m=80 pds_stages=1" \
        --json "$OUT/bwd_split.json" 2> >(quiet > "$OUT/bwd_split.log") \
        | tee "$OUT/bwd_split.txt"
    # (tile_m 80 is flash-attn-4's tile at head dim 128 without a mask; ours has 10 % fewer instructions
    # a query row there than at 64: benchmarks/sm90_bwd_sass.py --set tile_m=80)
    # GPU tests: the default configuration's cases (split at 6 of the 8, both dtypes), the LSE gradient
    # and the reused workspace, then tile_m 80's variants (both head dims, every case); every split value
    # in every variant is `bwd-tests`' (a test id names group_split=1 too, so -k cannot pick them alone)
    timeout 120 python3 -m pytest -q -m gpu tests/gpu/test_sm90_bwd_gpu.py -p no:cacheprovider \
        -k "gradients_follow or lse" 2>&1 | quiet > "$OUT/tests_bwd_split.txt"
    tail -n 8 "$OUT/tests_bwd_split.txt"
    # by node id: -k cannot name "tile_m=80" ('=' is not in its grammar)
    tile80=$(python3 -m pytest --collect-only -q -m gpu tests/gpu/test_sm90_bwd_gpu.py -p no:cacheprovider \
        | grep "tile_m=80")
    # shellcheck disable=SC2086
    timeout 110 python3 -m pytest -q -m gpu -p no:cacheprovider $tile80 2>&1 | quiet > "$OUT/tests_bwd_tile80.txt"
    tail -n 8 "$OUT/tests_bwd_tile80.txt"
    ;;
  training-pass)
    # optional KNOB=VALUE arguments: our default with those knobs changed (an A/B of a rule), files
    # named after them
    shift
    sets=""; name=training_pass
    # ("deterministic" instead: fa4.attention(..., deterministic=True))
    for kv in "$@"; do
      if [ "$kv" = deterministic ]; then sets="$sets --deterministic"; else sets="$sets --set $kv"; fi
      name="${name}_${kv//=/-}"
    done
    if [ "${FA4_BWD_PROGRAMMATIC_LAUNCH:-}" = 1 ]; then name="${name}_programmatic"; fi
    if [ -n "${FA4_BWD_DETERMINISTIC_ORDER:-}" ]; then name="${name}_${FA4_BWD_DETERMINISTIC_ORDER}"; fi
    # shellcheck disable=SC2086
    FA4_BACKWARD=ours timeout 560 python3 benchmarks/training_pass.py --json "$OUT/$name.json" $sets \
        2> >(quiet > "$OUT/$name.log") | cut -c1-300
    python3 benchmarks/training_pass.py --summary "$OUT/$name.json" | tee "$OUT/${name}_summary.txt"
    ;;
  bwd-space)
    # every configuration of the fast space (benchmarks/sm90_bwd_fast_space.toml) on the grid's 14 shapes
    # and the 12 others beside flash-attn-4: the data to refit the default's group_split and order rules
    # (judge a refit on the shapes it was not fitted on); about 7 minutes
    # shellcheck disable=SC2086
    timeout 560 python3 benchmarks/sm90_bwd_configs.py --jobs 8 --timeout 500 $grid_shapes $other_shapes \
        --space benchmarks/sm90_bwd_fast_space.toml --json "$OUT/bwd_space.json" \
        2> >(quiet > "$OUT/bwd_space.log") | tee "$OUT/bwd_space.txt" | tail -n 5
    ;;
  bwd-fragment)
    timeout 200 python3 -m pytest -q -m gpu tests/gpu/test_sm90_bwd_gpu.py -p no:cacheprovider -k fragment 2>&1 \
        | quiet > "$OUT/tests_bwd_fragment.txt"
    tail -n 8 "$OUT/tests_bwd_fragment.txt"
    # shellcheck disable=SC2086
    timeout 360 python3 benchmarks/sm90_bwd_configs.py --jobs 8 --timeout 300 $grid_shapes $other_shapes \
        --config rule --config "rule dq_accum=fragment" --json "$OUT/bwd_fragment.json" \
        2> >(quiet > "$OUT/bwd_fragment.log") | tee "$OUT/bwd_fragment.txt"
    ;;
  bwd-ncu)
    FA4_BACKWARD=ours PROFILE_ARGS=--backward timeout 560 bash benchmarks/h200_profile.sh \
        "b1-s8192-hq32-hkv8-d128-bf16-full b8-s512-hq16-hkv16-d64-bf16-full b2-s16384-hq8-hkv1-d128-bf16-causal" \
        "ours flash_attn_4" 2>&1 | quiet | tee "$OUT/bwd_ncu.txt"
    ;;
  bwd-stalls)
    FA4_BACKWARD=ours PROFILE_ARGS=--backward SOURCE=1 timeout 560 bash benchmarks/h200_profile.sh \
        "b8-s512-hq16-hkv16-d64-bf16-full b1-s8192-hq32-hkv8-d128-bf16-full" "ours flash_attn_4" 2>&1 | quiet \
        > "$OUT/bwd_stalls_ncu.txt"
    python3 benchmarks/ncu_stall_regions.py /tmp/ncu_source/*.source.csv | tee "$OUT/bwd_stalls.txt" | head -n 80
    ;;
  bwd-search)
    # the 14 grid shapes in four parts (PART 1-4: every fourth shape), each configuration of the fast
    # part of the space (benchmarks/sm90_bwd_fast_space.toml: 18 x the group_split values the GQA ratio
    # admits, two thirds of them at head dim 128: 72 at most) per shape, ours and the peers' backward
    # alone timed in one run; entries in $OUT/bwd_best.json
    part=${2:-1}
    python3 benchmarks/shapes_subset.py benchmarks/h200_grid.toml /tmp/bwd_grid_part.toml --start $((part - 1)) --step 4
    timeout 540 python3 -m fa4tune.cli search --backward --shapes-file /tmp/bwd_grid_part.toml \
        --space benchmarks/sm90_bwd_fast_space.toml --sampler grid --trials 72 --timeout 100 \
        --storage "$OUT/bwd_studies_$part.journal" --db "$OUT/bwd_best.json" --format json \
        > "$OUT/bwd_search_$part.json" 2> >(quiet > "$OUT/bwd_search_$part.log")
    tail -n 6 "$OUT/bwd_search_$part.log"
    python3 -m fa4tune.cli best --db "$OUT/bwd_best.json" | tee "$OUT/bwd_best_$part.txt"
    ;;
  bwd-retune)
    # 10 trials a study over the fast space: the default, the shape's stale winner (`fa4tune.searches.
    # warm_start` seeds it first), then TPE; the three fastest and the default re-timed, peers timed. The
    # search records into a copy of the packaged database (where the stale winners are); merge it back
    # with `python -m fa4tune.cli db merge -o fa4/data/best_configs.json $OUT/bwd_retune_db_PART.json`
    # (a current entry beats a stale one). On another GPU model (an H100) the seeds are the H200 entries
    # of the same shapes; STUDY_TRIALS (10) and STUDY_SECONDS (60) shorten the studies to tune the whole
    # grid in one call (`STUDY_SECONDS=30 ... bwd-retune 1 1`; the H200's grid search evaluated 18-54
    # configurations a study in 12-47 s with 12 workers), then `grid` in the next
    # (RETUNE_START / RETUNE_STOP: the grid's problems [start, stop) instead, e.g. 8 13 for its head-dim-64 ones)
    part=${2:-1}; parts=${3:-2}
    if [ -n "${RETUNE_START:-}" ]; then
      python3 benchmarks/shapes_subset.py benchmarks/h200_grid.toml /tmp/bwd_retune_part.toml --start "$RETUNE_START" \
          --stop "${RETUNE_STOP:-14}"
    else
      python3 benchmarks/shapes_subset.py benchmarks/h200_grid.toml /tmp/bwd_retune_part.toml --start $((part - 1)) \
          --step "$parts"
    fi
    cp fa4/data/best_configs.json "$OUT/bwd_retune_db_$part.json"
    timeout 540 python3 -m fa4tune.cli search --backward --shapes-file /tmp/bwd_retune_part.toml \
        --space benchmarks/sm90_bwd_fast_space.toml --trials "${STUDY_TRIALS:-10}" --timeout "${STUDY_SECONDS:-60}" \
        --storage "$OUT/bwd_retune_$part.journal" --db "$OUT/bwd_retune_db_$part.json" --format json \
        > "$OUT/bwd_retune_$part.json" 2> >(quiet > "$OUT/bwd_retune_$part.log")
    tail -n 6 "$OUT/bwd_retune_$part.log"
    COLUMNS=250 python3 -m fa4tune.cli best --db "$OUT/bwd_retune_db_$part.json" | grep -i "backward\|problem" | tee "$OUT/bwd_retune_best_$part.txt"
    ;;
  bwd-search-test)
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
    echo "unknown step $STEP ($STEPS)" >&2
    exit 2
    ;;
esac
