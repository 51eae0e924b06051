#!/usr/bin/env bash
# Tune half of the wide train set on the H200 (with the project installed, `pip install -e '.[peer]'`), within one
# 10-minute device call: `bash benchmarks/tune_wide_set.sh a` takes problems 1, 3, 5, ... of
# results/wide/train.toml, `b` takes 2, 4, 6, ... (the split only keeps a call under the limit).
# Cold start (no neighbour seeding, so each study's curve is its own), 30 configurations per study,
# peers timed; the journal, the database and the log land in $OUT. A journal carried back as
# RESUME_JOURNAL resumes the studies a cut call left unfinished.
set -uo pipefail
HALF=${1:?usage: tune_wide_set.sh a|b}
OUT=${OUT:-/tmp/fa4-wide-$HALF}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 benchmarks/shapes_subset.py results/wide/train.toml "$OUT/train_$HALF.toml" --step 2 \
    --start "$([ "$HALF" = a ] && echo 0 || echo 1)"
JOURNAL="$OUT/wide_$HALF.journal"
[ -n "${RESUME_JOURNAL:-}" ] && cp "$RESUME_JOURNAL" "$JOURNAL"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader > "$OUT/toolchain_$HALF.txt"
python3 -c "import kernels; print('toolchain', kernels.toolchain(), 'kernel_fingerprint sm90', kernels.kernel_fingerprint('sm90'))" >> "$OUT/toolchain_$HALF.txt"
start=$(date +%s)
timeout "${SEARCH_SECONDS:-540}" python3 -m fa4tune.cli search --shapes-file "$OUT/train_$HALF.toml" --trials 30 \
    --cold-start --storage "$JOURNAL" --db "$OUT/wide_$HALF.json" 2>&1 \
    | grep -v -i "userwarning\|exe_args" > "$OUT/$HALF.log"
echo "search $HALF: exit ${PIPESTATUS[0]} wall $(( $(date +%s) - start )) s" | tee "$OUT/wall_$HALF.txt"
tail -n 5 "$OUT/$HALF.log"
gzip -f "$OUT/$HALF.log" "$JOURNAL"
