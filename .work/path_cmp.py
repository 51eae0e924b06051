import sys
sys.path.insert(0, "benchmarks")
import sm90_bwd_sass as S
from collections import Counter
from fa4tune.sm100.sass import control_flow, kernel_function, parse_sass
def path_of(fn):
    func = kernel_function(parse_sass(open(fn).read())); blocks, loops = control_flow(func)
    best = None
    for lp in loops:
        if lp.spin: continue
        p = S.steady_path(func, blocks, loops, lp)
        h = sum(1 for i in p if i.base == "HGMMA")
        if best is None or h > best[0]: best = (h, p)
    return best[1]
a = path_of(sys.argv[1]); b = path_of(sys.argv[2])
ca = Counter(i.opcode for i in a); cb = Counter(i.opcode for i in b)
print(len(a), len(b))
for k in sorted(set(ca) | set(cb), key=lambda k: -(abs(ca[k]-cb[k]))):
    if ca[k] != cb[k]: print(f"{k:40s} {ca[k]:4d} {cb[k]:4d}")
open("/tmp/path_a.txt","w").write("\n".join(f"{i.opcode} {i.operands}" for i in a))
open("/tmp/path_b.txt","w").write("\n".join(f"{i.opcode} {i.operands}" for i in b))
