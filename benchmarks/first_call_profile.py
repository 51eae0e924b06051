"""Where a fresh process's first `fa4.attention` call spends its time, with the on-disk kernel cache
cold (compile) and then warm (load), one child process each (a development tool, GPU only):

    python benchmarks/first_call_profile.py [--top 25] > first_call.txt

Each child imports torch and makes its inputs first (not counted), then times `import fa4` and the
first call under cProfile, and prints the profile's top entries by cumulative time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap

CHILD = textwrap.dedent("""
    import cProfile, io, pstats, sys, time
    import torch
    q = torch.randn(1, 1024, 32, 128, device="cuda", dtype=torch.float16)
    k = torch.randn(1, 1024, 8, 128, device="cuda", dtype=torch.float16)
    torch.cuda.synchronize()
    profile = cProfile.Profile()
    profile.enable()
    t0 = time.perf_counter()
    import fa4
    fa4.use_config_db(sys.argv[1])
    t1 = time.perf_counter()
    fa4.attention(q, k, k, causal=True)
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(int(sys.argv[2]))
    print(text.getvalue())
    print(f"import fa4: {t1 - t0:.3f} s; first call: {t2 - t1:.3f} s")
""")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    from fa4 import database

    with tempfile.TemporaryDirectory(prefix="fa4-first-call-") as tmp:
        db = os.path.join(tmp, "best.json")
        with open(db, "w") as f:
            json.dump({"schema": database.SCHEMA_VERSION, "entries": []}, f)
        env = {**os.environ, "FA4TUNE_DISK_CACHE": "1", "FA4TUNE_CACHE_DIR": os.path.join(tmp, "kernels")}
        for label in ("cold", "warm"):
            proc = subprocess.run([sys.executable, "-c", CHILD, db, str(args.top)], env=env,
                                  capture_output=True, text=True)
            print(f"===== {label} cache (exit {proc.returncode})")
            print(proc.stdout)
            if proc.returncode:
                print(proc.stderr[-3000:])


if __name__ == "__main__":
    main()
