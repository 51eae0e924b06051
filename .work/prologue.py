import sys, re
sys.path.insert(0, "benchmarks"); sys.path.insert(0, "/tmp/fa4peer")
import sm90_bwd_sass as S
from fa4.kernels import AttentionProblem, sm90_bwd
p = AttentionProblem(8, 512, 512, 16, 16, 64, "bf16", False)
for name, text in (("ours", S.disassemble(S.ours_cubin(p, sm90_bwd.default_config(p)))),
                   ("fa4", S.disassemble(S.flash_attn4_cubin(p)))):
    lines = [l for l in text.splitlines() if re.match(r"\s*/\*[0-9a-f]{4,}\*/", l)]
    ops = [re.sub(r"^\s*/\*[0-9a-f]+\*/\s*", "", l).strip() for l in lines]
    first = {}
    for i, o in enumerate(ops):
        for key in ("UTMALDG", "HGMMA", "ACQBULK", "SYNCS.PHASECHK", "BAR.SYNC", "IMAD.HI", "I2F", "MUFU.RCP", "S2R", "LDC", "UTMASTG", "UTMAREDG", "UBLKRED", "EXIT"):
            if key in o and key not in first:
                first[key] = i
    print(name, "instructions", len(ops), {k: v for k, v in sorted(first.items(), key=lambda kv: kv[1])})
    n = first.get("UTMALDG", 0)
    print("  before first UTMALDG:", n, "MUFU.RCP", sum("MUFU.RCP" in o for o in ops[:n]), "I2F", sum(o.startswith("I2F") or " I2F" in o for o in ops[:n]), "LDC", sum("LDC" in o for o in ops[:n]))
