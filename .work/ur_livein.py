import sys, re
sys.path.insert(0, "benchmarks")
import sm90_bwd_sass as S
from fa4tune.sm100.sass import control_flow, kernel_function, parse_sass
func = kernel_function(parse_sass(open(sys.argv[1]).read())); blocks, loops = control_flow(func)
best=None
for lp in loops:
    if lp.spin: continue
    h = sum(1 for b in lp.blocks for j in range(blocks[b].start, blocks[b].end) if func.instructions[j].base=="HGMMA")
    if best is None or h > best[0]: best=(h, lp)
lp = best[1]
ins = [func.instructions[j] for b in sorted(lp.blocks) for j in range(blocks[b].start, blocks[b].end)]
written=set(); read=set()
def regs(s): 
    out=set()
    for m in re.finditer(r"U?R(\d+)", s): pass
    return set(re.findall(r"\bUR(\d+)\b", s))
for i in ins:
    ops = i.operands
    parts = [p.strip() for p in ops.split(",")]
    if not parts: continue
    dst = parts[0]
    d = set(re.findall(r"\bUR(\d+)\b", dst)) if not i.opcode.startswith(("HGMMA","SYNCS","UTMA","UBLK","STS","STG","REDG","UTMAREDG")) else set()
    for p in parts[1:] + ([dst] if not d else []): read |= set(re.findall(r"\bUR(\d+)\b", p))
    # 64-bit ops write pairs
    if d and (".64" in i.opcode or "gdesc" in ops): d |= {str(int(x)+1) for x in d}
    written |= d
livein = sorted((int(x) for x in read - written))
print("loop instr", len(ins), "UR read", len(read), "written", len(written), "live-in (read, never written in loop):", livein)
