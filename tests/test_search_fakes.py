"""CPU stand-ins injected by the search tests (no tests here): a kernel API model and an evaluator.

The search runs them exactly as it runs the real ones: the kernel API in the parent process
(`SearchSettings.kernel_api = "test_search_fakes"`), the evaluator in spawned worker processes
(`SearchSettings.evaluator = "test_search_fakes:FakeEvaluator"`). Nothing here touches CUDA.

The fake kernel: sm90 configurations with tile_m * tile_n > 128 * 160 are "infeasible" (a stand-in
for the shared-memory budget), pv_operand "ss" with tile_n >= 176 fails to compile, and the time is a
smooth function of the knobs with its minimum away from the default, so a search has something to find.
"""

from __future__ import annotations

import os
import signal
import time

from fa4.kernels import AttentionProblem, Config
from fa4.kernels import family as real_family

FAKE_FINGERPRINT_ENV = "FA4TUNE_FAKE_FINGERPRINT"
FAKE_COMPILE_S_ENV = "FA4TUNE_FAKE_COMPILE_S"


# ---- kernel API model (parent process) ----------------------------------------------------------

def feasible(config: Config, problem: AttentionProblem, device=None) -> list[str]:
    reasons = []
    if config.tile_m * config.tile_n > 128 * 160:
        reasons.append(f"shared memory {config.tile_m * config.tile_n * 12} B exceeds 232448 B")
    if problem.head_dim > 256:
        reasons.append("head_dim > 256")
    return reasons


def default_config(arch: str, problem: AttentionProblem, device=None) -> Config:
    return Config.make(arch)


def compile_key(config: Config, problem: AttentionProblem, device=None) -> tuple:
    return (config.arch, config.codegen_items(), (problem.head_dim, problem.dtype, problem.causal))


class _FakeFamily:
    def __init__(self, arch: str):
        self.PTX_MARKERS = real_family(arch).PTX_MARKERS

    @staticmethod
    def resources(config: Config, problem: AttentionProblem) -> dict:
        return {"smem_bytes": config.tile_m * config.tile_n * 12}


def family(arch: str) -> _FakeFamily:
    return _FakeFamily(arch)


def kernel_fingerprint(arch: str) -> str:
    return os.environ.get(FAKE_FINGERPRINT_ENV, "fake-fingerprint-1")


def source_fingerprint(arch: str) -> str:
    return "fake-source-1"


def toolchain() -> dict:
    return {"fake-dsl": "1.0"}


def fake_us(config: dict) -> float:
    us = 30.0
    us += abs(config["tile_n"] - 112) / 16.0
    us += {64: 6.0, 128: 0.0, 192: 3.0}[config["tile_m"]]
    us += {2: 1.0, 3: 0.0, 4: 0.5}[config["kv_stages"]]
    us += 0.0 if config["softmax_overlap"] else 2.0
    us += {"single": 1.5, "single_lpt": 1.0, "static": 0.5, "lpt": 0.0}[config["scheduler"]]
    us += 0.0 if config["pack_gqa"] else 1.0
    us += config["rescale_threshold"] / 16.0
    return round(us, 3)


# ---- evaluator (worker processes) ---------------------------------------------------------------

# A lucky measurement (the winner's curse, for the search's re-time step): with FA4TUNE_FAKE_LUCKY
# set to "<folder>:<part of a label>" (e.g. "tile_n=128 kv_stages=3"), the first time a worker times
# a configuration whose label holds that part it reads LUCKY_US faster than the configuration is; the
# folder records which were timed (across workers).
FAKE_LUCKY_ENV = "FA4TUNE_FAKE_LUCKY"
LUCKY_US = 3.0
# A transient and a one-off failure (for the bench's rounds), the same way: FA4TUNE_FAKE_SLOW makes the
# first timing of a matching configuration, peer name or "dispatched" SLOW_US slower (eager time too),
# FA4TUNE_FAKE_FAIL_ONCE makes it fail; "|" separates alternatives ("tile_n=112|sdpa_cudnn").
FAKE_SLOW_ENV = "FA4TUNE_FAKE_SLOW"
SLOW_US = 20.0
FAKE_FAIL_ONCE_ENV = "FA4TUNE_FAKE_FAIL_ONCE"


def _first_time(env: str, label: str) -> bool:
    spec = os.environ.get(env)
    if not spec:
        return False
    folder, parts = spec.rsplit(":", 1)
    if not any(part in label for part in parts.split("|")):
        return False
    marker = os.path.join(folder, label.replace(" ", "_").replace("=", "-"))
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def _lucky_first_time(config) -> bool:
    return _first_time(FAKE_LUCKY_ENV, config.label())


def _once(label: str) -> float:
    """The slow-down of this timing of `label` (raises for a one-off failure)."""
    if _first_time(FAKE_FAIL_ONCE_ENV, label):
        raise RuntimeError(f"fake launch failure of {label} (once)")
    return SLOW_US if _first_time(FAKE_SLOW_ENV, label) else 0.0


