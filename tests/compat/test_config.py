"""``LLMConfig`` and ``init`` take what llm_datadist clients set (issue #8, item 1).

Every option llm_datadist's ``LlmConfig`` has, its key names, digit strings, its ranges
(``LLMException(LLM_PARAM_INVALID)``), the dict its ``generate_options()`` emits, and a
second ``init`` being a no-op, async and ``aiokv.sync``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import pytest

import aiokv
import aiokv.sync
from aiokv import LLMClusterInfo
from aiokv import LLMConfig
from aiokv import LLMDataDist
from aiokv import LLMException
from aiokv import LLMRole
from aiokv import LLMStatusCode
from aiokv._config import _OPTION_KEYS
from aiokv.transport.tcp import TcpTransport

PARAM_INVALID = LLMStatusCode.LLM_PARAM_INVALID
POOL = '{"memory_size": 33554432, "page_shift": 12}'

#: what llm_datadist's own ``LlmConfig.generate_options()`` returns (captured from its
#: configs.py) for: device_id=0, sync_kv_timeout="5000", enable_cache_manager=True, both
#: pools, listen_ip_info, link_total_time=2**32-1, link_retry_count=3, rdma_* , local_comm_res="",
#: transfer_backend="hixl", buf_pool_cfg, enable_switch_role=True and two ge_options. Its
#: mem_utilization is always there (0.95, its default).
LLD_OPTIONS = {
    "ge.flowGraphMemMaxSize": "2147483648",
    "ge.exec.rankId": "0",
    "ge.exec.deviceId": "0",
    "ge.session_device_id": "0",
    "llm.SyncKvCacheWaitTime": "5000",
    "llm.BufPoolCfg": '{"buf_cfg":[{"total_size":2097152,"blk_size":256,"max_buf_size":8192}]}',
    "llm.MemPoolConfig": POOL,
    "llm.HostMemPoolConfig": POOL,
    "llm.EnableCacheManager": "1",
    "llm.listenIpInfo": "127.0.0.1:0",
    "llm.LinkTotalTime": "4294967295",
    "llm.LinkRetryCount": "3",
    "llm.RdmaTrafficClass": "132",
    "llm.RdmaServiceLevel": "4",
    "llm.LocalCommRes": "",
    "llm.TransferBackend": "hixl",
    "llm.EnableSwitchRole": "1",
    "llm.MemoryUtilization": "0.95",
}
IGNORED = {
    "ge.flowGraphMemMaxSize",
    "ge.exec.rankId",
    "llm.BufPoolCfg",
    "llm.RdmaTrafficClass",
    "llm.RdmaServiceLevel",
    "llm.LocalCommRes",
    "llm.EnableSwitchRole",
    "llm.MemoryUtilization",
}


def param_invalid(fn: Callable[[], Any]) -> LLMException:
    """Run ``fn``; it must raise LLM_PARAM_INVALID, which is also a ValueError."""
    with pytest.raises(LLMException) as info:
        fn()
    assert info.value.status_code == PARAM_INVALID
    assert isinstance(info.value, ValueError)
    return info.value


def test_every_llm_datadist_option_is_assignable() -> None:
    cfg = aiokv.LlmConfig()  # llm_datadist's spelling of the name
    cfg.device_id = 0
    cfg.sync_kv_timeout = "5000"  # type: ignore[assignment]  # a digit string, as llm_datadist
    cfg.enable_cache_manager = True
    cfg.mem_pool_cfg = POOL  # type: ignore[assignment]
    cfg.host_mem_pool_cfg = POOL  # type: ignore[assignment]
    cfg.listen_ip_info = "127.0.0.1:0"
    cfg.link_total_time = 2**32 - 1
    cfg.link_retry_count = 3
    cfg.rdma_traffic_class = 132
    cfg.rdma_service_level = 4
    cfg.local_comm_res = ""
    cfg.transfer_backend = "hixl"  # type: ignore[assignment]
    cfg.buf_pool_cfg = LLD_OPTIONS["llm.BufPoolCfg"]
    cfg.enable_switch_role = True
    cfg.ge_options = {"ge.flowGraphMemMaxSize": "2147483648", "ge.exec.rankId": "0"}
    cfg.mem_utilization = 0.95
    assert cfg.sync_kv_timeout == 5000 and cfg.transfer_backend == "tcp"
    assert cfg.enable_remote_cache_accessible  # implied by local_comm_res
    expected = dict(LLD_OPTIONS, **{"llm.TransferBackend": "tcp"})
    assert cfg.generate_options() == expected
    assert set(cfg.ignored_options()) == IGNORED
    assert aiokv.LlmConfig is LLMConfig and aiokv.sync.LlmConfig is LLMConfig
    assert "LlmConfig" in aiokv.__all__ and "LlmConfig" in aiokv.sync.__all__


def test_offline_mode_options_and_option_aliases() -> None:
    """llm_datadist's offline-mode options are accepted, echoed and listed as ignored;
    ``gen_options()`` and ``options`` are its other names for the generated dict."""
    cfg = LLMConfig()
    cfg.deploy_res_path = "/opt/res"
    cfg.output_max_size = 1 << 20
    cfg.cluster_info = '{"cluster_id": 1}'
    cfg.global_resource_config = "cfg"
    offline = {
        "llm.deployResPath": "/opt/res",
        "llm.OutputMaxSize": str(1 << 20),
        "llm.ClusterInfo": '{"cluster_id": 1}',
        "llm.GlobalResourceConfig": "cfg",
    }
    assert cfg.generate_options() == offline == cfg.gen_options() == cfg.options
    assert cfg.ignored_options() == offline
    assert LLMConfig.from_options(offline) == cfg
    param_invalid(lambda: setattr(cfg, "cluster_info", "not json"))
    param_invalid(lambda: setattr(cfg, "output_max_size", -1))
    assert cfg.generate_options() == offline  # refused values changed nothing


def test_generate_options_emits_only_what_was_set() -> None:
    assert LLMConfig().generate_options() == {}
    cfg = LLMConfig(link_retry_count=1)  # a default value, but set: emitted
    assert cfg.generate_options() == {"llm.LinkRetryCount": "1"}
    cfg.device_id = 3
    cfg.enable_switch_role = True
    cfg.mem_utilization = 0.5
    assert cfg.generate_options() == {
        "llm.LinkRetryCount": "1",
        "ge.exec.deviceId": "3",
        "ge.session_device_id": "3",
        "llm.EnableSwitchRole": "1",
        "llm.MemoryUtilization": "0.5",
    }
    cfg.listen_ip_info = ""  # "not set", as in llm_datadist
    assert "llm.listenIpInfo" not in cfg.generate_options()
    assert LLMConfig.from_options(cfg.generate_options()) == cfg


def test_false_values_are_left_out_where_llm_datadist_leaves_them_out() -> None:
    """llm_datadist's ``gen_options()`` emits these only while true (``if value:``);
    ``local_comm_res``, ``global_resource_config`` and the numbers and ``enable_*``
    flags it emits once set, ``""`` / ``0`` / ``False`` included."""
    cfg = LLMConfig()
    cfg.enable_switch_role = False
    cfg.deploy_res_path = ""
    cfg.buf_pool_cfg = ""
    cfg.listen_ip_info = ""
    cfg.mem_pool_cfg = ""
    cfg.host_mem_pool_cfg = ""
    assert cfg.generate_options() == {}
    assert cfg.listen_address is None and cfg.mem_pool_cfg is None  # "": no listener, no pool
    cfg.local_comm_res = ""
    cfg.global_resource_config = ""
    cfg.enable_cache_manager = True
    cfg.enable_remote_cache_accessible = False
    cfg.link_total_time = 0
    cfg.output_max_size = 0
    assert cfg.generate_options() == {
        "llm.LocalCommRes": "",
        "llm.GlobalResourceConfig": "",
        "llm.EnableCacheManager": "1",
        "llm.EnableRemoteCacheAccessible": "0",
        "llm.LinkTotalTime": "0",
        "llm.OutputMaxSize": "0",
    }


def test_unset_string_options_read_empty_as_in_llm_datadist() -> None:
    cfg = LLMConfig()
    for field in (
        "listen_ip_info",
        "deploy_res_path",
        "buf_pool_cfg",
        "cluster_info",
        "global_resource_config",
    ):
        assert getattr(cfg, field) == "", field
    cfg.listen_ip_info = None  # stored, as there; not set either way
    cfg.deploy_res_path = None
    assert (cfg.listen_ip_info, cfg.deploy_res_path) == (None, None)
    assert cfg.generate_options() == {}
    with pytest.raises(TypeError):  # llm_datadist: json.loads(None), a TypeError
        cfg.cluster_info = None  # type: ignore[assignment]
    param_invalid(lambda: setattr(cfg, "cluster_info", ""))  # not JSON, as there
    assert cfg.cluster_info == "" and cfg.generate_options() == {}


@pytest.mark.parametrize(
    ("field", "value", "unset"),
    [
        ("enable_cache_manager", True, False),
        ("enable_remote_cache_accessible", True, False),
        ("enable_switch_role", True, False),
        ("transfer_backend", "local", "tcp"),
        ("local_comm_res", "{}", None),
        ("global_resource_config", "g", ""),
    ],
)
def test_none_unsets_as_in_llm_datadist(field: str, value: Any, unset: Any) -> None:
    cfg = LLMConfig(**{field: value})
    assert _OPTION_KEYS[field] in cfg.generate_options()
    setattr(cfg, field, None)
    assert getattr(cfg, field) == unset
    assert cfg.generate_options() == {}
    given: dict[str, Any] = {field: None}
    assert LLMConfig(**given).generate_options() == {}  # given as None: not given


def test_none_unset_enable_flags_follow_local_comm_res_again() -> None:
    cfg = LLMConfig(local_comm_res="{}", enable_remote_cache_accessible=False)
    assert not cfg.enable_remote_cache_accessible
    cfg.enable_remote_cache_accessible = None
    assert cfg.enable_remote_cache_accessible  # implied by local_comm_res again
    assert cfg.generate_options() == {"llm.LocalCommRes": "{}"}
    cfg.local_comm_res = None
    assert not cfg.enable_cache_manager and not cfg.enable_remote_cache_accessible


def test_digit_strings_where_llm_datadist_takes_them() -> None:
    cfg = LLMConfig(sync_kv_timeout="250")
    assert cfg.sync_kv_timeout == 250
    for bad in ("5s", "-5", "", "1.5", "٣"):
        param_invalid(lambda bad=bad: setattr(cfg, "sync_kv_timeout", bad))
    param_invalid(lambda: setattr(cfg, "sync_kv_timeout", "0"))  # must be > 0
    param_invalid(lambda: setattr(cfg, "sync_kv_timeout", str(2**31)))  # an int32
    with pytest.raises(TypeError):
        cfg.sync_kv_timeout = 5.0  # type: ignore[assignment]
    assert cfg.sync_kv_timeout == 250
    with pytest.raises(TypeError):  # llm_datadist takes no digit string for these
        cfg.link_retry_count = "3"  # type: ignore[assignment]
    # in the dict form every number is a digit string
    opts = {"llm.LinkTotalTime": "4294967295", "llm.RdmaServiceLevel": "7"}
    parsed = LLMConfig.from_options(opts)
    assert (parsed.link_total_time, parsed.rdma_service_level) == (2**32 - 1, 7)
    for key, raw in [
        ("llm.LinkTotalTime", "4294967296"),
        ("llm.LinkTotalTime", "-1"),
        ("llm.LinkRetryCount", "0x3"),
        ("llm.MemoryUtilization", "most"),
        ("llm.EnableSwitchRole", "yes"),
        ("ge.exec.deviceId", "0;1"),  # one device per LLMDataDist
        ("ge.flowGraphMemMaxSize", "2G"),  # llm_datadist checks this one too
    ]:
        message = str(param_invalid(lambda key=key, raw=raw: LLMConfig.from_options({key: raw})))
        assert key in message


@pytest.mark.parametrize(
    ("field", "good", "bad"),
    [
        ("link_total_time", [0, 2**32 - 1], [-1, 2**32]),
        ("link_retry_count", [1, 100], [0, 101]),
        ("rdma_traffic_class", [0, 2**32 - 1], [-1, 2**32]),
        ("rdma_service_level", [0, 2**32 - 1], [-1, 2**32]),
        ("mem_utilization", [0.0, 1.0, 0.9], [-0.1, 1.5, float("nan"), float("inf")]),
    ],
)
def test_ranges_are_llm_datadist_s(field: str, good: list[Any], bad: list[Any]) -> None:
    for value in good:
        assert getattr(LLMConfig(**{field: value}), field) == value
    cfg = LLMConfig(**{field: good[0]})
    before = cfg.generate_options()
    for value in bad:
        assert field in str(param_invalid(lambda value=value: setattr(cfg, field, value)))
        param_invalid(lambda value=value: LLMConfig(**{field: value}))
    assert cfg.generate_options() == before  # failed assignments changed nothing


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("enable_switch_role", 1),
        ("rdma_traffic_class", "4"),
        ("buf_pool_cfg", 1),
        ("local_comm_res", {}),
        ("ge_options", "ge.x=1"),
        ("ge_options", {"ge.x": 1}),
        ("ge_options", {1: "x"}),
        ("transfer_backend", 1),
    ],
)
def test_wrong_types_raise_type_error(field: str, value: Any) -> None:
    cfg = LLMConfig()
    with pytest.raises(TypeError):
        setattr(cfg, field, value)
    assert cfg.generate_options() == {}


def test_local_comm_res_implies_cache_manager_and_remote_access() -> None:
    cfg = LLMConfig()
    cfg.local_comm_res = '{"rank_table": []}'
    assert cfg.enable_cache_manager and cfg.enable_remote_cache_accessible
    assert cfg.generate_options() == {"llm.LocalCommRes": '{"rank_table": []}'}  # implied: not set
    cfg.enable_remote_cache_accessible = False  # an explicit choice wins, as in llm_datadist
    assert cfg.enable_cache_manager and not cfg.enable_remote_cache_accessible
    cfg.local_comm_res = None
    assert not cfg.enable_cache_manager  # back to the default once nothing implies it
    # llm_datadist refuses local_comm_res outside cache-manager mode; nothing changes
    cfg = LLMConfig(enable_cache_manager=False)
    param_invalid(lambda: setattr(cfg, "local_comm_res", "x"))
    assert cfg.local_comm_res is None and cfg.generate_options() == {"llm.EnableCacheManager": "0"}
    cfg = LLMConfig(local_comm_res="x")
    assert "enable_cache_manager" in str(
        param_invalid(lambda: setattr(cfg, "enable_cache_manager", False))
    )
    assert cfg.enable_cache_manager and cfg.generate_options() == {"llm.LocalCommRes": "x"}
    param_invalid(lambda: LLMConfig(local_comm_res="x", enable_cache_manager=False))


def test_hixl_is_the_best_backend_between_processes() -> None:
    assert LLMConfig(transfer_backend="hixl").transfer_backend == "tcp"
    assert LLMConfig.from_options({"llm.TransferBackend": "hixl"}).transfer_backend == "tcp"
    # aiokv's earlier key is still read
    assert LLMConfig.from_options({"aiokv.transferBackend": "local"}).transfer_backend == "local"
    with pytest.raises(ValueError):
        LLMConfig(transfer_backend="rdma")  # type: ignore[arg-type]
    param_invalid(
        lambda: LLMConfig.from_options(
            {"llm.TransferBackend": "tcp", "aiokv.transferBackend": "tcp"}
        )
    )


def test_llm_datadist_generate_options_dict_parses() -> None:
    cfg = LLMConfig.from_options(LLD_OPTIONS)
    assert cfg.device_id == 0 and cfg.sync_kv_timeout == 5000
    assert cfg.enable_cache_manager and cfg.enable_remote_cache_accessible
    assert (cfg.link_total_time, cfg.link_retry_count) == (2**32 - 1, 3)
    assert (cfg.rdma_traffic_class, cfg.rdma_service_level) == (132, 4)
    assert cfg.enable_switch_role and cfg.mem_utilization == 0.95 and cfg.transfer_backend == "tcp"
    assert cfg.mem_pool_cfg is not None and cfg.mem_pool_cfg.memory_size == 32 << 20
    assert cfg.ge_options == {"ge.flowGraphMemMaxSize": "2147483648", "ge.exec.rankId": "0"}
    assert LLMConfig.from_options(cfg.generate_options()) == cfg
    # llm_datadist's engine-internal keys and any ge.* key: kept in ge_options
    extra = {"llm.Role": "Prompt", "llm.kvTensorFormat": "ND", "ge.anything": "v"}
    assert LLMConfig.from_options(extra).ge_options == extra
    assert "llm.Nope" in str(param_invalid(lambda: LLMConfig.from_options({"llm.Nope": "1"})))
    with pytest.raises(TypeError):
        LLMConfig.from_options({"llm.LinkRetryCount": 3})  # type: ignore[dict-item]


async def test_init_takes_llm_datadist_options_and_second_init_is_a_no_op(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="aiokv")
    dd = LLMDataDist(LLMRole.PROMPT, 11)
    try:
        await dd.init(dict(LLD_OPTIONS, **{"aiokv.deviceType": "cpu"}))
        assert dd.config.enable_remote_cache_accessible and dd.listen_address is not None
        assert isinstance(dd._transport, TcpTransport)  # "hixl"
        cm = dd.cache_manager  # local_comm_res / EnableCacheManager: cache-manager mode
        assert cm.get_pool_stats() is not None
        logged = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG)
        for key in IGNORED:
            assert key in logged
        state = (dd.config, dd.listen_address, dd.cache_manager, dd._engine)
        with pytest.warns(RuntimeWarning, match="already initialized.*finalize"):
            await dd.init(LLMConfig(device_type="cpu"))  # no-op: nothing changes
        with pytest.warns(RuntimeWarning, match="already initialized"):
            await dd.init(None)  # type: ignore[arg-type]  # not even checked, as llm_datadist
        assert (dd.config, dd.listen_address, dd.cache_manager, dd._engine) == state
    finally:
        await dd.finalize()
    assert not dd.initialized
    # a ge_options key naming an option takes effect, as llm_datadist's merge does
    cfg = LLMConfig(device_type="cpu", ge_options={"llm.SyncKvCacheWaitTime": "77"})
    async with LLMDataDist(LLMRole.MIX, 12, cfg) as dd:
        assert dd.config.sync_kv_timeout == 77
        assert isinstance(dd.kv_cache_manager, aiokv.KvCacheManager)  # legacy by default


def test_sync_hixl_link_with_full_link_total_time_and_second_init() -> None:
    def options(cluster: int) -> dict[str, str]:
        cfg = aiokv.sync.LlmConfig()
        cfg.device_type = "cpu"
        cfg.listen_ip_info = "127.0.0.1:0"
        cfg.transfer_backend = "hixl"  # type: ignore[assignment]
        cfg.local_comm_res = ""
        cfg.link_total_time = 2**32 - 1
        cfg.link_retry_count = 2
        return cfg.generate_options()

    prompt = aiokv.sync.LLMDataDist(LLMRole.PROMPT, 21)
    decoder = aiokv.sync.LLMDataDist(LLMRole.DECODER, 22)
    try:
        prompt.init(options(21))
        decoder.init(options(22))
        address = prompt.listen_address
        prompt.init(options(21))  # no-op
        assert prompt.listen_address == address and prompt.initialized
        info = LLMClusterInfo()
        info.remote_cluster_id = 21
        assert address is not None
        info.append_local_ip_info("127.0.0.1", 0)
        info.append_remote_ip_info(*address)
        code, codes = decoder.link_clusters([info], timeout=5000)
        assert (code, codes) == (LLMStatusCode.LLM_SUCCESS, [LLMStatusCode.LLM_SUCCESS])
        assert decoder.linked_clusters() == [21]
    finally:
        decoder.finalize()
        prompt.finalize()
    try:  # after finalize, init starts afresh
        prompt.init(options(21))
        assert prompt.initialized and prompt.listen_address is not None
    finally:
        prompt.finalize()
    names = [t.name for t in threading.enumerate()]
    assert not any(n in ("aiokv-engine-21", "aiokv-engine-22") for n in names), names
