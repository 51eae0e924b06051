import json, sys, math
from collections import defaultdict
rows = json.load(open(sys.argv[1]))
t = defaultdict(dict)
for r in rows:
    t[r["shape"]][r["config"]] = r["us"] if r.get("outcome") == "ok" else r.get("outcome")
labels = sorted({c for v in t.values() for c in v})
print(labels)
ratios = []
for s, v in sorted(t.items()):
    a, b = v.get("rule"), v.get("rule dq_accum=fragment")
    f = v.get("flash-attn-4")
    ok = isinstance(a, float) and isinstance(b, float)
    if ok: ratios.append(b / a)
    print(f"{s:34} fa4 {f}  rule {a}  frag {b}  frag/rule {b/a if ok else '-':.4}" if ok else f"{s:34} {v}")
print("geomean frag/rule", math.exp(sum(map(math.log, ratios)) / len(ratios)), "n", len(ratios), "min", min(ratios), "max", max(ratios))
