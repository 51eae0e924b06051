import sys, json, time
from fa4.kernels import AttentionProblem, Config
from fa4.kernels import sm90_bwd
cases = [
  (dict(tile_m=80, sdp_swap=True, dq_accum="fragment", pds_stages=2), 128, False),
  (dict(tile_m=64, sdp_swap=True, dq_accum="fragment", pds_stages=2), 128, True),
  (dict(tile_m=128, sdp_swap=True, dq_accum="fragment", pds_stages=2), 64, False),
  (dict(tile_m=64, dq_accum="fragment"), 64, True),
  (dict(tile_m=80, sdp_swap=True, dq_accum="fragment", pds_stages=2, group_split=2), 128, True),
]
for knobs, d, causal in cases[: int(sys.argv[1]) if len(sys.argv) > 1 else None]:
    c = Config.make("sm90_bwd", **knobs)
    p = AttentionProblem(1, 256, 256, 8, 2, d, "bf16", causal)
    t = time.time()
    r = sm90_bwd.compile_report(c, p)
    print(c.label(), d, causal, {k: (v["registers"], v["spill_stores"], v["smem_bytes"]) for k, v in r.items()}, round(time.time()-t,1), flush=True)
