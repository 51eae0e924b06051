"""Marker handling: GPU tests run only where the GPU they need is present, slow tests only when asked.

`gpu`   needs a CUDA GPU our runnable kernel supports (Hopper, sm_90).
`sm100` needs a Blackwell GPU our sm100 kernel runs on (compute capability 10.0, `fa4.arch`).
`slow`  long CPU compiles: skipped unless `--run-slow` is given or the `-m` expression names `slow`.
Detection touches CUDA only when such a test was collected, so CPU collection never needs it.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from fa4.arch import arch_of_capability

# The repository's kernels/ folder is installed as `fa4.kernels`; with the repository root on sys.path
# (`python -m pytest` puts the working directory first) it would also be a top-level `kernels`, and
# shadow Hugging Face's `kernels` package, which transformers (5.25 and later) imports. Nothing of ours
# imports the top-level name, so the root goes from the path.
_REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or os.getcwd()).resolve() != _REPO_ROOT]
if getattr(sys.modules.get("kernels"), "__file__", None) == str(_REPO_ROOT / "kernels" / "__init__.py"):
    del sys.modules["kernels"]


# a test never reads or writes the developer's own results directory (fa4tune.paths): the runtime
# would otherwise pick up a tuned database from ~/.cache/fa4tune, and the harness write into it; the
# folder is the session's own and goes when the session ends (pytest_unconfigure)
_TEST_HOME = tempfile.mkdtemp(prefix="fa4tune-test-home-")
os.environ["FA4TUNE_HOME"] = _TEST_HOME
os.environ.pop("FA4_CONFIG_DB", None)
# nor the developer's compiled-kernel cache; and tests that count compiles must see them, so the
# disk cache is off unless a test turns it on (tests/test_compile_cache*.py do)
os.environ["FA4TUNE_CACHE_DIR"] = os.path.join(os.environ["FA4TUNE_HOME"], "kernels")
os.environ["FA4TUNE_DISK_CACHE"] = "0"


@pytest.fixture(autouse=True, scope="session")
def _compile_reports_as_the_harness_makes_them():
    """CPU compile reports here are made as fa4tune's evaluator makes them: without source locations,
    which cost half a report's time and change nothing in it (tests/test_compile_report_locations.py)."""
    from fa4.kernels.dsl_internals import without_source_locations

    with without_source_locations():
        yield


@functools.lru_cache(maxsize=1)
def _compute_capability() -> tuple[int, int] | None:
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability()


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", default=False,
                     help="also run the tests marked slow (long CPU compiles); `-m slow` runs only them")


def pytest_unconfigure(config):
    shutil.rmtree(_TEST_HOME, ignore_errors=True)


def _skip_slow_unless_asked(config, items):
    # an -m expression that names slow (`-m slow`, `-m "not slow"`) already says what the caller wants
    if config.getoption("--run-slow") or "slow" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="slow: run with --run-slow, or only these with -m slow")
    for item in items:
        if item.get_closest_marker("slow"):
            item.add_marker(skip)


def pytest_collection_modifyitems(config, items):
    _skip_slow_unless_asked(config, items)
    # markers, not keywords: a parametrize id such as "sm100" is a keyword too
    wants_gpu = [i for i in items if i.get_closest_marker("gpu") or i.get_closest_marker("sm100")]
    if not wants_gpu:
        return
    cc = _compute_capability()
    for item in wants_gpu:
        if item.get_closest_marker("sm100"):
            if cc is None or arch_of_capability(cc) != "sm100":
                item.add_marker(pytest.mark.skip(reason=f"needs a Blackwell GPU (sm_100); found {cc}"))
        elif cc is None:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU; none is available"))
        elif arch_of_capability(cc) != "sm90":
            item.add_marker(pytest.mark.skip(reason=f"needs a Hopper GPU (sm_90); found sm_{cc[0]}{cc[1]}"))
