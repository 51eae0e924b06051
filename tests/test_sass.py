"""The static SASS tool (`fa4tune sass`): parsing, loops, spin waits, role counts, the estimate.

No Blackwell GPU exists here: what is checked is the analysis of code compiled for sm_100a on CPU.
The parser and loop finder run on a small hand-written SASS text (fast, and each test fails if the
analysis is wrong); one compile of our default configuration is disassembled when nvdisasm is present
(the `test` extra installs it), and flash-attn-4's build arguments are held to its interface.
"""

from __future__ import annotations


import pytest

from fa4tune.sm100 import sass, sass_build

# A softmax-like loop (exp2, a TMEM load, FFMA2) whose mbarrier wait retries out of line, after EXIT.
SAMPLE = """
.text.kernel_x:
        /*0000*/                   MOV R1, RZ ;
.L_x_1:
        /*0010*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4+0x50], R12 ;
        /*0020*/              @!P0 BRA `(.L_x_9) ;
.L_x_2:
        /*0030*/                   LDTM.x32 R4, tmem[UR5] ;
        /*0040*/                   ISETP.GE.AND P1, PT, R2, 0x3, PT ;
        /*0050*/                   FSEL R4, R4, -INF , P1 ;
        /*0060*/                   FFMA2 R4, R4.F32x2.HI_LO, R6.F32, R8.F32 ;
        /*0070*/                   MUFU.EX2 R4, R4 ;
        /*0080*/                   MUFU.EX2 R5, R5 ;
        /*0090*/                   FADD2 R10, R4.F32x2.HI_LO, R10.F32x2.HI_LO ;
        /*00a0*/                   SYNCS.ARRIVE.TRANS64.ART0 RZ, [UR4+0x60] ;
        /*00b0*/                   ISETP.NE.AND P2, PT, R3, RZ, PT ;
        /*00c0*/               @P2 BRA `(.L_x_1) ;
        /*00d0*/                   EXIT ;
.L_x_9:
        /*00e0*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4+0x50], R12 ;
        /*00f0*/              @!P0 NANOSLEEP.SYNCS 0x989680 ;
        /*0100*/              @!P0 BRA `(.L_x_9) ;
        /*0110*/                   BRA `(.L_x_2) ;
"""


def test_parse_and_loops_leave_the_spin_retry_out():
    func = sass.kernel_function(sass.parse_sass(SAMPLE))
    assert len(func.instructions) == 18
    assert func.instructions[2].predicate == "@!P0" and func.instructions[2].target == ".L_x_9"
    blocks, loops = sass.control_flow(func)
    spins = [l for l in loops if l.spin]
    mains = [l for l in loops if not l.spin]
    # the retry block branches back into the loop but does not make a loop of the code it returns to
    assert len(spins) == 1 and len(mains) == 1
    main, nested = sass._loop_instructions(func, blocks, mains[0], loops)
    counts = sass.count(main)
    assert counts["instructions"] == 12  # header wait .. back branch, without the 4 retry instructions
    assert counts["mufu_ex2"] == 2 and counts["ffma2"] == 1 and counts["fadd2"] == 1
    assert counts["barrier_waits"] == 1 and counts["barrier_arrives"] == 1
    assert counts["tmem_ld_columns"] == 32
    # the mask: the FSEL to -INF and the compare that feeds it, not the loop's own compare
    assert counts["mask"] == 2


def test_role_loops_normalise_to_a_kv_block():
    text = SAMPLE.replace("MUFU.EX2 R5, R5 ;", "MUFU.EX2 R5, R5 ;\n" + "\n".join(
        f"        /*{0x80 + i:04x}*/                   MUFU.EX2 R5, R5 ;" for i in range(1, 16)))
    # 17 exp2 and 32 S columns per iteration: a softmax loop; with tile_n=32 one block per iteration
    (rep,) = sass.role_loops(text, tile_n=32, head_dim=128, q_stages=1)
    assert rep.role == "softmax" and rep.blocks_per_iteration == 1.0
    assert rep.body["mufu_ex2"] == 17 and rep.fast_path == rep.body["instructions"]


