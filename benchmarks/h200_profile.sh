#!/usr/bin/env bash
# Nsight Compute profiles of our kernel (tuned configuration) beside flash-attn-4, shape by shape, on the
# H200 (with the project installed, `pip install -e '.[peer]'`). One CSV per (shape, implementation) (in $OUT/ncu.tgz),
# then one summary table (benchmarks/ncu_summary.py). Nsight locks clocks at base: read cycles and ratios.
#   bash benchmarks/h200_profile.sh "d64-s2048-full s1024-causal" "ours flash_attn_4"
# PROFILE_ARGS passes options to ncu_profile.py (PROFILE_ARGS=--backward: the gradient call).
# SOURCE=1 adds, per (shape, implementation), the warp-stall samples of each SASS instruction of the kernel
# whose name matches $SOURCE_KERNEL (a regex; default the sm90 backward's main kernel, ours and
# flash-attn-4's): $OUT/ncu_source.tgz holds each as a CSV (`ncu --page source`; the reports stay on the
# machine), read on a CPU by benchmarks/ncu_stall_regions.py (which part of the kernel the stalls fall in:
# prologue, block loops, epilogue).
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
if [ "${SOURCE:-0}" = 1 ]; then
  src=/tmp/ncu_source; mkdir -p "$src"
  for shape in $shapes; do
    for impl in $impls; do
      # shellcheck disable=SC2086
      "$NCU" --profile-from-start off --section SourceCounters --section WarpStateStats \
        -k "regex:${SOURCE_KERNEL:-BackwardSm90}" -c 1 -f -o "$src/$shape.$impl" \
        python3 benchmarks/ncu_profile.py --shape "$shape" --impl "$impl" ${PROFILE_ARGS:-} \
        > "$src/$shape.$impl.err" 2>&1 || tail -5 "$src/$shape.$impl.err"
      "$NCU" --import "$src/$shape.$impl.ncu-rep" --page source --csv --print-source sass \
        > "$src/$shape.$impl.source.csv" 2>> "$src/$shape.$impl.err" || tail -5 "$src/$shape.$impl.err"
    done
  done
  tar -czf "${OUT:-/tmp/out}/ncu_source.tgz" -C /tmp --exclude="*.err" --exclude="*.ncu-rep" ncu_source
fi
python3 benchmarks/ncu_summary.py "$out"/*.csv | tee "$out/summary.txt"
# the CSVs and the summary; not the .err logs (their warnings name the machine's install paths)
tar -czf "${OUT:-/tmp/out}/ncu.tgz" -C /tmp --exclude="*.err" ncu
