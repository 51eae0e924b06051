#!/usr/bin/env bash
# A/B/C/D on the device, our backward's default only (no peers), CUDA-graph replay via training_pass.py:
# main, PDL+LSE thread order, PDL, LSE thread order (kernel sources swapped in between)
set -u
OUT=${OUT:-/tmp/out}
export FA4TUNE_HOME=/tmp/fa4tune-home FA4TUNE_CACHE_DIR=/tmp/fa4tune-cache PYTHONUNBUFFERED=1
python3 - <<'PY'
import json
path = "fa4/data/best_configs.json"
db = json.load(open(path))
db["entries"] = [e for e in db["entries"] if e.get("arch") != "sm90_bwd"]
json.dump(db, open(path, "w"))
PY
per=${PER:-125}
for v in main both bwd-pdl bwd-lse-order; do
  cp .work/variants/$v/kernels/sm90_bwd/*.py kernels/sm90_bwd/
  echo "== $v ($SECONDS s)"
  FA4_BACKWARD=ours timeout $per python3 benchmarks/training_pass.py --shapes-file .work/ab_shapes.toml --peers , --json "$OUT/tp_$v.json" \
      2>"$OUT/tp_$v.log" > "$OUT/tp_$v.rows"
  grep -c '"bwd_us"' "$OUT/tp_$v.rows"; grep -o '"error": "[^"]*"' "$OUT/tp_$v.rows" | head -3
done
cp .work/variants/both/kernels/sm90_bwd/*.py kernels/sm90_bwd/
for v in both bwd-pdl bwd-lse-order; do
  echo "== $v / main"; python3 .work/cmp_pdl.py "$OUT/tp_$v.rows" "$OUT/tp_main.rows" | grep -E "^bwd|^fwd|geomean"
done | tee "$OUT/ab4.txt"
python3 .work/cmp_pdl.py "$OUT/tp_both.rows" "$OUT/tp_main.rows" > "$OUT/ab4_both_detail.txt"
