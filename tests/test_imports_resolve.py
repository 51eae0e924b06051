"""Every import of our own code resolves, including in code that CI never runs.

GPU tests, benchmarks and worker-side paths run only on the H200, so a renamed helper breaks them
unnoticed until device time is spent (the SDPA stand-in of tests/test_search_gpu.py imported a helper
of fa4tune.workers.peers for months after it had moved). This reads the imports without running the code.
"""

from __future__ import annotations

import ast
import importlib
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OURS = ("fa4", "fa4tune", "test_search_fakes")  # kernels/ is imported as fa4.kernels
SOURCES = ("fa4", "fa4tune", "kernels", "tests", "benchmarks")


def _resolves(module_name: str, name: str | None) -> bool:
    """`import module_name` (name None) or `from module_name import name`; ImportError when the module
    itself does not import."""
    module = importlib.import_module(module_name)
    if name is None or hasattr(module, name):
        return True
    try:  # `from package import submodule`
        importlib.import_module(f"{module_name}.{name}")
        return True
    except ImportError:
        return False


def unresolved_imports(paths) -> list[str]:
    """'file:line module.name' for each absolute import of our packages that does not resolve."""
    missing = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                wanted = [(node.module, alias.name) for alias in node.names if alias.name != "*"]
            elif isinstance(node, ast.Import):
                wanted = [(alias.name, None) for alias in node.names]
            else:
                continue
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            for module, name in wanted:
                if module.split(".")[0] not in OURS:
                    continue
                try:
                    if not _resolves(module, name):
                        missing.append(f"{where} {module}.{name}")
                except ImportError as exc:
                    missing.append(f"{where} {module} ({exc})")
    return missing


def test_every_import_of_our_code_resolves():
    paths = sorted(p for top in SOURCES for p in (ROOT / top).rglob("*.py"))
    assert len(paths) > 100
    assert unresolved_imports(paths) == []


def test_a_missing_name_is_reported(tmp_path, monkeypatch):
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    stale = tmp_path / "stale.py"
    stale.write_text("from fa4tune.workers.peers import _sdpa_call\nimport fa4tune.no_such_module\n")
    assert unresolved_imports([stale]) == ["stale.py:1 fa4tune.workers.peers._sdpa_call",
                                           "stale.py:2 fa4tune.no_such_module (No module named "
                                           "'fa4tune.no_such_module')"]


def test_every_package_is_installed():
    """A sub-package missing from pyproject's package list imports from a checkout and is missing from
    an installed wheel (`fa4tune` is used installed on the device), so every folder of modules is listed."""
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folder_of = {package: folder for package, folder in setup["package-dir"].items()}
    roots = {"fa4": ROOT / "fa4", "fa4tune": ROOT / "fa4tune", "fa4.kernels": ROOT / folder_of["fa4.kernels"]}
    found = {".".join((package, *init.parent.relative_to(root).parts))
             for package, root in roots.items() for init in root.rglob("__init__.py")}
    assert {"fa4tune.searches", "fa4tune.workers", "fa4.kernels.sm90"} <= found
    assert found <= set(setup["packages"]), sorted(found - set(setup["packages"]))
