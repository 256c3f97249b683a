"""``--plot``: per table the charts a reader wants — throughput with the raw baseline,
ratios with a line at 1.0, latency percentiles — every axis with its unit, input
columns as labels, never as bars."""

from __future__ import annotations

from pathlib import Path

import pytest

from aiokv._bench._plot import UNITS
from aiokv._bench._plot import charts
from aiokv._bench._plot import plot_report

REPORT = {
    "bench": "transfer",
    "meta": {"quick": True},
    "throughput": [
        {"block_kib": 16, "count": 256, "mib_moved": 4.0, "raw_gbps": 2.2,
         "pull_gbps": 2.4, "pull_ratio": 1.09, "pull_added_us": 5.0, "verified": True},
        {"block_kib": 1024, "count": 64, "mib_moved": 64.0, "raw_gbps": 1.5,
         "pull_gbps": 4.2, "pull_ratio": 2.83, "pull_added_us": 6.0, "verified": True},
    ],
    "concurrent": {"completed": 16, "p50_ms": 1.5, "p99_ms": 3.0, "wall_ms": 40.0},
}  # fmt: skip


def test_the_charts_a_reader_wants() -> None:
    got = {c.unit: c for c in charts(REPORT)}
    assert set(got) == {"gbps", "ratio", "ms"}
    gbps, ratio, pct = got["gbps"], got["ratio"], got["ms"]
    assert gbps.labels == ["16 KiB × 256", "1 MiB × 64"] and gbps.xlabel == "block size × blocks"
    assert set(gbps.series) == {"raw_gbps", "pull_gbps"} and gbps.baselines == ["raw_gbps"]
    assert ratio.series == {"pull_ratio": [1.09, 2.83]} and ratio.reference == 1.0
    assert gbps.reference is None
    assert pct.labels == ["p50", "p99"] and pct.series == {"concurrent": [1.5, 3.0]}
    for chart in got.values():
        assert "mib_moved" not in chart.series and "count" not in chart.series
        assert "pull_added_us" not in chart.series  # a difference of two bars
        assert UNITS[chart.unit]


def test_a_report_without_numbers_draws_nothing(tmp_path: Path) -> None:
    assert charts({"bench": "x", "meta": {}, "t": [{"case": "a", "verified": True}]}) == []


def test_the_png_is_drawn(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "r.png"
    assert plot_report(REPORT, out) == 3
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
