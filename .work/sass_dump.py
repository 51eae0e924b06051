import sys
sys.path.insert(0, "benchmarks")
import sm90_bwd_sass as S
from fa4.kernels import AttentionProblem, Config
from fa4tune.sm100.sass import control_flow, kernel_function, parse_sass
from fa4tune.sm100.sass_build import disassemble
d = int(sys.argv[1]); knobs = dict(kv.split("=") for kv in sys.argv[2:])
knobs = {k: (int(v) if v.isdigit() else v) for k, v in knobs.items()}
c = Config.make("sm90_bwd", tile_n=128, q_stages=2, sdp_swap=True, pds_stages=2, **knobs)
p = AttentionProblem(4, 2048, 2048, 16, 4, d, "bf16", False)
text = disassemble(S.ours_cubin(p, c))
open("/tmp/sass.txt", "w").write(text)
func = kernel_function(parse_sass(text)); blocks, loops = control_flow(func)
print("total HGMMA", sum(1 for i in func.instructions if i.base == "HGMMA"), "instr", len(func.instructions))
for lp in loops:
    n = sum(blocks[b].end - blocks[b].start for b in lp.blocks)
    h = sum(1 for b in lp.blocks for j in range(blocks[b].start, blocks[b].end) if func.instructions[j].base == "HGMMA")
    print("loop header", lp.header, "blocks", len(lp.blocks), "instr", n, "hgmma", h, "spin", lp.spin)
