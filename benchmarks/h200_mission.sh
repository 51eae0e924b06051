#!/usr/bin/env bash
# The mission run on the H200 (with the project installed, `pip install -e '.[peer]'`): the mission search (docs/tuning.md) at
# B=1, S=1024, Hq=32, Hkv=8, D=128 fp16, both causal modes, then the benchmark of tuned vs default vs
# peers and the runtime's host overhead. Everything lands in $OUT as it is written, so a run cut short
# still returns its storage; copy the files into results/ afterwards.
#   STUDY_TIMEOUT  wall-clock budget per study, seconds (default 170)
set -uo pipefail
OUT=${OUT:-/tmp/fa4-mission-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
cp fa4/data/best_configs.json "$OUT"/ && gunzip -c results/studies.journal.gz > "$OUT/studies.journal"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee "$OUT/device.txt"
start=$(date +%s)
python3 -m fa4tune.cli search --seqlen 1024 --gqa 4 --timeout "${STUDY_TIMEOUT:-170}" \
    --storage "$OUT/studies.journal" --db "$OUT/best_configs.json" --format json \
    > "$OUT/search.json" 2> "$OUT/search.log"
echo "search exit $? after $(( $(date +%s) - start )) s" | tee -a "$OUT/search.log"
tail -n 25 "$OUT/search.log"
python3 -m fa4tune.cli bench --db "$OUT/best_configs.json" --out "$OUT/bench.json" 2>&1 | tail -n 30
python3 benchmarks/bench_overhead.py --json "$OUT/overhead_full.json" 2>&1 | tail -n 30