def test_static_estimate_against_the_tensor_floor():
    est = sass.static_estimate(softmax_per_block=[512], mufu_per_block=128, correction_per_block=32,
                               mma_per_block=256, tile_n=128, head_dim=128, q_stages=2, two_cta=False)
    # 4 GEMMs of 128x128x128 at 8192 FLOP/clock
    assert est["tensor_floor_clocks"] == 2048
    assert est["exp_clocks"] == 2 * 128 * 128 / 16
    assert est["issue_clocks_low"] == 2 * 512 + 32 and est["issue_clocks_high"] == 2 * 512 + 32 + 256
    # Q + K + V per stage, 32 KiB each, at 128 B/clock; a 2-CTA pair halves K and V
    assert est["smem_clocks"] == 2 * 3 * 32768 / 128
    pair = sass.static_estimate(softmax_per_block=[512], mufu_per_block=128, correction_per_block=32,
                                mma_per_block=256, tile_n=128, head_dim=128, q_stages=2, two_cta=True)
    assert pair["smem_clocks"] == 2 * 2 * 32768 / 128
    assert est["throughput_vs_floor"] == round(2048 / max(2048, 2 * 128 * 128 / 16, 2 * 512 + 288), 3)


def test_flash_attn4_arguments_follow_its_interface():
    from fa4.kernels import AttentionProblem
    base = AttentionProblem(1, 1024, 1024, 32, 8, 128)
    full = sass_build._flash_attn4_kernel_args(base)
    causal = sass_build._flash_attn4_kernel_args(AttentionProblem(1, 1024, 1024, 32, 8, 128, causal=True))
    assert full["q_stage"] == 2 and full["pack_gqa"] and full["qhead_per_kvhead"] == 4
    assert full["use_2cta_instrs"] and full["is_static_persistent"]
    assert not causal["use_2cta_instrs"] and not causal["is_static_persistent"]
    # one packed tile: a single Q stage and no pair
    small = sass_build._flash_attn4_kernel_args(AttentionProblem(1, 16, 1024, 8, 8, 128))
    assert small["q_stage"] == 1 and not small["use_2cta_instrs"]
    import importlib.util
    import pathlib
    spec = importlib.util.find_spec("flash_attn")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("flash-attn-4 not installed (the [peer] extra)")
    # read, not imported: importing flash_attn.cute needs triton
    source = (pathlib.Path(list(spec.submodule_search_locations)[0]) / "cute" / "interface.py").read_text()
    # the rules the arguments copy: if the interface changes them, this test says so
    assert "q_stage = 2 if seqlen_q_packgqa > tile_m and head_dim_v != 256 else 1" in source
    assert "not causal\n                and not local" in source


def _has_nvdisasm() -> bool:
    try:
        sass_build.nvdisasm_path()
        return True
    except RuntimeError:
        return False


@pytest.mark.skipif(not _has_nvdisasm(), reason="nvdisasm missing (pip install nvidia-cuda-nvdisasm)")
def test_our_default_compiles_and_its_roles_are_found():
    pytest.importorskip("cutlass")
    from fa4.kernels import AttentionProblem
    problem = AttentionProblem(1, 1024, 1024, 32, 8, 128)
    result = sass_build.analyze("ours", problem)
    steady = result["softmax_steady"]
    assert len(steady) == 2  # one loop per softmax warpgroup (Q stage)
    for loop in steady:
        assert loop["mufu_ex2_per_128"] > 0 and loop["instructions"] > 128
        assert loop["mask_instructions"] == 0, "the unmasked steady-state loop applies a mask"
        assert loop["ffma2"] >= 64 and loop["fadd2"] >= 32  # packed exp2 argument and partial sums
    assert result["mma"]["tcgen05_mma"] == 32  # 4 GEMMs x 8 K-steps per KV block
    assert 0 < result["estimate"]["throughput_vs_floor"] <= 1


def test_keep_mask_words_count_as_mask_work():
    # R2P moves a keep-mask word into P0-P6; the FSELs that read those predicates are the mask
    text = """
.text.kernel_m:
        /*0000*/                   SHF.R.U32.HI R36, RZ, R3, R36 ;
        /*0010*/                   R2P PR, R36, 0x7f ;
        /*0020*/                   FSEL R4, R4, -INF , P0 ;
        /*0030*/                   FSEL R5, R5, -INF , P1 ;
        /*0040*/                   R2P PR, R37, 0x7f ;
        /*0050*/                   FMNMX R6, R4, R5, !PT ;
        /*0060*/                   EXIT ;
"""
    instrs = sass.kernel_function(sass.parse_sass(text)).instructions
    assert sass.count(instrs)["mask"] == 4
    # without a mask FSEL an R2P is something else
    assert sass.count([i for i in instrs if i.base != "FSEL"])["mask"] == 0


