"""Errors and logs an llm_datadist program run through ``aiokv.sync`` can act on: each
names what went wrong and what to do (link failures keep their reason, mismatches name
both sides, config errors list the valid choices, lifecycle words fit the caller)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import pytest
from _helpers import free_port
from _helpers import not_listening
from _helpers import raises
from _helpers import raw_link

import aiokv.sync as llm_datadist
from aiokv import BlocksCacheKey
from aiokv import CacheDesc
from aiokv import DataType
from aiokv import LLMConfig
from aiokv import LLMDataDist
from aiokv import LLMException
from aiokv import LLMRole
from aiokv import LLMStatusCode
from aiokv import TransferConfig
from aiokv import TransferWithCacheKeyConfig
from aiokv._config import InvalidOptionError
from aiokv._remote import _links
from aiokv.testing import cluster_info
from aiokv.testing import linked_pair

CODE = LLMStatusCode
pytestmark = pytest.mark.timeout(60)


def config(**kw: Any) -> LLMConfig:
    """A participant that does not listen unless told to (over TCP)."""
    return not_listening(**({"pool": 4 << 20, "sync_kv_timeout": 3000} | kw))


# ---------------------------------------------------------------- link failures


async def test_link_failure_logs_once_and_keeps_its_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    port = free_port()
    async with LLMDataDist(LLMRole.DECODER, 2, config(link_retry_count=3)) as d:
        peer = cluster_info(7, ("127.0.0.1", port))
        with caplog.at_level(logging.DEBUG, logger="aiokv"):
            code, codes = await d.link_clusters([peer], timeout=600)
        assert code == CODE.LLM_LINK_FAILED and codes == [CODE.LLM_LINK_FAILED]
        links = [r for r in caplog.records if r.name == "aiokv.links"]
        retries = [r for r in links if r.levelno == logging.DEBUG and "try" in r.getMessage()]
        warnings = [r for r in links if r.levelno >= logging.WARNING]
        assert len(retries) == 3 and not any(r.exc_info for r in links)  # no tracebacks
        assert len(warnings) == 1 and f"127.0.0.1:{port}" in warnings[0].getMessage()
        reason = d.link_failure(7)
        assert reason is not None and f"127.0.0.1:{port}" in reason and "3 attempt" in reason
        assert reason in warnings[0].getMessage()
        assert d.link_failure(8) is None
        dst = await d.cache_manager.allocate_blocks_cache(CacheDesc(1, [4, 64], DataType.DT_INT8))
        exc = await raises(
            CODE.LLM_NOT_YET_LINK,
            d.cache_manager.pull_blocks(BlocksCacheKey(7, 0), dst, [0], [0]),
            "cluster 7 is not linked",  # the cause
            reason,
            "call link_clusters again",  # the remedy
        )
        assert "call link_clusters first" not in str(exc)


async def test_link_failure_clears_once_linked() -> None:
    async with linked_pair(config(listen_ip_info="127.0.0.1:0"), config(), link=False) as (p, d):
        wrong = cluster_info(1, ("127.0.0.1", free_port()))
        assert (await d.link_clusters([wrong], timeout=300))[0] == CODE.LLM_LINK_FAILED
        assert d.link_failure(1) is not None
        right = cluster_info(1, p.listen_address)
        assert (await d.link_clusters([right]))[0] == CODE.LLM_SUCCESS
        assert d.link_failure(1) is None


async def test_a_link_that_ended_keeps_its_reason() -> None:
    """The peer went away (here: it finalized): operations on its cluster say the link
    ended and why, not "call link_clusters first"; a new link clears it, and a link this
    side unlinks leaves nothing to report."""
    async with linked_pair(config(listen_ip_info="127.0.0.1:0"), config()) as (p, d):
        dst = await d.cache_manager.allocate_blocks_cache(CacheDesc(1, [4, 64], DataType.DT_INT8))
        pull = d.cache_manager.pull_blocks
        await p.finalize()
        for _ in range(500):  # until this side saw the link end
            if not d.linked_clusters():
                break
            await asyncio.sleep(0.01)
        assert d.linked_clusters() == []
        reason = d.link_failure(1)
        assert reason is not None and reason.startswith("link ended: ")
        assert "closed by peer" in reason  # a CLOSE frame, or the connection's end
        exc = await raises(
            CODE.LLM_NOT_YET_LINK,
            pull(BlocksCacheKey(1, 0), dst, [0], [0]),
            f"cluster 1 is not linked: its link ended ({reason.removeprefix('link ended: ')})",
            "call link_clusters to link it again",
        )
        assert "call link_clusters first" not in str(exc)
    async with linked_pair(config(listen_ip_info="127.0.0.1:0"), config()) as (p, d):
        assert d.link_failure(1) is None
        assert (await d.unlink_clusters([cluster_info(1, p.listen_address)]))[0] == CODE.LLM_SUCCESS
        assert d.link_failure(1) is None  # unlinked here: nothing ended by itself
        dst = await d.cache_manager.allocate_blocks_cache(CacheDesc(1, [4, 64], DataType.DT_INT8))
        await raises(
            CODE.LLM_NOT_YET_LINK,
            d.cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, [0], [0]),
            "call link_clusters first",
        )


async def test_why_links_ended_is_kept_for_the_most_recent_clusters_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Peers linking and leaving under ever new cluster ids (any id, without a secret)
    leave at most ``MAX_LOST_REASONS`` reasons behind: the most recent ones."""
    monkeypatch.setattr(_links, "MAX_LOST_REASONS", 8)
    async with LLMDataDist(LLMRole.PROMPT, 1, config(listen_ip_info="127.0.0.1:0")) as p:
        assert p.listen_address is not None
        port = p.listen_address[1]
        for cid in range(100, 120):
            s = await asyncio.to_thread(raw_link, port, cid)
            for filed in (True, False):  # until the link was filed, then seen ending
                for _ in range(500):
                    if (cid in p.linked_clusters()) is filed:
                        break
                    await asyncio.sleep(0.01)
                else:
                    pytest.fail(f"cluster {cid}: never {'filed' if filed else 'ended'}")
                s.close()
        assert p.link_failure(119) is not None and p.link_failure(112) is not None
        assert p.link_failure(111) is None and p.link_failure(100) is None
        assert len(p._links._lost) == 8