class FakeKernel:
    def __init__(self, config: Config):
        self.config = config


class FakeEvaluator:
    def __init__(self, mode: str):
        self.mode = mode

    def setup(self) -> dict:
        if self.mode != "gpu":
            return {}
        return {"name": "Fake H200", "sm_count": 132, "cc": "9.0", "driver": "fake"}

    def compile_key(self, config, problem):
        return compile_key(config, problem)

    def compile(self, config, problem):
        time.sleep(float(os.environ.get(FAKE_COMPILE_S_ENV, "0.01")))
        if config.pv_operand == "ss" and config.tile_n >= 176:
            raise RuntimeError("fake DSL: register allocation failed\nptxas error: too many registers")
        return FakeKernel(config)

    def compile_report(self, config, problem) -> dict:
        kernel = self.compile(config, problem)
        return {"registers": 168 if kernel.config.tile_m == 128 else 232, "spills": 0,
                "smem_bytes": kernel.config.tile_m * kernel.config.tile_n * 12,
                "ptx_markers": {name: True for name in real_family(config.arch).PTX_MARKERS}}

    def run_trial(self, kernel, config, problem, timing, validate, perturb) -> dict:
        if perturb:
            return {"outcome": "mismatch", "max_err": 1.0, "max_err_sdpa": 1.0,
                    "error": "differs from the fp32 reference: max abs error 1", "passed": False}
        us = round(fake_us(config.to_dict()) + _once(config.label()), 3)
        if _lucky_first_time(config):
            us = round(us - LUCKY_US, 3)
        return {"outcome": "ok", "us": us, "tflops": round(problem.flops() / us / 1e6, 2),
                "max_err": 0.001, "max_err_sdpa": 0.0005,
                "visible_gpu": os.environ.get("CUDA_VISIBLE_DEVICES"), "worker_pid": os.getpid()}

    def time_peers(self, problem, timing, names, eager: bool = False) -> dict:
        table = {"sdpa_flash": (53.0, 54.0), "sdpa_cudnn": (31.6, 32.4)}  # name: (GPU us, eager us)
        out = {}
        for name in names:
            if name in table:
                try:
                    slow = _once(name)
                except RuntimeError as exc:
                    out[name] = {"error": str(exc)}
                    continue
                us, eager_us = (round(t + slow, 3) for t in table[name])
                out[name] = {"us": us, "tflops": round(problem.flops() / us / 1e6, 2)}
                if eager:
                    out[name]["eager_us"] = eager_us
            else:
                out[name] = {"error": "flash-attn-4 not importable: ModuleNotFoundError"}
        return out

    def time_training(self, problem, timing, names) -> dict:
        # fa4.attention: 100 us forward + backward, 70 us backward; cuDNN faster; FA2 refuses the shape
        table = {"fa4": (100.0, 70.0, "blockwise"), "sdpa_cudnn": (90.0, 60.0, None)}
        slow = _once("training")
        return {name: ({"fwdbwd_us": table[name][0] + slow, "bwd_us": table[name][1] + slow,
                        "bwd_peak_extra_mib": 12.5, "validated": True,
                        **({"backward": table[name][2]} if table[name][2] else {})}
                       if name in table else {"error": f"{name} cannot train this shape"})
                for name in names}

    def time_dispatched(self, problem, timing, db_path) -> dict:
        # what fa4.attention would run in a bench: ours in both modes, 30 us of GPU time (within 2 % of
        # the fastest everywhere); eager, ours forced (ours_eager_us) costs 31 us per call, and so does
        # fa4.attention on a causal shape, while on a non-causal one its eager call costs 33.5 us: a
        # stand-in for a shape that misses the dispatch bar (within 2 %) in eager mode only
        slow = _once("dispatched")
        return {"outcome": "ok", "us": 30.0 + slow, "eager_us": (31.0 if problem.causal else 33.5) + slow,
                "ours_eager_us": 31.0 + slow, "backend": {"eager": "ours", "graph": "ours"},
                "tflops": round(problem.flops() / (30.0 + slow) / 1e6, 2), "max_err": 0.001}

    def trigger_fault(self) -> None:
        os.kill(os.getpid(), signal.SIGSEGV)

    def healthy(self) -> bool:
        return True


# ---- backward (`fa4tune search --backward`): the real kernel API judges, this evaluator times -----

def fake_bwd_us(config: dict, causal: bool) -> float:
    """A backward time of the sm90_bwd knobs: sdp_swap and the bulk dQ fastest (as the SASS counts
    suggest), the default (80 us) slower than FakeBackwardEvaluator's cuDNN backward (60 us), the best
    (about 45 us) faster."""
    us = 80.0
    us -= 20.0 if config["sdp_swap"] else 0.0
    us -= 10.0 if config["dq_accum"] == "bulk" else 0.0
    us -= 2.0 if config["pds_stages"] == 2 else 0.0
    us -= 3.0 if config["tile_m"] == 128 else 0.0
    us += 8.0 if config["tile_n"] == 64 else 0.0
    us += 4.0 if config["q_stages"] == 1 else 0.0
    us -= 1.0 if config["scheduler"] == "single_lpt" and causal else 0.0
    return round(us, 3)


