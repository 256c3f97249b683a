"""Observability (issue #11 item 5): ``statistics()`` snapshots after real transfers,
``aiokv.*`` logging that is quiet by default, and the Prometheus endpoint serving the
documented series (scraped over HTTP on 127.0.0.1, port 0)."""

from __future__ import annotations

import asyncio
import logging
import re
import urllib.request
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch
from _helpers import run_code

import aiokv.sync
from aiokv import BlocksCacheKey
from aiokv import CacheDesc
from aiokv import DataDistStats
from aiokv import DataType
from aiokv import LLMConfig
from aiokv import LLMDataDist
from aiokv import LLMException
from aiokv import LLMRole
from aiokv import LLMStatusCode
from aiokv import Placement
from aiokv._copy import CopyScheduler
from aiokv.testing import cluster_info
from aiokv.testing import linked_pair
from aiokv.testing import make_config

CODE = LLMStatusCode
pytestmark = pytest.mark.timeout(60)
# 2 tensors x 4 blocks of 4*2*32 bf16 (512 bytes a block)
DESC = CacheDesc(2, [8, 4, 2, 32], DataType.DT_BF16)
BLOCK = 512


def config(**kw: Any) -> LLMConfig:
    return make_config("tcp", pool=1 << 20, **({"sync_kv_timeout": 3000} | kw))


@pytest.fixture
async def moved() -> AsyncIterator[tuple[LLMDataDist, LLMDataDist]]:
    """P (1) and D (2), D linked to P; D pulled 3 blocks, pushed 2, and was refused once."""
    async with linked_pair(config()) as (p, d):
        src = await p.cache_manager.allocate_blocks_cache(DESC, BlocksCacheKey(1, 0))
        for t in src.tensors:
            t.copy_(torch.arange(t.numel()).reshape(t.shape).to(t.dtype))
        dst = await d.cache_manager.allocate_blocks_cache(DESC)
        await d.cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, [0, 1, 2], [5, 6, 7])
        assert torch.equal(dst.tensors[1][5:8], src.tensors[1][0:3])
        await d.cache_manager.push_blocks(BlocksCacheKey(1, 0), dst, [5, 6], [3, 4])
        with pytest.raises(LLMException):
            await d.cache_manager.pull_blocks(BlocksCacheKey(1, 9), dst, [0], [0])
        await d.cache_manager.copy_blocks(dst, {5: [0, 1]})
        yield p, d


async def test_statistics_after_real_transfers(moved: tuple[LLMDataDist, LLMDataDist]) -> None:
    p, d = moved
    ds, ps = d.statistics(), p.statistics()
    assert isinstance(ds, DataDistStats) and ds.cluster_id == 2 and ds.initialized
    assert ds.links_up == 1 and ps.links_up == 1 and ds.links_down == 0
    mine = ds.links[1]
    assert mine.linked and mine.cluster_id == 1
    r = mine.requests
    assert r.ops == 3 and r.in_flight == 0
    assert r.bytes == (3 + 2) * BLOCK * 2  # pulled 3, pushed 2 blocks, 2 tensors
    assert dict(r.failures) == {"LLM_KV_CACHE_NOT_EXIST": 1}
    assert r.latency.count == 3 and sum(r.latency.counts) == 3 and r.latency.sum > 0
    assert len(r.latency.counts) == len(r.latency.bounds) + 1
    served = ps.links[2].served
    assert served.granted == 2 and served.completed == 2 and served.in_flight == 0
    assert served.bytes == r.bytes
    assert dict(served.refused) == {"LLM_KV_CACHE_NOT_EXIST": 1}
    assert ps.links[2].requests.ops == 0  # P asked nothing of D
    # the local copy: 2 destination blocks x 2 tensors, inline or on a worker
    copies = ds.copies
    assert copies.jobs.bytes + copies.inline.bytes == 2 * 2 * BLOCK
    assert copies.inline.ops + copies.jobs.ops >= 1 and copies.queue_depth == 0  # + init's
    pool = ds.device_pool
    assert pool is not None and pool.used >= 2 * 8 * BLOCK and pool.peak_used >= pool.used
    assert ds.host_pool is None
    assert ds.caches is not None and ds.caches.caches == 1


async def test_totals_survive_finalize_and_gauges_go() -> None:
    d = LLMDataDist(LLMRole.DECODER, 2)
    assert d.statistics().initialized is False and d.statistics().links == {}
    await d.init(config(listen_ip_info=None))
    cm = d.cache_manager
    await cm.allocate_cache(CacheDesc(1, [64, 64], DataType.DT_UINT8))
    assert d.statistics().caches is not None
    await d.finalize()
    s = d.statistics()
    assert not s.initialized and s.device_pool is None and s.caches is None
    assert s.copies.queue_depth == 0


