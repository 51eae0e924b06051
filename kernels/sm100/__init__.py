"""The Blackwell (sm_100a) FA4 forward kernel family.

THIS KERNEL HAS NOT RUN ON HARDWARE. No Blackwell GPU is available anywhere in this project. What is
checked instead: `resource_reasons` rejects, with a reason, what does not fit (TMEM columns, shared
memory, a register model calibrated on sm_100a compiles, GQA packing); configurations it accepts are
compiled for sm_100a on a CPU (`compile_report`: registers, spills, SharedStorage bytes, tcgen05
MMA / ld / st and TMA in the PTX) -- a representative sample in CI, random samples of the space by
hand, the whole space with `fa4tune compile-space --arch sm100`; the tile algorithm's
numerics are replayed by `emulation.py` against SDPA; `fa4tune sass` reads the generated SASS per
warp role beside flash-attn-4's. The first B200 launch may still fault, hang or be wrong.

Implements `fa4.kernels.family.KernelFamily` (no DSL import at module import time; compiling goes
through the shared `fa4.kernels.compiling`).
"""

from __future__ import annotations

import re
from typing import Optional

from .. import compiling
from ..device import DeviceDescription
from ..knobs import Config
from ..problem import AttentionProblem
# the family's judgement and default live outside the fingerprint: they pick configurations
from .defaults import DEFAULT_RULES, default_config
from .feasibility import (REFERENCE_DEVICE, can_implement, launch_grid, launch_reasons, resource_reasons,
                          resources, tile_counts)
from .plan import KernelPlan, device_key, make_plan

ARCH = "sm100"

# The files that decide the generated code (emulation.py, feasibility.py and defaults.py do not); the
# kernel takes its exp2 polynomial's exponent add from the shared fast_exp2.py.
SOURCE_FILES = ("__init__.py", "plan.py", "kernel.py", "scheduler.py", "../fast_exp2.py")
# what a right sm_100a compile's PTX holds
PTX_MARKERS = {
    "tcgen05.mma": re.compile(r"\btcgen05\.mma\b"),
    "tcgen05.ld": re.compile(r"\btcgen05\.ld\b"),
    "tcgen05.st": re.compile(r"\btcgen05\.st\b"),
    "cp.async.bulk.tensor": re.compile(r"\bcp\.async\.bulk\.tensor\b"),
}

__all__ = [
    "ARCH", "SOURCE_FILES", "REFERENCE_DEVICE", "PTX_MARKERS",
    "can_implement", "resources", "resource_reasons", "tile_counts", "launch_grid", "launch_reasons",
    "default_config", "problem_key", "device_key", "make_kernel", "traced_smem_bytes", "compile_attention",
    "compile_report", "make_plan", "KernelPlan", "DEFAULT_RULES",
]
def problem_key(config: Config, problem: AttentionProblem) -> tuple:
    """What of the problem is compiled in: never sequence lengths, batch or head counts."""
    return (("head_dim", problem.head_dim), ("dtype", problem.dtype), ("causal", problem.causal),
            ("return_lse", problem.return_lse),
            ("gqa_ratio", problem.gqa_ratio if config.pack_gqa else None))


def make_kernel(config: Config, problem: AttentionProblem, device: DeviceDescription):
    """The DSL kernel object of one configuration for `device`, built from its plan (`device_key`: what
    of the device is compiled in)."""
    from .kernel import FlashAttentionForwardSm100
    return FlashAttentionForwardSm100(make_plan(config, problem, device))


def traced_smem_bytes(kernel) -> int:
    return kernel.shared_storage.size_in_bytes()  # the SharedStorage struct built while tracing


def compile_report(config: Config, problem: AttentionProblem, device: Optional[DeviceDescription] = None) -> dict:
    """Compile for sm_100a on this machine (CPU is fine) for `device` (default: the reference B200) and
    report registers, spills, SMEM, PTX."""
    return compiling.compile_report(config, problem, device)


def compile_attention(config: Config, problem: AttentionProblem, device: Optional[DeviceDescription] = None):
    """A launchable kernel for the Blackwell GPU in this process (`device`: its description, default
    read from torch's current device): `.run(q, k, v, out, lse, scale)`. Not cached (the runtime's
    cache is `fa4.compile_cache`).

    Refuses on anything but a Blackwell GPU: this kernel has never run on hardware, and the caller
    (`fa4.attention`) must have asked for it explicitly.
    """
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("the sm100 kernel needs a Blackwell GPU (sm_100); no CUDA GPU is available")
    device = device or compiling.current_device()
    if device.arch != ARCH:
        major, minor = device.capability
        raise RuntimeError(
            f"the sm100 kernel needs a Blackwell GPU of compute capability 10.0 (its sm_100a code runs "
            f"there only); {device.name} is sm_{major}{minor}. Use the sm90 kernel on Hopper, or PyTorch "
            f"SDPA elsewhere.")
    return compiling.compile_attention(config, problem, device)