@pytest.mark.skipif(not _has_nvdisasm(), reason="nvdisasm missing (pip install nvidia-cuda-nvdisasm)")
def test_causal_masked_loop_uses_keep_words():
    """The diagonal blocks: about one instruction of mask work per score element (the keep-mask's
    FSEL, plus its R2P moves), not a compare and a select per element as before (257 of 769)."""
    pytest.importorskip("cutlass")
    from fa4.kernels import AttentionProblem
    problem = AttentionProblem(1, 1024, 1024, 32, 8, 128, causal=True)
    result = sass_build.analyze("ours", problem)
    assert len(result["softmax_masked"]) == 2
    for loop in result["softmax_masked"]:
        assert 128 <= loop["mask_instructions"] <= 160, loop
    assert all(s["mask_instructions"] == 0 for s in result["softmax_steady"])


@pytest.mark.skipif(not _has_nvdisasm(), reason="nvdisasm missing (pip install nvidia-cuda-nvdisasm)")
def test_two_cta_is_a_cluster_pair_in_the_sass():
    """two_cta compiles to the pair's instructions: 2-CTA MMAs issued by the leader, commits
    multicast to both CTAs, 2-CTA TMA loads, cluster barriers; the estimate halves the K/V
    shared-memory reads per CTA."""
    pytest.importorskip("cutlass")
    import re
    from fa4.kernels import AttentionProblem
    from fa4.kernels.sm100 import default_config
    from fa4.kernels.sm100 import compile_report
    problem = AttentionProblem(1, 1024, 1024, 32, 8, 128)
    config = default_config(problem).replace(two_cta=True)
    rep = compile_report(config, problem)
    assert rep["spill_stores"] == 0 and rep["smem_bytes"] == rep["smem_model_bytes"], rep
    text = sass_build.disassemble(sass_build.compile_ours(config, problem))
    ops = re.findall(r"\b(UTCHMMA\S*|UTCBAR\S*|UTMALDG\S*|UCGABAR_\w+)", text)
    # one KV block per MMA-loop iteration: two Q stages x (8 + 8) K-steps, every one cta_group::2
    assert ops.count("UTCHMMA.2CTA") == 32 and "UTCHMMA" not in ops, sorted(set(ops))
    assert all(op.endswith(".2CTA") for op in ops if op.startswith("UTMALDG")), sorted(set(ops))
    assert "UTCBAR.2CTA.MULTICAST" in ops and "UCGABAR_WAIT" in ops
    pair = sass.summarize(text, tile_n=128, head_dim=128, q_stages=2, two_cta=True)
    assert pair["mma"]["tcgen05_mma"] == 32
    single = sass.static_estimate(softmax_per_block=[500], mufu_per_block=113, correction_per_block=28,
                                  mma_per_block=400, tile_n=128, head_dim=128, q_stages=2,
                                  two_cta=False)
    assert pair["estimate"]["smem_vs_floor"] < single["smem_vs_floor"]


def test_the_peers_hardware_query_answers_from_the_device_description(monkeypatch):
    """flash-attn-4's persistent scheduler asks the DSL's HardwareInfo for the SM count while tracing;
    `fa4tune sass` answers from the B200's description (`fa4.kernels.dsl_internals`). A DSL whose class loses
    either method fails here, not in a peer compile that silently traces for another grid."""
    cutlass_utils = pytest.importorskip("cutlass.utils")
    real = cutlass_utils.HardwareInfo
    for name in ("get_device_multiprocessor_count", "get_max_active_clusters"):
        assert callable(getattr(real, name, None)), name
    monkeypatch.setattr(cutlass_utils, "HardwareInfo", real)   # restored after the test
    from fa4.kernels.dsl_internals import answer_hardware_info_from
    from fa4.kernels.device import B200

    answer_hardware_info_from(B200)
    info = cutlass_utils.HardwareInfo()
    assert info.get_device_multiprocessor_count() == 148 and info.get_max_active_clusters(2) == 74


@pytest.mark.skipif(not _has_nvdisasm(), reason="nvdisasm missing (pip install nvidia-cuda-nvdisasm)")
def test_sass_without_flash_attn_4_runs_ours_and_says_so(monkeypatch, tmp_path):
    """`fa4tune sass` on a machine without the [peer] extra: ours only, with a note, not a traceback."""
    pytest.importorskip("cutlass")
    import importlib.util
    import json

    from click.testing import CliRunner

    from fa4tune import cli

    real = importlib.util.find_spec
    monkeypatch.setattr(sass_build.importlib.util, "find_spec",
                        lambda name, *a: None if name == "flash_attn" else real(name, *a))
    out = tmp_path / "sass.json"
    result = CliRunner().invoke(cli.main, ["sass", "--no-causal", "--seqlen", "256", "--heads", "4",
                                           "--heads-kv", "2", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "flash-attn-4 is not installed" in result.stderr
    saved = json.loads(out.read_text())
    assert len(saved["results"]) == 1
    assert "--no-causal" in saved["command"] and "--heads 4 --heads-kv 2" in saved["command"]
