#!/usr/bin/env bash
# Runs the sm90 GPU test suites on the H200 in parallel shards (one compile cache per process) and
# logs go to $OUT. Timing is `fa4tune bench`'s job. Usage (after sourcing the device bundle's setup.sh):
#   bash tests/gpu/run_sm90_suites.sh default|knobs|window|head-dim-v|all [shards [pytest args, e.g. -k softcap]]
# $SUITE_SECONDS (optional) stops every shard after that long and still writes the summary: a shard cut
# short is reported with the outcomes its verbose log holds ("cut after N s: P passed, F failed"), so a
# device call's limit never leaves a suite without a record.
set -u
what=${1:-all}; n=${2:-8}; out=${OUT:-/tmp/out}; mkdir -p "$out"
extra=("${@:3}")
run_suite() {  # $1 = test file stem
  local pids=()
  for i in $(seq 0 $((n - 1))); do
    FA4_SM90_SHARD="$i/$n" timeout "${SUITE_SECONDS:-86400}" python3 -m pytest -v --tb=line -p no:cacheprovider \
      -m gpu "tests/gpu/$1.py" "${extra[@]}" > "/tmp/$1.$i.log" 2>&1 &
    pids+=($!)
  done
  local codes=()
  for p in "${pids[@]}"; do wait "$p"; codes+=($?); done
  for i in $(seq 0 $((n - 1))); do
    echo "=== shard $i"
    if [ "${codes[$i]}" = 124 ]; then   # timeout's code: pytest printed no summary line
      echo "cut after ${SUITE_SECONDS} s: $(grep -c " PASSED" "/tmp/$1.$i.log") passed," \
           "$(grep -c " FAILED" "/tmp/$1.$i.log") failed, $(grep -c " SKIPPED" "/tmp/$1.$i.log") skipped so far"
      grep " FAILED" "/tmp/$1.$i.log"
    fi
    tail -25 "/tmp/$1.$i.log"
  done > "$out/$1.log"
  grep -h -E "passed|failed|error|skipped" "$out/$1.log" | grep -E "^[0-9=]|^cut after" | sed 's/^/  /'
}
case $what in
  default) run_suite test_sm90_default ;;
  knobs) run_suite test_sm90_knobs ;;
  window) run_suite test_window_softcap_gpu ;;
  head-dim-v) run_suite test_sm90_head_dim_v_gpu ;;
  all) run_suite test_sm90_default; run_suite test_sm90_knobs; run_suite test_window_softcap_gpu ;;
esac
