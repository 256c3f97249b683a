"""``aiokv bench device --backend nixl`` (issue #10): the option, its clear failures on a
machine without CUDA or without NIXL, and the raw NIXL contender it shares with
``bench transfer --backend nixl`` (host buffers, one verified row). The device rows
themselves need a GPU: docs/benchmarks.md, "Device caches over NIXL vs raw NIXL"."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from aiokv._bench._harness import run_loop
from aiokv._bench._harness import scattered
from aiokv._bench.nixl import SETTINGS
from aiokv._bench.nixl import RawNixl
from aiokv.cli import app
from aiokv.testing import requires_transport

needs_nixl = requires_transport("nixl")


def test_the_backend_option_takes_tcp_or_nixl_only() -> None:
    runner = CliRunner()
    shown = runner.invoke(app, ["bench", "device", "--help"])
    assert shown.exit_code == 0
    assert "--backend" in shown.output and "nixl" in shown.output
    bad = runner.invoke(app, ["bench", "device", "--backend", "rdma"])
    assert bad.exit_code == 2  # a usage error: nothing ran


@needs_nixl
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_the_nixl_mode_fails_as_the_tcp_mode_does() -> None:
    runner = CliRunner()
    tcp = runner.invoke(app, ["bench", "device"])
    nixl = runner.invoke(app, ["bench", "device", "--backend", "nixl", "--json"])
    assert nixl.exit_code == tcp.exit_code == 1
    assert nixl.output == tcp.output
    assert nixl.output.strip().startswith("aiokv bench device: needs an accelerator: ")
    assert "Traceback" not in nixl.output


@needs_nixl
def test_raw_nixl_over_host_memory_reads_the_right_bytes_and_times_both_ways() -> None:
    block, count = 16 << 10, 64

    async def main() -> tuple[bool, bool, float, float, float]:
        raw = RawNixl(SETTINGS["shm"], 2 * block * count, "DRAM")
        try:
            srcs, dsts = scattered(count, seed=1), scattered(count, seed=2)
            ok = await raw.row(block, srcs, dsts)
            # the check can fail: the blocks read are not the target's in another order
            got = await raw.initiator.request("row", block, srcs, dsts)
            other = got != await raw.target.request("digest", block, srcs[::-1])
            read, write = await raw.move("READ"), await raw.move("WRITE")
            return ok, other, read, write, await raw.build_ms()
        finally:
            raw.stop()

    ok, differs, read, write, build_ms = run_loop(main, use_uvloop=False)
    assert ok  # every byte of the READ matched the target's source blocks
    assert differs
    assert read > 0 and write > 0 and build_ms > 0
