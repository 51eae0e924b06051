"""fa4.kernels: our FA4-style attention forward kernels (CuTe DSL) and the facts the harness needs.

This package is the bottom of the dependency chain (harness `fa4tune` -> runtime `fa4` -> kernels) and
imports nothing from above. Importing it does not import the DSL: compiling does.

Public surface, the same for every kernel family:
- `Config`, `knobs_for`, `AttentionProblem`: the knob model and the problem.
- `DeviceDescription`, `reference_device(arch)`, `device_from_torch(index)`: the GPU, as the kernels
  read it (`device.py`). Every function below takes an optional `device`; None is the family's
  reference device (the H200, the B200), except for `compile_attention`, where it is torch's GPU.
- `feasible(config, problem, device) -> list[str]`: every reason the configuration cannot run the
  problem on the device, CUDA's grid limits included (empty: feasible). The single check used by the
  tests, the search and the runtime.
- `default_config(arch, problem, device)`: the heuristic default that seeds every search.
- `compile_key(config, problem, device)`: what the generated code depends on (no sequence lengths or
  batch; the device's facts that are compiled in).
- `compile_attention(config, problem, device)`: a launchable kernel, compiled now (the runtime's
  cache of compiled kernels is `fa4.compile_cache`).
- `compile_report(config, problem, device)`: compile without a GPU and report registers, spills,
  shared memory.
- `kernel_fingerprint(arch)`: a hash of everything that decides a family's generated code (our sources
  and the DSL toolchain, `toolchain()`), to detect stale tunings; `source_fingerprint(arch)` is our
  sources' part alone (what a compile check of the sources records beside the toolchain).

A family (`sm90`, `sm100`) is a subpackage implementing the protocol `family.KernelFamily` (the
registry: `family(arch)`); what families share when compiling (target architecture, fake arguments,
options, the compile cache, the compile-report schema) is `compiling.py`.
"""

from __future__ import annotations

import hashlib
from importlib import metadata
from pathlib import Path
from typing import Optional

from .device import DeviceDescription, reference_device
from .device import from_torch as device_from_torch
from .family import KernelFamily, family
from .knobs import ARCHS, KNOBS, Config, Knob, knob, knobs_for
from .problem import DTYPES, AttentionProblem

__all__ = [
    "ARCHS", "KNOBS", "DTYPES", "Config", "Knob", "knob", "knobs_for", "AttentionProblem",
    "DeviceDescription", "reference_device", "device_from_torch",
    "KernelFamily", "family", "feasible", "default_config", "compile_key", "compile_attention", "compile_report",
    "source_fingerprint", "kernel_fingerprint", "toolchain",
]

_HERE = Path(__file__).resolve().parent
# shared files that decide every family's generated code (with the family's own SOURCE_FILES)
SHARED_SOURCE_FILES = ("problem.py", "compiling.py", "scheduling.py", "exp2_fit.py")
# Besides our sources, the DSL decides the generated code: its MLIR passes and the ptxas it bundles
# (the distributions `nvidia-cutlass-dsl` pins, one per CUDA major). Read from the installed
# packages' metadata: importing the DSL takes seconds.
TOOLCHAIN_DISTRIBUTIONS = ("nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base", "nvidia-cutlass-dsl-libs-core",
                           "nvidia-cutlass-dsl-libs-cu12", "nvidia-cutlass-dsl-libs-cu13")


def feasible(config: Config, problem: AttentionProblem, device: Optional[DeviceDescription] = None) -> list[str]:
    """Every reason `config` cannot run `problem` on `device` (default: the family's reference
    device): the problem, one block's resources, and the launch's grid limits."""
    fam = family(config.arch)
    return (list(fam.can_implement(problem)) + list(fam.resource_reasons(config, problem, device))
            + list(fam.launch_reasons(config, problem, device)))


def default_config(arch: str, problem: AttentionProblem, device: Optional[DeviceDescription] = None) -> Config:
    return family(arch).default_config(problem, device)


def compile_key(config: Config, problem: AttentionProblem, device: Optional[DeviceDescription] = None) -> tuple:
    """(arch, codegen knobs, what of the problem is compiled in, what of `device` is compiled in)."""
    fam = family(config.arch)
    return (config.arch, config.codegen_items(), tuple(fam.problem_key(config, problem)),
            tuple(fam.device_key(device or fam.REFERENCE_DEVICE)))


def compile_attention(config: Config, problem: AttentionProblem, device: Optional[DeviceDescription] = None):
    """A launchable kernel for `device` (default: torch's current GPU), compiled now; refuses an
    infeasible configuration."""
    fam = family(config.arch)
    if device is None:
        from .compiling import current_device
        device = current_device()
    reasons = feasible(config, problem, device)
    if reasons:
        raise ValueError(f"infeasible configuration {config.label()}: {'; '.join(reasons)}")
    return fam.compile_attention(config, problem, device)


def compile_report(config: Config, problem: AttentionProblem, device: Optional[DeviceDescription] = None):
    return family(config.arch).compile_report(config, problem, device)


def toolchain() -> dict[str, str]:
    """{distribution: version} of the installed DSL distributions (`TOOLCHAIN_DISTRIBUTIONS`)."""
    found = {}
    for name in TOOLCHAIN_DISTRIBUTIONS:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


def kernel_fingerprint(arch: str) -> str:
    """sha256 (first 16 hex digits) of what decides a family's generated code: our sources
    (`source_fingerprint`) and the DSL toolchain (`toolchain`). A tuning recorded under another
    fingerprint is stale: after an edit of our kernel sources and after a DSL upgrade alike."""
    text = repr((source_fingerprint(arch), sorted(toolchain().items())))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def source_fingerprint(arch: str) -> str:
    """sha256 (first 16 hex digits) of our sources that decide the generated code of a family (the
    toolchain's part is `kernel_fingerprint`'s)."""
    fam = family(arch)
    fam_dir = _HERE / arch
    paths = [_HERE / p for p in SHARED_SOURCE_FILES] + [fam_dir / p for p in sorted(fam.SOURCE_FILES)]
    digest = hashlib.sha256()
    # this architecture's knob declarations, not the whole knob file: another family's knobs do
    # not change this family's code
    digest.update(repr(knobs_for(arch)).encode())
    for path in paths:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]
