"""Compare the runs scripts/ab_bench.sh wrote: each same-run ratio's median (min-max)
over the rounds, before and after, and after/before of the medians.

Usage: python scripts/ab_compare.py OUT
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any


def _runs(out: Path, bench: str, side: str) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(out.glob(f"{bench}-{side}-*.json"))]


def _ratios(out: Path, side: str) -> dict[str, list[float]]:
    rows: dict[str, list[float]] = defaultdict(list)
    for d in _runs(out, "latency", side):
        for r in d["latency"]:
            shape = f"{r['block_kib']} KiB x{r.get('tensors', 1)} tensors"
            rows[f"latency {shape} pull_us"].append(r["pull_us"])
            rows[f"latency {shape} pull/raw"].append(r["pull_us"] / r["raw_us"])
    for d in _runs(out, "layerwise", side):
        for r in d["layerwise_overhead"]:
            for k in ("by_key_ratio", "by_addrs_ratio"):
                rows[f"layerwise {r['mib']:.0f} MiB {k}"].append(r[k])
    for d in _runs(out, "nixl", side):
        for r in d["nixl_ratios"]:
            for k in ("shm_read", "shm_write", "utcp_read", "utcp_write"):
                rows[f"nixl {r['block_kib']} KiB x{r['count']} {k}"].append(r[k])
    return rows


def main(out: Path) -> None:
    before, after = _ratios(out, "before"), _ratios(out, "after")

    def cell(v: list[float]) -> str:
        return f"{statistics.median(v):.3f} ({min(v):.2f}-{max(v):.2f})"

    print("| metric | before | after | after/before |\n|---|---|---|---|")
    for name, b in before.items():
        a = after.get(name)
        if a:
            ratio = statistics.median(a) / statistics.median(b)
            print(f"| {name} | {cell(b)} | {cell(a)} | {ratio:.3f} |")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
