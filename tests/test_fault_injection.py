"""benchmarks/fault_injection.py runs whole, briefly, on CPU: non-journal files given as storage,
database writers and journal writers killed with SIGKILL, bad-typed database entries. It must find
every acknowledged write present, no file the user did not ask to change changed, nothing raised."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "fault_injection.py"


def test_the_fault_injection_run_loses_changes_and_raises_nothing():
    done = subprocess.run([sys.executable, str(SCRIPT), "--seconds", "5", "--seed", "1"],
                          capture_output=True, text=True, timeout=240)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    [summary] = [line for line in done.stdout.splitlines() if line.startswith("summary:")]
    written = re.search(r"writes acknowledged (\d+), writes present (\d+), lost (\d+);", summary)
    assert written and int(written[1]) > 0 and written[1] == written[2] and written[3] == "0", summary
    assert "files changed that the user did not ask to change 0;" in summary, summary
    assert "; raised 0;" in summary and summary.endswith("OK"), summary
    # every part ran and counted something
    assert "refused 9 of 9" in done.stdout
    assert re.search(r"2\. concurrent database writers with SIGKILLs: writes acknowledged [1-9]", done.stdout)
    assert re.search(r"3\. journal with SIGKILLs: writes acknowledged [1-9]", done.stdout)
    assert "bad entries skipped at load: 14" in done.stdout
