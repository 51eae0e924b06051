import sys, os, multiprocessing, functools, json
sys.path.insert(0, "tests")
from concurrent.futures import ProcessPoolExecutor
import test_sm90_bwd_compile as T
from fa4.kernels import sm90_bwd
def main():
    out = {}
    for problem in T.SPACE_KINDS:
        configs = [c for c in T._whole_space_to_compile() if not sm90_bwd.reasons(c, problem)]
        with ProcessPoolExecutor(max_workers=2, mp_context=multiprocessing.get_context("spawn")) as pool:
            reports = list(pool.map(T._MAIN_REPORT, configs, [problem] * len(configs)))
        bad = [(c.label(), r["main"]["spill_stores"], r["main"]["spill_loads"], r["main"]["wgmma_serialized"]) for c, r in zip(configs, reports)
               if r["main"]["spill_stores"] or r["main"]["spill_loads"] or r["main"]["wgmma_serialized"]]
        print(T._case_id(problem), len(configs), "admitted;", len(bad), "broken", flush=True)
        for b in bad: print("   ", b, flush=True)
if __name__ == "__main__":
    main()
