import sys, re, tempfile
sys.path.insert(0, "benchmarks")
import sm90_bwd_sass as S
from collections import Counter
from fa4.kernels import AttentionProblem, sm90_bwd
for hd, dq in ((128, "bulk"), (128, "fragment"), (64, "fragment"), (64, "bulk")):
    p = AttentionProblem(4, 2048, 2048, 16, 4, hd, "bf16", False)
    cfg = sm90_bwd.default_config(p).replace(dq_accum=dq)
    with tempfile.TemporaryDirectory() as tmp:
        out = sm90_bwd._compile_all(cfg, p, options=f"--keep-cubin --dump-dir {tmp}", tvm_ffi=False, only=("postprocess",))
        (compiled, _, _), = out.values()
        text = S.disassemble(bytes(compiled.__cubin__))
    ops = [re.sub(r"^\s*/\*[0-9a-f]+\*/\s*", "", l).strip() for l in text.splitlines() if re.match(r"\s*/\*[0-9a-f]{4,}\*/", l)]
    c = Counter(o.split()[0] if not o.startswith("@") else o.split()[1] for o in ops if o)
    main = {k: v for k, v in c.items() if k.split(".")[0] in ("STS", "LDS", "STG", "LDG", "BAR", "BRA", "EXIT")}
    print(hd, dq, cfg.tile_m, "instructions", len(ops), dict(sorted(main.items())))
