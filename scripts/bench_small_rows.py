"""Some rows of ``aiokv bench transfer`` alone, in a fixed order.

``python scripts/bench_small_rows.py [BLOCK_KIB:COUNT ...] [--times N]`` (from the
repository root, or from a worktree of another commit with today's ``aiokv/_bench/``
copied in, for before/after figures). Default: the 4 MiB rows ``16:256 64:64``, twice
(``--times 2``). Each row is the shipped bench's: pull and push against the raw socket
stream and the raw stream between the same blocks, in interleaved rounds, with the
per-block slopes between rows of one block size. The grid's first row is its coldest;
measuring the same rows in the same order in both trees keeps that from looking like a
regression.
"""

from __future__ import annotations

import sys
from typing import Any

from aiokv._bench import transfer
from aiokv._bench._harness import Report
from aiokv._bench._harness import run_remote
from aiokv._bench.mooncake import Peers
from aiokv._bench.raw import RawStream

KIB = 1 << 10
DEFAULT = [(16 * KIB, 256), (64 * KIB, 64)]


def _rows(argv: list[str]) -> list[tuple[int, int]]:
    """The rows the command line names, repeated ``--times`` times."""
    times = 2
    if "--times" in argv:
        at = argv.index("--times")
        times = int(argv[at + 1])
        argv = argv[:at] + argv[at + 2 :]
    rows = [(int(b) * KIB, int(k)) for b, k in (a.split(":") for a in argv)] or DEFAULT
    return rows * times


def main(rows: list[tuple[int, int]]) -> None:
    report = Report("small-rows", {})

    async def run(peer: Any, decoder: Any) -> None:
        pair = (decoder.cache_manager, peer)
        await transfer._throughput(report, pair, rows, None, None, RawStream, Peers())

    run_remote(run)
    report.render()


if __name__ == "__main__":
    main(_rows(sys.argv[1:]))
