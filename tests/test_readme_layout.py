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


def test_every_module_is_named():
    layout = _layout()
    for package in ("fa4", "fa4tune"):
        for path in sorted((REPO / package).glob("*.py")):
            if path.name != "__init__.py":
                assert path.name in layout, f"{package}/{path.name} is not in the layout of docs/design.md"
