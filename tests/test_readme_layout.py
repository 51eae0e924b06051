"""The README's layout section matches the tree: every path it names exists, and every module of the
runtime and the harness is named there (a new file gets its line)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _layout() -> str:
    text = (REPO / "README.md").read_text()
    start = text.index("## Layout")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else None]


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
                assert path.name in layout, f"{package}/{path.name} is not in the README's layout"
