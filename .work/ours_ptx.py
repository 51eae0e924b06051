import sys, os, shutil
sys.path.insert(0, "benchmarks")
from fa4.kernels import AttentionProblem, Config, sm90_bwd
d = int(sys.argv[1]); causal = sys.argv[2] == "causal"
knobs = dict(kv.split("=") for kv in sys.argv[3:])
knobs = {k: (int(v) if v.isdigit() else v) for k, v in knobs.items()}
c = Config.make("sm90_bwd", **{**dict(tile_m=80, tile_n=128, q_stages=2, sdp_swap=True, pds_stages=2, dq_accum="bulk"), **knobs})
p = AttentionProblem(4, 2048, 2048, 16, 4, d, "bf16", causal)
out = "/tmp/oursdump"; shutil.rmtree(out, ignore_errors=True); os.makedirs(out)
sm90_bwd._compile_all(c, p, options=f"--keep-cubin --keep-ptx --dump-dir {out}", tvm_ffi=False, only=("main",))
print(os.listdir(out))
