#!/usr/bin/env bash
# The whole sm100 search space compiled on CPU (no GPU is used), in 40 shards that each fit a time-limited run:
# shard i is `fa4tune compile-space --arch sm100 --shard i/40` at the base problem (B=1 S=1024 H32/8
# D128 fp16), once non-causal and once causal with LSE. Shards FIRST..LAST, skipping those already in
# DIR, starting none after BUDGET seconds (0: no limit). A shard, both masks: 24-56 min on 2 cores
# here (1.7-4 s a compile, by the day); 4-5.5 min on the device host's 16 (non-causal 158-240 s,
# causal 78-120 s), so one 600 s device call holds one shard pair and the next shard's non-causal
# half at most: a BUDGET of 340 s leaves a late start room to finish.
#     bash benchmarks/sm100_whole_space.sh 0 3                        # into results/compile_space
#     DIR=$OUT JOBS=16 bash benchmarks/sm100_whole_space.sh 4 9 340   # on the device host, into $OUT
# A shard already in DIR or in results/compile_space is skipped: on the device host $OUT starts empty
# every call, so copy each call's shards into results/compile_space before the next call (the working
# tree travels with it) and no shard is compiled twice. MASKS (default "full causal-lse") picks the
# masks: a call's last ~100 s hold a causal shard but not a non-causal one, so a call can go on after
# its pairs with causal shards alone, BUDGET being what the call has left less ~110 s:
#     DIR=$OUT JOBS=16 bash benchmarks/sm100_whole_space.sh 12 12 330; \
#     DIR=$OUT JOBS=16 MASKS=causal-lse bash benchmarks/sm100_whole_space.sh 13 14 100
# Then `python benchmarks/sm100_whole_space_summary.py DIR` adds them up (one kernel source only).
set -u
first=$1 last=$2 budget=${3:-0}
dir=${DIR:-results/compile_space} jobs=${JOBS:-$(nproc)} masks=${MASKS:-full causal-lse} shards=40
logs=${LOGS:-/tmp/sm100-whole-space}   # compile-space's progress, one file a run (not kept in results/)
declare -A mask_flags=([full]="--no-causal" [causal-lse]="--causal --lse")
for mask in $masks; do   # a bad name fails before any shard compiles, not after the good ones
  [ -n "${mask_flags[$mask]:-}" ] || { echo "unknown mask '$mask' in MASKS (full, causal-lse)" >&2; exit 2; }
done
mkdir -p "$dir" "$logs"
start=$(date +%s)
for i in $(seq "$first" "$last"); do
  for mask in $masks; do
    name="sm100-v5-shard-$i-of-$shards-$mask"
    out="$dir/$name.json.gz" part="$dir/$name.part.json.gz"
    [ -s "$out" ] || [ -s "results/compile_space/$name.json.gz" ] && continue
    elapsed=$(( $(date +%s) - start ))
    if [ "$budget" -gt 0 ] && [ "$elapsed" -gt "$budget" ]; then
      echo "budget spent after $elapsed s: shard $i $mask and later not started"
      exit 0
    fi
    read -ra flags <<< "${mask_flags[$mask]}"
    fa4tune compile-space --arch sm100 "${flags[@]}" --jobs "$jobs" --shard "$i/$shards" --format json \
        --out "$part" > /dev/null 2> "$logs/shard-$i-of-$shards-$mask.log"
    rc=$?
    # exit 1 is a finding (a configuration the model accepts failed the check): keep it
    if [ -s "$part" ]; then mv "$part" "$out"; fi
    echo "shard $i/$shards $mask: exit $rc at $(( $(date +%s) - start )) s on $jobs processes"
  done
done
