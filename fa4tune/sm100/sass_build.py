"""`fa4tune sass`: compile sm100 attention forward kernels for sm_100a on CPU, disassemble, report.

NO BLACKWELL GPU EXISTS HERE: the kernels are compiled on a CPU and never run; the analysis
(`fa4tune.sm100.sass`) reads the generated code, and its throughput estimate is a model.

Ours is compiled through `fa4.kernels.compiling`; the peer (flash-attn-4's sm100 forward) in a
child process, built with the arguments its `interface.py` would choose for the problem (see
`_flash_attn4_kernel_args`). `nvdisasm` comes from the nvidia-cuda-nvdisasm wheel.
"""

from __future__ import annotations

import importlib.util

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from fa4tune.sm100.sass import (EXP2_PER_CLOCK, ISSUE_PER_CLOCK, NOT_RUN_NOTE, SMEM_BYTES_PER_CLOCK,
                                TENSOR_FLOP_PER_CLOCK, summarize)


# ------------------------------------------------------------------------------------------------
# compiling and disassembling

def nvdisasm_path() -> str:
    """nvdisasm from the nvidia-cuda-nvdisasm wheel, else from PATH."""
    try:
        import nvidia  # namespace package of the NVIDIA wheels
        for root in nvidia.__path__:
            for sub in ("cu13", "cuda_nvdisasm", "cu12"):
                candidate = Path(root) / sub / "bin" / "nvdisasm"
                if candidate.exists():
                    return str(candidate)
    except ImportError:
        pass
    found = shutil.which("nvdisasm")
    if not found:
        raise RuntimeError("nvdisasm not found: pip install nvidia-cuda-nvdisasm")
    return found


def disassemble(cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([nvdisasm_path(), "-c", f.name], check=True, capture_output=True,
                              text=True).stdout


# ours: compiled in this process by the family's own compile path
def compile_ours(config, problem) -> bytes:
    from fa4.kernels.compiling import compile_cubin
    return compile_cubin(config, problem)


# the peer: flash-attn-4's sm100 forward, in a child process (its import needs stubs, see below)
def _flash_attn4_kernel_args(problem) -> dict:
    """The constructor arguments flash-attn-4 4.0.0b36's `interface._flash_attn_fwd` picks for a
    dense (no varlen, no split, no mods) problem on a B200 with a CUDA 13 torch, by its own rules:
    128 x 128 tiles; two Q stages when the packed rows exceed one tile; GQA packed when the ratio
    is > 1; the 2-CTA pair for non-causal head dim 128 (not for causal); the static persistent
    scheduler for non-causal; no CLC scheduler (off unless FA_CLC=1); S ping-pong only with one Q
    stage. Checked against the interface by `tests/test_sass.py`."""
    ratio = problem.gqa_ratio
    pack_gqa = ratio > 1
    packed_rows = problem.seqlen_q * (ratio if pack_gqa else 1)
    q_stage = 2 if packed_rows > 128 else 1
    two_cta = (not problem.causal and problem.head_dim == 128 and packed_rows > q_stage * 128
               and (128 % ratio == 0 or not pack_gqa))
    return dict(head_dim=problem.head_dim, head_dim_v=problem.head_dim, qhead_per_kvhead=ratio,
                is_causal=problem.causal, is_local=False, is_split_kv=False, pack_gqa=pack_gqa,
                m_block_size=128, n_block_size=128, q_stage=q_stage,
                is_static_persistent=not problem.causal, use_2cta_instrs=two_cta,
                use_clc_scheduler=False, use_s_ping_pong=False)


_PEER_CHILD = r"""
import json, sys, types
# flash_attn.cute imports quack, whose autotuner imports triton (not installed on this CPU
# machine, and not needed to trace a kernel): stand in for the autotuner module only.
stub = types.ModuleType("quack.autotuner")
stub.autotune = lambda *a, **k: (lambda f: f)
stub.AutotuneConfig = lambda *a, **k: None
sys.modules.setdefault("quack.autotuner", stub)
import cutlass, cutlass.cute as cute
from cutlass.cute.runtime import make_fake_stream, make_fake_tensor
# the static persistent scheduler asks the driver for the SM count at trace time; there is no driver
# here, so the B200's description answers
from fa4.kernels.dsl_internals import answer_hardware_info_from
from fa4.kernels.device import B200
answer_hardware_info_from(B200)
from flash_attn.cute.flash_fwd_sm100 import FlashAttentionForwardSm100

args, dtype, out = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
dt = {"fp16": cutlass.Float16, "bf16": cutlass.BFloat16}[dtype]
d = args["head_dim"]
b, sq, sk, hq, hk = (cute.sym_int() for _ in range(5))
def bshd(s, h):
    stride = tuple(cute.sym_int64(divisibility=8) for _ in range(3)) + (1,)
    return make_fake_tensor(dt, (b, s, h, d), stride=stride, assumed_align=16)
kernel = FlashAttentionForwardSm100(**args)
compiled = cute.compile(kernel, bshd(sq, hq), bshd(sk, hk), bshd(sk, hk), bshd(sq, hq), None,
                        cutlass.Float32(1.0), stream=make_fake_stream(use_tvm_ffi_env_stream=True),
                        options="--gpu-arch sm_100a --keep-cubin --enable-tvm-ffi")
open(out, "wb").write(compiled.__cubin__)
"""


def compile_flash_attn4(problem) -> bytes:
    """flash-attn-4's sm100 forward for `problem`, compiled for sm_100a in a child process."""
    args = _flash_attn4_kernel_args(problem)
    with tempfile.TemporaryDirectory(prefix="fa4tune_peer_") as tmp:
        out = os.path.join(tmp, "peer.cubin")
        env = {**os.environ, "CUTE_DSL_ARCH": "sm_100a"}
        proc = subprocess.run([sys.executable, "-c", _PEER_CHILD, json.dumps(args), problem.dtype, out],
                              capture_output=True, text=True, env=env, cwd=tmp)
        if proc.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"flash-attn-4 compile failed: {proc.stderr[-2000:]}")
        return open(out, "rb").read()


