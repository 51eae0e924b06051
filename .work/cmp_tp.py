import json, sys, math
def load(p):
    return {r["shape"]: r for r in map(json.loads, open(p)) } if not p.endswith("json") or open(p).read(1) == "{" and "\n{" in open(p).read() else None
def rows(p):
    out = {}
    txt = open(p).read().strip()
    try:
        data = json.loads(txt)
        items = data if isinstance(data, list) else data.get("rows", data)
    except json.JSONDecodeError:
        items = [json.loads(l) for l in txt.splitlines() if l.strip()]
    for r in items: out[r["shape"]] = r
    return out
files = sys.argv[1:]
R = [rows(f) for f in files]
print("shape".ljust(36), *[f"ours_bwd[{i}]" for i in range(len(R))], "fa4peer[0]", "cudnn[0]", "ratio new/old")
logs = []
for s in R[0]:
    o = [r[s]["fa4"]["bwd_us"] for r in R]
    p = [r[s]["flash_attn_4"]["bwd_us"] for r in R]
    c = R[0][s].get("sdpa_cudnn", {}).get("bwd_us")
    logs.append([math.log(x / o[1]) for x in o])
    print(s.ljust(36), *[f"{x:9.1f}" for x in o], " |", *[f"{x:9.1f}" for x in p], c, " ", " ".join(f"{x/o[1]:.3f}" for x in o))
print("geomean vs file[1]:", [round(math.exp(sum(l[i] for l in logs)/len(logs)),4) for i in range(len(R))])
