#!/usr/bin/env bash
# Re-tune, on the H200, the packaged database's entries that a kernel change left stale (their
# generated code changed; `benchmarks/restamp_unchanged_code.py` re-stamped the rest): a quick search
# per problem (10 configurations, the study's own stale winner seeded first, peers timed), recorded
# into fa4/data/best_configs.json; the database, journal and log land in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/fa4-retune}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 benchmarks/stale_problems.py fa4/data/best_configs.json "$OUT/stale.toml"
python3 -c "import fa4.kernels as k; print('toolchain', k.toolchain(), 'kernel_fingerprint sm90', k.kernel_fingerprint('sm90'))" > "$OUT/toolchain.txt"
start=$(date +%s)
timeout "${SEARCH_SECONDS:-480}" python3 -m fa4tune.cli search --shapes-file "$OUT/stale.toml" --effort quick \
    --storage "$OUT/retune.journal" --db fa4/data/best_configs.json 2>&1 \
    | grep -v -i "userwarning\|exe_args" > "$OUT/retune.log"
echo "retune: exit ${PIPESTATUS[0]} wall $(( $(date +%s) - start )) s" | tee "$OUT/wall.txt"
cp fa4/data/best_configs.json "$OUT/best_configs.json"
python3 benchmarks/stale_problems.py fa4/data/best_configs.json "$OUT/still_stale.toml"
tail -n 5 "$OUT/retune.log"
gzip -f "$OUT/retune.log" "$OUT/retune.journal"