# ------------------------------------------------------------------------------------------------
# one kernel, end to end, and the table

def analyze(kernel: str, problem, config=None) -> dict:
    """Compile (ours: `config` or the default; "flash-attn-4": its interface's choices), disassemble,
    summarise. Raises if the compile fails."""
    if kernel == "ours":
        from fa4.kernels.sm100 import default_config
        from fa4.kernels.sm100.plan import make_plan
        config = config or default_config(problem)
        plan = make_plan(config, problem)
        sass = disassemble(compile_ours(config, problem))
        shape = dict(tile_n=plan.tile_n, head_dim=plan.head_dim, q_stages=plan.q_stages,
                     two_cta=plan.two_cta)
        described = config.to_dict()
    elif kernel == "flash-attn-4":
        args = _flash_attn4_kernel_args(problem)
        sass = disassemble(compile_flash_attn4(problem))
        shape = dict(tile_n=args["n_block_size"], head_dim=args["head_dim"], q_stages=args["q_stage"],
                     two_cta=args["use_2cta_instrs"])
        described = args
    else:
        raise ValueError(f"unknown kernel {kernel!r}: ours or flash-attn-4")
    return {"kernel": kernel, "problem": problem.label(), "causal": problem.causal,
            "config": described, **summarize(sass, **shape)}


TABLE_ROWS = (
    ("softmax loop instructions per block (per loop)", lambda r: " / ".join(
        str(s["instructions"]) for s in r["softmax_steady"])),
    ("  masked-block loop(s)", lambda r: " / ".join(str(s["instructions"]) for s in r["softmax_masked"]) or "-"),
    ("  of which mask instructions", lambda r: " / ".join(
        str(s["mask_instructions"]) for s in r["softmax_masked"]) or "-"),
    ("mask instructions in the unmasked loop", lambda r: " / ".join(
        str(s["mask_instructions"]) for s in r["softmax_steady"])),
    ("instructions per score element", lambda r: " / ".join(
        f"{s['instructions_per_score_element']:.2f}" for s in r["softmax_steady"])),
    ("MUFU.EX2 per 128 elements", lambda r: " / ".join(f"{s['mufu_ex2_per_128']:g}" for s in r["softmax_steady"])),
    ("FFMA / FFMA2 / FADD / FADD2", lambda r: " | ".join(
        f"{s['ffma']}/{s['ffma2']}/{s['fadd']}/{s['fadd2']}" for s in r["softmax_steady"])),
    ("MMA warp: instructions / wait sites per block", lambda r: (
        f"{r['mma']['instructions']:g} / {r['mma']['barrier_waits']:g}" if "mma" in r else "-")),
    ("correction: no-rescale path (loop body)", lambda r: (
        f"{r['correction']['no_rescale_path']} ({r['correction']['body']})" if "correction" in r else "-")),
    ("est. exp unit / tensor floor", lambda r: f"{100 * r['estimate']['exp_vs_floor']:.0f} %"),
    ("est. issue slots / tensor floor", lambda r: (
        f"{100 * r['estimate']['issue_vs_floor_low']:.0f}-{100 * r['estimate']['issue_vs_floor_high']:.0f} %")),
    ("est. shared memory / tensor floor", lambda r: f"{100 * r['estimate']['smem_vs_floor']:.0f} %"),
    ("est. throughput vs tensor floor", lambda r: f"{r['estimate']['throughput_vs_floor']:.2f}"),
)


