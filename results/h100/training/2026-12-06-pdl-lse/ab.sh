#!/usr/bin/env bash
# Our backward's default on the same device under several versions of its kernel sources, one after
# the other in one call (fa4.attention through autograd, CUDA-graph replay: benchmarks/training_pass.py,
# no peers). The packaged backward entries are dropped first so that every side runs the default
# configuration (an entry matches one side's kernel fingerprint only).
#   locally, each side's sources (untracked, so they travel with the working tree):
#     for b in main bwd-pdl bwd-pdl-lse; do mkdir -p .ab/$b && git archive $b kernels/sm90_bwd | tar -x -C .ab/$b; done
#   on the device, after the bundle's setup.sh:
#     bash results/h100/training/2026-12-06-pdl-lse/ab.sh main bwd-pdl bwd-pdl-lse
set -u
OUT=${OUT:-/tmp/out}
here=$(dirname "$0")
export FA4TUNE_HOME=/tmp/fa4tune-home FA4TUNE_CACHE_DIR=/tmp/fa4tune-cache PYTHONUNBUFFERED=1
# the run rewrites the packaged database and the kernel sources in place: put both back on any exit
kept=$(mktemp -d)
cp fa4/data/best_configs.json kernels/sm90_bwd/*.py "$kept"/
trap 'cp "$kept"/best_configs.json fa4/data/ && cp "$kept"/*.py kernels/sm90_bwd/ && rm -rf "$kept"' EXIT
python3 - <<'PY'
import json
path = "fa4/data/best_configs.json"
db = json.load(open(path))
db["entries"] = [e for e in db["entries"] if e.get("arch") != "sm90_bwd"]
json.dump(db, open(path, "w"))
PY
for side in "$@"; do
  cp ".ab/$side/kernels/sm90_bwd/"*.py kernels/sm90_bwd/
  FA4_BACKWARD=ours timeout "${PER:-90}" python3 benchmarks/training_pass.py --shapes-file "$here/shapes.toml" \
      --peers , 2>/dev/null > "$OUT/$side.rows"
  echo "== $side"
  python3 -c "
import json, sys
for line in open(sys.argv[1]):
    if line.startswith('{'):
        row = json.loads(line); ours = row['fa4']
        print(row['shape'], ours.get('bwd_us'), ours.get('fwdbwd_us'), ours.get('validated'), ours.get('error', ''))
" "$OUT/$side.rows"
done
