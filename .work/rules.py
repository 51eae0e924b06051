import json, math, re, sys
from collections import defaultdict
from fa4.kernels import AttentionProblem
from fa4.kernels.sm90_bwd import defaults as D
from fa4.kernels.sm90_bwd.defaults import default_config, streamed_bytes, group_split_for

rows = json.load(open(sys.argv[1]))
fa4, ours = {}, defaultdict(dict)
for r in rows:
    if r.get("outcome") != "ok": continue
    if r["kernel"] != "ours": fa4[r["shape"]] = r["us"]; continue
    k = dict(kv.split("=") for kv in r["ran"].split())
    ours[r["shape"]][(int(k["tile_m"]), k["scheduler"], int(k["group_split"]))] = r["us"]

def problem(shape):
    b, s, hq, hk, d, mask = re.match(r"b(\d+)-s(\d+)-(\d+)/(\d+)-d(\d+)-(\w+)", shape).groups()
    return AttentionProblem(int(b), int(s), int(s), int(hq), int(hk), int(d), "bf16", mask == "causal")

def evaluate(name, sched_rule, shapes):
    rs = []
    for s in shapes:
        p = problem(s); t = ours[s]; best = min(t.values())
        c = default_config(p)
        sc = sched_rule(p)
        c = c.replace(scheduler=sc); c = c.replace(group_split=group_split_for(c, p))
        us = t.get((c.tile_m, c.scheduler, c.group_split))
        if us is None: print("missing", s, c.label()); continue
        rs.append((us / best, s))
    g = math.exp(sum(math.log(r) for r, _ in rs) / len(rs))
    within = sum(r <= 1.05 for r, _ in rs)
    worst = max(rs)
    print(f"{name:40} geomean {g:.3f} worst {worst[0]:.3f} ({worst[1]}) within5% {within}/{len(rs)}")

causal = [s for s in ours if s.endswith("causal")]
big = [s for s in causal if fa4.get(s, 0) > 300]
R0 = lambda p: "single_lpt" if streamed_bytes(p) <= D.LONGEST_FIRST_STREAMED_BYTES else "single"
R1 = lambda p: "sectioned_lpt"
R2 = lambda p: "sectioned_lpt" if p.gqa_ratio > 1 else R0(p)
R4 = lambda p: "single_lpt"
for shapes, label in ((causal, "all causal"), (big, "causal > 300 us")):
    print("==", label, len(shapes))
    for n, r in (("R0 current", R0), ("R1 sectioned", R1), ("R2 sectioned if GQA", R2), ("R4 single_lpt", R4), ("single", lambda p: "single")):
        evaluate(n, r, shapes)

print("== R2 detail")
for s in sorted(causal):
    p = problem(s); t = ours[s]; best = min(t, key=t.get)
    c = default_config(p).replace(scheduler=R2(p)); c = c.replace(group_split=group_split_for(c, p))
    key = (c.tile_m, c.scheduler, c.group_split)
    sect = {k: round(v / t[best], 3) for k, v in t.items() if k[1] == c.scheduler and k[0] == c.tile_m}
    print(f"{s:30} fa4 {fa4[s]:8.1f} R2 {key} {t.get(key, 0)/t[best]:.3f}  best {best} {t[best]/fa4[s]:.3f}  same-sched splits {sect}")

print("== R2 + at most 4 heads a CTA")
def split_min4(c, p):
    lo = -(-p.gqa_ratio // 4)
    g = group_split_for(c, p)
    if g >= lo: return g
    # the smallest admitted split >= lo
    from fa4.kernels.sm90_bwd.feasibility import split_reasons
    for s in (1, 2, 4, 8):
        if s >= lo and not split_reasons(c.replace(group_split=s), p):
            return s
    return g
for shapes, label in ((causal, "all causal"), (big, "causal > 300 us"), ([s for s in ours if s.endswith("full")], "full")):
    rs = []
    for s in shapes:
        p = problem(s); t = ours[s]; best = min(t.values())
        c = default_config(p)
        if p.causal: c = c.replace(scheduler=R2(p))
        c = c.replace(group_split=split_min4(c, p))
        us = t[(c.tile_m, c.scheduler, c.group_split)]
        rs.append((us / best, s))
    g = math.exp(sum(math.log(r) for r, _ in rs) / len(rs))
    print(label, f"geomean {g:.3f} worst {max(rs)[0]:.3f} {max(rs)[1]} within5% {sum(r <= 1.05 for r, _ in rs)}/{len(rs)}")
    for r, s in sorted(rs, reverse=True)[:5]: print("   ", s, round(r, 3))

print("== leave-one-out over the candidate rules (scheduler x min split)")
cands = {}
for sn, sr in (("R0", R0), ("R1", R1), ("R2", R2), ("R4", R4), ("single", lambda p: "single")):
    for mn, mf in (("model", lambda c, p: group_split_for(c, p)), ("min4", split_min4)):
        cands[(sn, mn)] = (sr, mf)
def ratio(cand, s):
    sr, mf = cands[cand]; p = problem(s); t = ours[s]
    c = default_config(p).replace(scheduler=sr(p)); c = c.replace(group_split=mf(c, p))
    return t[(c.tile_m, c.scheduler, c.group_split)] / min(t.values())
lo = []
for s in causal:
    others = [o for o in causal if o != s]
    pick = min(cands, key=lambda c: sum(math.log(ratio(c, o)) for o in others))
    lo.append(ratio(pick, s)); 
    print(f"   {s:30} pick {pick} -> {lo[-1]:.3f}")
print("LOO geomean", round(math.exp(sum(map(math.log, lo)) / len(lo)), 3), "worst", round(max(lo), 3))
