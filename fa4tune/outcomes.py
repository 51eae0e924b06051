"""How a configuration's evaluation can end: the one list of outcome names.

A failing configuration is a result with a reason, not an exception that ends the run. The search
writes one of these to a trial's user attribute "outcome", the bench to a row's "outcome", and the
report counts them in this order.

    ok             validated and timed
    infeasible     rejected by the kernel's feasibility model before any worker saw it
    compile_error  compilation raised (or the compiler process died)
    launch_error   the launch raised and the CUDA context is still healthy afterwards
    fault          the CUDA context is poisoned afterwards, or the worker died during the GPU phase
    timeout        compile phase over its limit, or GPU phase over its limit (the worker is killed)
    mismatch       wrong output (`fa4.reference.compare`: rtol = atol = 1e-2 against SDPA and fp32)
    interrupted    the harness died while the trial ran (swept on the next run; never measured)
    missing        a bench row of the tuned configuration when the database has no usable entry
"""

from __future__ import annotations

OK = "ok"
INFEASIBLE = "infeasible"
INTERRUPTED = "interrupted"
MISSING = "missing"
# what a worker can report for a configuration it was given
WORKER_FAILURES = ("compile_error", "launch_error", "fault", "timeout", "mismatch")
# the outcomes of a measured trial (infeasible counts: it is recorded, with its reasons)
OUTCOMES = (OK, INFEASIBLE) + WORKER_FAILURES
# every outcome a stored trial can carry
ALL_OUTCOMES = OUTCOMES + (INTERRUPTED,)
FAILED = tuple(o for o in OUTCOMES if o != OK)


def short_error(exc: BaseException | str, limit: int = 400) -> str:
    """The reason recorded with a failed outcome: one line, at most `limit` characters."""
    text = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
    lines = [ln for ln in str(text).strip().splitlines() if ln.strip()]
    if not lines:
        return str(text)[:limit]
    # DSL and CUDA errors put the useful line last, Python puts it first: keep both ends
    joined = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"
    return joined[:limit]
