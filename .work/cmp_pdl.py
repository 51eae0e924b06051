"""ours (PDL branch) / ours (main) per shape from two training_pass.py --json files; and PDL / fastest peer."""
import json, math, sys
FA4 = "fa4"
def load(path):
    rows = []
    for line in open(path):
        line = line.strip()
        if line.startswith("{"):
            try:
                rows.append(json.loads(line))
            except ValueError:
                pass
    return {r["shape"]: r for r in rows}
pdl = load(sys.argv[1]); main = load(sys.argv[2])
for key in ("bwd_us", "fwdbwd_us"):
    logs, peer_logs = [], []
    print(key)
    for shape, row in pdl.items():
        a = row.get(FA4, {}).get(key); b = main.get(shape, {}).get(FA4, {}).get(key)
        peers = [row[n][key] for n in row if n not in ("shape", FA4) and isinstance(row[n], dict) and row[n].get(key)]
        if a and b:
            logs.append(math.log(a / b))
        p = min(peers) if peers else None
        if a and p:
            peer_logs.append(math.log(a / p))
        print(f"  {shape:40s} pdl {a} main {b} pdl/main {a / b if a and b else float('nan'):.3f} "
              f"pdl/peer {a / p if a and p else float('nan'):.3f}")
    if logs:
        print(f"  geomean pdl/main {math.exp(sum(logs) / len(logs)):.3f}")
