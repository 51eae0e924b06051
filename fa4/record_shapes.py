"""`FA4_RECORD_SHAPES=path`: append each new problem `fa4.attention` sees to a shapes file, so that
`fa4tune search --shapes-file path` tunes what a real program runs.

The runtime calls `note` only on the first call of a signature (its checked path, `_slow_call`), never
on the kernel path of later calls, so a program's per-call host time does not change; `note` itself is
one set lookup for a problem already written by this process. Each new problem is appended as one
`[[problem]]` table (`fa4tune.inputs.shape_sets`), whole, under an `flock` on the shapes file itself (the file
is only ever appended to, never replaced, so its own lock serves and no lock file is left beside it),
so several processes may record into one file; a problem recorded by two processes appears twice and
is read once. Recording never breaks a forward pass: a file that cannot be written warns once and
recording stops.
"""

from __future__ import annotations

import fcntl
import os
import warnings

from fa4.kernels import AttentionProblem

RECORD_ENV = "FA4_RECORD_SHAPES"

_path: str | None = os.environ.get(RECORD_ENV) or None
_seen: set[AttentionProblem] = set()


# a variable-length batch's fields a [[varlen]] table does not take: its lengths say them
_VARLEN_IMPLIED = ("batch", "seqlen_q", "seqlen_k", "varlen")


def problem_table(problem: AttentionProblem) -> str:
    """One `[[problem]]` table of a shapes file, every field single-valued, or for a variable-length
    batch (`fa4.varlen_batch.VarlenProblem`) its `[[varlen]]` table with the lengths written out. It
    lives here, not in `fa4tune.inputs.shape_sets` (which reads shapes files), because the runtime does
    not import the harness."""
    values = problem.to_dict()
    kind = "varlen" if values.get("lengths_q") is not None else "problem"
    fields = []
    for name, value in values.items():
        if kind == "varlen" and name in _VARLEN_IMPLIED:
            continue
        text = ("true" if value else "false") if isinstance(value, bool) else (
            f'"{value}"' if isinstance(value, str) else str(value))   # a window or lengths: [a, b, ...]
        fields.append(f"{name} = {text}")
    return f"[[{kind}]]\n" + "\n".join(fields) + "\n"


def note(spec, causal: bool, return_lse: bool, window=None, softcap=None) -> None:
    """Record the problem of these inputs (an `fa4.checks.InputSpec`; the mask as resolved) if it is new
    to this process."""
    global _path
    if _path is None or spec.dtype is None or spec.is_empty:
        return
    try:
        problem = spec.problem(causal, return_lse, window, softcap)
    except ValueError:
        return
    if problem in _seen:
        return
    _seen.add(problem)
    try:
        # O_NONBLOCK: a FIFO with no reader is an error here, not a forward pass that waits forever
        fd = os.open(_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            # one write of the whole table, in append mode: readers never see half a table
            os.write(fd, (problem_table(problem) + "\n").encode())
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)   # before closing: a child forked meanwhile shares the descriptor
            os.close(fd)
    except OSError as exc:
        warnings.warn(f"fa4: {RECORD_ENV}={_path}: cannot record shapes ({exc}); recording stops",
                      RuntimeWarning, stacklevel=3)
        _path = None
