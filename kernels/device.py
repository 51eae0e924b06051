"""The GPU a kernel runs on, as the kernels need to know it: one description, passed in.

A family reads every fact of the device from a `DeviceDescription`: its scheduler (the SM count a
persistent grid is compiled for, the L2 a longest-first order fills with a group of heads' K and V),
its default rules (those marked `reads_device`) and its feasibility (shared memory per block, CUDA's
grid limits). The runtime describes each GPU once (`from_torch`) and passes the description down.
Compiling without a GPU (compile reports, SASS, the search's checks) uses the family's reference
device, declared here once: the H200 for sm90, the B200 for sm100.

Nothing here imports the DSL; `from_torch` imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable, Optional, Sequence

from .archs import CAPABILITY_ARCH, FAMILIES

MiB = 1 << 20


@dataclass(frozen=True)
class DeviceDescription:
    """What a family reads of a GPU. Frozen and hashable: the runtime keeps one per device."""

    name: str                    # as torch names it, e.g. "NVIDIA H200"
    capability: tuple[int, int]  # compute capability (major, minor): decides the family (`arch`)
    sm_count: int
    smem_per_block_bytes: int    # dynamic shared memory one block can opt in to
    l2_bytes: int
    # CUDA's grid limits, the same on every GPU since compute capability 3.0 (torch does not report them)
    max_grid_x: int = 2**31 - 1
    max_grid_y: int = 65_535
    max_grid_z: int = 65_535

    @property
    def arch(self) -> Optional[str]:
        """The kernel family that runs on this device ("sm90", "sm100"), or None."""
        return CAPABILITY_ARCH.get(tuple(self.capability))

    @property
    def max_grid(self) -> tuple[int, int, int]:
        return (self.max_grid_x, self.max_grid_y, self.max_grid_z)


# The reference devices: what a compile without a GPU is for, and what each family's compiled-in
# budgets were chosen on. The H200's facts are torch's on our H200; no B200 was available, so its
# facts are NVIDIA's published ones (148 SMs, 227 KiB of shared memory per block, 126 MB of L2).
H200 = DeviceDescription(name="NVIDIA H200", capability=(9, 0), sm_count=132,
                         smem_per_block_bytes=232_448, l2_bytes=60 * MiB)
B200 = DeviceDescription(name="NVIDIA B200", capability=(10, 0), sm_count=148,
                         smem_per_block_bytes=232_448, l2_bytes=126 * MiB)
_DECLARED = {device.name: device for device in (H200, B200)}
REFERENCE_DEVICES = {name: _DECLARED[arch.reference_device] for name, arch in FAMILIES.items()}
assert all(d.arch == arch for arch, d in REFERENCE_DEVICES.items()), "a reference device of another family"


def reference_device(arch: str) -> DeviceDescription:
    """The device a family is compiled for when no GPU is asked (reports, SASS, CPU checks)."""
    if arch not in REFERENCE_DEVICES:
        raise ValueError(f"unknown architecture {arch!r}; known: {', '.join(REFERENCE_DEVICES)}")
    return REFERENCE_DEVICES[arch]


def from_torch(device_index: int) -> DeviceDescription:
    """The description of CUDA device `device_index`, from `torch.cuda.get_device_properties`."""
    import torch

    props = torch.cuda.get_device_properties(device_index)
    return DeviceDescription(name=props.name, capability=(props.major, props.minor),
                             sm_count=props.multi_processor_count,
                             smem_per_block_bytes=props.shared_memory_per_block_optin,
                             l2_bytes=props.L2_cache_size)


def scaled_to_l2(budget_bytes: int, chosen_on: DeviceDescription, device: DeviceDescription) -> int:
    """A byte budget chosen for `chosen_on`'s L2, scaled to `device`'s L2 and rounded down to a whole
    MiB: exactly `budget_bytes` on `chosen_on` itself (and on any device with its L2)."""
    return budget_bytes * device.l2_bytes // chosen_on.l2_bytes // MiB * MiB


# ------------------------------------------------------------------------------------------------
# default rules that read the device

FACTS = tuple(f.name for f in fields(DeviceDescription))


def reads_device(*facts: str) -> Callable:
    """Mark a default rule that reads these facts of the device (`DeviceDescription` fields): it is
    called `rule(config, problem, device)`; the other rules `rule(config, problem)`."""
    unknown = [f for f in facts if f not in FACTS]
    if not facts or unknown:
        raise ValueError(f"reads_device needs facts of DeviceDescription ({', '.join(FACTS)}); got {facts}")

    def mark(rule: Callable) -> Callable:
        rule.device_facts = facts
        return rule

    return mark


def apply_default_rules(rules: Sequence[Callable], config, problem, device: DeviceDescription):
    """`config` after each rule in order, the device given to the rules that read it."""
    for rule in rules:
        config = rule(config, problem, device) if getattr(rule, "device_facts", ()) else rule(config, problem)
    return config


__all__ = ["DeviceDescription", "H200", "B200", "REFERENCE_DEVICES", "reference_device", "from_torch",
           "scaled_to_l2", "reads_device", "apply_default_rules", "FACTS", "MiB"]
