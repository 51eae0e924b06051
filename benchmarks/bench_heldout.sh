#!/usr/bin/env bash
# The held-out verdict on the H200 (with the project installed, `pip install -e '.[peer]'`): `fa4tune bench` over part
# PART (1 or 2: problems 1-12 or 13-24) of results/wide/heldout.toml with the packaged database, which
# holds no held-out shape, so every ours row is a borrowed (nearest bucket) or default configuration
# and the dispatched row is what fa4.attention does on a shape nobody tuned. One part fits a 10-minute
# device call. Judge both parts with `python benchmarks/heldout_summary.py heldout_1.json heldout_2.json`.
set -uo pipefail
PART=${1:?usage: bench_heldout.sh 1|2}
OUT=${OUT:-/tmp/fa4-heldout-$PART}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 benchmarks/shapes_subset.py results/wide/heldout.toml "$OUT/heldout_$PART.toml" \
    $([ "$PART" = 1 ] && echo --stop 12 || echo --start 12)
start=$(date +%s)
timeout "${BENCH_SECONDS:-540}" python3 -m fa4tune.cli bench --shapes-file "$OUT/heldout_$PART.toml" \
    --db fa4/data/best_configs.json --out "$OUT/heldout_$PART.json" --jobs 12 2>&1 \
    | grep -v -i "userwarning\|exe_args" > "$OUT/heldout_$PART.log"
echo "bench $PART: exit ${PIPESTATUS[0]} wall $(( $(date +%s) - start )) s" | tee -a "$OUT/heldout_$PART.log"
tail -n 40 "$OUT/heldout_$PART.log"
[ -f "$OUT/heldout_$PART.json" ] && python3 benchmarks/heldout_summary.py "$OUT/heldout_$PART.json" | tail -n 4
