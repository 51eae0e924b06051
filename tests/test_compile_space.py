"""`fa4tune compile-space`: the verdict on one compiled configuration."""

from click.testing import CliRunner

from fa4tune.cli import main
from fa4tune.compile_space import check_report

GOOD_SM100 = {"outcome": "ok", "report": {
    "smem_bytes": 1000, "spill_stores": 0, "spill_loads": 0,
    "ptx_markers": {"tcgen05.mma": True, "tcgen05.ld": True, "tcgen05.st": True, "cp.async.bulk.tensor": True}}}


def test_a_clean_compile_has_no_problems():
    assert check_report("sm100", 1000, GOOD_SM100) == []


def test_each_disagreement_is_named():
    entry = {**GOOD_SM100, "warnings": ["register spills"],
             "report": {**GOOD_SM100["report"], "smem_bytes": 1024,
                        "ptx_markers": {**GOOD_SM100["report"]["ptx_markers"], "tcgen05.st": False}}}
    problems = check_report("sm100", 1000, entry)
    assert "register spills" in problems
    assert any("tcgen05.st" in p for p in problems)
    assert any("1024 B compiled vs 1000 B modelled" in p for p in problems)


def test_a_failed_compile_is_a_problem():
    assert check_report("sm90", 0, {"outcome": "compile_error", "error": "boom"}) == ["compile_error: boom"]


def test_sm90_needs_wgmma_and_tma():
    entry = {"outcome": "ok", "report": {"smem_bytes": 5, "ptx_markers": {"wgmma": True, "tma_load": False}}}
    assert check_report("sm90", 5, entry) == ["PTX lacks tma_load"]


def test_bad_space_file_is_a_usage_error(tmp_path):
    bad = tmp_path / "sm90.toml"
    bad.write_text("[knobs]\ntile_q = [1]\n")
    result = CliRunner().invoke(main, ["compile-space", "--arch", "sm90", "--space", str(bad)])
    assert result.exit_code == 2 and "unknown knob 'tile_q'" in result.output
