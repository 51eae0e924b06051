"""Compile reports without source locations (fa4.kernels.dsl_internals.without_source_locations): the hook
still reaches the DSL, and the report it gives is the one a compile with source locations gives.

tests/conftest.py makes every test's compile reports this way, as fa4tune's evaluator does; this
test compiles once each way. It fails loudly when a DSL upgrade moves the hook (reports would
silently take twice as long) or when dropping the locations changes what ptxas reports.
"""

from __future__ import annotations

import pytest

from fa4.kernels.dsl_internals import without_source_locations
from fa4.kernels import AttentionProblem, Config, sm90

PROBLEM = AttentionProblem(1, 1024, 1024, 32, 8, 128, "fp16", causal=True)
SAME_KEYS = ("ok", "registers", "spill_stores", "spill_loads", "stack_frame", "wgmma_serialized",
             "ptxas_warnings", "smem_bytes", "ptx_markers")


def _location_tracking():
    from cutlass._mlir_helpers import op
    return op._ENABLE_FRAME_FILTERING


def test_a_report_without_source_locations_is_the_same_report(monkeypatch):
    from cutlass._mlir_helpers import op
    from cutlass.base_dsl import dsl

    config = Config.make("sm90")
    # with locations: the DSL's own switch, whatever the session's fixture installed
    monkeypatch.setattr(dsl, "_set_enable_frame_filtering", op._set_enable_frame_filtering)
    with_locations = sm90.compile_report(config, PROBLEM)
    assert _location_tracking() is True, "a report (ptxas remarks) no longer turns source locations on"

    with without_source_locations() as took_effect:
        assert took_effect, "the DSL has no cutlass.base_dsl.dsl._set_enable_frame_filtering any more"
        without = sm90.compile_report(config, PROBLEM)
        assert _location_tracking() is False
    assert {k: without[k] for k in SAME_KEYS} == {k: with_locations[k] for k in SAME_KEYS}
    assert dsl._set_enable_frame_filtering is op._set_enable_frame_filtering  # restored


def test_the_hook_is_restored_when_the_compile_raises():
    from cutlass.base_dsl import dsl

    before = dsl._set_enable_frame_filtering
    with pytest.raises(RuntimeError):
        with without_source_locations():
            raise RuntimeError("a failed compile")
    assert dsl._set_enable_frame_filtering is before
