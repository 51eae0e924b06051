import sys
sys.path.insert(0, "benchmarks")
import sm90_bwd_sass as S
from fa4.kernels import AttentionProblem, Config, sm90_bwd
from fa4tune.sm100.sass import control_flow, kernel_function, parse_sass
from fa4tune.sm100.sass_build import disassemble
d = int(sys.argv[1]); causal = sys.argv[2] == "causal"
knobs = dict(kv.split("=") for kv in sys.argv[3:])
knobs = {k: (int(v) if v.isdigit() else {"True": True, "False": False}.get(v, v)) for k, v in knobs.items()}
p = AttentionProblem(4, 2048, 2048, 16, 4, d, "bf16", causal)
c = sm90_bwd.default_config(p).replace(**knobs) if knobs else sm90_bwd.default_config(p)
text = disassemble(S.ours_cubin(p, c))
open("/tmp/ours_cur.sass", "w").write(text)
