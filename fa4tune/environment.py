"""Facts about the software a result was measured with: versions, and the kernel API and fingerprint."""

from __future__ import annotations

import importlib


def versions() -> dict:
    """{"torch", "cutlass_dsl", "optuna", "cuda"} and each peer's own package under the peer's name
    (`fa4.backends.recorded_versions`: "flash_attn_4"); None where not installed. Recorded with every
    result."""
    import optuna
    import torch

    from fa4 import backends

    return {"torch": torch.__version__, "cutlass_dsl": backends.distribution_version("nvidia-cutlass-dsl"),
            "optuna": optuna.__version__, "cuda": torch.version.cuda, **backends.recorded_versions()}


def kernel_api(name: str = "fa4.kernels"):
    """The module giving feasible/default_config/compile_key/kernel_fingerprint (tests inject one)."""
    return importlib.import_module(name)


def kernel_fingerprint(arch: str, api: str = "fa4.kernels") -> str:
    """The kernel fingerprint of a family (our sources and the DSL toolchain), or "unavailable (why)"
    when it cannot be imported."""
    from fa4tune.workers.outcomes import portable_error

    try:
        return kernel_api(api).kernel_fingerprint(arch)
    except Exception as exc:  # the family is not importable (yet): say so, do not guess
        return f"unavailable ({portable_error(exc, 80)})"


def utc_now() -> str:
    from fa4.database import utc_now as now

    return now()
