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

A reason is a note that travels: into the journal, a bench file, a report, all of which are committed
and shared. `portable_note` rewrites the absolute paths in one (a compiler's traceback names files
under site-packages or a home directory) so that no note carries a machine's layout; `portable_error`
applies it to every reason it makes, and the bench and the report apply it again to what they read.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

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


def portable_error(exc: BaseException | str, limit: int = 400) -> str:
    """The reason recorded with a failed outcome: one line, at most `limit` characters, without an
    absolute path (`portable_note`), since it is committed and shared. (A message to the user of this
    process keeps its paths: `fa4.backends.first_error_line`.)"""
    text = portable_note(exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}")
    lines = [ln for ln in str(text).strip().splitlines() if ln.strip()]
    if not lines:
        return str(text)[:limit]
    # DSL and CUDA errors put the useful line last, Python puts it first: keep both ends
    joined = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"
    return joined[:limit]


# An absolute path inside a note: a "/" that starts a word (not the second half of "us/call", not the
# "//" of a URL, not a path `portable_note` already shortened: "<home>/x", "…/x"), unless it follows
# a URL's "scheme:///" (sqlite:////abs/s.db), then the characters a file name may hold in a message.
_PATH_CHAR = r"[^\s/'\"`<>:;,()\[\]{}|]"
_ABSOLUTE_PATH = re.compile(rf"(?:(?<=:///)|(?<![\w.~…<>/:\\-]))/{_PATH_CHAR}+(?:/{_PATH_CHAR}*)*")
_SITE_PACKAGES = re.compile(r"/(?:site|dist)-packages(?=/|$)")
_HOME = re.compile(r"^(?:/home/[^/]+|/Users/[^/]+|/root)(?=/|$)")


def portable_note(text: str, results_dir: str | os.PathLike | None = None) -> str:
    """`text` with each absolute path rewritten so it names no machine's layout: below a
    site-packages folder `<site-packages>/...`, below the results directory (`results_dir`, default
    the user's, `fa4tune.paths`) `<results>/...`, below a home directory (this user's, /home/NAME,
    /root, /Users/NAME) `<home>/...`, anywhere else its file name alone. Idempotent."""
    results = os.path.abspath(results_dir if results_dir is not None else _user_results_dir())
    roots = [("<results>", results)] + ([("<home>", str(Path.home()))] if str(Path.home()) != "/" else [])

    def shorten(path: str) -> str:
        site = list(_SITE_PACKAGES.finditer(path))
        if site:
            return "<site-packages>" + path[site[-1].end():]
        for placeholder, root in roots:
            if path == root or path.startswith(root + "/"):
                return placeholder + path[len(root):]
        if _HOME.match(path):
            return _HOME.sub("<home>", path)
        return Path(path).name or path

    def rewrite(match: re.Match) -> str:
        path = match.group(0).rstrip(".")   # a sentence's full stop is not part of the file name
        return shorten(path) + match.group(0)[len(path):]

    return _ABSOLUTE_PATH.sub(rewrite, str(text))


def _user_results_dir() -> Path:
    from fa4tune.paths import results_dir   # (imports fa4: only when a note is made)

    return results_dir()