def test_copy_scheduler_statistics() -> None:
    async def run() -> None:
        sched = CopyScheduler(torch.device("cpu"))
        src = [torch.arange(8 * 256, dtype=torch.uint8).reshape(8, 256)]
        dst = [torch.zeros(8, 256, dtype=torch.uint8)]
        await sched.copy_blocks(src, dst, [(0, 1), (2, 3)])
        await sched.copy_many([(src[0], dst[0])])
        with pytest.raises(ZeroDivisionError):
            await sched.call(lambda: 1 // 0)
        s = sched.statistics()
        await sched.aclose()
        assert s.jobs.ops == 3 and s.jobs.bytes == 2 * 256 + 8 * 256
        assert dict(s.jobs.failures) == {"LLM_FAILED": 1}
        assert s.jobs.in_flight == 0 and s.threads >= 1 and s.queue_depth == 0

    asyncio.run(run())


def test_copy_job_failures_are_counted_under_the_code_the_caller_sees() -> None:
    """A copy job failing with a foreign error (torch's out-of-memory, ``MemoryError``,
    an ``OSError``) reaches the caller through ``map_errors`` with its own code
    (``LLM_DEVICE_OUT_OF_MEMORY``, ``LLM_OUT_OF_MEMORY``, ...); ``statistics()`` must
    count it under that code. Before the fix every foreign error was counted as
    ``LLM_FAILED`` (found in review)."""
    from aiokv._errors import map_errors

    failures: list[BaseException] = [
        torch.OutOfMemoryError("CUDA out of memory"),
        MemoryError(),
        ConnectionResetError(),
        RuntimeError("something else"),
    ]

    async def run() -> None:
        sched = CopyScheduler(torch.device("cpu"))
        seen: list[str] = []
        for exc in failures:

            def fail(exc: BaseException = exc) -> None:
                raise exc

            # as CacheManager awaits its jobs: through map_errors
            with pytest.raises(LLMException) as ei, map_errors("copy_blocks"):
                await sched.call(fail)
            seen.append(ei.value.status_code.name)
        s = sched.statistics()
        await sched.aclose()
        assert seen == [
            "LLM_DEVICE_OUT_OF_MEMORY",
            "LLM_OUT_OF_MEMORY",
            "LLM_LINK_FAILED",
            "LLM_FAILED",
        ]
        assert dict(s.jobs.failures) == {name: seen.count(name) for name in seen}

    asyncio.run(run())


def test_pool_statistics_is_stats() -> None:
    d = aiokv.sync.LLMDataDist(LLMRole.DECODER, 3)
    d.init(
        config(listen_ip_info=None, host_mem_pool_cfg='{"memory_size": 262144, "page_shift": 12}')
    )
    try:
        cm = d.cache_manager
        cm.allocate_cache(CacheDesc(1, [4096], DataType.DT_UINT8, Placement.HOST))
        s = d.statistics()  # the blocking face
        assert s.host_pool is not None and s.host_pool.used == 4096
        assert s.host_pool == cm.get_pool_stats(Placement.HOST)
    finally:
        d.finalize()


# ---------------------------------------------------------------------------- logging


def test_quiet_by_default() -> None:
    """Without logging configured, nothing of aiokv reaches stderr (not even WARNING)."""
    out = run_code(
        "import logging, aiokv\n"
        "logging.getLogger('aiokv.remote').warning('refused a pull')\n"
        "logging.getLogger('aiokv.links').error('boom')\n"
        "logging.getLogger('other').warning('visible')\n"
    )
    assert "refused" not in out.stderr and "boom" not in out.stderr
    assert "visible" in out.stderr  # Python's own default still applies to others
    handlers = logging.getLogger("aiokv").handlers
    assert any(isinstance(h, logging.NullHandler) for h in handlers)


async def test_log_levels(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="aiokv"):
        async with (
            LLMDataDist(LLMRole.PROMPT, 1, config()) as p,
            LLMDataDist(LLMRole.DECODER, 2, config()) as d,
        ):
            assert p.listen_address is not None
            await d.link_clusters([cluster_info(1, p.listen_address)])
            await p.cache_manager.allocate_blocks_cache(DESC, BlocksCacheKey(1, 0))
            dst = await d.cache_manager.allocate_blocks_cache(DESC)
            await d.cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, [0], [0])
            with pytest.raises(LLMException):
                await d.cache_manager.pull_blocks(BlocksCacheKey(1, 9), dst, [0], [0])
            await d.unlink_clusters([cluster_info(1, p.listen_address)])

    def at(level: int, pattern: str) -> list[logging.LogRecord]:
        return [
            r
            for r in caplog.records
            if r.levelno == level
            and r.name.startswith("aiokv")
            and re.search(pattern, r.getMessage())
        ]

    assert at(logging.INFO, r"link to cluster 1 up")
    assert at(logging.INFO, r"link to cluster 1 down")
    assert at(logging.DEBUG, rf"pull_blocks: {2 * BLOCK} bytes from cluster 1")
    assert at(logging.DEBUG, rf"granted a pull of {2 * BLOCK} bytes to cluster 2")
    assert at(logging.WARNING, r"refused a pull from cluster 2 \(LLM_KV_CACHE_NOT_EXIST\)")


