import sys
sys.path.insert(0, "tests")
import test_sm90_bwd_compile as T
from fa4.kernels import Config
for d, dt, causal in [(128, "bf16", False), (128, "fp16", True), (128, "bf16", True)]:
    p = T._problem(d, dt, causal=causal)
    for q in (1, 2):
      for pds in (1, 2):
        c = Config.make("sm90_bwd", tile_m=64, tile_n=128, q_stages=q, dq_accum="bulk", sdp_swap=False, scheduler="single", pds_stages=pds, group_split=1)
        r = T._MAIN_REPORT(c, p)["main"]
        print(d, dt, causal, q, pds, r["registers"], r["spill_stores"], r["spill_loads"], flush=True)