async def test_why_a_link_ended_is_told_as_soon_as_it_is_no_longer_listed() -> None:
    """A link breaks on the engine's thread before the transport reports its end: from
    the moment ``linked_clusters`` stops listing the cluster, ``link_failure`` says why
    (it said None until the report: CI saw that race)."""
    async with linked_pair(config(listen_ip_info="127.0.0.1:0"), config()) as (_p, d):
        link = d._links.live(1)
        assert link is not None and d._engine is not None
        reports: list[Any] = []

        def cut() -> None:  # the break, with the transport's report held back
            transport = link._t  # type: ignore[attr-defined]
            report, transport._link_lost = transport._link_lost, reports.append
            try:
                link._break("connection lost: cut in the test")  # type: ignore[attr-defined]
            finally:
                transport._link_lost = report

        await d._engine.run_sync(cut)
        assert reports == [link] and 1 not in d.linked_clusters()
        assert d.link_failure(1) == "link ended: connection lost: cut in the test"
        await d._engine.run_sync(link._t._link_lost, link)  # type: ignore[attr-defined]
        assert d.link_failure(1) == "link ended: connection lost: cut in the test"


async def test_wrong_cluster_at_the_address_names_both(caplog: pytest.LogCaptureFixture) -> None:
    async with linked_pair(config(listen_ip_info="127.0.0.1:0"), config(), link=False) as (p, d):
        peer = cluster_info(5, p.listen_address)
        with caplog.at_level(logging.WARNING, logger="aiokv"):
            assert (await d.link_clusters([peer]))[0] == CODE.LLM_LINK_FAILED
        reason = d.link_failure(5)
        assert reason is not None and "is cluster 1, not 5" in reason
        assert "check remote_cluster_id" in reason


