"""The kernel-family protocol: what every family (`sm90`, `sm100`) provides, with the same signatures,
and the one registry of families.

A family is a subpackage of `fa4.kernels` whose module implements `KernelFamily` (a module satisfies a
Protocol structurally: a type checker and `isinstance(module, KernelFamily)` both see it). Importing a
family does not import the DSL; `kernel`, `compile_attention` and `compile_report` do. What the
families share (target architecture, fake arguments, compile options, the compile cache, the
compile-report schema) is in `compiling.py`; the tile-scheduler protocol in `scheduling.py`.
"""

from __future__ import annotations

import importlib
from typing import Any, Mapping, Optional, Protocol, runtime_checkable

from .knobs import ARCHS, Config
from .problem import AttentionProblem

# The one mapping of families to GPUs (`fa4/arch.py` answers questions with it; it lives here because
# the kernels sit below the runtime and import nothing from it). Each family is compiled for an
# arch-specific "a" target (what `CUTE_DSL_ARCH` / `--gpu-arch` take), whose code runs on exactly one
# compute capability: sm_90a on 9.0 (H100, H200), sm_100a on 10.0 (B200, GB200).
CAPABILITY_ARCH = {(9, 0): "sm90", (10, 0): "sm100"}
DSL_TARGET = {"sm90": "sm_90a", "sm100": "sm_100a"}
assert set(CAPABILITY_ARCH.values()) == set(DSL_TARGET) == set(ARCHS), "a family without a GPU or target"


@runtime_checkable
class KernelFamily(Protocol):
    """One kernel family. Every function takes the same arguments in every family."""

    ARCH: str                      # "sm90" or "sm100"
    SOURCE_FILES: tuple[str, ...]  # files of the family's folder that decide its generated code
    DEFAULT_NUM_SMS: int           # SM count compiled in when no GPU is asked (reports, CPU compiles)
    PTX_MARKERS: Mapping[str, Any]  # name -> compiled regex: instructions a right compile's PTX holds

    def can_implement(self, problem: AttentionProblem) -> list[str]:
        """Reasons no configuration of this family can run the problem (empty: some can)."""

    def resources(self, config: Config, problem: AttentionProblem) -> dict:
        """What the configuration uses (at least `smem_bytes`, `smem_limit_bytes`, `threads`)."""

    def resource_reasons(self, config: Config, problem: AttentionProblem) -> list[str]:
        """Reasons this configuration cannot run the problem (shared memory, registers, ...)."""

    def default_config(self, problem: AttentionProblem) -> Config:
        """The heuristic default: the knobs' declared defaults, then per-problem rules."""

    def problem_key(self, config: Config, problem: AttentionProblem) -> tuple:
        """What of the problem the generated code depends on (never lengths, batch or heads)."""

    def make_kernel(self, config: Config, problem: AttentionProblem, num_sms: int) -> Any:
        """The DSL kernel object (a `@cute.jit` callable on Q, K, V, O, LSE, scale, stream)."""

    def traced_smem_bytes(self, kernel: Any) -> int:
        """Dynamic shared memory of a kernel object, read from its SharedStorage after tracing."""

    def compile_attention(self, config: Config, problem: AttentionProblem,
                          num_sms: Optional[int] = None) -> Any:
        """A launchable kernel for the GPU in this process: `.run(q, k, v, out, lse, scale)`."""

    def compile_report(self, config: Config, problem: AttentionProblem,
                       num_sms: Optional[int] = None) -> dict:
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