class FakeBackwardEvaluator(FakeEvaluator):
    """Backward trials of the knob set sm90_bwd: compiles fail where tile_m is 128 and q_stages 1 (a
    stand-in for a ptxas failure), times from `fake_bwd_us`; the peers' backward from `time_training`
    (cuDNN 60 us backward alone)."""

    def compile(self, config, problem):
        assert config.arch == "sm90_bwd", config.arch
        time.sleep(float(os.environ.get(FAKE_COMPILE_S_ENV, "0.01")))
        if config.tile_m == 128 and config.q_stages == 1:
            raise RuntimeError("fake DSL: ptxas error: too many registers")
        return FakeKernel(config)

    def run_trial(self, kernel, config, problem, timing, validate, perturb) -> dict:
        if perturb:
            return {"outcome": "mismatch", "max_err": 1.0, "error": "gradients: dQ: error 1 > 2 x 0.01 + 0.01"}
        us = fake_bwd_us(config.to_dict(), problem.causal)
        return {"outcome": "ok", "us": us, "tflops": round(2.5 * problem.flops() / us / 1e6, 2), "max_err": 0.002}


# ---- GPU: the real worker machinery with SDPA standing in for our kernel ------------------------

class SdpaKernel:
    """A "compiled kernel" that runs torch SDPA (flash backend) into the given output."""

    def __init__(self, config: Config, problem: AttentionProblem):
        self.config, self.problem = config, problem

    def run(self, q, k, v, out, lse, softmax_scale):
        from fa4.backends import runner

        # K and V always expanded to the query heads, as before the dispatch rework: the peers'
        # try-then-expand (fa4tune.workers.peers.peer_call) probes with a call, which would run inside
        # the CUDA-graph capture that times this kernel
        group = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
        out.copy_(runner("sdpa_flash", self.problem.causal)(q, k, v, softmax_scale, False)[0])


def _real_evaluator_base():
    from fa4tune.workers.evaluator import KernelEvaluator

    return KernelEvaluator


class SdpaGpuEvaluator(_real_evaluator_base()):
    """The real KernelEvaluator (validation, CUDA-graph timing, real device faults) with SDPA as the
    kernel, so the GPU tests of the worker machinery do not depend on our kernel."""

    def compile_key(self, config, problem):
        return compile_key(config, problem)

    def compile(self, config, problem):
        return SdpaKernel(config, problem)


# ---- varlen batches (`fa4tune search --varlen`): the real kernel API judges, this evaluator times ----

def fake_varlen_us(config: dict, problem) -> float:
    """A varlen time: `fake_us` without GQA packing (varlen refuses it), plus what empty grid cells cost
    one CTA per tile: 20 us x the share of cells without rows (1 - tokens / (sequences x max)), a
    tenth of that in a persistent loop. So a batch of one long and many short sequences is fastest
    persistent, a near-uniform one with single_lpt's order."""
    empty = 1.0 - problem.tokens_q / (problem.batch * problem.seqlen_q)
    persistent = config["scheduler"] in ("static", "lpt")
    us = fake_us({**config, "pack_gqa": True}) + 20.0 * empty * (0.1 if persistent else 1.0)
    return round(us, 3)


class FakeVarlenEvaluator(FakeEvaluator):
    """Varlen trials: the problem must reach the worker with its lengths (a `VarlenProblem`), times from
    `fake_varlen_us`; the other implementations: flash-attn-4's varlen kernel 33 us, per sequence 80 us,
    SDPA's backends without a varlen kernel."""

    def run_trial(self, kernel, config, problem, timing, validate, perturb) -> dict:
        from fa4.varlen_batch import VarlenProblem

        assert isinstance(problem, VarlenProblem), type(problem)
        if perturb:
            return {"outcome": "mismatch", "max_err": 1.0, "error": "differs from the fp32 reference"}
        us = fake_varlen_us(config.to_dict(), problem)
        return {"outcome": "ok", "us": us, "tflops": round(problem.flops() / us / 1e6, 2), "max_err": 0.001}

    def time_peers(self, problem, timing, names, eager: bool = False) -> dict:
        from fa4.varlen_batch import VarlenProblem

        assert isinstance(problem, VarlenProblem), type(problem)
        out = {name: {"error": f"{name} has no varlen kernel"} for name in names if name != "flash_attn_4"}
        if "flash_attn_4" in names:
            out["flash_attn_4"] = {"us": 33.0, "tflops": 1.0, "max_err": 0.002}
        out["per_sequence"] = {"us": 80.0, "tflops": 0.5, "max_err": 0.001}
        return out
