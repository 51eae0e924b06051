#!/usr/bin/env bash
# Compile shards FIRST..LAST of 20 of the sm100 search space on the device machine's CPU cores (no GPU
# is used), starting no shard after BUDGET seconds, and pack the finished shards into $OUT/shards.tgz
# (a run brings back at most 8 files). Per shard: fa4tune compile-space --arch sm100 --no-causal --shard i/20.
#     bash benchmarks/h200_compile_space.sh 5 16 480
set -u
first=$1 last=$2 budget=$3
out=${OUT:-/tmp/fa4-compile-space}
mkdir -p "$out/shards"
start=$(date +%s)
for i in $(seq "$first" "$last"); do
  elapsed=$(( $(date +%s) - start ))
  if [ "$elapsed" -gt "$budget" ]; then
    echo "budget spent after $elapsed s: shard $i and later not started" | tee -a "$out/log.txt"
    break
  fi
  timeout $(( budget + 90 - elapsed )) fa4tune compile-space --arch sm100 --no-causal --jobs "$(nproc)" --shard "$i/20" \
      --format json --out "$out/shards/sm100-shard-$i-of-20.json" > /dev/null 2>> "$out/log.txt"
  echo "shard $i/20 rc=$? at $(( $(date +%s) - start )) s on $(nproc) cores" | tee -a "$out/log.txt"
done
tar -C "$out" -czf "$out/shards.tgz" shards && rm -rf "$out/shards"
