"""The one registry of kernel families: each architecture, the GPU it runs on, its compile target and
the device it is compiled for without a GPU. A new family is a folder `kernels/<arch>/` implementing
`family.KernelFamily`, one line here, and its search space `search_spaces/<arch>.toml`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Arch:
    # compute capability its code runs on: each family is compiled for an arch-specific "a" target
    # (what `CUTE_DSL_ARCH` / `--gpu-arch` take), whose code runs on exactly that capability
    capability: tuple[int, int]
    dsl_target: str
    reference_device: str  # name of a `device.DeviceDescription` declared in kernels/device.py


FAMILIES = {
    "sm90": Arch(capability=(9, 0), dsl_target="sm_90a", reference_device="NVIDIA H200"),    # H100, H200
    "sm100": Arch(capability=(10, 0), dsl_target="sm_100a", reference_device="NVIDIA B200"),  # B200, GB200
}
ARCHS = tuple(FAMILIES)
CAPABILITY_ARCH = {arch.capability: name for name, arch in FAMILIES.items()}
DSL_TARGET = {name: arch.dsl_target for name, arch in FAMILIES.items()}