def format_table(results: list[dict]) -> str:
    """Markdown: one column per analysed kernel."""
    heads = [f"{r['kernel']} {'causal' if r['causal'] else 'full'}" for r in results]
    lines = ["| per KV block of 128 keys (both Q stages) | " + " | ".join(heads) + " |",
             "| --- |" + " --- |" * len(results)]
    for label, fn in TABLE_ROWS:
        cells = []
        for r in results:
            try:
                cells.append(fn(r))
            except (KeyError, ValueError, ZeroDivisionError):
                cells.append("-")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_json_atomic(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as handle:
        json.dump(payload, handle, sort_keys=True, indent=1)
        handle.write("\n")
    os.replace(tmp, path)


def sass_command_factory():
    import click

    @click.command("sass", context_settings={"help_option_names": ["-h", "--help"]})
    @click.option("--causal", "mask", flag_value="causal", help="causal only")
    @click.option("--no-causal", "mask", flag_value="full", help="non-causal only")
    @click.option("--both", "mask", flag_value="both", default=True, help="both (default)")
    @click.option("--seqlen", type=click.IntRange(min=1), default=1024, show_default=True)
    @click.option("--heads", type=click.IntRange(min=1), default=32, show_default=True, help="query heads")
    @click.option("--heads-kv", type=click.IntRange(min=1), default=8, show_default=True, help="KV heads")
    @click.option("--head-dim", type=click.Choice(["64", "128"]), default="128", show_default=True)
    @click.option("--dtype", type=click.Choice(["fp16", "bf16"]), default="fp16", show_default=True)
    @click.option("--set", "overrides", multiple=True, metavar="KNOB=VALUE",
                  help="our configuration: the default for the problem with these knobs changed")
    @click.option("--peer/--no-peer", default=True, show_default=True,
                  help="also compile flash-attn-4's sm100 forward (needs the [peer] extra)")
    @click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table", show_default=True)
    @click.option("--out", "out_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
                  help="also write the JSON (sorted keys) here, e.g. results/sass/base.json")
    def sass_command(mask, seqlen, heads, heads_kv, head_dim, dtype, overrides, peer, fmt, out_path):
        """Compile ours (and flash-attn-4) for sm_100a on CPU, disassemble, count per warp role.

        Compile-time figures only: no Blackwell GPU exists here and the sm100 kernels never ran."""
        from fa4.kernels import AttentionProblem
        from fa4.kernels.sm100 import default_config
        from fa4tune.paths import check_output

        check_output(out_path, "--out")   # before the compiles, not after them
        heads_q = heads
        if peer and importlib.util.find_spec("flash_attn") is None:
            click.echo("fa4tune sass: flash-attn-4 is not installed (pip install -e '.[peer]'): ours only",
                       err=True)
            peer = False
        masks = {"causal": ("causal",), "full": ("full",)}.get(mask, ("full", "causal"))
        results = []
        for mask in masks:
            problem = AttentionProblem(1, seqlen, seqlen, heads_q, heads_kv, int(head_dim), dtype,
                                       causal=mask == "causal")
            config = default_config(problem)
            if overrides:
                config = config.replace(**_parse_overrides(overrides, config))
            click.echo(f"fa4tune sass: {problem.label()}: ours ({config.label()})", err=True)
            results.append(analyze("ours", problem, config))
            if peer:
                click.echo(f"fa4tune sass: {problem.label()}: flash-attn-4", err=True)
                results.append(analyze("flash-attn-4", problem))
        command = "fa4tune sass " + " ".join(
            [{"causal": "--causal", "full": "--no-causal"}.get(mask, "--both")]
            + [f"--seqlen {seqlen} --heads {heads} --heads-kv {heads_kv} --head-dim {head_dim} --dtype {dtype}"]
            + [f"--set {o}" for o in overrides]
            + ([] if peer else ["--no-peer"]) + ([f"--out {out_path}"] if out_path else []))
        payload = {"command": command, "note": NOT_RUN_NOTE, "rates": {
            "tensor_flop_per_clock": TENSOR_FLOP_PER_CLOCK, "exp2_per_clock": EXP2_PER_CLOCK,
            "issue_per_clock_per_sub_partition": ISSUE_PER_CLOCK, "smem_bytes_per_clock": SMEM_BYTES_PER_CLOCK},
            "results": results}
        if out_path:
            write_json_atomic(out_path, payload)
        if fmt == "json":
            click.echo(json.dumps(payload, sort_keys=True, indent=1))
        else:
            click.echo(format_table(results))
            click.echo(f"\n({NOT_RUN_NOTE})")

    return sass_command


def _parse_overrides(overrides, config) -> dict:
    from fa4.kernels.knobs import knob
    values = {}
    for text in overrides:
        name, _, raw = text.partition("=")
        k = knob("sm100", name.strip())
        for choice in k.choices:
            if str(choice).lower() == raw.strip().lower() or (
                    not isinstance(choice, (bool, str)) and _number(raw) == choice):
                values[k.name] = choice
                break
        else:
            raise ValueError(f"{text}: {name} takes one of {list(k.choices)}")
    return values


def _number(raw: str):
    try:
        return float(raw)
    except ValueError:
        return None
