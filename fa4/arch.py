"""Which kernel family a GPU runs: the one mapping from compute capability to architecture.

Our kernels are compiled for arch-specific targets (`sm_90a`, `sm_100a`). Code for an "a" target runs
only on exactly that compute capability: sm_90a on 9.0 (H100, H200), sm_100a on 10.0 (B200, GB200).
A B300 (10.3) needs sm_103a and a consumer Blackwell (12.x) has no tcgen05 at all, so neither maps to
a family: any capability not listed here runs no fa4 kernel.
"""

from __future__ import annotations

from typing import Optional

# the tables themselves are declared with the kernel families (the compile path targets DSL_TARGET)
from fa4.kernels.family import CAPABILITY_ARCH, DSL_TARGET  # noqa: F401  (DSL_TARGET re-exported)


def arch_of_capability(capability) -> Optional[str]:
    """The family of a compute capability (major, minor), or None where none runs."""
    major, minor = (int(x) for x in capability)
    return CAPABILITY_ARCH.get((major, minor))


def describe_capabilities() -> str:
    """What runs where, for error messages."""
    return ", ".join(f"{arch} on compute capability {major}.{minor}"
                     for (major, minor), arch in CAPABILITY_ARCH.items())