def test_two_sided_link_retries_quietly_and_fails_once(caplog: pytest.LogCaptureFixture) -> None:
    """``link`` toward a party that never comes: a DEBUG line per retry (no
    tracebacks), one WARNING with the reason, the reason kept per cluster."""
    port = free_port()
    table = (
        '{"server_count": "1", "status": "completed", "version": "1.0", "server_list": '
        '[{"server_id": "127.0.0.1", "device": ['
        f'{{"device_id": "0", "device_ip": "127.0.0.1", "rank_id": "0", "device_port": "{port}"}},'
        f'{{"device_id": "1", "device_ip": "127.0.0.1", "rank_id": "1", "device_port": "{port}"}}'
        "]}]}"
    )
    cfg = config(link_total_time=1)
    with (
        caplog.at_level(logging.DEBUG, logger="aiokv"),
        llm_datadist.LLMDataDist(llm_datadist.LLMRole.DECODER, 2, cfg) as d,
    ):
        comm = d.link("c", {1: 0, 2: 1}, table)
        for _ in range(300):
            if d.query_register_mem_status(comm) != llm_datadist.RegisterMemStatus.PREPARING:
                break
            time.sleep(0.01)
        assert d.query_register_mem_status(comm) == llm_datadist.RegisterMemStatus.FAILED
        reason = d.link_failure(1)
    links = [r for r in caplog.records if r.name == "aiokv.links"]
    assert not any(r.exc_info for r in links)
    assert sum(r.levelno == logging.DEBUG and "try" in r.getMessage() for r in links) >= 2
    warnings = [r for r in links if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and f"127.0.0.1:{port}" in warnings[0].getMessage()
    assert reason is not None and f"127.0.0.1:{port}" in reason


# ---------------------------------------------------------------- mismatches, indices


@pytest.fixture
def sync_cm() -> Any:
    with llm_datadist.LLMDataDist(llm_datadist.LLMRole.PROMPT, 1, config()) as d:
        yield d.cache_manager


def _param_invalid(call: Any) -> str:
    with pytest.raises(LLMException) as ei:
        call()
    assert ei.value.status_code == CODE.LLM_PARAM_INVALID
    return str(ei.value)


def test_block_mismatch_names_both_caches_and_the_fields(sync_cm: Any) -> None:
    a = sync_cm.allocate_blocks_cache(CacheDesc(1, [4, 64], DataType.DT_INT8))
    b = sync_cm.allocate_blocks_cache(CacheDesc(1, [4, 32], DataType.DT_INT8))
    c = sync_cm.allocate_blocks_cache(CacheDesc(1, [4, 32], DataType.DT_BF16))
    d = sync_cm.allocate_blocks_cache(CacheDesc(2, [4, 64], DataType.DT_INT8))
    msg = _param_invalid(lambda: sync_cm.copy_kv_blocks(a, b, [0], [[1]]))
    assert "block sizes differ" in msg and f"src cache {a.cache_id} has 64 bytes" in msg
    assert f"dst cache {b.cache_id} has 32" in msg and "CacheDesc.shape" in msg
    msg = _param_invalid(lambda: sync_cm.copy_kv_blocks(b, c, [0], [[1]]))
    assert "data types differ" in msg and "DT_INT8" in msg and "DT_BF16" in msg
    assert "CacheDesc.data_type" in msg and "DataType." not in msg and " 1 vs" not in msg
    msg = _param_invalid(lambda: sync_cm.copy_kv_blocks(a, d, [0], [[1]]))
    assert "tensor counts differ" in msg and "has 1" in msg and "has 2" in msg
    assert "CacheDesc.num_tensors" in msg


def test_copy_cache_mismatch_names_both(sync_cm: Any) -> None:
    a = sync_cm.allocate_cache(CacheDesc(1, [2, 64], DataType.DT_INT8))
    b = sync_cm.allocate_cache(CacheDesc(1, [2, 32], DataType.DT_BF16))
    msg = _param_invalid(lambda: sync_cm.copy_cache(b, a))
    assert f"src cache {a.cache_id}" in msg and f"dst cache {b.cache_id}" in msg
    assert "DT_INT8" in msg and "DT_BF16" in msg and "data_type must be equal" in msg


@pytest.mark.parametrize("bad", [-1, 4])
def test_negative_block_index_is_the_same_error_as_past_the_end(sync_cm: Any, bad: int) -> None:
    a = sync_cm.allocate_blocks_cache(CacheDesc(1, [4, 64], DataType.DT_INT8))
    msg = _param_invalid(lambda: sync_cm.copy_blocks(a, {bad: [1]}))
    assert f"src block={bad} is out of range [0, 4)" in msg
    msg = _param_invalid(lambda: sync_cm.copy_blocks(a, {0: [bad]}))
    assert f"entry {bad} is out of range [0, 4)" in msg
    assert "9223372036854775807" not in msg


def test_a_repeated_destination_block_is_named(sync_cm: Any) -> None:
    a = sync_cm.allocate_blocks_cache(CacheDesc(1, [8, 64], DataType.DT_INT8))
    msg = _param_invalid(lambda: sync_cm.copy_blocks(a, {0: [3, 5, 3]}))
    assert "appears twice: 3" in msg


@pytest.mark.parametrize("config_type", [TransferConfig, TransferWithCacheKeyConfig])
def test_a_layer_range_of_the_wrong_type_names_the_model_and_field(config_type: Any) -> None:
    args = (2, [1]) if config_type is TransferConfig else (BlocksCacheKey(2),)
    with pytest.raises(TypeError) as err:
        config_type(*args, [0, 1])
    name = config_type.__name__
    assert str(err.value) == f"{name}: src_layer_range must be a range or None, got list"


def test_cache_manager_in_legacy_mode_says_how_to_get_one() -> None:
    cfg = config(enable_cache_manager=False)
    with llm_datadist.LLMDataDist(llm_datadist.LLMRole.PROMPT, 1, cfg) as legacy:
        msg = _param_invalid(lambda: legacy.cache_manager)
    assert "use kv_cache_manager" in msg and "enable_cache_manager = True" in msg


async def test_remote_mismatch_names_requester_and_owner() -> None:
    async with linked_pair(config(listen_ip_info="127.0.0.1:0"), config()) as (p, d):
        src = await p.cache_manager.allocate_blocks_cache(
            CacheDesc(1, [4, 64], DataType.DT_BF16), BlocksCacheKey(1, 0)
        )
        dst = await d.cache_manager.allocate_blocks_cache(CacheDesc(1, [4, 64], DataType.DT_INT8))
        await raises(
            CODE.LLM_PARAM_INVALID,
            d.cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, [0], [0]),
            "the requester's cache is DT_INT8",
            f"cache {src.cache_id} here (the owner's) is DT_BF16",
            "CacheDesc.data_type must be equal",
        )


