"""Deployment configuration and secrets (issue #12, packaging): ``AIOKV_<FIELD>`` variables
supply ``LLMConfig`` defaults (arguments win), and ``link_secret`` is a ``SecretStr`` that
no repr, log record or ``generate_options()`` shows unless asked."""

from __future__ import annotations

import logging

import pytest
from pydantic import SecretStr

from aiokv import LLMClusterInfo, LLMConfig, LLMDataDist, LLMException, LLMRole, LLMStatusCode
from aiokv.sync import LLMConfig as SyncLLMConfig

SECRET = "tops3cret-value"
POOL = '{"memory_size": 16777216, "page_shift": 12}'


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No AIOKV_<FIELD> variable of the outer environment leaks into these tests."""
    import os

    for name in list(os.environ):
        if name.startswith("AIOKV_") and name[6:].lower() in LLMConfig.model_fields:
            monkeypatch.delenv(name)


def test_environment_supplies_defaults_and_arguments_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIOKV_DEVICE_ID", "3")
    monkeypatch.setenv("AIOKV_ENABLE_CACHE_MANAGER", "true")
    monkeypatch.setenv("aiokv_sync_kv_timeout", "2500")  # case-insensitive names
    monkeypatch.setenv("AIOKV_HOST_MEM_POOL_CFG", POOL)
    monkeypatch.setenv("AIOKV_TRANSFER_BACKEND", "hixl")  # llm_datadist's name, as in options
    monkeypatch.setenv("AIOKV_LISTEN_IP_INFO", "")  # empty: unset
    cfg = LLMConfig()
    assert (cfg.device_id, cfg.enable_cache_manager, cfg.sync_kv_timeout) == (3, True, 2500)
    assert cfg.host_mem_pool_cfg is not None and cfg.host_mem_pool_cfg.page_shift == 12
    assert cfg.transfer_backend == "tcp" and cfg.listen_ip_info is None
    # defaults, not options that were set: generate_options() leaves them out
    assert cfg.generate_options() == {}
    explicit = LLMConfig(device_id=1, sync_kv_timeout=10)
    assert (explicit.device_id, explicit.sync_kv_timeout) == (1, 10)
    assert explicit.generate_options()["ge.exec.deviceId"] == "1"
    assert LLMConfig.from_options({"ge.exec.deviceId": "2"}).device_id == 2
    assert LLMConfig.from_options({}).device_id == 3  # the dict form gets them too
    assert SyncLLMConfig is LLMConfig
    monkeypatch.delenv("AIOKV_DEVICE_ID")
    assert LLMConfig().device_id == 0


@pytest.mark.parametrize(
    ("name", "value", "match"),
    [
        ("AIOKV_DEVICE_ID", "x", "AIOKV_DEVICE_ID='x' is not an integer"),
        ("AIOKV_DEVICE_ID", "-1", "AIOKV_DEVICE_ID='-1': .*greater than or equal to 0"),
        ("AIOKV_ENABLE_CACHE_MANAGER", "maybe", "AIOKV_ENABLE_CACHE_MANAGER='maybe' is not a"),
        ("AIOKV_MEM_POOL_CFG", "{", "AIOKV_MEM_POOL_CFG='{'"),
        ("AIOKV_TRANSFER_BACKEND", "rdma", "AIOKV_TRANSFER_BACKEND='rdma'"),
        ("AIOKV_LINK_SECRET", "s" * 4097, r"AIOKV_LINK_SECRET=\*{10}: .*4096"),
    ],
)
def test_bad_environment_value_names_the_variable(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str, match: str
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(LLMException, match=match) as ei:
        LLMConfig(device_type="cpu")  # even with other arguments
    assert ei.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    assert isinstance(ei.value, ValueError)
    if name == "AIOKV_LINK_SECRET":
        assert "sss" not in str(ei.value)


def test_secret_is_masked_unless_asked() -> None:
    cfg = LLMConfig(link_secret=SECRET)
    assert isinstance(cfg.link_secret, SecretStr)
    assert cfg.link_secret.get_secret_value() == SECRET
    cfg.link_secret = SECRET + "2"  # type: ignore[assignment]  # llm_datadist-style
    assert isinstance(cfg.link_secret, SecretStr)
    for shown in (repr(cfg), str(cfg), cfg.generate_options(), cfg.options, cfg.gen_options()):
        assert SECRET not in str(shown)
    assert cfg.generate_options()["aiokv.linkSecret"] == "**********"
    revealed = cfg.generate_options(reveal_secrets=True)
    assert revealed["aiokv.linkSecret"] == SECRET + "2"
    back = LLMConfig.from_options(revealed)
    assert back.link_secret is not None and back.link_secret.get_secret_value() == SECRET + "2"
    # the mask is refused, never taken as the secret
    with pytest.raises(LLMException, match="reveal_secrets=True") as ei:
        LLMConfig.from_options(cfg.generate_options())
    assert ei.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    with pytest.raises(ValueError):
        LLMConfig(link_secret="")


async def test_environment_secret_authenticates_links_and_is_never_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A deployment sets AIOKV_LINK_SECRET once; llm_datadist-style dict options (which
    never carry it) still get it; a peer with another secret is refused; no log shows it."""
    monkeypatch.setenv("AIOKV_LINK_SECRET", SECRET)
    monkeypatch.setenv("AIOKV_DEVICE_TYPE", "cpu")
    monkeypatch.setenv("AIOKV_ENABLE_CACHE_MANAGER", "1")
    monkeypatch.setenv("AIOKV_MEM_POOL_CFG", POOL)
    caplog.set_level(logging.DEBUG, logger="aiokv")
    options = {"llm.listenIpInfo": "127.0.0.1:0"}
    p, good, bad = (LLMDataDist(LLMRole.PROMPT, 1), LLMDataDist(LLMRole.DECODER, 2), None)
    try:
        await p.init(options)
        await good.init(LLMConfig(listen_ip_info="127.0.0.1:0"))
        bad = LLMDataDist(LLMRole.DECODER, 3)
        await bad.init(LLMConfig(link_secret="another-secret"))
        assert p.listen_address is not None
        peer = [
            LLMClusterInfo(
                remote_cluster_id=1,
                local_ip_info=[("127.0.0.1", 0)],
                remote_ip_info=[p.listen_address],
            )
        ]
        assert (await bad.link_clusters(peer))[1] == [LLMStatusCode.LLM_LINK_FAILED]
        assert (await good.link_clusters(peer))[1] == [LLMStatusCode.LLM_SUCCESS]
    finally:
        for d in (bad, good, p):
            if d is not None:
                await d.finalize()
    assert caplog.records
    assert not [r for r in caplog.records if SECRET in r.getMessage()]
