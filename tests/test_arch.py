"""The one compute capability -> kernel family mapping (`fa4.arch`), used by the runtime, the CLI and
the test markers."""

from __future__ import annotations

import dataclasses

import pytest

from fa4.arch import CAPABILITY_ARCH, DSL_TARGET, arch_of_capability
from fa4.kernels import ARCHS


@pytest.mark.parametrize("capability, arch", [
    ((9, 0), "sm90"),      # H100, H200
    ((10, 0), "sm100"),    # B200: sm_100a code
    ((10, 3), None),       # B300 needs sm_103a, which we do not build
    ((12, 0), None),       # consumer Blackwell: no tcgen05
    ((8, 0), None),        # A100
    ((9, 1), None),
])
def test_capability_to_family(capability, arch):
    assert arch_of_capability(capability) == arch


def test_every_family_has_one_capability_and_one_dsl_target():
    assert sorted(CAPABILITY_ARCH.values()) == sorted(ARCHS)
    assert set(DSL_TARGET) == set(ARCHS)


def test_runtime_and_cli_use_the_same_mapping():
    import fa4.runtime
    from fa4tune import cli

    from fa4.kernels.device import H200
    for capability in ((9, 0), (10, 0), (10, 3), (8, 0)):   # the device's architecture (its description)
        assert dataclasses.replace(H200, capability=capability).arch == arch_of_capability(capability)
    assert fa4.runtime.arch_of_capability is arch_of_capability  # explain's assumed target
    gpu = {"index": 0, "name": "NVIDIA B300", "cc": (10, 3)}
    import click
    with pytest.raises(click.ClickException, match="10.3"):
        cli._resolve_arch("auto", [gpu], need_gpu=True)
    assert cli._resolve_arch("auto", [{**gpu, "cc": (10, 0)}], need_gpu=True) == "sm100"
