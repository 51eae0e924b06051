import sys, json, time
from fa4.kernels import sm90_bwd
from fa4.kernels.knobs import Config
from fa4.kernels.problem import AttentionProblem
prob = AttentionProblem(2, 177, 301, 8, 2, int(sys.argv[1]), sys.argv[2], sys.argv[3] == "causal")
over = dict(a.split("=") for a in sys.argv[4:])
over = {k: (int(v) if v.isdigit() else (v == "True" if v in ("True", "False") else v)) for k, v in over.items()}
cfg = Config.make("sm90_bwd", **over)
for det in (False, True):
    t = time.time()
    r = sm90_bwd.compile_report(cfg, prob, only=("main",), deterministic=det)["main"]
    print(det, {k: r[k] for k in ("registers", "spill_stores", "spill_loads", "smem_bytes", "wgmma_serialized")}, r["ptx_markers"], round(time.time()-t,1))
