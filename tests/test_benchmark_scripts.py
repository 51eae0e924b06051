"""The benchmark scripts import what they use: a renamed or moved harness module breaks them here, on
CPU, rather than on the H200 where a broken script costs device time."""

from __future__ import annotations

import contextlib
import importlib.util
import io
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).resolve().parents[1] / "benchmarks").glob("*.py"))


def test_there_are_scripts():
    assert SCRIPTS


@pytest.mark.parametrize("path", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_script_imports(path):
    spec = importlib.util.spec_from_file_location(f"benchmark_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # module level only: `main()` runs under __main__
    assert callable(getattr(module, "main", None))


def test_the_cpu_fast_path_bench_runs_every_row(tmp_path):
    """bench_fastpath_cpu.py patches the runtime's own modules (the kernel family, device facts): it
    runs whole here, in a subprocess, so a runtime change that breaks one of its rows shows on CPU."""
    import json
    import os
    import subprocess
    import sys

    out = tmp_path / "rows.json"
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_fastpath_cpu.py"
    # the script keeps its stand-in database in a temporary folder of its own: this test's, not the machine's
    done = subprocess.run([sys.executable, str(script), "--number", "20", "--repeat", "2", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["name"] for r in rows if "error" in r] == []
    assert rows[0]["note"] == "as shipped"  # the call took the kernel path


def _load(name: str):
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_backward_configuration_bench_names_and_tabulates_configurations():
    """benchmarks/sm90_bwd_configs.py on CPU: labels parse back to their configurations, the default
    set is what the model admits at every timed head dim, and the table puts each time beside
    flash-attn-4's (a failing configuration shows its outcome, not a time)."""
    from fa4.kernels import AttentionProblem, Config, sm90_bwd

    bench = _load("sm90_bwd_configs")
    every = Config.make("sm90_bwd", sdp_swap=True, dq_accum="bulk", pds_stages=2)
    assert bench.parse_config(every.label()) == every
    assert bench.parse_config("default") == Config.make("sm90_bwd")
    assert bench.parse_config("sdp_swap=on dq_accum=bulk pds_stages=2") == every
    with pytest.raises(ValueError, match="dq_accum takes one of"):
        bench.parse_config("dq_accum=fast")
    admitted = bench.admitted_configs(bench.SHAPES)
    assert Config.make("sm90_bwd") in admitted and every in admitted
    assert all(c.tile_n == 128 for c in admitted if c.sdp_swap)
    kinds = [bench._kind(shape) for shape in bench.SHAPES]   # a shape's head dim, mask and heads
    assert all(any(not sm90_bwd.reasons(c, p) for p in kinds) for c in admitted)
    # flash-attn-4's head-dim-64 tile is admitted there only, and timed there only
    d64_tile = Config.make("sm90_bwd", tile_m=128, sdp_swap=True)
    assert d64_tile in admitted and sm90_bwd.reasons(d64_tile, AttentionProblem(1, 128, 128, 4, 2, 128, "bf16", True))
    # a split group is judged at the shape's GQA ratio: 4 parts of GQA 4, none of MHA
    split4 = Config.make("sm90_bwd", group_split=4, sdp_swap=True)
    assert split4 in admitted and not sm90_bwd.reasons(split4, bench._kind((4, 2048, 16, 4, 128, True)))
    assert sm90_bwd.reasons(split4, bench._kind((8, 1024, 16, 16, 64, False)))
    # --space: a space file's configurations instead (the fast space holds one P/dS depth, S^T swapped)
    fast = bench.admitted_configs(bench.SHAPES, Path(__file__).resolve().parents[1] / "benchmarks"
                                  / "sm90_bwd_fast_space.toml")
    assert fast and set(fast) < set(admitted) and all(c.sdp_swap and c.pds_stages == 2 for c in fast)
    # "rule" is each shape's default configuration (what an untuned call runs), pairs over it
    small, wide = (1, 1024, 32, 8, 128, True), (16, 1024, 32, 8, 128, True)
    assert bench.config_for("rule", small) == sm90_bwd.default_config(
        AttentionProblem(1, 1024, 1024, 32, 8, 128, "bf16", True))
    assert bench.config_for("rule", small).group_split > 1 and bench.config_for("rule", wide).group_split == 1
    assert bench.config_for("rule group_split=1", small) == bench.config_for("rule", small).replace(group_split=1)
    assert bench.config_for(every.label(), small) == every
    rows = [{"shape": "s", "kernel": "some_peer", "config": "Some Peer", "outcome": "ok", "us": 100.0},
            {"shape": "s", "kernel": bench.OURS, "config": "a", "outcome": "ok", "us": 150.0},
            {"shape": "s", "kernel": bench.OURS, "config": "b", "outcome": "timeout", "reason": "hang"}]
    # what a child prints is what the parent reads back (a mismatch once turned every row into a fault)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        print("a compiler's chatter")
        bench.print_rows(rows)
    assert bench.rows_from_child(printed.getvalue()) == rows and bench.rows_from_child("chatter\n") is None
    table = bench.format_table(rows)
    assert "| a | 150.0 (1.50x) |" in table and "| b | timeout |" in table and "| Some Peer (us) | 100.0 |" in table
    # the peer timed beside ours comes from the registry of backends
    from fa4.backward import peers_with_backward
    assert bench.peer_with_backward() in (peers_with_backward() or (None,))


def test_the_window_cost_summary_puts_each_window_beside_its_unwindowed_shape():
    """benchmarks/window_cost.py: a windowed row's visible pairs and its time per pair against the
    same shape without a window, per implementation (a kernel that skips the blocks outside the window
    sits near 1.0; one that only masks them grows as the window narrows)."""
    bench = _load("window_cost")
    base = dict(batch=1, seqlen_q=16384, seqlen_k=16384, heads_q=32, heads_kv=8, head_dim=128, dtype="bf16",
                causal=True, return_lse=False)

    def row(variant, us, window=None):
        problem = {**base, **({"window": list(window)} if window else {})}
        return {"variant": variant, "outcome": "ok", "us": us, "problem": problem}

    # a 1024-key causal window over 16384 rows: rows 0-1023 see i + 1 keys, the rest 1024
    share = (1024 * 1025 // 2 + 15360 * 1024) / (16384 * 16384 // 2)
    rows = [row("tuned", 1000.0), row("tuned", 1000.0 * share * 1.05, (1023, 0)),
            row("flash_attn_4", 1100.0), row("flash_attn_4", 1100.0, (1023, 0)),   # masks, skips nothing
            row("default", 5.0, (1023, 0)),                                        # not the variant asked
            {"variant": "tuned", "outcome": "wrong", "us": None, "problem": base}]
    entries = {e["implementation"]: e for e in bench.window_rows({"rows": rows}, "tuned")}
    assert set(entries) == {"tuned", "flash_attn_4"}
    ours, peer = entries["tuned"], entries["flash_attn_4"]
    assert ours["pairs_vs_plain"] == pytest.approx(share)
    assert ours["per_pair_vs_plain"] == pytest.approx(1.05)
    assert peer["per_pair_vs_plain"] == pytest.approx(1 / share)
    table = bench.format_table(list(entries.values()))
    assert "| tuned | " in table and "1.05 |" in table


def test_the_training_pass_summary_divides_by_the_fastest_peer_per_shape():
    """benchmarks/training_pass.py --summary: fa4's time over the fastest peer's of each shape, a peer
    with an error left out, a shape where fa4 has no time left out of the geomean."""
    bench = _load("training_pass")
    rows = [{"shape": "a", "fa4": {"bwd_us": 90.0, "fwdbwd_us": 120.0},
             "flash_attn_4": {"bwd_us": 100.0, "fwdbwd_us": 100.0},
             "sdpa_cudnn": {"bwd_us": 150.0, "fwdbwd_us": 150.0}},
            {"shape": "b", "fa4": {"bwd_us": 110.0}, "flash_attn_4": {"error": "refused"},
             "sdpa_cudnn": {"bwd_us": 100.0}},
            {"shape": "c", "fa4": {"error": "compile"}, "flash_attn_4": {"bwd_us": 100.0}}]
    assert bench.ratios(rows, "bwd_us") == pytest.approx({"a": 0.9, "b": 1.1})
    assert bench.ratios(rows, "fwdbwd_us") == pytest.approx({"a": 1.2})
    text = bench.summary(rows)
    assert "backward alone: fa4 / fastest peer geomean 0.995, worst 1.100 (b), at most 1.00 on 1 of 2" in text
    assert "forward + backward: fa4 / fastest peer geomean 1.200, worst 1.200 (a), at most 1.00 on 0 of 1" in text


def test_the_training_pass_can_change_the_backwards_default(monkeypatch):
    """benchmarks/training_pass.py --set KNOB=VALUE: our backward's default with the knob changed where
    the model admits it, the default where it does not; an unknown value is refused by name."""
    from fa4.kernels import AttentionProblem, sm90_bwd

    bench = _load("training_pass")
    monkeypatch.setattr(sm90_bwd, "default_config", sm90_bwd.default_config)   # restored after the test
    bench.override_default(bench.parse_overrides(["dq_accum=fragment", "tile_m=64"]))
    gqa = AttentionProblem(1, 1024, 1024, 32, 8, 128, "bf16", True)
    config = sm90_bwd.default_config(gqa)
    assert (config.dq_accum, config.tile_m) == ("fragment", 64)
    # group_split 8 at GQA 4 is refused (a part would hold no query head): the default stays
    bench.override_default(bench.parse_overrides(["group_split=8"]))
    assert sm90_bwd.default_config(gqa).group_split != 8
    with pytest.raises(SystemExit, match="dq_accum takes one of"):
        bench.parse_overrides(["dq_accum=fast"])


def test_the_training_pass_times_the_deterministic_backward_when_asked(monkeypatch, tmp_path):
    """benchmarks/training_pass.py --deterministic: the harness's fa4.attention row runs with
    deterministic=True (what it calls is looked up at call time)."""
    import fa4

    bench = _load("training_pass")
    monkeypatch.setattr(fa4, "attention", fa4.attention)   # restored after the test
    seen = []
    monkeypatch.setattr(bench, "measure", lambda problems, names: seen.append(fa4.attention) or [])
    shapes = tmp_path / "one.toml"
    shapes.write_text('[[problem]]\nbatch = 1\nseqlen = 128\nheads_q = 4\nheads_kv = 2\nhead_dim = 64\n'
                      'dtype = "bf16"\ncausal = true\n')
    bench.main(["--shapes-file", str(shapes), "--peers", "", "--deterministic"])
    assert seen[0].keywords == {"deterministic": True}


def test_the_stall_regions_split_samples_by_loop():
    """benchmarks/ncu_stall_regions.py: a source-page CSV's stall samples summed per innermost wgmma
    loop, other loops and code outside loops; columns found by name, preamble lines skipped."""
    regions = _load("ncu_stall_regions")
    text = "\n".join([
        '==PROF== a preamble line',
        '"# Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
        '"stall_short_scoreboard"',
        '"0x0000","MOV R1, c[0x0][0x28] ;","5","4","0"',
        '"0x0010","SYNCS.PHASECHK.TRANS64 P0, [UR4], R2 ;","30","30","0"',
        '"0x0020","@!P0 BRA 0x10 ;","2","2","0"',
        '"0x0030","HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], RZ ;","40","30","0"',
        '"0x0040","LDS.64 R4, [R5] ;","20","20","18"',
        '"0x0050","@P1 BRA 0x30 ;","3","1","0"',
        '"0x0060","EXIT ;","0","0","0"',
    ])
    instructions = regions.read_source_csv(text)
    assert [i.address for i in instructions] == [0, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60]
    assert regions.loops(instructions) == [(0x10, 0x20), (0x30, 0x50)]
    split = regions.regions(instructions)
    assert split == {"outside loops": 5.0, "other loops": 32.0, "wgmma loop 0x30-0x50": 63.0}
    table = regions.report("k", instructions, top=3).splitlines()
    assert "HGMMA" in table[-3] and "LDS.64" in table[-1] and "stall_short_scoreboard 18" in table[-1]
    assert "no backward branch" not in "\n".join(table)
    # no loop found (branch targets printed as labels, say): the report says so
    straight = [i for i in instructions if "BRA" not in i.text]
    assert "no backward branch found" in regions.report("k", straight, top=1)
    with pytest.raises(ValueError, match="not an `ncu --page source --csv` export"):
        regions.read_source_csv("a,b\n1,2")


def test_the_peer_ratio_bar_counts_a_problem_ours_did_not_run_as_a_miss():
    """benchmarks/peer_ratio.py: our variant over the fastest named peer per problem; a problem no peer
    ran is left out, one our variant did not run fails the bar (a bench that tuned nothing cannot pass)."""
    bench = _load("peer_ratio")

    def row(shape, variant, us, outcome="ok"):
        return {"shape": shape, "variant": variant, "us": us, "outcome": outcome}

    rows = [row("a", "tuned", 90.0), row("a", "flash_attn_4", 100.0), row("a", "sdpa_cudnn", 80.0),
            row("b", "tuned", 45.0), row("b", "flash_attn_4", 50.0),
            row("c", "tuned", 10.0), row("c", "flash_attn_4", None, "launch_error")]
    entries = bench.ratios(rows, "tuned", ["flash_attn_4"])
    assert [e["ratio"] for e in entries] == [pytest.approx(0.9), pytest.approx(0.9), None]
    table, holds = bench.summarise(entries, 1.0, 0.95, "tuned")
    assert holds and "at most 1.00 on 2 of 2" in table and "no peer ran on 1: c" in table
    # with cuDNN named too, problem a is 90 / 80: past the bar
    table, holds = bench.summarise(bench.ratios(rows, "tuned", ["flash_attn_4", "sdpa_cudnn"]), 1.0, 0.95, "tuned")
    assert not holds and "a (1.125)" in table
    # no tuned row where the peer ran: a miss, not a problem left out
    rows.append(row("d", "tuned", None, "missing"))
    rows.append(row("d", "flash_attn_4", 30.0))
    table, holds = bench.summarise(bench.ratios(rows, "tuned", ["flash_attn_4"]), 1.0, 0.95, "tuned")
    assert not holds and "d (ours: missing)" in table
