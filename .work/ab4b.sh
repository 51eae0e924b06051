#!/usr/bin/env bash
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
for v in main bwd-pdl both; do
  cp .work/variants/$v/kernels/sm90_bwd/*.py kernels/sm90_bwd/
  FA4_BACKWARD=ours timeout 60 python3 benchmarks/training_pass.py --shapes-file .work/ab_shapes.toml --peers , \
      --json "$OUT/tp2_$v.json" 2>/dev/null > "$OUT/tp2_$v.rows"
  echo "== $v $SECONDS"
  python3 -c "
import json,sys
for l in open('$OUT/tp2_$v.rows'):
    if l.startswith('{'):
        r=json.loads(l); f=r['fa4']; print(r['shape'], f.get('bwd_us'), f.get('fwdbwd_us'), f.get('validated'), f.get('error','')[:80])
"
done
