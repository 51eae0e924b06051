"""Analyse bwd_space.json: per shape best, default, flash-attn-4; candidate rules."""
import json, math, re, sys
from collections import defaultdict
from fa4.kernels import AttentionProblem
from fa4.kernels.sm90_bwd.defaults import default_config

rows = json.load(open(sys.argv[1]))
fa4 = {}
ours = defaultdict(dict)
for r in rows:
    if r.get("outcome") != "ok":
        continue
    if r["kernel"] != "ours":
        fa4[r["shape"]] = r["us"]
        continue
    knobs = dict(kv.split("=") for kv in r["ran"].split())
    key = (knobs["tile_m"], knobs["scheduler"], knobs["group_split"])
    ours[r["shape"]][key] = r["us"]

def problem(shape):
    m = re.match(r"b(\d+)-s(\d+)-(\d+)/(\d+)-d(\d+)-(\w+)", shape)
    b, s, hq, hk, d, mask = m.groups()
    return AttentionProblem(int(b), int(s), int(s), int(hq), int(hk), int(d), "bf16", mask == "causal")

print(f"{'shape':32} {'fa4':>8} {'best':>8} {'b/fa4':>6} {'dflt/fa4':>8} {'dflt/best':>9}  best config | default")
g_best, g_def = [], []
for shape in sorted(ours, key=lambda s: (s not in GRID if (GRID := set()) else 0, s)):
    p = problem(shape)
    d = default_config(p)
    dkey = (str(d.tile_m), d.scheduler, str(d.group_split))
    table = ours[shape]
    bkey = min(table, key=table.get)
    f = fa4.get(shape, float("nan"))
    dus = table.get(dkey, float("nan"))
    g_best.append(table[bkey] / f); g_def.append(dus / f)
    print(f"{shape:32} {f:8.1f} {table[bkey]:8.1f} {table[bkey]/f:6.3f} {dus/f:8.3f} {dus/table[bkey]:9.3f}  {bkey} | {dkey}")
gm = lambda xs: math.exp(sum(math.log(x) for x in xs if x == x) / len([x for x in xs if x == x]))
print("geomean best/fa4", round(gm(g_best), 3), "default/fa4", round(gm(g_def), 3))

print("\nper shape: best time per scheduler (any tile_m/split) / best overall; best split per (tile_m, sched) of default tile")
for shape in sorted(ours):
    table = ours[shape]; best = min(table.values())
    p = problem(shape); d = default_config(p)
    per_sched = {}
    for (tm, sc, gs), us in table.items():
        per_sched[sc] = min(per_sched.get(sc, 1e9), us)
    dt = str(d.tile_m)
    splits = {gs: us for (tm, sc, gs), us in table.items() if tm == dt and sc == d.scheduler}
    from fa4.kernels.sm90_bwd.defaults import streamed_bytes
    print(f"{shape:32} MiB {streamed_bytes(p)/2**20:6.0f} " + " ".join(f"{k}:{v/best:.3f}" for k, v in sorted(per_sched.items()))
          + "  splits@default " + " ".join(f"{k}:{v/best:.3f}" for k, v in sorted(splits.items())) + f" dflt split {d.group_split}")
