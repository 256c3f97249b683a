"""``aiokv bench ... --plot FILE.png``: the charts a reader of a benchmark wants.

matplotlib is optional (the ``aiokv[plot]`` extra): :func:`check_plotting` says so
before a benchmark runs, not after. :func:`charts` decides what to draw from the report
alone (no matplotlib), :func:`plot_report` draws it:

* per table, one chart per measured unit — throughput (``*_gbps``), ratios
  (``*ratio``), times (``*_ms``, ``*_us``) — against the table's inputs (block size,
  block count, case) on the x axis; input columns are labels, never bars, and
  differences of two charted columns (``*_added_*``, ``*_over_*``) are left out;
* the raw baseline (a column named ``raw…``) drawn grey beside aiokv's bars;
* ratio charts with a dashed line at 1.0 (as fast as the baseline);
* latency percentiles of a summary (``p50_ms``, ``p99_ms``, …) as one chart;
* every axis with its unit, fonts readable at 100 %.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any

__all__ = ["PLOT_HINT", "Chart", "charts", "check_plotting", "plot_report"]

PLOT_HINT = "--plot needs matplotlib: pip install 'aiokv[plot]' (or pip install matplotlib)"

#: column suffix -> the y axis of its chart
UNITS = {
    "gbps": "throughput, GB/s (10⁹ bytes/s)",
    "ratio": "ratio to the raw baseline (>1: faster)",
    "ms": "time, ms",
    "us": "time, µs",
}
#: columns that say what was measured on, shown in the x labels (in this order)
_SIZE_KEYS = ("case", "block_kib", "block", "count", "nblocks", "K", "op")
#: how the x axis names an input column
_AXIS = {"block_kib": "block size", "count": "blocks", "nblocks": "blocks", "K": "blocks"}
#: differences of two charted columns (``pull_added_us``, ``sync_over_async_us``): the
#: bars already show them
_DERIVED = re.compile(r"_(added|over)_")
_PERCENTILE = re.compile(r"p(\d+(?:\.\d+)?)_(ms|us)")


@dataclass(frozen=True, slots=True)
class Chart:
    """One chart: ``series[name][i]`` is the bar of row ``labels[i]``, in ``unit``."""

    title: str
    unit: str
    labels: list[str]
    series: dict[str, list[float]]
    xlabel: str = ""
    reference: float | None = None  # a horizontal line (1.0 on ratio charts)
    baselines: list[str] = field(default_factory=list)  # series drawn as the baseline


def check_plotting() -> str | None:
    """``None`` where matplotlib can be imported; otherwise what to install."""
    try:
        found = importlib.util.find_spec("matplotlib") is not None
    except (ImportError, ValueError):
        found = False
    return None if found else PLOT_HINT


def _unit(column: str) -> str | None:
    for suffix in UNITS:
        if column == suffix or column.endswith("_" + suffix):
            return suffix
    return None


#: what a chart of each unit shows, in its title
_NOUN = {"gbps": "", "ratio": ", ratio to the raw baseline", "ms": ", time", "us": ", time"}


def _legend(column: str, unit: str) -> str:
    """A series' name without its unit suffix (``pull_gbps`` -> ``pull``)."""
    return column.removesuffix("_" + unit) or column


def _label(row: Mapping[str, Any], inputs: list[str]) -> str:
    """The x label of ``row``: its case (if any) over its size (``16 KiB × 64``)."""
    names, sizes = [], []
    for key in inputs:
        value = row[key]
        if key == "block_kib":
            sizes.append(f"{value} KiB" if value < 1024 else f"{value // 1024} MiB")
        elif key in ("count", "nblocks", "K"):
            sizes.append(f"× {value}")
        else:
            names.append(str(value))
    return "\n".join(filter(None, (" ".join(names), " ".join(sizes))))


def _charted(row: Mapping[str, Any]) -> list[str]:
    """The columns of ``row`` drawn as bars: numbers in a unit, differences left out."""
    return [
        k
        for k, v in row.items()
        if isinstance(v, int | float) and _unit(k) and not _DERIVED.search(k)
    ]


