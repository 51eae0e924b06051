import sys
sys.path.insert(0, "benchmarks")
import sm90_bwd_sass as S
from collections import Counter
from fa4.kernels import AttentionProblem, Config
from fa4tune.sm100.sass import control_flow, kernel_function, parse_sass
from fa4tune.sm100.sass_build import disassemble
d = int(sys.argv[1]); causal = sys.argv[2] == "causal"
knobs = dict(kv.split("=") for kv in sys.argv[3:])
knobs = {k: (int(v) if v.isdigit() else v) for k, v in knobs.items()}
c = Config.make("sm90_bwd", **{**dict(tile_n=128, q_stages=2, sdp_swap=True, pds_stages=2, dq_accum="bulk"), **knobs})
p = AttentionProblem(4, 2048, 2048, 16, 4, d, "bf16", causal)
text = disassemble(S.ours_cubin(p, c))
func = kernel_function(parse_sass(text)); blocks, loops = control_flow(func)
loop = max((lp for lp in loops if not lp.spin), key=lambda lp: sum(1 for b in lp.blocks for j in range(blocks[b].start, blocks[b].end) if func.instructions[j].base == "HGMMA"))
path = S.steady_path(func, blocks, loops, loop)
print(len(path))
print(sorted(Counter(i.base for i in path).items(), key=lambda x: -x[1]))
if len(sys.argv) > 3 and "--print" in sys.argv: pass
open("/tmp/path.txt", "w").write("\n".join(f"{i.opcode} {i.operands}" for i in path))
