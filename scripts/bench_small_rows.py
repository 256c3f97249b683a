"""The 4 MiB rows of ``aiokv bench transfer`` alone, twice each, in a fixed order.

``python scripts/bench_small_rows.py`` (from the repository root, or from a worktree of
another commit with today's ``aiokv/_bench/`` copied in, for before/after figures).
The grid's first row is its coldest; measuring the same rows in the same order in both
trees keeps that from looking like a regression.
"""

from __future__ import annotations

from typing import Any

from aiokv._bench import transfer
from aiokv._bench._harness import Report
from aiokv._bench._harness import run_remote
from aiokv._bench.mooncake import Peers
from aiokv._bench.raw import RawStream

KIB = 1 << 10
ROWS = [(16 * KIB, 256), (64 * KIB, 64)] * 2


def main() -> None:
    report = Report("small-rows", {})

    async def run(peer: Any, decoder: Any) -> None:
        pair = (decoder.cache_manager, peer)
        await transfer._throughput(report, pair, ROWS, None, None, RawStream, Peers())

    run_remote(run)
    report.render()


if __name__ == "__main__":
    main()
