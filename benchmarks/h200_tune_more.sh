#!/usr/bin/env bash
# Tune the shapes the mission did not (with the project installed, `pip install -e '.[peer]'`): D=64 S=2048 fp16 and
# D=128 S=8192 bf16, GQA 4, both causal modes, each study capped at STUDY_TIMEOUT seconds, appending
# to the journal and database carried from results/; then bench those shapes (tuned vs default vs
# peers). Everything lands in $OUT as it is written; copy it into results/ afterwards.
set -uo pipefail
OUT=${OUT:-/tmp/fa4-tune-more-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
cp fa4/data/best_configs.json "$OUT"/ && gunzip -c results/studies.journal.gz > "$OUT/studies.journal"
start=$(date +%s)
for args in "--seqlen 2048 --head-dim 64" "--seqlen 8192 --dtype bf16"; do
  python3 -m fa4tune.cli search $args --gqa 4 --timeout "${STUDY_TIMEOUT:-50}" \
      --storage "$OUT/studies.journal" --db "$OUT/best_configs.json" --format json \
      >> "$OUT/search.json" 2>> "$OUT/search.log"
  echo "search $args exit $? at $(( $(date +%s) - start )) s" | tee -a "$OUT/search.log"
done
python3 -m fa4tune.cli bench --shapes "d64-s2048-full d64-s2048-causal bf16-s8192-full bf16-s8192-causal" \
    --db "$OUT/best_configs.json" --out "$OUT/bench.json" 2>&1 | grep -v -i "warning\|exe_args" | tail -n 30
