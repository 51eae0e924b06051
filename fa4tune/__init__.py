"""fa4tune: the harness that searches kernel knobs per shape, keeps the best-config database and reports.

`fa4tune.search(...)` and `fa4tune.bench(...)` are the Python API (`fa4tune.api`), loaded on first use so
that `import fa4tune` (and `fa4tune --help`) stays light.
"""

_API = ("search", "bench")


def __getattr__(name: str):
    if name in _API:
        from fa4tune import api

        return getattr(api, name)
    raise AttributeError(f"module 'fa4tune' has no attribute {name!r}")
