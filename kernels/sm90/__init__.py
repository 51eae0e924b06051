"""The Hopper (sm_90a) family: our FA4-style warp-specialised TMA + wgmma forward kernel.

Implements `fa4.kernels.family.KernelFamily`. Importing this module does not import the DSL;
compiling does (kernel.py, through the shared `fa4.kernels.compiling`). What it can run (the
resource model) is `feasibility.py`, outside the source fingerprint; what it compiles in beside the
knobs, `plan.py`.
"""

from __future__ import annotations

import re
from typing import Optional

from .. import compiling, launch
from ..device import H200, DeviceDescription, scaled_to_l2
from ..knobs import Config
from ..problem import AttentionProblem
from .defaults import default_config  # noqa: F401  (the family's default_config)
# the family protocol's resource functions; the model itself is feasibility.py
from .feasibility import REFERENCE_DEVICE, can_implement, resource_reasons, resources, smem_bytes  # noqa: F401
from .scheduler import L2_BYTES_FOR_KV_ON_H200

ARCH = "sm90"
SOURCE_FILES = ("__init__.py", "plan.py", "kernel.py", "layouts.py", "scheduler.py", "../fast_exp2.py")
# what a right sm_90a compile's PTX holds
PTX_MARKERS = {
    "wgmma": re.compile(r"wgmma\.mma_async"),
    "tma_load": re.compile(r"cp\.async\.bulk\.tensor"),
    "setmaxnreg": re.compile(r"setmaxnreg"),
    "stmatrix": re.compile(r"stmatrix"),
}


def tile_counts(config: Config, problem: AttentionProblem) -> tuple[int, int, int]:
    """(m blocks, tile heads, batch) the kernel's `__call__` builds its tile scheduler from: a tile
    holds `tile_m` rows (`launch.tile_counts`)."""
    return launch.tile_counts(problem, config.tile_m, config.pack_gqa)


def launch_grid(config: Config, problem: AttentionProblem,
                device: Optional[DeviceDescription] = None) -> tuple[int, int, int]:
    """The grid (x, y, z) the kernel launches for `problem` on `device`: its own tile scheduler on plain
    integers (`launch.scheduler_grid`; imports the DSL)."""
    from .scheduler import TileScheduler

    compiled_in = dict(device_key(device or REFERENCE_DEVICE))
    return launch.scheduler_grid(TileScheduler, config.scheduler, tile_counts(config, problem), problem,
                                 compiled_in["num_sms"], compiled_in["l2_bytes_for_kv"])


def launch_reasons(config: Config, problem: AttentionProblem,
                   device: Optional[DeviceDescription] = None) -> list[str]:
    """Why launching `config` on `problem` would exceed `device`'s grid limits (empty: it would not)."""
    return launch.grid_reasons(config, tile_counts(config, problem), device or REFERENCE_DEVICE,
                               lambda: launch_grid(config, problem, device))


def device_key(device: DeviceDescription) -> tuple:
    """What of the device is compiled into the kernel: the SM count of the persistent grids and the
    L2 budget of the longest-first orders' head groups (`L2_BYTES_FOR_KV_ON_H200`, scaled to the
    device's L2)."""
    return (("num_sms", device.sm_count),
            ("l2_bytes_for_kv", scaled_to_l2(L2_BYTES_FOR_KV_ON_H200, H200, device)))


def problem_key(config: Config, problem: AttentionProblem) -> tuple:
    """What of the problem the generated code depends on (never sequence lengths, batch or heads;
    the GQA ratio only when rows are packed, where it shapes the tile; which sides of a window are
    bounded and whether there is a softcap, never their values: those are runtime arguments; whether
    the batch is variable-length, never its offsets; the value head dim where it is not the head dim)."""
    key = (("dtype", problem.dtype), ("head_dim", problem.head_dim), ("causal", problem.causal),
           ("return_lse", problem.return_lse))
    if config.pack_gqa:
        key += (("gqa_ratio", problem.gqa_ratio),)
    if problem.head_dim_v is not None:   # Dv = D: the key it had before values had a head dim of their own
        key += (("head_dim_v", problem.head_dim_v),)
    features = _mask_features(problem)
    if any(features.values()):   # a dense problem's key is what it was before windows existed
        key += tuple(features.items())
    return key


def _mask_features(problem: AttentionProblem) -> dict:
    """The kernel's compile-time mask flags of `problem` (its constructor's arguments)."""
    return {"bounded_left": problem.window_left is not None,
            "bounded_right": problem.window_right is not None and not problem.causal,
            "softcap": problem.softcap is not None,
            "varlen": problem.varlen}


def make_kernel(config: Config, problem: AttentionProblem, device: DeviceDescription):
    """The DSL kernel object of one configuration for `device` (`device_key`: what of it is compiled in)."""
    from .kernel import FlashAttentionSm90
    compiled_in = dict(device_key(device))
    # every knob but pack_gqa reaches the kernel under its own name: a new knob needs no line here
    knobs = config.to_dict()
    pack_gqa = knobs.pop("pack_gqa")
    return FlashAttentionSm90(
        dtype=problem.dtype, head_dim=problem.head_dim, causal=problem.causal,
        return_lse=problem.return_lse, gqa_pack_ratio=problem.gqa_ratio if pack_gqa else None,
        num_sms=compiled_in["num_sms"], l2_bytes_for_kv=compiled_in["l2_bytes_for_kv"],
        head_dim_v=problem.head_dim_v, **_mask_features(problem), **knobs)


def traced_smem_bytes(kernel) -> int:
    return kernel.smem_bytes  # recorded from SharedStorage while tracing (kernel.py `__call__`)


def compile_attention(config: Config, problem: AttentionProblem, device: Optional[DeviceDescription] = None):
    """A launchable kernel for `device` (default: read from torch's current device): `.run(q, k, v,
    out, lse, softmax_scale)` on torch's current stream. Not cached (the runtime's cache is
    `fa4.compile_cache`)."""
    device = device or compiling.current_device()
    reasons = can_implement(problem) + resource_reasons(config, problem, device)
    if reasons:
        raise ValueError(f"infeasible configuration {config.label()}: {'; '.join(reasons)}")
    return compiling.compile_attention(config, problem, device)


def compile_report(config: Config, problem: AttentionProblem, device: Optional[DeviceDescription] = None) -> dict:
    """Compile for sm_90a without a GPU for `device` (default: the reference H200): registers, spills,
    smem (SharedStorage), seconds, PTX markers."""
    return compiling.compile_report(config, problem, device)

