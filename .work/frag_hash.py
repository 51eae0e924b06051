import hashlib, tempfile, sys
from fa4.kernels import AttentionProblem, Config, sm90_bwd
sys.path.insert(0, "benchmarks")
from restamp_unchanged_code import sass_hash
from fa4tune.sm100.sass_build import disassemble
for knobs, d in ((dict(tile_m=80, sdp_swap=True, dq_accum="fragment", pds_stages=2), 128),
                 (dict(tile_m=128, sdp_swap=True, dq_accum="fragment", pds_stages=2), 64),
                 (dict(tile_m=64, dq_accum="fragment"), 64)):
    c = Config.make("sm90_bwd", **knobs); p = AttentionProblem(1, 256, 256, 8, 2, d, "bf16", True)
    out = []
    for name in ("main", "postprocess"):
        with tempfile.TemporaryDirectory() as tmp:
            (comp, _, _), = sm90_bwd._compile_all(c, p, options=f"--keep-cubin --dump-dir {tmp}", tvm_ffi=False, only=(name,)).values()
            out.append(hashlib.sha256(disassemble(bytes(comp.__cubin__)).encode()).hexdigest()[:12])
    print(c.label(), d, out)
