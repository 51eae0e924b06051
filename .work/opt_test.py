import sys, tempfile
sys.path.insert(0, "benchmarks")
import sm90_bwd_sass as S
from collections import Counter
from fa4.kernels import AttentionProblem, Config
from fa4.kernels import sm90_bwd
from fa4tune.sm100.sass import control_flow, kernel_function, parse_sass
from fa4tune.sm100.sass_build import disassemble
extra = sys.argv[1] if len(sys.argv) > 1 else ""
c = Config.make("sm90_bwd", tile_m=80, tile_n=128, q_stages=2, sdp_swap=True, pds_stages=2, dq_accum="fragment")
p = AttentionProblem(4, 2048, 2048, 16, 4, 128, "bf16", False)
with tempfile.TemporaryDirectory() as tmp:
    (compiled, _, _), = sm90_bwd._compile_all(c, p, options=f"{extra} --keep-cubin --dump-dir {tmp}", tvm_ffi=False, only=("main",)).values()
    cub = bytes(compiled.__cubin__)
text = disassemble(cub)
func = kernel_function(parse_sass(text)); blocks, loops = control_flow(func)
loop = max((lp for lp in loops if not lp.spin), key=lambda lp: sum(1 for b in lp.blocks for j in range(blocks[b].start, blocks[b].end) if func.instructions[j].base == "HGMMA"))
path = S.steady_path(func, blocks, loops, loop)
print(len(path), sorted(Counter(i.opcode.split(".")[0] + (".64" if ".64" in i.opcode and i.base.startswith("U") else "") for i in path).items(), key=lambda x: -x[1])[:12])