def _inputs(row: Mapping[str, Any], charted: list[str]) -> list[str]:
    """The columns of ``row`` that name what was measured on (the x labels)."""
    known = [k for k in _SIZE_KEYS if k in row]
    if known:
        return known
    return [k for k, v in row.items() if k not in charted and not isinstance(v, bool)][:2]


def _table_charts(bench: str, name: str, rows: list[Mapping[str, Any]]) -> list[Chart]:
    numeric = _charted(rows[0])
    inputs = _inputs(rows[0], numeric)
    labels = [_label(r, inputs) for r in rows]
    by_unit: dict[str, list[str]] = {}
    for column in numeric:
        by_unit.setdefault(_unit(column) or "", []).append(column)
    return [
        Chart(
            title=f"aiokv bench {bench}: {name}" + _NOUN[unit],
            unit=unit,
            labels=labels,
            series={k: [float(r.get(k, 0.0)) for r in rows] for k in columns},
            xlabel=" × ".join(_AXIS.get(k, k) for k in inputs),
            reference=1.0 if unit == "ratio" else None,
            baselines=[k for k in columns if k.startswith("raw")],
        )
        for unit, columns in by_unit.items()
    ]


def _percentile_chart(bench: str, name: str, values: Mapping[str, Any]) -> Chart | None:
    found = [(m, k) for k in values if (m := _PERCENTILE.fullmatch(k))]
    if not found:
        return None
    unit = found[0][0].group(2)
    keys = [k for m, k in found if m.group(2) == unit]
    return Chart(
        title=f"aiokv bench {bench}: {name}, latency percentiles",
        unit=unit,
        labels=[k.split("_")[0] for k in keys],
        series={name: [float(values[k]) for k in keys]},
        xlabel="percentile",
    )


def charts(report: Mapping[str, Any]) -> list[Chart]:
    """What :func:`plot_report` draws for ``report`` (:meth:`~._harness.Report.as_dict`)."""
    bench = str(report.get("bench", ""))
    out: list[Chart] = []
    for name, part in report.items():
        if isinstance(part, list) and part and isinstance(part[0], Mapping):
            out += _table_charts(bench, name, part)
        elif isinstance(part, Mapping) and name != "meta":
            chart = _percentile_chart(bench, name, part)
            if chart is not None:
                out.append(chart)
    return out


def plot_report(report: Mapping[str, Any], path: Path) -> int:
    """Draw :func:`charts` of ``report`` into ``path`` (PNG, SVG or PDF by its suffix);
    returns the number of charts (0: nothing to draw, nothing is written).

    Raises:
        ImportError: matplotlib is not installed.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    drawn = charts(report)
    if not drawn:
        return 0
    plt.rcParams.update({"font.size": 11, "axes.titlesize": 13, "legend.fontsize": 10})
    width = max(11.0, 3.0 + 1.5 * max(len(c.labels) for c in drawn))  # room for each label
    fig, axes = plt.subplots(len(drawn), 1, figsize=(width, 4.2 * len(drawn)), squeeze=False)
    for ax, chart in zip(axes[:, 0], drawn, strict=True):
        n = len(chart.series)
        width = 0.8 / n
        xs = range(len(chart.labels))
        for i, (column, values) in enumerate(chart.series.items()):
            baseline = column in chart.baselines
            ax.bar(
                [x - 0.4 + width * (i + 0.5) for x in xs],
                values,
                width,
                label=_legend(column, chart.unit) + (" (baseline)" if baseline else ""),
                color="0.6" if baseline else None,
                hatch="//" if baseline else None,
            )
        if chart.reference is not None:
            ax.axhline(
                chart.reference,
                color="black",
                linestyle="--",
                linewidth=1.2,
                label=f"{chart.reference:g} = as fast as the baseline",
            )
        ax.set_title(chart.title, loc="left")
        ax.set_ylabel(UNITS[chart.unit])
        ax.set_xlabel(chart.xlabel)
        ax.set_xticks(list(xs))
        ax.set_xticklabels(chart.labels, fontsize=10 if len(chart.labels) > 6 else 11)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return len(drawn)
