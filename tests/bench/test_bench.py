"""The benchmark harness and the layer-wise benchmark: they time what they claim, and a
benchmark whose transfer leaves wrong bytes fails instead of reporting a figure."""

from __future__ import annotations

import io
import json
from functools import partial
from typing import Any

import pytest
from _helpers import hide_nixl
from rich.console import Console
from typer.testing import CliRunner

from aiokv import CacheManager
from aiokv import LLMDataDist
from aiokv._bench import _harness
from aiokv._bench import latency
from aiokv._bench import layerwise
from aiokv._bench import nixl
from aiokv._bench import transfer
from aiokv._bench._harness import PromptPeer
from aiokv._bench._harness import Report
from aiokv._bench._harness import interleave
from aiokv._bench._harness import run_loop
from aiokv._bench._harness import run_remote
from aiokv._bench._harness import scattered
from aiokv._bench.raw import RawBlocks
from aiokv.cli import app
from aiokv.testing import requires_transport

TINY = ((64, 256), (8, 4096))  # (blocks, block bytes): the benchmark's shapes, scaled down


def test_scattered_blocks_are_never_neighbours_and_repeatable() -> None:
    blocks = scattered(100, seed=3)
    assert len(set(blocks)) == 100
    assert all(b % 2 == 0 and 0 <= b < 200 for b in blocks)
    assert blocks != sorted(blocks)  # shuffled
    assert blocks == scattered(100, seed=3)
    assert blocks != scattered(100, seed=4)


def test_interleave_alternates_contenders_and_drops_warmup() -> None:
    calls: list[str] = []

    def sync() -> None:
        calls.append("s")

    async def coro() -> None:
        calls.append("a")

    times = run_loop(
        lambda: interleave({"s": sync, "a": coro}, 3, per_round=2, warmup=1), use_uvloop=False
    )
    assert calls == ["s", "s", "a", "a"] * 4
    assert {k: len(v) for k, v in times.items()} == {"s": 6, "a": 6}
    assert all(t >= 0 for v in times.values() for t in v)


def test_report_prints_and_serialises_the_same_figures() -> None:
    report = Report("x", {"loop": "asyncio"})
    report.table("t", "a table").append({"name": "row", "ratio": 1.23456, "n": 7})
    report.summary("s", "ratio {ratio:.1f}", ratio=2.0)
    assert report.as_dict() == {
        "bench": "x",
        "meta": {"loop": "asyncio"},
        "t": [{"name": "row", "ratio": 1.23456, "n": 7}],
        "s": {"ratio": 2.0},
    }
    out = io.StringIO()
    report.render(Console(file=out, width=120))
    text = out.getvalue()
    assert "loop: asyncio" in text and "a table" in text
    assert "1.23" in text and "1.234" not in text and "ratio 2.0" in text


def test_layerwise_bench_verifies_and_reports_every_shape() -> None:
    report = layerwise.run_layerwise_bench(quick=True, shapes=TINY, layers=2, pool_bytes=1 << 24)
    rows = report.as_dict()["layerwise_overhead"]
    assert [(r["blocks"], r["block_bytes"]) for r in rows] == list(TINY)
    for r in rows:
        assert r["verified"] is True
        assert r["push_blocks_ms"] > 0
        assert r["by_key_ratio"] == pytest.approx(r["by_key_ms"] / r["push_blocks_ms"])
        assert r["by_addrs_ratio"] == pytest.approx(r["by_addrs_ms"] / r["push_blocks_ms"])
        # one request at least, one per layer at most (layers taken together go in one)
        assert 1 <= r["by_key_requests"] <= 2 and 1 <= r["by_addrs_requests"] <= 2
    overlap = report.as_dict()["layerwise_overlap"]
    assert overlap["layers"] == 2 and overlap["mib"] == 2 * 2 * 32 * 64 / 1024
    assert overlap["ratio"] == pytest.approx(
        overlap["total_ms"] / max(overlap["transfer_ms"], overlap["compute_ms"])
    )
    json.dumps(report.as_dict())


