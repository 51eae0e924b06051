#!/usr/bin/env bash
# A/B on the device: the PDL branch's default backward (with peers) then main's kernel files, ours only
set -uo pipefail
OUT=${OUT:-/tmp/out}
# both sides run the backward's default: the packaged backward entries (main's fingerprint) dropped
python3 - <<'PY'
import json
path = "fa4/data/best_configs.json"
db = json.load(open(path))
db["entries"] = [e for e in db["entries"] if e.get("arch") != "sm90_bwd"]
json.dump(db, open(path, "w"))
PY
export FA4TUNE_HOME=/tmp/fa4tune-home FA4TUNE_CACHE_DIR=/tmp/fa4tune-cache PYTHONUNBUFFERED=1
FA4_BACKWARD=ours timeout 260 python3 benchmarks/training_pass.py --json "$OUT/tp_pdl.json" 2>"$OUT/tp_pdl.log" | tee "$OUT/tp_pdl.rows" | cut -c1-150
python3 benchmarks/training_pass.py --summary "$OUT/tp_pdl.json" > "$OUT/tp_pdl_summary.txt"
cp kernels/sm90_bwd/kernel.py /tmp/pdl_kernel.py; cp kernels/sm90_bwd/prepost.py /tmp/pdl_prepost.py
cp .work/main_kernels/kernel.py .work/main_kernels/prepost.py kernels/sm90_bwd/
FA4_BACKWARD=ours timeout 170 python3 benchmarks/training_pass.py --peers , --json "$OUT/tp_main.json" 2>"$OUT/tp_main.log" | tee "$OUT/tp_main.rows" | cut -c1-150
cp /tmp/pdl_kernel.py kernels/sm90_bwd/kernel.py; cp /tmp/pdl_prepost.py kernels/sm90_bwd/prepost.py
python3 .work/cmp_pdl.py "$OUT/tp_pdl.rows" "$OUT/tp_main.rows" | tee "$OUT/ab_pdl.txt"
