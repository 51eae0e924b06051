"""The layout section of the design document (docs/design.md, "Layout") matches the tree: every path
it names exists, and every module of the runtime and the harness is named there (a new file gets its
line)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _layout() -> str:
    text = (REPO / "docs" / "design.md").read_text()
    heading = re.search(r"^## (?:\d+\. )?Layout$", text, re.MULTILINE)
    assert heading, "docs/design.md has no Layout section"
    end = text.find("\n## ", heading.end())
    return text[heading.start():end if end != -1 else None]


def test_every_named_path_exists():
    names = re.findall(r"`([\w./*-]+/[\w./*-]*)`", _layout())
    assert names
    for name in names:
        if "*" in name:
            assert list(REPO.glob(name)), name
        else:
            assert (REPO / name).exists(), name


def _modules(package: str) -> list[str]:
    """Every module of a package and its sub-packages, as its path from the repository root; a
    sub-package's `__init__.py` stands for the sub-package (its folder)."""
    modules = []
    for path in sorted((REPO / package).rglob("*.py")):
        name = path.relative_to(REPO).as_posix()
        if path.name != "__init__.py":
            modules.append(name)
        elif path.parent != REPO / package:
            modules.append(name.removesuffix("__init__.py"))
    return modules


def test_every_module_is_named():
    """By its path (`fa4tune/searches/study.py`), or by its name in a row that names its folder
    (`fa4tune/searches/`: ... `study.py`); a sub-package by its folder."""
    layout = _layout()
    rows = layout.splitlines()
    for package in ("fa4", "fa4tune"):
        for name in _modules(package):
            folder, _, leaf = name.rstrip("/").rpartition("/")
            named = f"`{name}`" in layout or any(f"`{folder}/`" in row and f"`{leaf}`" in row for row in rows)
            assert named, f"{name} is not in the layout of docs/design.md"


def test_sub_packages_are_found():
    assert "fa4tune/searches/study.py" in _modules("fa4tune") and "fa4tune/searches/" in _modules("fa4tune")
