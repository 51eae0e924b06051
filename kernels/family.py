"""The kernel-family protocol: what every family (`sm90`, `sm100`) provides, with the same signatures,
and the one registry of families.

A family is a subpackage of `fa4.kernels` whose module implements `KernelFamily` (a module satisfies a
Protocol structurally: a type checker and `isinstance(module, KernelFamily)` both see it). Importing a
family does not import the DSL; `kernel`, `compile_attention` and `compile_report` do. What the
families share (target architecture, fake arguments, compile options, the compile-report schema) is
in `compiling.py`; the tile-scheduler protocol in `scheduling.py`; CUDA's grid limits in `launch.py`.

Every fact of the GPU comes from a `device.DeviceDescription` passed in (`device`); where a function
takes `device=None`, None means the family's `REFERENCE_DEVICE` (what a compile without a GPU is for).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Mapping, Optional, Protocol, runtime_checkable

# the GPU and DSL-target tables (`fa4/arch.py` answers questions with them) come from the one registry
# of families, `archs.py`, and are re-exported here
from .archs import ARCHS, CAPABILITY_ARCH, DSL_TARGET  # noqa: F401
from .knobs import Config
from .problem import AttentionProblem

if TYPE_CHECKING:
    from .device import DeviceDescription


@runtime_checkable
class KernelFamily(Protocol):
    """One kernel family. Every function takes the same arguments in every family."""

    ARCH: str                      # "sm90" or "sm100"
    SOURCE_FILES: tuple[str, ...]  # files of the family's folder that decide its generated code
    REFERENCE_DEVICE: DeviceDescription  # compiled for when no GPU is asked (reports, CPU compiles)
    PTX_MARKERS: Mapping[str, Any]  # name -> compiled regex: instructions a right compile's PTX holds

    def can_implement(self, problem: AttentionProblem) -> list[str]:
        """Reasons no configuration of this family can run the problem (empty: some can)."""

    def resources(self, config: Config, problem: AttentionProblem,
                  device: Optional[DeviceDescription] = None) -> dict:
        """What the configuration uses (at least `smem_bytes`, `smem_limit_bytes`, `threads`)."""

    def resource_reasons(self, config: Config, problem: AttentionProblem,
                         device: Optional[DeviceDescription] = None) -> list[str]:
        """Reasons this configuration cannot run the problem in one block of `device` (shared
        memory, registers, ...)."""

    def tile_counts(self, config: Config, problem: AttentionProblem) -> tuple[int, int, int]:
        """(m blocks, heads, batch) the kernel builds its tile scheduler from."""

    def launch_grid(self, config: Config, problem: AttentionProblem,
                    device: Optional[DeviceDescription] = None) -> tuple[int, int, int]:
        """The grid the kernel launches on `device` (its scheduler on plain integers; imports the DSL)."""

    def launch_reasons(self, config: Config, problem: AttentionProblem,
                       device: Optional[DeviceDescription] = None) -> list[str]:
        """Reasons the launch exceeds `device`'s grid limits (`launch.grid_reasons`)."""

    def default_config(self, problem: AttentionProblem, device: Optional[DeviceDescription] = None) -> Config:
        """The heuristic default on `device`: the knobs' declared defaults, then per-problem rules
        (those that read the device say which facts: `device.reads_device`)."""

    def problem_key(self, config: Config, problem: AttentionProblem) -> tuple:
        """What of the problem the generated code depends on (never lengths, batch or heads)."""

    def device_key(self, device: DeviceDescription) -> tuple:
        """What of the device the generated code depends on (the facts compiled in)."""

    def make_kernel(self, config: Config, problem: AttentionProblem, device: DeviceDescription) -> Any:
        """The DSL kernel object (a `@cute.jit` callable on Q, K, V, O, LSE, scale, stream)."""

    def traced_smem_bytes(self, kernel: Any) -> int:
        """Dynamic shared memory of a kernel object, read from its SharedStorage after tracing."""

    def compile_attention(self, config: Config, problem: AttentionProblem,
                          device: Optional[DeviceDescription] = None) -> Any:
        """A launchable kernel for `device` (None: torch's current GPU): `.run(q, k, v, out, lse,
        scale)`. Not cached: `fa4.compile_cache` is the cache."""

    def compile_report(self, config: Config, problem: AttentionProblem,
                       device: Optional[DeviceDescription] = None) -> dict:
        """Compile without a GPU; the report of `compiling.REPORT_KEYS`."""


def family(arch: str) -> KernelFamily:
    """The kernel family of one architecture ("sm90" or "sm100"): the one registry."""
    if arch not in ARCHS:
        raise ValueError(f"unknown architecture {arch!r}; known: {', '.join(ARCHS)}")
    module = importlib.import_module(f"{__package__}.{arch}")
    if not isinstance(module, KernelFamily):  # a family that lost a member fails here, loudly
        missing = [n for n in protocol_members() if not hasattr(module, n)]
        raise TypeError(f"kernel family {arch} does not implement KernelFamily: missing {missing}")
    return module


def protocol_members() -> list[str]:
    """The names a family module must have: the protocol's attributes and functions."""
    return list(KernelFamily.__annotations__) + [n for n in vars(KernelFamily) if not n.startswith("_")]



def unsupported_by_family(problem: AttentionProblem, family: str, head_dims: tuple[int, ...],
                          head_dim_pairs: tuple[tuple[int, int], ...] = ()) -> list[str]:
    """What no configuration of a family can run, whatever the family: a head dim it has no code for,
    or a value head dim Dv != D outside the (D, Dv) pairs it has code for (each family's
    `can_implement` starts here; the dtype is checked where a problem is made)."""
    if problem.head_dim not in head_dims:
        return [f"head dim {problem.head_dim} is not supported ({family} kernel: {', '.join(map(str, head_dims))})"]
    if problem.head_dim_v is not None and (problem.head_dim, problem.head_dim_v) not in head_dim_pairs:
        pairs = ", ".join(f"{d}/{dv}" for d, dv in head_dim_pairs)
        return [f"value head dim {problem.head_dim_v} != head dim {problem.head_dim} is not supported "
                f"({family} kernel: Dv = D" + (f", or D/Dv {pairs})" if pairs else " only)")]
    return []
