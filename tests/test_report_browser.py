"""The report, built from synthetic searches, rendered in headless Chromium: every figure must draw.

Skipped where no Chromium is installed (`apt-get install chromium`; `.ci/run` installs it as root).
The screenshot is checked with a small PNG decoder (zlib + struct), so the test needs nothing new.
"""

from __future__ import annotations

import re
import struct
import zlib

import pytest

from fa4tune.report import data as rd
from fa4tune.report import draw as report_draw
from test_report_data import write_synthetic_results

CHROMIUM = report_draw.find_chromium()
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="Chromium is not installed (apt-get install chromium; .ci/run installs it "
                             "when run as root), so the report cannot be rendered")

WHITE = (255, 255, 255)
TUNED_BLUE = (0x1F, 0x77, 0xB4)
PEER_RED = (0xD6, 0x27, 0x28)


def decode_png(data: bytes) -> tuple[int, int, list[tuple[int, ...]]]:
    """(width, height, pixels as RGB tuples, row-major) of an 8-bit, non-interlaced PNG."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, header = 8, [], None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat.append(body)
        elif kind == b"IEND":
            break
    width, height, depth, color, _, _, interlace = header
    assert depth == 8 and interlace == 0, f"unsupported PNG: depth {depth}, interlace {interlace}"
    channels = {0: 1, 2: 3, 4: 2, 6: 4}[color]
    raw = zlib.decompress(b"".join(idat))
    stride = width * channels
    prev = bytearray(stride)
    pixels: list[tuple[int, ...]] = []
    at = 0
    for _ in range(height):
        kind, line = raw[at], bytearray(raw[at + 1:at + 1 + stride])
        at += 1 + stride
        if kind == 1:    # Sub
            for x in range(channels, stride):
                line[x] = (line[x] + line[x - channels]) & 0xFF
        elif kind == 2:  # Up
            line = bytearray((a + b) & 0xFF for a, b in zip(line, prev))
        elif kind == 3:  # Average
            for x in range(stride):
                left = line[x - channels] if x >= channels else 0
                line[x] = (line[x] + ((left + prev[x]) >> 1)) & 0xFF
        elif kind == 4:  # Paeth
            for x in range(stride):
                a = line[x - channels] if x >= channels else 0
                b, c = prev[x], (prev[x - channels] if x >= channels else 0)
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[x] = (line[x] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
        else:
            assert kind == 0, f"bad PNG filter {kind}"
        rgb = channels if channels >= 3 else 1
        for x in range(0, stride, channels):
            pixels.append(tuple(line[x:x + 3]) if rgb >= 3 else (line[x],) * 3)
        prev = line
    return width, height, pixels


def _near(pixel, color, tol=12) -> bool:
    return all(abs(a - b) <= tol for a, b in zip(pixel, color))


def _figure_chunks(dom: str, ids: list[str]) -> dict[str, str]:
    """The DOM between each figure's div and the next one's."""
    starts = [dom.index(f'id="{i}"') for i in ids]
    return {i: dom[s:e] for i, s, e in zip(ids, starts, starts[1:] + [len(dom)])}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    folder = tmp_path_factory.mktemp("results")
    write_synthetic_results(folder, n_trials=30)
    data = rd.collect(folder)
    return data, report_draw.write_report(data, folder / "report.html")


def test_every_figure_draws(built, tmp_path):
    data, report = built
    # comparison, heatmap, failures, importance, and history + parallel coordinates per study
    assert len(report.figure_ids) == 4 + 2 * len(data.studies) == 10
    shot = tmp_path / "report.png"
    dom = report_draw.render_in_chromium(report.path, shot, window=(1400, 2000))

    assert report_draw.rendered_plot_count(dom) == len(report.figure_ids)
    assert len(re.findall(r'class="plot-container plotly"', dom)) == len(report.figure_ids)
    for div_id, chunk in _figure_chunks(dom, report.figure_ids).items():
        assert 'class="main-svg"' in chunk, f"{div_id}: no SVG drawn"
        marks = chunk.count('class="point"') + chunk.count('class="hm"') + chunk.count("js-line")
        assert marks > 0, f"{div_id}: an empty plot (no bars, cells, points or lines)"
    assert '<div class="missing">' not in dom  # every input was there, every section drew

    width, height, pixels = decode_png(shot.read_bytes())
    assert (width, height) == (1400, 2000)
    inked = sum(1 for p in pixels if p != WHITE)
    assert inked > 0.05 * len(pixels), f"screenshot nearly blank: {inked} of {len(pixels)} pixels inked"
    # the comparison bars at the top: ours in blue, flash-attn-4 in red
    assert sum(1 for p in pixels if _near(p, TUNED_BLUE)) > 2000
    assert sum(1 for p in pixels if _near(p, PEER_RED)) > 2000


def test_report_without_inputs_renders_and_says_so(tmp_path):
    data = rd.collect(tmp_path / "nothing")
    report = report_draw.write_report(data, tmp_path / "report.html")
    assert report.figure_ids == []
    dom = report_draw.render_in_chromium(report.path)
    assert dom.count('<div class="missing">missing: ') == 3  # storage, database, bench
    assert "fa4tune report" in dom


def test_the_check_catches_plots_that_do_not_draw(built, tmp_path, monkeypatch):
    """Without plotly.js the divs stay empty: the checks above must see that, or they prove nothing."""
    data, _ = built
    monkeypatch.setattr(report_draw.plotly.offline, "get_plotlyjs", lambda: "/* plotly.js left out */")
    report = report_draw.write_report(data, tmp_path / "broken.html")
    shot = tmp_path / "broken.png"
    dom = report_draw.render_in_chromium(report.path, shot, window=(1400, 1000))
    assert report_draw.rendered_plot_count(dom) == 0
    _, _, pixels = decode_png(shot.read_bytes())
    assert sum(1 for p in pixels if _near(p, TUNED_BLUE)) < 200
