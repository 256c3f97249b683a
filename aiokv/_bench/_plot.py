"""``aiokv bench ... --plot FILE.png``: a report's tables as bar charts (matplotlib).

matplotlib is optional (the ``aiokv[plot]`` extra): :func:`check_plotting` says so
before a benchmark runs, not after. Every table becomes one chart per unit: its float
columns grouped by their name's suffix (``gbps``, ``ratio``, ``ms``, ``us``, ...), one
group of bars per row, the row labelled by its other columns (sizes, counts, names).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["PLOT_HINT", "check_plotting", "plot_report"]

PLOT_HINT = "--plot needs matplotlib: pip install 'aiokv[plot]' (or pip install matplotlib)"


def check_plotting() -> str | None:
    """``None`` where matplotlib can be imported; otherwise what to install."""
    try:
        found = importlib.util.find_spec("matplotlib") is not None
    except (ImportError, ValueError):
        found = False
    return None if found else PLOT_HINT


def _unit(column: str) -> str:
    return column.rsplit("_", 1)[-1] if "_" in column else column


def _charts(report: Mapping[str, Any]) -> list[tuple[str, list[str], dict[str, list[float]]]]:
    """``(title, row labels, {column: values})`` for every table and unit."""
    charts = []
    for name, rows in report.items():
        if not isinstance(rows, list) or not rows or not isinstance(rows[0], dict):
            continue
        floats = [k for k, v in rows[0].items() if isinstance(v, float)]
        labels = [
            " ".join(f"{k}={v}" for k, v in r.items() if k not in floats and k != "verified")
            for r in rows
        ]
        for unit in dict.fromkeys(_unit(k) for k in floats):
            columns = {k: [float(r[k]) for r in rows] for k in floats if _unit(k) == unit}
            charts.append((f"{report.get('bench', '')} {name}: {unit}", labels, columns))
    return charts


def plot_report(report: Mapping[str, Any], path: Path) -> int:
    """Draw ``report`` (:meth:`~._harness.Report.as_dict`) into the PNG ``path``;
    returns the number of charts (0: no table had numbers, nothing is written).

    Raises:
        ImportError: matplotlib is not installed.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    charts = _charts(report)
    if not charts:
        return 0
    fig, axes = plt.subplots(len(charts), 1, figsize=(11, 3.6 * len(charts)), squeeze=False)
    for ax, (title, labels, columns) in zip(axes[:, 0], charts, strict=True):
        width = 0.8 / len(columns)
        for i, (column, values) in enumerate(columns.items()):
            ax.bar([x + i * width for x in range(len(labels))], values, width, label=column)
        ax.set_title(title)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(labels))])
        ax.set_xticklabels(labels, rotation=20, ha="right", fontsize=7)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return len(charts)