# ------------------------------------------------------------------ Prometheus endpoint


def _scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            name, _, labels = series.partition("{")
            pairs = re.findall(r'(\w+)="([^"]*)"', labels)
            samples[key(name, **dict(pairs))] = float(value)
    return samples


def key(name: str, **labels: str) -> str:
    """A series as ``name{a="x",b="y"}``, labels sorted (the scrape is read the same way)."""
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return f"{name}{{{inner}}}" if labels else name


async def test_metrics_endpoint_serves_the_documented_series(
    moved: tuple[LLMDataDist, LLMDataDist],
) -> None:
    pytest.importorskip("prometheus_client")
    from aiokv.metrics import start_metrics_server

    p, d = moved
    server = start_metrics_server(p, d, host="127.0.0.1", port=0)
    try:
        host, port = server.address
        assert host == "127.0.0.1" and port > 0
        m = await asyncio.to_thread(_scrape, f"http://{host}:{port}/metrics")
    finally:
        await asyncio.to_thread(server.close)  # joins the server thread (blocks briefly)
    moved_bytes = float((3 + 2) * BLOCK * 2)
    on_d = 'cluster="2",peer="1"'
    on_p = 'cluster="1",peer="2"'
    assert m['aiokv_up{cluster="2"}'] == 1.0
    assert m['aiokv_links_up_total{cluster="2"}'] == 1.0
    assert m['aiokv_links_down_total{cluster="2"}'] == 0.0
    assert m[f"aiokv_link_up{{{on_d}}}"] == 1.0
    assert m[f"aiokv_transfer_ops_total{{{on_d}}}"] == 3.0
    assert m[f"aiokv_transfer_bytes_total{{{on_d}}}"] == moved_bytes
    assert (
        m['aiokv_transfer_failures_total{cluster="2",code="LLM_KV_CACHE_NOT_EXIST",peer="1"}']
        == 1.0
    )
    assert m[f"aiokv_transfer_in_flight{{{on_d}}}"] == 0.0
    bucket = "aiokv_transfer_latency_seconds_bucket"
    assert m[key(bucket, cluster="2", peer="1", le="+Inf")] == 3.0
    assert m[key(bucket, cluster="2", peer="1", le="10.0")] == 3.0  # cumulative
    assert m[key(bucket, cluster="2", peer="1", le="0.0001")] <= 3.0
    assert m[f"aiokv_transfer_latency_seconds_count{{{on_d}}}"] == 3.0
    assert m[f"aiokv_transfer_latency_seconds_sum{{{on_d}}}"] > 0
    assert m[f"aiokv_served_grants_total{{{on_p}}}"] == 2.0
    assert m[f"aiokv_served_bytes_total{{{on_p}}}"] == moved_bytes
    assert (
        m['aiokv_served_refusals_total{cluster="1",code="LLM_KV_CACHE_NOT_EXIST",peer="2"}'] == 1.0
    )
    assert m[f"aiokv_served_in_flight{{{on_p}}}"] == 0.0
    jobs = m['aiokv_copy_jobs_total{cluster="2"}'] + m['aiokv_copy_inline_total{cluster="2"}']
    assert jobs >= 1.0  # the copy, and init's page touching
    copied = (
        m['aiokv_copy_bytes_total{cluster="2"}'] + m['aiokv_copy_inline_bytes_total{cluster="2"}']
    )
    assert copied == 2 * 2 * BLOCK
    assert m['aiokv_copy_queue_depth{cluster="2"}'] == 0.0
    assert m['aiokv_copy_in_flight{cluster="2"}'] == 0.0
    assert 'aiokv_copy_latency_seconds_count{cluster="2"}' in m
    assert m['aiokv_pool_bytes{cluster="2",pool="device",state="total"}'] == 1048576.0
    assert m['aiokv_pool_bytes{cluster="2",pool="device",state="used"}'] >= 2 * 8 * BLOCK
    assert 'aiokv_pool_bytes{cluster="2",pool="device",state="peak_used"}' in m
    assert m['aiokv_pool_allocations{cluster="2",pool="device"}'] == 2.0
    assert m['aiokv_pool_failed_allocations_total{cluster="2",pool="device"}'] == 0.0
    assert m['aiokv_caches{cluster="2"}'] == 1.0
    assert m['aiokv_cache_keys{cluster="2"}'] == 0.0
    assert m['aiokv_cache_pins{cluster="2"}'] == 0.0
    assert m['aiokv_cache_leases{cluster="2"}'] == 0.0
    # closed: the port no longer answers
    with pytest.raises(OSError):
        await asyncio.to_thread(urllib.request.urlopen, f"http://{host}:{port}/metrics", timeout=2)


