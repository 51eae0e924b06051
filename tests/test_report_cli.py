"""`fa4tune report` as a command: writes one self-contained file, and reports what is missing."""

from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner

from fa4tune.report import report_command
from test_report_data import write_synthetic_results


def test_report_command_writes_a_self_contained_file(tmp_path):
    write_synthetic_results(tmp_path / "results", n_trials=12)
    out = tmp_path / "out" / "report.html"
    result = CliRunner().invoke(report_command, ["--results", str(tmp_path / "results"), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == str(out)  # data on stdout, progress on stderr
    assert "3 studies" in result.stderr
    text = out.read_text(encoding="utf-8")
    # offline: no script or stylesheet is fetched from anywhere
    assert not re.search(r"<script[^>]+src=", text)
    assert not re.search(r"<link[^>]+href=\"?https?:", text)
    assert "Plotly" in text and len(text) > 3_000_000  # plotly.js itself is inlined
    assert text.count('class="plotly-graph-div') == 4 + 2 * 3
    assert not list(out.parent.glob("*.tmp"))  # the atomic write left nothing behind


def test_report_command_data_json(tmp_path):
    write_synthetic_results(tmp_path / "results", n_trials=12)
    data_json = tmp_path / "report.json"
    result = CliRunner().invoke(report_command, ["--results", str(tmp_path / "results"), "--out",
                                                 str(tmp_path / "r.html"), "--data-json", str(data_json)])
    assert result.exit_code == 0, result.output
    data = json.loads(data_json.read_text())
    assert len(data["studies"]) == 3 and "ok_study" not in data["studies"][0]
    assert data["studies"][0]["outcomes"]["ok"] > 0
    assert data["speedup_summary"]["flash_attn_4"]["geomean"] == pytest.approx(1.1)
    assert len(data["shape_rows"]) == 3 and data["heatmaps"][0]["baseline"] == "default"


def test_report_command_explicit_inputs_and_missing_ones(tmp_path):
    write_synthetic_results(tmp_path / "results", n_trials=12)
    out = tmp_path / "report.html"
    result = CliRunner().invoke(report_command, [
        "--results", str(tmp_path / "elsewhere"), "--storage", str(tmp_path / "results" / "studies.journal"),
        "--bench", str(tmp_path / "results" / "bench.json"), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "missing: best-config database" in result.stderr
    text = out.read_text(encoding="utf-8")
    assert "missing: best-config database" in text and "3 studies" in text


def test_report_is_registered_in_the_cli():
    cli = pytest.importorskip("fa4tune.cli", reason="fa4tune.cli is not written yet")
    assert cli.main.get_command(None, "report") is report_command
