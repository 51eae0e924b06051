import sys
sys.path.insert(0, "benchmarks")
import sm90_bwd_sass as S
from fa4.kernels import AttentionProblem, Config
from fa4tune.sm100.sass import control_flow, kernel_function, parse_sass
from fa4tune.sm100.sass_build import disassemble
from collections import Counter
d = int(sys.argv[1]); causal = sys.argv[2] == "causal"
p = AttentionProblem(8, 512, 512, 16, 16, d, "bf16", causal)
c = Config.make("sm90_bwd", tile_n=128, q_stages=2, sdp_swap=True, pds_stages=2, tile_m=128, dq_accum="fragment", scheduler="single_lpt")
for who, cubin in (("ours", S.ours_cubin(p, c)), ("fa4", S.flash_attn4_cubin(p))):
    text = disassemble(cubin)
    open(f"/tmp/sass_{who}.txt", "w").write(text)
    func = kernel_function(parse_sass(text)); blocks, loops = control_flow(func)
    inloop = set()
    for lp in loops:
        for b in lp.blocks:
            inloop.update(range(blocks[b].start, blocks[b].end))
    outside = [i for j, i in enumerate(func.instructions) if j not in inloop]
    print(who, "total", len(func.instructions), "in loops", len(inloop), "outside", len(outside))
    print("  ", Counter(i.base for i in outside).most_common(25))
    for lp in loops:
        n = sum(blocks[b].end - blocks[b].start for b in lp.blocks)
        h = sum(1 for b in lp.blocks for j in range(blocks[b].start, blocks[b].end) if func.instructions[j].base == "HGMMA")
        print("   loop", lp.header, "blocks", len(lp.blocks), "instr", n, "hgmma", h, "spin", lp.spin)
