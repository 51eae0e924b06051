#!/usr/bin/env bash
# Search at scale on the two-GPU H200 machine (with the project installed, `pip install -e '.[peer]'`), in three steps
# that each fit one device call; state stays in $KEEP on the machine between calls, copies go to $OUT.
#   bash benchmarks/h200_search_scaling.sh one    # the grid, cold, 1 GPU, 12 worker processes
#   bash benchmarks/h200_search_scaling.sh two    # the same grid and budget, cold, 2 GPUs, 24 processes
#   bash benchmarks/h200_search_scaling.sh warm   # warm vs cold trial counts (benchmarks/warm_vs_cold.py)
# `one` then `WORKERS=1 JOBS=12 ... warm` also fit the one-GPU machine (the counts do not depend on the
# number of GPUs: same seed, same budget).
# TRIALS (default 40) configurations per study that pass the feasibility model; the re-time step runs
# in one and two (the search's default). Wall times are printed and kept in $OUT/<step>.wall.
set -u
step=$1; trials=${TRIALS:-40}; grid=benchmarks/h200_grid.toml
KEEP=${KEEP:-/tmp/scaling}; OUT=${OUT:-/tmp/out}; mkdir -p "$KEEP" "$OUT"
export PYTHONUNBUFFERED=1
search() {  # $1 = name, then the search's own options
  local name=$1; shift
  local t0; t0=$(date +%s.%N)
  python3 -m fa4tune.cli search --shapes-file "$grid" --trials "$trials" --cold-start --no-peers \
    --storage "$KEEP/$name.journal" --db "$KEEP/$name.json" --format json "$@" \
    > "$KEEP/$name.summary.json" 2> "$KEEP/$name.log"
  local rc=$?
  echo "$name: exit $rc, $(python3 -c "import sys; print(round(float(sys.argv[2]) - float(sys.argv[1]), 1))" \
    "$t0" "$(date +%s.%N)") s wall for $(python3 -c "import json, sys; print(len(json.load(open(sys.argv[1]))))" \
    "$KEEP/$name.summary.json" 2>/dev/null) studies ($*)" \
    | tee "$KEEP/$name.wall"
  tail -3 "$KEEP/$name.log"
  cp "$KEEP/$name".* "$OUT"/
}
case $step in
  one) search one --workers 1 --jobs 12 ;;
  two) search two --workers 2 --jobs 24 ;;
  warm)
    t0=$(date +%s)
    python3 benchmarks/warm_vs_cold.py --shapes-file "$grid" --trials "$trials" --cold-storage "$KEEP/one.journal" \
      --seed-db "$KEEP/one.json" --storage "$KEEP/warm.journal" --workers "${WORKERS:-2}" --jobs "${JOBS:-24}" --out "$OUT/warm_vs_cold.json" \
      2> "$OUT/warm.log" | tail -20
    echo "warm: $(( $(date +%s) - t0 )) s wall"
    cp "$KEEP/warm.journal" "$OUT"/ ;;
  *) echo "usage: $0 one|two|warm" >&2; exit 2 ;;
esac
