"""The kernel fingerprint covers what decides the generated code: our sources and the DSL toolchain.
A DSL upgrade makes every tuning recorded under the old one stale, as an edit of our sources does."""

from __future__ import annotations

from importlib import metadata

import pytest

from fa4 import kernels
from fa4.database import BestConfigDB, Entry
from fa4.kernels import AttentionProblem, Config


def _with_dsl_version(monkeypatch, version: str) -> None:
    real = metadata.version

    def fake(name: str) -> str:
        return version if name.startswith("nvidia-cutlass-dsl") else real(name)

    monkeypatch.setattr(kernels.metadata, "version", fake)


@pytest.mark.parametrize("arch", kernels.ARCHS)
def test_a_dsl_upgrade_changes_the_kernel_fingerprint_not_the_source_one(monkeypatch, arch):
    source, kernel = kernels.source_fingerprint(arch), kernels.kernel_fingerprint(arch)
    _with_dsl_version(monkeypatch, "99.0.0")
    assert kernels.toolchain()["nvidia-cutlass-dsl"] == "99.0.0"
    assert kernels.source_fingerprint(arch) == source
    assert kernels.kernel_fingerprint(arch) != kernel


def test_the_toolchain_lists_the_installed_dsl_distributions():
    found = kernels.toolchain()
    assert found["nvidia-cutlass-dsl"] == metadata.version("nvidia-cutlass-dsl")
    assert set(found) <= set(kernels.TOOLCHAIN_DISTRIBUTIONS)


def test_an_entry_tuned_under_the_old_dsl_is_stale_after_an_upgrade(monkeypatch):
    problem = AttentionProblem(batch=1, seqlen_q=1024, seqlen_k=1024, heads_q=32, heads_kv=8,
                               head_dim=128, dtype="fp16", causal=False)
    db = BestConfigDB()
    db.merge(Entry.from_result(
        arch="sm90", device="NVIDIA H200", problem=problem, config=Config.make("sm90").to_dict(), us=30.0,
        tflops=500.0, default_us=33.0, peers_us={}, max_err=0.001,
        kernel_fingerprint=kernels.kernel_fingerprint("sm90"), versions={}, study="s", trial=1))
    assert db.lookup("sm90", "NVIDIA H200", problem, kernels.kernel_fingerprint("sm90")).kind == "exact"
    _with_dsl_version(monkeypatch, "99.0.0")
    found = db.lookup("sm90", "NVIDIA H200", problem, kernels.kernel_fingerprint("sm90"))
    assert found.kind == "default" and len(found.stale) == 1
