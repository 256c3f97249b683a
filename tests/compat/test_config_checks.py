"""LLMConfig and LLMClusterInfo checks: explicit values win over the environment at
init, ge_options are checked when assigned, an address list is extended all or nothing."""

from __future__ import annotations

import warnings

import pytest

import aiokv.sync as llm_datadist
from aiokv import LLMClusterInfo
from aiokv import LLMConfig
from aiokv import LLMException
from aiokv import LLMRole
from aiokv import LLMStatusCode

POOL = '{"memory_size": 1048576, "page_shift": 16}'


def test_explicit_values_win_over_the_environment_at_init(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """docs/options.md: "Arguments, option keys and assignments win" over ``AIOKV_*``
    defaults. A config that says "no listener, no pool" (``""`` / ``None``, values its
    dict form leaves out) must not get the environment's listener and pool at init."""
    monkeypatch.setenv("AIOKV_LISTEN_IP_INFO", "127.0.0.1:0")
    monkeypatch.setenv("AIOKV_MEM_POOL_CFG", POOL)
    cfg = LLMConfig(device_type="cpu", enable_cache_manager=True)
    cfg.listen_ip_info = ""  # assignments win
    cfg.mem_pool_cfg = None
    assert cfg.listen_address is None and cfg.mem_pool_cfg is None
    with llm_datadist.LLMDataDist(LLMRole.PROMPT, 1, cfg) as dd:
        assert dd.listen_address is None  # no listener opened behind the config's back
        assert dd.config.mem_pool_cfg is None
        assert dd.cache_manager.get_pool_stats() is None  # no pool reserved
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            dd.init(cfg)  # the same options again: a no-op, without a warning


def test_ip_info_list_extend_with_a_bad_address_adds_none() -> None:
    """A failed call changes nothing: ``extend`` with a bad address among good ones
    raised, yet added the good ones before it."""
    info = LLMClusterInfo()
    info.remote_cluster_id = 1
    with pytest.raises(LLMException) as ei:
        info.local_ip_info_list.extend([("127.0.0.1", 26000), ("localhost", 26001)])
    assert ei.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    assert info.local_ip_info == []
    with pytest.raises(ValueError):
        info.remote_ip_info_list.extend([("127.0.0.1", 26000), ("127.0.0.1", 70000)])
    assert info.remote_ip_info == []
    info.remote_ip_info_list.extend([("127.0.0.1", 26000), (0x0100007F, 26001)])
    assert info.remote_ip_info == [("127.0.0.1", 26000), ("127.0.0.1", 26001)]


@pytest.mark.parametrize(
    "ge",
    [{"llm.listenIpInf": "127.0.0.1:0"}, {"llm.SyncKvCacheWaitTime": "abc"}, {"foo": "1"}],
)
def test_a_ge_options_key_init_refuses_is_refused_when_assigned(ge: dict[str, str]) -> None:
    """docs/compat.md said ``ge_options`` keys other than options' "are not used", but
    ``init`` refuses them (unknown option, bad value): the config took them silently
    and the error came only at ``init``. Refused when assigned, as every other field's
    bad value is; nothing changes."""
    with pytest.raises(LLMException) as ei:
        LLMConfig(ge_options=ge)
    assert ei.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    cfg = LLMConfig()
    with pytest.raises(LLMException):
        cfg.ge_options = ge
    assert cfg.ge_options == {}
    # what init takes is still taken
    ok = LLMConfig(ge_options={"ge.x": "1", "llm.Role": "Prompt", "llm.SyncKvCacheWaitTime": "7"})
    assert LLMConfig.from_options(ok.generate_options()).sync_kv_timeout == 7


def test_a_second_init_with_the_same_options_in_the_other_form_does_not_warn() -> None:
    """``init(dict)`` then ``init(LLMConfig)`` of the same options: a no-op, without the
    "different options" warning (``""`` and ``None`` both mean not set)."""
    cfg = LLMConfig(device_type="cpu", enable_cache_manager=True)
    cfg.listen_ip_info = None
    with (
        llm_datadist.LLMDataDist(LLMRole.PROMPT, 1, cfg.generate_options()) as dd,
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("error", RuntimeWarning)
        dd.init(cfg)


@pytest.mark.parametrize("value", ["1.2.3.4:\u0665", "::1:5", "fe80::1:26000", "1.2.3.4:"])
def test_listen_ip_info_in_an_ambiguous_or_non_ascii_form_is_refused(value: str) -> None:
    """``"ip:port"`` with ASCII digits; an IPv6 address in brackets: ``"::1:5"`` reads
    as ``::1`` port 5 or ``::1:5`` with no port, and was taken as the first; an Arabic-
    Indic digit read as a port number."""
    cfg = LLMConfig()
    with pytest.raises(LLMException) as ei:
        cfg.listen_ip_info = value
    assert ei.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    assert cfg.listen_ip_info == ""
    cfg.listen_ip_info = "[::1]:5"
    assert cfg.listen_address == ("::1", 5)