# ------------------------------------------------------------ bounded per-peer entries


def test_peer_counters_fold_old_idle_peers_and_keep_totals() -> None:
    """Beyond the recent set, idle unlinked peers fold into OTHER_PEERS; linked and busy
    ones never fold; every total stays exact."""
    from aiokv._stats import OTHER_PEERS
    from aiokv._stats import PeerCounters

    pc = PeerCounters(recent=4)
    pc.up(1000)  # linked: kept however old
    busy = pc.requests(1001).measure(7)
    busy.__enter__()  # in flight: kept
    for cid in range(50):
        with pc.requests(cid).measure(10):
            pass
        pc.served(cid).refused(CODE.LLM_PARAM_INVALID)
    snap = pc.snapshot([1000])
    assert set(snap) == {1000, 1001, 46, 47, 48, 49, OTHER_PEERS}
    assert snap[1000].linked and not snap[OTHER_PEERS].linked
    assert snap[1001].requests.in_flight == 1
    other = snap[OTHER_PEERS]
    assert other.cluster_id == OTHER_PEERS
    assert sum(s.requests.ops for s in snap.values()) == 50
    assert sum(s.requests.bytes for s in snap.values()) == 500
    assert sum(s.requests.latency.count for s in snap.values()) == 50
    refused = [s.served.refused["LLM_PARAM_INVALID"] for s in snap.values() if s.served.refused]
    assert sum(refused) == 50
    busy.__exit__(None, None, None)
    pc.down(1000)  # now unlinked and the most recent: the oldest recent one folds
    snap = pc.snapshot([])
    assert len(snap) == 4 + 1 and OTHER_PEERS in snap and 1000 not in snap  # 1000 never counted
    assert sum(s.requests.ops for s in snap.values()) == 51


async def test_many_short_peers_keep_statistics_and_scrape_bounded() -> None:
    """Peers under ever new cluster ids, each linking once and being refused once: the
    entries and the Prometheus scrape stay bounded; the refusal total stays exact."""
    from aiokv._stats import OTHER_PEERS
    from aiokv._stats import RECENT_PEERS
    from aiokv.transport import get_transport

    class Nothing:
        async def grant_read(self, peer: Any, meta: bytes) -> Any:
            raise AssertionError("not asked")

        async def grant_write(self, peer: Any, meta: bytes, nbytes: int) -> Any:
            raise AssertionError("not asked")

    tcp = get_transport("tcp")
    sizes = []
    async with LLMDataDist(LLMRole.PROMPT, 1, config()) as p:
        assert p.listen_address is not None
        host, port = p.listen_address
        for rnd in range(2):
            for cid in range(1000 + rnd * 100, 1100 + rnd * 100):
                t = tcp(cid, Nothing())
                try:
                    link = await t.connect(host, port, timeout=5)
                    with pytest.raises(LLMException):
                        await link.read(b"not a request", [memoryview(bytearray(8))], timeout=5)
                finally:
                    await t.aclose()
            stats = p.statistics()
            assert len(stats.links) <= RECENT_PEERS + 1 + 1  # + other + one still linked
            assert OTHER_PEERS in stats.links
            refused = sum(sum(s.served.refused.values()) for s in stats.links.values())
            assert refused == 100 * (rnd + 1)
            if pytest.importorskip("prometheus_client"):
                from prometheus_client import CollectorRegistry
                from prometheus_client import generate_latest

                from aiokv.metrics import Collector

                registry = CollectorRegistry(auto_describe=False)
                registry.register(Collector(p))
                text = (await asyncio.to_thread(generate_latest, registry)).decode()
                assert 'peer="other"' in text
                sizes.append(len(text))
    assert sizes[1] <= sizes[0] * 1.1  # twice the peers, about the same scrape