# ---------------------------------------------------------------- config errors


def test_unknown_pool_key_lists_the_valid_ones_and_the_nearest() -> None:
    with pytest.raises(InvalidOptionError) as ei:
        llm_datadist.LLMConfig().mem_pool_cfg = '{"memroy_size": 67108864}'
    msg = str(ei.value)
    assert ei.value.status_code == CODE.LLM_PARAM_INVALID
    assert "unknown key 'memroy_size'" in msg and "did you mean 'memory_size'?" in msg
    assert "Valid: memory_size, page_shift" in msg


@pytest.mark.parametrize(
    ("typed", "shown"), [("tpc", "; did you mean 'tcp'?"), ("carrier-pigeon", "'carrier-pigeon'.")]
)
def test_an_unknown_transfer_backend_suggests_the_nearest(typed: str, shown: str) -> None:
    with pytest.raises(InvalidOptionError) as err:
        LLMConfig(transfer_backend=typed)
    assert shown in str(err.value) and "Valid: hixl, local, nixl, tcp" in str(err.value)
    assert LLMConfig(transfer_backend="hixl").transfer_backend == "tcp"  # the alias


def test_unknown_option_suggests_the_nearest() -> None:
    with pytest.raises(InvalidOptionError) as ei:
        LLMConfig.from_options({"llm.SyncKvCacheWaitTme": "5"})
    assert "did you mean 'llm.SyncKvCacheWaitTime'?" in str(ei.value)
    assert "llm.listenIpInfo" in str(ei.value)  # the valid ones are listed
    with pytest.raises(InvalidOptionError) as ei:
        LLMConfig(sync_kv_timout=5)  # type: ignore[call-arg]
    assert "did you mean 'sync_kv_timeout'?" in str(ei.value)
    with pytest.raises(AttributeError) as ai:
        LLMConfig().sync_kv_timout = 5  # type: ignore[attr-defined]
    assert "did you mean 'sync_kv_timeout'?" in str(ai.value)


