"""The README is a front page that stays true: short, its install and test commands are the ones CI
runs, its links lead somewhere, and neither it nor docs/ speaks of our work sessions, issue numbers or
the paths of our own machines."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
CI = REPO / ".ci" / "run"
MAX_LINES = 200
MAX_WIDTH = 120


def _section(text: str, title: str) -> str:
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else None]


def _first_fenced_block(section: str) -> list[str]:
    """The command lines of the section's first ``` block, comments and blank lines left out."""
    match = re.search(r"^```[\w-]*\n(.*?)^```$", section, re.MULTILINE | re.DOTALL)
    assert match, "no fenced block"
    lines = [line.split("  #")[0].strip() for line in match.group(1).splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def _ci_lines() -> set[str]:
    return {line.strip() for line in CI.read_text().splitlines()}


def test_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines; details belong in docs/"
    wide = [(n, len(line)) for n, line in enumerate(lines, 1) if len(line) > MAX_WIDTH]
    assert not wide, f"README.md lines over {MAX_WIDTH} characters (line, width): {wide}"


def test_install_block_is_what_ci_runs():
    install = _first_fenced_block(_section(README.read_text(), "Install"))
    assert any("pip install" in line and "-e" in line for line in install), install
    missing = [line for line in install if line not in _ci_lines()]
    assert not missing, f"README install lines that .ci/run does not run: {missing}"


def test_two_commands_are_what_ci_runs():
    commands = _first_fenced_block(_section(README.read_text(), "Two commands"))
    assert len(commands) == 2, commands
    assert commands[1].startswith("python -m pytest"), commands
    # CI may add options to a command (the tests: --run-slow), never change it
    missing = [line for line in commands if not any(ci == line or ci.startswith(line + " ") for ci in _ci_lines())]
    assert not missing, f"README commands that .ci/run does not run: {missing}"


def test_ci_runs_the_slow_tests_too():
    assert any(line.startswith("python -m pytest") and ("--run-slow" in line or "-m slow" in line)
               for line in _ci_lines())
    assert "--run-slow" in _section(README.read_text(), "Two commands")


def _documents() -> list[Path]:
    return [README, *sorted((REPO / "docs").glob("*.md"))]


def test_links_lead_to_files():
    for doc in _documents():
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" not in target:
                assert (doc.parent / target).exists(), f"{doc.name} links to a missing {target}"


# what a reader cannot use: which of our work sessions or issues did something, or where a file lay on
# one of our own machines
INTERNAL = re.compile(r"\b(?:session|issue)s?[- ]#?\d+|\bthis session\b|#\d{1,4}\b(?![\w-])|/work/|/tmp/fa4",
                      re.IGNORECASE)


def test_no_session_issue_or_machine_path():
    found = [f"{doc.relative_to(REPO)}:{n}: {line.strip()}"
             for doc in _documents()
             for n, line in enumerate(doc.read_text().splitlines(), 1) if INTERNAL.search(line)]
    assert not found, "\n".join(found)


def test_the_pattern_catches_what_it_should():
    for line in ("as issue 12 asks", "in session 5's bench", "session-5 grid", "Issues 3 and 4",
                 "before this session", "see #14", "kept in /work/main/results", "OUT=/tmp/fa4-wide-out"):
        assert INTERNAL.search(line), line
    for line in ("issue slots per clock", "a session of optuna", "results/h200/s6/bench_first.json",
                 "`scaled_dot_product_attention`", "| 1, 1024, 32/8 |"):
        assert not INTERNAL.search(line), line
