#!/usr/bin/env bash
# Nsight Compute profiles of our kernel (tuned configuration) beside flash-attn-4, shape by shape, on the
# H200 (with the project installed, `pip install -e '.[peer]'`). One CSV per (shape, implementation) (in $OUT/ncu.tgz),
# then one summary table (benchmarks/ncu_summary.py). Nsight locks clocks at base: read cycles and ratios.
#   bash benchmarks/h200_profile.sh "d64-s2048-full s1024-causal" "ours flash_attn_4"
# PROFILE_ARGS passes options to ncu_profile.py (PROFILE_ARGS=--backward: the gradient call).
set -u
shapes=${1:-"d64-s2048-full"}; impls=${2:-"ours flash_attn_4"}
out=/tmp/ncu; mkdir -p "$out" "${OUT:-/tmp/out}"
NCU=${NCU:-/usr/local/cuda/bin/ncu}
sections="--section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats
  --section SchedulerStats --section InstructionStats --section MemoryWorkloadAnalysis
  --section ComputeWorkloadAnalysis"
for shape in $shapes; do
  for impl in $impls; do
    # shellcheck disable=SC2086
    "$NCU" --profile-from-start off $sections --csv --page raw \
      python3 benchmarks/ncu_profile.py --shape "$shape" --impl "$impl" ${PROFILE_ARGS:-} \
      > "$out/$shape.$impl.csv" 2> "$out/$shape.$impl.err" || tail -5 "$out/$shape.$impl.err"
  done
done
python3 benchmarks/ncu_summary.py "$out"/*.csv | tee "$out/summary.txt"
# the CSVs and the summary; not the .err logs (their warnings name the machine's install paths)
tar -czf "${OUT:-/tmp/out}/ncu.tgz" -C /tmp --exclude="*.err" ncu