@pytest.mark.parametrize("bad", ['"64MiB"', "1.5", "true"])
def test_a_value_of_the_wrong_kind_is_the_same_config_error(bad: str) -> None:
    cfg = llm_datadist.LLMConfig()
    with pytest.raises(InvalidOptionError) as ei:  # as for any other bad value
        cfg.mem_pool_cfg = f'{{"memory_size": {bad}}}'
    assert ei.value.status_code == CODE.LLM_PARAM_INVALID
    assert isinstance(ei.value, TypeError)  # still the TypeError it was
    assert "memory_size must be an integer number of bytes" in str(ei.value)  # the unit
    assert cfg.mem_pool_cfg is None  # nothing changed
    with pytest.raises(InvalidOptionError, match="log2 of the page size"):
        cfg.mem_pool_cfg = f'{{"memory_size": 67108864, "page_shift": {bad}}}'


@pytest.mark.parametrize("bad", ["64MiB", 1.5, True])
def test_a_pool_built_directly_with_a_value_of_the_wrong_kind_names_the_unit(bad: Any) -> None:
    with pytest.raises(TypeError) as ei:  # SPEC: a wrong type is a TypeError
        llm_datadist.MemPoolConfig(memory_size=bad)
    assert "memory_size must be an integer number of bytes (67108864 for 64 MiB)" in str(ei.value)
    with pytest.raises(TypeError, match="page_shift must be an integer, log2 of the page size"):
        llm_datadist.MemPoolConfig(memory_size=1 << 26, page_shift=bad)


# ---------------------------------------------------------------- lifecycle wording


def test_after_finalize_the_error_says_finalized_and_never_await() -> None:
    d = llm_datadist.LLMDataDist(llm_datadist.LLMRole.PROMPT, 1)
    with pytest.raises(RuntimeError) as ei:
        d.link_clusters([], 1000)
    assert "is not initialized; call init() first" in str(ei.value)
    assert "await" not in str(ei.value)
    d.init(config())
    cm = d.cache_manager
    d.finalize()
    for call in (
        lambda: d.cache_manager,
        lambda: d.link_clusters([], 1000),
        lambda: d.check_link_status(3),
    ):
        with pytest.raises(RuntimeError) as ei:
            call()
        msg = str(ei.value)
        assert "was finalized" in msg and "call init() to start it again" in msg, msg
        assert "await" not in msg and "not initialized" not in msg
    with pytest.raises(RuntimeError) as ei:
        cm.allocate_cache(CacheDesc(1, [2, 64], DataType.DT_INT8))
    assert "finalized" in str(ei.value) and "await" not in str(ei.value)
    d.init(config())  # init after finalize starts it afresh
    assert d.cache_manager is not None
    d.finalize()


def test_a_blocking_call_on_the_engine_thread_does_not_say_await() -> None:
    with llm_datadist.LLMDataDist(llm_datadist.LLMRole.PROMPT, 1, config()) as d:
        engine = d._engine_for()

        async def inside() -> str:
            try:
                engine.call(_noop)
            except RuntimeError as exc:
                return str(exc)
            return ""

        msg = engine.call(inside)
    assert "would deadlock" in msg and "async aiokv method" in msg and "await" not in msg


async def _noop() -> None:
    return None


