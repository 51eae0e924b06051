"""The CPU compile check the sm90 variant tests share (window/softcap, varlen): a configuration the
model admits compiles without spills or a serialised wgmma, its shared memory is the model's, and the
PTX holds the instructions the kernel is built on."""

from fa4.kernels import default_config, feasible, sm90


def assert_compiles_clean(problem, knobs=None):
    cfg = default_config("sm90", problem)
    if knobs:
        cfg = cfg.replace(**knobs)
    assert feasible(cfg, problem) == [], cfg.label()
    report = sm90.compile_report(cfg, problem)
    assert report["spill_stores"] == 0 and report["spill_loads"] == 0, (cfg.label(), report["registers"])
    assert not report["wgmma_serialized"], cfg.label()
    assert report["smem_bytes"] == sm90.resources(cfg, problem)["smem_bytes"]
    assert all(report["ptx_markers"].values()), report["ptx_markers"]
