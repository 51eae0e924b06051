import sys, itertools, multiprocessing
sys.path.insert(0, "tests")
from concurrent.futures import ProcessPoolExecutor
import test_sm90_bwd_compile as T
from fa4.kernels import Config, sm90_bwd
def main():
    jobs = []
    for causal in (True, False):
        p = T._problem(128, "bf16", causal=causal)
        for q, pds, gs, sched, dq in itertools.product((1, 2), (1, 2), (1, 2), ("single", "sectioned_lpt"), ("bulk", "atomic")):
            c = Config.make("sm90_bwd", tile_m=64, tile_n=128, q_stages=q, dq_accum=dq, sdp_swap=False, scheduler=sched, pds_stages=pds, group_split=gs)
            jobs.append((c, p))
    with ProcessPoolExecutor(max_workers=2, mp_context=multiprocessing.get_context("spawn")) as pool:
        reps = list(pool.map(T._MAIN_REPORT, [j[0] for j in jobs], [j[1] for j in jobs]))
    for (c, p), r in zip(jobs, reps):
        r = r["main"]
        print(p.causal, c.label(), "spill", r["spill_stores"], r["spill_loads"], "refused" if sm90_bwd.reasons(c, p) else "admitted", flush=True)
if __name__ == "__main__":
    main()
