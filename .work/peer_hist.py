import sys
sys.path.insert(0, "benchmarks")
import sm90_bwd_sass as S
from collections import Counter
from fa4.kernels import AttentionProblem
from fa4tune.sm100.sass import control_flow, kernel_function, parse_sass
from fa4tune.sm100.sass_build import disassemble
d = int(sys.argv[1]); causal = sys.argv[2] == "causal"
p = AttentionProblem(4, 2048, 2048, 16, 4, d, "bf16", causal)
text = disassemble(S.flash_attn4_cubin(p))
func = kernel_function(parse_sass(text)); blocks, loops = control_flow(func)
loop = max((lp for lp in loops if not lp.spin), key=lambda lp: sum(1 for b in lp.blocks for j in range(blocks[b].start, blocks[b].end) if func.instructions[j].base == "HGMMA"))
path = S.steady_path(func, blocks, loops, loop)
print(len(path))
print(sorted(Counter(i.base for i in path).items(), key=lambda x: -x[1]))
open("/tmp/peer_path.txt", "w").write("\n".join(f"{i.opcode} {i.operands}" for i in path))
