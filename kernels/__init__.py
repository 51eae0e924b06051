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
- Our backward kernels' knob sets (`knobs.BACKWARD_KERNELS`: "sm90_bwd") answer the same five
  (`feasible`, `default_config`, `compile_key`, `compile_report`, the fingerprints) through their
  module (`fa4.kernels.sm90_bwd`), so the search and the database serve a backward as one more knob
  set; `arch_of(name)` is the GPU architecture a knob set runs on, `backward_knob_set(arch)` the
  backward of an architecture. (Launching one is `sm90_bwd.compile_backward`: its `.run` takes the
  backward's tensors, not the forward's.)
- `kernel_fingerprint(arch)`: a hash of everything that decides a family's generated code (our sources
  and the DSL toolchain, `toolchain()`), to detect stale tunings; `source_fingerprint(arch)` is our
  sources' part alone (what a compile check of the sources records beside the toolchain).

A family (`sm90`, `sm100`) is a subpackage implementing the protocol `family.KernelFamily` (the
registry: `family(arch)`); what families share when compiling (target architecture, fake arguments,
options, the compile cache, the compile-report schema) is `compiling.py`.
"""

from __future__ import annotations

import hashlib
import importlib
from importlib import metadata
from pathlib import Path
from typing import Optional

from .device import DeviceDescription, reference_device
from .device import from_torch as device_from_torch
from .family import KernelFamily, family
from .knobs import ARCHS, BACKWARD_KERNELS, KNOB_SETS, KNOBS, Config, Knob, knob, knobs_for
from .problem import DTYPES, AttentionProblem

__all__ = [
    "ARCHS", "BACKWARD_KERNELS", "KNOB_SETS", "KNOBS", "arch_of", "backward_knob_set", "backward_kernel", "DTYPES", "Config", "Knob", "knob", "knobs_for", "AttentionProblem",
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
# files of other folders a backward kernel's code is built from (tests/test_backward_search.py checks
# that every module it imports from a family folder is named here)
BACKWARD_BORROWED_FILES = {"sm90_bwd": ("../sm90/layouts.py",)}
# a backward kernel folder's files that pick configurations and compile nothing (its default rules):
# left out of its fingerprint, so a rule can move without making tuned entries stale
BACKWARD_RULE_FILES = ("defaults.py",)
TOOLCHAIN_DISTRIBUTIONS = ("nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base", "nvidia-cutlass-dsl-libs-core",
                           "nvidia-cutlass-dsl-libs-cu12", "nvidia-cutlass-dsl-libs-cu13")


def backward_kernel(name: str):
    """The module of a backward knob set (`fa4.kernels.sm90_bwd`); importing it imports no DSL."""
    if name not in BACKWARD_KERNELS:
        raise ValueError(f"{name!r} is not a backward kernel; known: {', '.join(BACKWARD_KERNELS)}")
    return importlib.import_module(f"{__package__}.{name}")


def arch_of(knob_set: str) -> str:
    """The GPU architecture a knob set's kernels run on: a family's own name, a backward kernel's ARCH."""
    if knob_set in ARCHS:
        return knob_set
    return backward_kernel(knob_set).ARCH


def backward_knob_set(arch: str) -> str:
    """The knob set of our backward kernel for a GPU architecture; ValueError where there is none."""
    for name in BACKWARD_KERNELS:
        if backward_kernel(name).ARCH == arch:
            return name
    raise ValueError(f"no backward kernel of ours runs on {arch} (backward kernels: "
                     + ", ".join(f"{n} on {backward_kernel(n).ARCH}" for n in BACKWARD_KERNELS) + ")")


def feasible(config: Config, problem: AttentionProblem, device: Optional[DeviceDescription] = None) -> list[str]:
    """Every reason `config` cannot run `problem` on `device` (default: the family's reference
    device): the problem, one block's resources, and the launch's grid limits."""
    if config.arch in BACKWARD_KERNELS:
        return list(backward_kernel(config.arch).reasons(config, problem, device))
    fam = family(config.arch)
    return (list(fam.can_implement(problem)) + list(fam.resource_reasons(config, problem, device))
            + list(fam.launch_reasons(config, problem, device)))


def default_config(arch: str, problem: AttentionProblem, device: Optional[DeviceDescription] = None) -> Config:
    if arch in BACKWARD_KERNELS:
        return backward_kernel(arch).default_config(problem, device)
    return family(arch).default_config(problem, device)


def compile_key(config: Config, problem: AttentionProblem, device: Optional[DeviceDescription] = None) -> tuple:
    """(arch, codegen knobs, what of the problem is compiled in, what of `device` is compiled in)."""
    if config.arch in BACKWARD_KERNELS:   # nothing of the device is compiled into the backward
        return backward_kernel(config.arch).compile_key(config, problem)
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
    if config.arch in BACKWARD_KERNELS:
        return backward_kernel(config.arch).compile_report(config, problem, device)
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
    fam_dir = _HERE / arch
    if arch in BACKWARD_KERNELS:   # a backward kernel's folder: what decides its code, and its rules
        own = (sorted(p.name for p in fam_dir.glob("*.py") if p.name not in BACKWARD_RULE_FILES)
               + list(BACKWARD_BORROWED_FILES.get(arch, ())))
    else:
        own = sorted(family(arch).SOURCE_FILES)
    paths = [_HERE / p for p in SHARED_SOURCE_FILES] + [fam_dir / p for p in own]
    digest = hashlib.sha256()
    # this architecture's knob declarations, not the whole knob file: another family's knobs do
    # not change this family's code
    digest.update(repr(knobs_for(arch)).encode())
    for path in paths:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]