class _Recorder:
    """A CacheManager that records the cache and block lists of every push_blocks and
    transfer_cache_async, then does them."""

    def __init__(self, cm: CacheManager) -> None:
        self._cm = cm
        self.calls: list[tuple[str, int, list[int], list[int], Any]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cm, name)

    async def push_blocks(self, key: Any, src: Any, srcs: Any, dsts: Any, *more: Any) -> None:
        self.calls.append(("push_blocks", src.cache_id, list(srcs), list(dsts), more))
        await self._cm.push_blocks(key, src, srcs, dsts, *more)

    def transfer_cache_async(self, src: Any, sync: Any, cfgs: Any, srcs: Any, dsts: Any) -> Any:
        kinds = tuple(type(c).__name__ for c in cfgs)
        self.calls.append(("transfer_cache_async", src.cache_id, list(srcs), list(dsts), kinds))
        return self._cm.transfer_cache_async(src, sync, cfgs, srcs, dsts)


@pytest.mark.usefixtures("small_pools")
def test_latency_bench_times_the_engine_hop_against_a_bare_thread_hand_off() -> None:
    report = latency.run_latency_bench(quick=True).as_dict()
    hop = report["engine_hop"]
    assert hop["rounds"] == latency.HOPS * 30
    assert 0 < hop["thread_us"] <= hop["thread_p90_us"]
    assert 0 < hop["hop_us"] <= hop["hop_p90_us"]
    rows = [(r["tensors"], r["block_kib"]) for r in report["latency"]]
    assert rows == [(n, n * b // 1024) for n, b in latency.SHAPES]
    assert all(r["pull_us"] > 0 and r["raw_us"] > 0 for r in report["latency"])


def test_layerwise_baseline_is_one_push_of_the_same_contiguous_blocks() -> None:
    calls: list[tuple[str, int, list[int], list[int], Any]] = []
    count = TINY[0][0]

    async def main(peer: PromptPeer, decoder: LLMDataDist) -> None:
        cm: Any = _Recorder(decoder.cache_manager)
        started = layerwise.requests_to_peer(decoder)
        await layerwise.overhead(
            Report("x"), cm, peer, requests=started, rounds=1, shapes=TINY[:1], layers=2
        )
        calls.extend(cm.calls)

    run_remote(main, pool_bytes=1 << 24)
    pushes = [c for c in calls if c[0] == "push_blocks"]
    layer_wise = [c for c in calls if c[0] == "transfer_cache_async"]
    assert pushes and layer_wise
    # every push is of every tensor (no layer range), one request
    assert all(c[4] == () for c in pushes)
    assert {c[4] for c in layer_wise} == {("TransferWithCacheKeyConfig",), ("TransferConfig",)}
    # the same cache and the same block lists for every contender: the same bytes, laid
    # out the same way; contiguous on both sides (one run per tensor), not onto itself
    assert {(c[1], tuple(c[2]), tuple(c[3])) for c in calls} == {
        (calls[0][1], tuple(range(count)), tuple(range(count, 2 * count)))
    }
    assert layerwise.block_lists(count) == (calls[0][2], calls[0][3])


class _PushDropsBytes:
    """A CacheManager whose ``push_blocks`` returns at once without moving anything."""

    def __init__(self, cm: CacheManager) -> None:
        self._cm = cm

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cm, name)

    async def push_blocks(self, *args: Any, **kwargs: Any) -> None:
        return None


def test_layerwise_bench_fails_on_a_fast_wrong_result() -> None:
    async def main(peer: PromptPeer, decoder: LLMDataDist) -> None:
        cm: Any = _PushDropsBytes(decoder.cache_manager)
        started = layerwise.requests_to_peer(decoder)
        await layerwise.overhead(
            Report("x"), cm, peer, requests=started, rounds=1, shapes=TINY[:1], layers=2
        )

    with pytest.raises(AssertionError, match="push_blocks delivered wrong bytes"):
        run_remote(main, pool_bytes=1 << 24)


def test_cli_bench_json_prints_one_object(monkeypatch: pytest.MonkeyPatch) -> None:
    tiny = partial(layerwise.run_layerwise_bench, shapes=TINY[1:], layers=1, pool_bytes=1 << 24)
    monkeypatch.setattr(layerwise, "run_layerwise_bench", tiny)
    result = CliRunner().invoke(app, ["bench", "layerwise", "--quick", "--json"])
    assert result.exit_code == 0, result.output
    got = json.loads(result.stdout)
    assert got["bench"] == "layerwise" and got["meta"]["rounds"] == 2
    assert got["layerwise_overhead"][0]["verified"] is True


def test_per_block_slopes_cancel_the_per_call_cost() -> None:
    """The slope between two block counts is the overhead of the added blocks only, and
    the summary takes the worst of the 4-16 KiB rows at 1,024-16,384 blocks."""

    def row(kib: int, count: int, fixed_us: float, per_block_us: float) -> dict[str, Any]:
        over = fixed_us + per_block_us * count  # t - t_raw, us
        return {
            "block_kib": kib,
            "count": count,
            "pull_ratio": 0.5 + count / 65536,
            "push_ratio": 0.6,
            "pull_us_per_block": over / count,
            "push_us_per_block": 2 * over / count,
            "raw_blocks_us_per_block": 1.0,
            "pull_tail": 1.1,
            "raw_tail": 1.05,
            "raw_gbps": 2.0,
            "raw_blocks_gbps": 1.6 if count == 4096 else 1.8,
            "pull_vs_raw_blocks": 0.9 - count / 65536,
            "push_vs_raw_blocks": 1.1,
        }

    rows = [
        row(4, 1024, 500, 0.25),
        row(4, 4096, 500, 0.25),
        row(16, 256, 900, 3.0),  # outside the goals' counts
        row(16, 1024, 900, 0.5),
        row(64, 64, 100, 9.0),  # outside the goals' sizes
        row(64, 1024, 100, 9.0),
    ]
    rows[1]["pull_tail"] = 1.7
    rows[3]["raw_tail"] = 1.4
    report = Report("transfer")
    transfer._per_block(report, rows)
    got = report.as_dict()
    slopes = {(r["block_kib"], r["from"], r["to"]): r for r in got["per_block"]}
    assert set(slopes) == {(4, 1024, 4096), (16, 256, 1024), (64, 64, 1024)}
    assert slopes[4, 1024, 4096]["pull_us"] == pytest.approx(0.25)
    assert slopes[4, 1024, 4096]["push_us"] == pytest.approx(0.5)  # its fixed cost cancels too
    assert slopes[4, 1024, 4096]["raw_blocks_us"] == pytest.approx(1.0)
    goals = got["per_block_goals"]
    # 16 KiB 256 -> 1024 starts below 1,024 blocks, 64 KiB is too big: neither counts
    assert (goals["slope_pull"], goals["slope_push"]) == pytest.approx((0.25, 0.5))
    assert goals["pull_ratio"] == pytest.approx(0.5 + 1024 / 65536)
    assert goals["tail"] == pytest.approx(1.7)
    assert goals["raw_tail"] == pytest.approx(1.4)
    # against the kernel's floor: the same rows' worst
    assert goals["floor"] == pytest.approx(0.8)
    assert goals["pull_floor"] == pytest.approx(0.9 - 4096 / 65536)
    assert goals["push_floor"] == pytest.approx(1.1)
    out = io.StringIO()  # and the rendered line says it
    report.render(Console(file=out, width=400))
    assert "vs the same blocks' raw stream (itself 0.80 of the raw stream)" in out.getvalue()


def test_raw_blocks_moves_every_block_into_place() -> None:
    """One round of the raw stream between scattered blocks fills exactly the blocks it
    names, and a second layout replaces the first."""
    block = 4096
    raw = RawBlocks(8 * block)
    try:
        raw.blocks(block, [0, 6, 2], [5, 1, 3])
        raw.receive()
        got = raw.buf.numpy().tobytes()
        for b in range(16):
            want = 0xA5 if b in (5, 1, 3) else 0x5A
            assert got[b * block : (b + 1) * block] == bytes([want]) * block, b
        raw.blocks(block, [1], [9])
        raw.receive()
        got = raw.buf.numpy().tobytes()
        assert got[9 * block : 10 * block] == b"\xa5" * block
        assert got[8 * block : 9 * block] == b"\x5a" * block
    finally:
        raw.stop()


def test_peer_that_never_greets_is_reported_and_stopped() -> None:
    with pytest.raises(RuntimeError, match="did not start"):
        _harness.Peer(_silent, start_timeout=0.5)


def _silent(conn: Any) -> None:
    """A peer process that never sends its greeting."""
    conn.recv()  # until the parent's ("stop",)


@requires_transport("nixl")
@pytest.mark.usefixtures("one_transfer_row")
def test_cli_bench_transfer_nixl_times_every_path_on_checked_bytes() -> None:
    result = CliRunner().invoke(
        app, ["bench", "transfer", "--quick", "--json", "--backend", "nixl"]
    )
    assert result.exit_code == 0, result.output
    got = json.loads(result.stdout)
    assert got["meta"]["backend"] == "nixl"
    [speeds] = got["nixl"]
    [ratios] = got["nixl_ratios"]
    paths = ["memcpy", "socket", "tcp_pull", "tcp_push"] + [
        f"{u}_{p}" for u in ("shm", "utcp") for p in ("pull", "push", "raw_read", "raw_write")
    ]
    assert list(speeds) == ["block_kib", "count", *paths]
    assert all(speeds[p] > 0 for p in paths)
    for u in ("shm", "utcp"):
        for op in ("read", "write"):
            assert ratios[f"{u}_{op}"] > 0
    assert ratios["fastest"] in paths[1:] and ratios["fastest_vs_memcpy"] > 0
    assert ratios["verified"] is True  # every pull, aiokv and raw, matched its digest
    assert "shm_read" in got["nixl_summary"]


@requires_transport("nixl")
def test_latency_nixl_times_a_leased_block_against_raw_nixl(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``bench latency --backend nixl``'s table: a leased block over NIXL and raw NIXL's
    READ / WRITE of it, checked byte for byte first (here one UCX setting and one block
    size: four processes, not eight, beside the rest of the suite)."""
    monkeypatch.setattr(nixl, "SETTINGS", {"shm": nixl.SETTINGS["shm"]})
    monkeypatch.setattr(latency, "NIXL_BLOCKS", (4096,))
    report = Report("latency")
    run_loop(lambda: latency._nixl(report, 5))
    [row] = report.as_dict()["nixl"]
    assert (row["block_kib"], row["ucx"]) == (4, "shm")
    assert min(row["raw_read_us"], row["pull_us"], row["raw_write_us"], row["push_us"]) > 0
    assert row["pull_x"] == pytest.approx(row["pull_us"] / row["raw_read_us"])
    assert row["push_x"] == pytest.approx(row["push_us"] / row["raw_write_us"])


@pytest.mark.parametrize("command", ["transfer", "device", "latency"])
def test_cli_bench_nixl_without_nixl_names_the_extra(
    command: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    hide_nixl(monkeypatch)
    result = CliRunner().invoke(app, ["bench", command, "--backend", "nixl"])
    assert result.exit_code == 1
    assert "pip install 'aiokv[nixl]'" in result.output
    assert "Traceback" not in result.output
