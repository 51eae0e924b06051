import sys, os
from fa4.kernels import sm90_bwd
from fa4.kernels.knobs import Config
from fa4.kernels.problem import AttentionProblem
prob = AttentionProblem(2, 177, 301, 8, 2, int(sys.argv[1]), sys.argv[2], sys.argv[3] == "causal")
over = dict(a.split("=") for a in sys.argv[4:])
over = {k: (int(v) if v.isdigit() else (v == "True" if v in ("True", "False") else v)) for k, v in over.items()}
cfg = Config.make("sm90_bwd", **over)
r = sm90_bwd.compile_report(cfg, prob, only=("preprocess", "main"), deterministic=os.environ.get("DET") == "1")
for k, v in r.items():
    print(k, {x: v[x] for x in ("registers", "spill_stores", "spill_loads", "smem_bytes")}, v["ptx_markers"]["griddepcontrol"], v["ptx_markers"]["turns"])
