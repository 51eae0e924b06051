"""Facts about the software a result was measured with: versions, and the kernel API and fingerprint."""

from __future__ import annotations

import importlib
from importlib import metadata
from typing import Optional


def versions() -> dict:
    """{"torch", "cutlass_dsl", "optuna", "cuda", "flash_attn_4"}: recorded with every result."""
    def dist(name: str) -> Optional[str]:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    import optuna
    import torch

    return {"torch": torch.__version__, "cutlass_dsl": dist("nvidia-cutlass-dsl"),
            "optuna": optuna.__version__, "cuda": torch.version.cuda,
            "flash_attn_4": dist("flash-attn-4")}


def kernel_api(name: str = "fa4.kernels"):
    """The module giving feasible/default_config/compile_key/kernel_fingerprint (tests inject one)."""
    return importlib.import_module(name)


def kernel_fingerprint(arch: str, api: str = "fa4.kernels") -> str:
    """The kernel fingerprint of a family (our sources and the DSL toolchain), or "unavailable (why)"
    when it cannot be imported."""
    from fa4tune.outcomes import short_error

    try:
        return kernel_api(api).kernel_fingerprint(arch)
    except Exception as exc:  # the family is not importable (yet): say so, do not guess
        return f"unavailable ({short_error(exc, 80)})"


def utc_now() -> str:
    from fa4.database import utc_now as now

    return now()
