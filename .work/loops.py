import sys
sys.path.insert(0, "benchmarks")
import sm90_bwd_sass as S
from collections import Counter
from fa4tune.sm100.sass import control_flow, kernel_function, parse_sass
func = kernel_function(parse_sass(open(sys.argv[1]).read())); blocks, loops = control_flow(func)
for lp in loops:
    if lp.spin: continue
    p = S.steady_path(func, blocks, loops, lp)
    h = sum(1 for i in p if i.base == "HGMMA")
    if h == 0: continue
    c = Counter(i.opcode for i in p)
    print("loop", lp.header, "path", len(p), "hgmma", h, "masked", any("-INF" in i.operands for i in p),
          "UIADD3.X", c["UIADD3.X"], "UIADD3.64", c["UIADD3.64"], "UMOV", c["UMOV"])
