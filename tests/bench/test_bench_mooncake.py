"""``aiokv bench transfer --peers``: the clear failure without Mooncake Transfer Engine
(the main suite runs without it), and, where it imports, its contender in the same
rounds as aiokv over checked bytes (docs/benchmarks.md, "aiokv vs Mooncake Transfer
Engine over TCP")."""

from __future__ import annotations

import importlib.util
import json
import multiprocessing
import sys
from typing import Any

import pytest
from typer.testing import CliRunner

from aiokv._bench import transfer
from aiokv.cli import app
from aiokv.testing import requires_transport

try:
    has_mooncake = importlib.util.find_spec("mooncake.engine") is not None
except ImportError:  # a ``mooncake`` that is not Mooncake's
    has_mooncake = False
needs_mooncake = pytest.mark.skipif(
    not has_mooncake, reason="mooncake-transfer-engine-non-cuda is not installed"
)


def _hide_mooncake(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)  # import fails, as if absent


def test_peers_without_mooncake_is_one_line_naming_the_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _hide_mooncake(monkeypatch)
    result = CliRunner().invoke(app, ["bench", "transfer", "--quick", "--peers"])
    assert result.exit_code == 1
    [line] = result.output.strip().splitlines()
    assert line.startswith(
        "aiokv bench transfer: --peers: Mooncake Transfer Engine does not import ("
    )
    assert line.endswith(
        "apt-get install libibverbs1 libnl-3-200 libnl-route-3-200, then "
        "pip install mooncake-transfer-engine-non-cuda"
    )
    assert not multiprocessing.active_children()  # refused before any process


def test_peers_without_mooncake_fails_in_the_api_too(monkeypatch: pytest.MonkeyPatch) -> None:
    _hide_mooncake(monkeypatch)
    with pytest.raises(RuntimeError, match="pip install mooncake-transfer-engine-non-cuda"):
        transfer.run_transfer_bench(quick=True, peers=True)


@pytest.mark.parametrize("other", [["--connect", "127.0.0.1:9"], ["--listen", "127.0.0.1:0"]])
def test_peers_runs_here_only(other: list[str]) -> None:
    result = CliRunner().invoke(app, ["bench", "transfer", "--peers", *other])
    assert result.exit_code == 2
    [line] = result.output.strip().splitlines()
    assert "--peers" in line and line.startswith("aiokv bench transfer: ")


@needs_mooncake
@pytest.mark.usefixtures("one_transfer_row")
def test_peers_times_mooncake_in_the_same_rounds_on_checked_bytes() -> None:
    result = CliRunner().invoke(app, ["bench", "transfer", "--quick", "--json", "--peers"])
    assert result.exit_code == 0, result.output
    got = json.loads(result.stdout)
    assert got["meta"]["peers"] is True
    [speeds] = got["peers"]
    [ratios] = got["peers_ratios"]
    paths = ["raw", "pull", "push", "mooncake_read", "mooncake_write"]
    assert list(speeds) == ["block_kib", "count", *(f"{p}_gbps" for p in paths)]
    assert all(speeds[f"{p}_gbps"] > 0 for p in paths)
    assert ratios["pull_vs_read"] > 0 and ratios["push_vs_write"] > 0
    assert {"pull_us", "push_us", "mc_read_us", "mc_write_us"} <= set(ratios)
    assert ratios["verified"] is True  # aiokv's pull and Mooncake's READ matched digests
    assert set(got["peers_summary"]) == {
        f"{k}_{f}" for k in ("pull_vs_read", "push_vs_write") for f in ("min", "max")
    }
    assert [row["count"] for row in got["throughput"]] == [128]


@needs_mooncake
@requires_transport("nixl")
@pytest.mark.usefixtures("one_transfer_row")
def test_peers_with_nixl_adds_aiokv_nixl_vs_mooncake_per_ucx_setting() -> None:
    args = ["bench", "transfer", "--quick", "--json", "--peers", "--backend", "nixl"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    got = json.loads(result.stdout)
    [ratios] = got["peers_ratios"]
    pairs = [f"{u}{op}" for u in ("", "shm_", "utcp_") for op in ("pull_vs_read", "push_vs_write")]
    assert [k for k in ratios if "_vs_" in k] == pairs
    assert all(ratios[k] > 0 for k in pairs)
    assert set(got["peers_summary"]) == {f"{k}_{f}" for k in pairs for f in ("min", "max")}
    assert got["nixl_ratios"][0]["verified"] is True


@needs_mooncake
def test_a_mooncake_read_of_other_blocks_fails_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    from aiokv._bench._harness import Report
    from aiokv._bench._harness import run_loop
    from aiokv._bench._harness import scattered
    from aiokv._bench.mooncake import mooncake_contenders

    block, count = 16 << 10, 64
    srcs, dsts = scattered(count, seed=1), scattered(count, seed=2)

    async def main() -> tuple[float, float, BaseException | None]:
        async with mooncake_contenders(Report("t", {}), 2 * block * count) as mc:
            await mc.row(block, srcs, dsts)  # checked: raises on wrong bytes
            times = [await fn() for fn in mc.contenders().values()]
            # the target is asked for other blocks than the ones read: the check fails
            monkeypatch.setattr(mc, "_pair", _Swapped(mc._pair))
            try:
                await mc.row(block, srcs, dsts)
            except AssertionError as exc:
                return times[0], times[1], exc
            return times[0], times[1], None

    read, write, failed = run_loop(main, use_uvloop=False)
    assert read > 0 and write > 0
    assert isinstance(failed, AssertionError) and "wrong bytes" in str(failed)


class _Swapped:
    """A Mooncake pair whose target digests the source blocks in reverse order."""

    def __init__(self, pair: Any) -> None:
        self.initiator = pair.initiator
        self.target = _Reversed(pair.target)


class _Reversed:
    def __init__(self, peer: Any) -> None:
        self._peer = peer

    async def request(self, name: str, block: int, srcs: list[int]) -> Any:
        return await self._peer.request(name, block, srcs[::-1])