def test_a_second_init_with_other_options_warns(caplog: pytest.LogCaptureFixture) -> None:
    with llm_datadist.LLMDataDist(llm_datadist.LLMRole.PROMPT, 1) as d:
        d.init(config())
        with caplog.at_level(logging.WARNING, logger="aiokv"):
            d.init(config())  # the same options: quiet, as before
        assert not caplog.records
        with pytest.warns(RuntimeWarning) as rec, caplog.at_level(logging.WARNING, "aiokv"):
            d.init(config(sync_kv_timeout=9000))
        msg = str(rec[0].message)
        assert "already initialized" in msg and "options are ignored" in msg  # cause
        assert "call finalize() first, then init()" in msg  # remedy
        assert any(msg in r.getMessage() for r in caplog.records)
        assert d.config.sync_kv_timeout == 3000  # nothing changed
        assert rec[0].filename == __file__  # the caller's line, not aiokv.sync's


# ---------------------------------------------------------------- llm_datadist's link check


def test_link_clusters_without_local_ip_info_is_refused_as_llm_datadist() -> None:
    """Cache-manager mode without ``local_comm_res``: ``LLM_PARAM_INVALID`` with
    llm_datadist's words, before any connection; legacy mode and a ``local_comm_res``
    do not ask for it."""
    peer = llm_datadist.LLMClusterInfo()
    peer.remote_cluster_id = 1
    peer.append_remote_ip_info("127.0.0.1", free_port())
    with llm_datadist.LLMDataDist(llm_datadist.LLMRole.DECODER, 2, config()) as d:
        with pytest.raises(LLMException) as ei:
            d.link_clusters([peer], 300)
        assert ei.value.status_code == CODE.LLM_PARAM_INVALID
        msg = str(ei.value)
        assert "local_ip_info_list is empty" in msg and "Call append_local_ip_info" in msg
        assert d.link_failure(1) is None  # nothing was tried
    for cfg in (
        config(local_comm_res='{"status": "completed"}'),
        config(enable_cache_manager=False, mem_pool_cfg=None),
    ):
        with llm_datadist.LLMDataDist(llm_datadist.LLMRole.DECODER, 2, cfg) as d:
            assert d.link_clusters([peer], 300)[0] == CODE.LLM_LINK_FAILED  # tried
    peer.append_local_ip_info("127.0.0.1", 0)
    with llm_datadist.LLMDataDist(llm_datadist.LLMRole.DECODER, 2, config()) as d:
        assert d.link_clusters([peer], 300)[0] == CODE.LLM_LINK_FAILED  # tried
        # no address of the peer: failed without a try, the remedy kept for the caller
        nowhere = llm_datadist.LLMClusterInfo()
        nowhere.remote_cluster_id = 3
        nowhere.append_local_ip_info("127.0.0.1", 0)
        assert d.link_clusters([nowhere], 300) == (CODE.LLM_LINK_FAILED, [CODE.LLM_LINK_FAILED])
        assert "call append_remote_ip_info(ip, port)" in str(d.link_failure(3))


def test_a_misspelt_option_is_refused_naming_the_call_that_took_it() -> None:
    """``init`` and ``switch_role`` name themselves (and the nearest option), not the
    ``LLMConfig.from_options`` they parse with; nothing changes."""
    with llm_datadist.LLMDataDist(llm_datadist.LLMRole.PROMPT, 1) as d:
        with pytest.raises(InvalidOptionError) as ei:
            d.init({"llm.listenIpInf": "127.0.0.1:0"})
        assert ei.value.op == "init" and ei.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
        assert str(ei.value).startswith("init: unknown option 'llm.listenIpInf'; did you mean")
        assert not d.initialized
        d.init(config())
        with pytest.raises(InvalidOptionError) as ei:
            d.switch_role(llm_datadist.LLMRole.DECODER, {"llm.listenIpInfo2": "127.0.0.1:0"})
        assert ei.value.op == "switch_role"
        assert str(ei.value).startswith("switch_role: unknown option 'llm.listenIpInfo2'")
        assert d.role == llm_datadist.LLMRole.PROMPT
