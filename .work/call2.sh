#!/usr/bin/env bash
# one device call: the PDL A/B, then the new head dims' default-config GPU cases
set -u
OUT=${OUT:-/tmp/out}; export OUT
timeout 430 bash .work/ab_pdl.sh
left=$(( 570 - SECONDS ))
echo "head dims with ${left}s"
if [ "$left" -gt 60 ]; then
  timeout $((left - 15)) bash tests/gpu/run_sm90_suites.sh default 8 -k "d96 or d192 or d256" > "$OUT/head_dims_run.txt" 2>&1
  pkill -f "pytest" ; sleep 1
  for f in /tmp/test_sm90_default.*.log; do echo "== $f"; grep -E "FAILED|passed|failed|error" "$f" | grep -v "%\]" | tail -n 12; grep -c PASSED "$f"; done > "$OUT/tests_head_dims_default.txt"
  cat "$OUT/tests_head_dims_default.txt" | tail -n 40
fi
