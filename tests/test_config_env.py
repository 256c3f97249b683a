"""Deployment configuration and secrets (issue #12, packaging): ``AIOKV_<FIELD>`` variables
supply ``LLMConfig`` defaults (arguments win), and ``link_secret`` is a ``SecretStr`` that
no repr, log record or ``generate_options()`` shows unless asked."""

from __future__ import annotations

import logging
import warnings

import pytest
from pydantic import SecretStr

from aiokv import LLMConfig
from aiokv import LLMDataDist
from aiokv import LLMException
from aiokv import LLMRole
from aiokv import LLMStatusCode
from aiokv import _config
from aiokv.sync import LLMConfig as SyncLLMConfig
from aiokv.testing import cluster_info

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
    assert cfg.transfer_backend == "tcp" and cfg.listen_ip_info == ""
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


async def only_the_secret_links(p: LLMDataDist, good: LLMDataDist, bad: LLMDataDist) -> None:
    """``bad`` (another secret, or none) fails to link to ``p``; ``good`` (the secret of
    ``p``) links."""
    peer = [cluster_info(1, p.listen_address)]
    assert (await bad.link_clusters(peer))[1] == [LLMStatusCode.LLM_LINK_FAILED]
    assert (await good.link_clusters(peer))[1] == [LLMStatusCode.LLM_SUCCESS]


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
        await only_the_secret_links(p, good, bad)
    finally:
        for d in (bad, good, p):
            if d is not None:
                await d.finalize()
    assert caplog.records
    assert not [r for r in caplog.records if SECRET in r.getMessage()]


def _outputs(cfg: LLMConfig) -> dict[str, str]:
    """Every way an ``LLMConfig`` shows itself."""
    return {
        "repr": repr(cfg),
        "str": str(cfg),
        "generate_options": str(cfg.generate_options()),
        "gen_options": str(cfg.gen_options()),
        "options": str(cfg.options),
        "ignored_options": str(cfg.ignored_options()),
        "ge_options": str(cfg.ge_options),
        "model_dump": str(cfg.model_dump()),
        "model_dump_json": cfg.model_dump_json(),
        "model_dump(json)": str(cfg.model_dump(mode="json")),
        "copy": repr(cfg.model_copy()),
    }


def _by_assigned_ge() -> LLMConfig:
    cfg = LLMConfig()
    cfg.ge_options = {"ge.x": "1", "aiokv.linkSecret": SECRET}
    return cfg


def _by_assigned_field() -> LLMConfig:
    cfg = LLMConfig()
    cfg.link_secret = SECRET  # type: ignore[assignment]
    return cfg


@pytest.mark.parametrize(
    "make",
    [
        lambda: LLMConfig(link_secret=SECRET),
        lambda: LLMConfig(link_secret=SecretStr(SECRET)),
        _by_assigned_field,
        lambda: LLMConfig(ge_options={"aiokv.linkSecret": SECRET}),
        _by_assigned_ge,
        lambda: LLMConfig.from_options({"aiokv.linkSecret": SECRET}),
        lambda: LLMConfig.from_options({"ge.a": "1", "aiokv.linkSecret": SECRET}),
        lambda: LLMConfig.from_options(
            LLMConfig(ge_options={"aiokv.linkSecret": SECRET}).generate_options(reveal_secrets=True)
        ),
    ],
    ids=["keyword", "SecretStr", "attribute", "ge_options", "ge_options=", "dict", "dict+ge", "rt"],
)
def test_no_output_shows_the_secret_from_any_input(make) -> None:  # type: ignore[no-untyped-def]
    cfg = make()
    leaks = [name for name, text in _outputs(cfg).items() if SECRET in text]
    assert not leaks
    # ... and the secret is still there for init, which reads the revealed dict form
    back = LLMConfig.from_options(cfg.generate_options(reveal_secrets=True))
    assert back.link_secret is not None and back.link_secret.get_secret_value() == SECRET


def test_environment_secret_shows_nowhere(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIOKV_LINK_SECRET", SECRET)
    cfg = LLMConfig()
    assert cfg.link_secret is not None and cfg.link_secret.get_secret_value() == SECRET
    assert not [name for name, text in _outputs(cfg).items() if SECRET in text]


def test_ge_options_secret_keeps_its_rules() -> None:
    """``ge_options`` shows the mask in the secret's place; reassigning the mask keeps
    the secret; the field (when set) wins at init; a bad length is refused unseen."""
    cfg = LLMConfig(ge_options={"aiokv.linkSecret": SECRET, "ge.x": "1"})
    assert cfg.ge_options == {"aiokv.linkSecret": "**********", "ge.x": "1"}
    assert cfg.generate_options(reveal_secrets=True)["aiokv.linkSecret"] == SECRET
    cfg.ge_options = dict(cfg.ge_options)  # the mask back: still the same secret
    assert cfg.generate_options(reveal_secrets=True)["aiokv.linkSecret"] == SECRET
    cfg.link_secret = "field-wins"  # type: ignore[assignment]
    won = LLMConfig.from_options(cfg.generate_options(reveal_secrets=True)).link_secret
    assert won is not None and won.get_secret_value() == "field-wins"
    cfg.ge_options = {}
    assert "aiokv.linkSecret" in cfg.generate_options()  # the field's, masked
    assert cfg.generate_options(reveal_secrets=True)["aiokv.linkSecret"] == "field-wins"
    # a copied mask alone is refused at init, as for the field
    with pytest.raises(LLMException, match="reveal_secrets=True"):
        LLMConfig.from_options(LLMConfig(ge_options={"aiokv.linkSecret": "**********"}).options)


@pytest.mark.parametrize(
    "bad",
    [
        lambda: LLMConfig(ge_options={"aiokv.linkSecret": SECRET * 400}),
        lambda: LLMConfig(link_secret=SECRET * 400),
        lambda: LLMConfig.from_options({"aiokv.linkSecret": SECRET * 400}),
        lambda: LLMConfig.from_options({"ge.a": "1", "aiokv.linkSecret": SECRET * 400}),
        lambda: LLMConfig.from_options({"aiokv.linkSecret": SECRET.encode()}),
        lambda: LLMConfig(ge_options={"aiokv.linkSecret": SECRET.encode()}),
        lambda: LLMConfig(link_secret=SECRET.encode()),
        lambda: setattr(LLMConfig(), "ge_options", {"aiokv.linkSecret": SECRET * 400}),
    ],
    ids=[
        "ge-long",
        "kw-long",
        "dict-long",
        "dict+ge-long",
        "dict-bytes",
        "ge-bytes",
        "kw-bytes",
        "ge=-long",
    ],
)
def test_errors_never_echo_the_secret(bad) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises((LLMException, TypeError, ValueError)) as ei:
        bad()
    assert SECRET not in str(ei.value) and SECRET not in repr(ei.value)


async def test_a_secret_given_in_ge_options_authenticates_links() -> None:
    base = {"device_type": "cpu", "enable_cache_manager": True, "mem_pool_cfg": POOL}
    p = LLMDataDist(LLMRole.PROMPT, 1)
    good, bad = LLMDataDist(LLMRole.DECODER, 2), LLMDataDist(LLMRole.DECODER, 3)
    try:
        await p.init(
            LLMConfig(listen_ip_info="127.0.0.1:0", ge_options={"aiokv.linkSecret": SECRET}, **base)
        )
        await good.init({"aiokv.linkSecret": SECRET, "aiokv.deviceType": "cpu"})
        await bad.init(LLMConfig(device_type="cpu"))
        assert p.listen_address is not None
        await only_the_secret_links(p, good, bad)
    finally:
        for d in (bad, good, p):
            await d.finalize()


def test_a_misspelt_variable_warns_once_naming_the_right_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A variable within a typo of one aiokv reads is not ignored without a word: one
    warning per variable and process, at the caller's line; other ``AIOKV_*`` names (a
    deployment's own) and the variables aiokv reads elsewhere stay silent."""
    monkeypatch.setattr(_config, "_WARNED", set())
    monkeypatch.setenv("AIOKV_DEVICEID", "3")
    monkeypatch.setenv("aiokv_link_secrt", SECRET)
    monkeypatch.setenv("AIOKV_HOME", "/opt/aiokv")  # not near any name aiokv reads
    monkeypatch.setenv("AIOKV_DEVICE_PORT", "26000")  # read by the rank table
    with pytest.warns(UserWarning, match="is not read by aiokv") as rec:
        cfg = LLMConfig()
    assert cfg.device_id == 0 and cfg.link_secret is None  # ignored, as said
    got = sorted(str(w.message) for w in rec)
    assert got == [
        "environment variable AIOKV_DEVICEID is not read by aiokv and is ignored; "
        "did you mean AIOKV_DEVICE_ID?",
        "environment variable aiokv_link_secrt is not read by aiokv and is ignored; "
        "did you mean AIOKV_LINK_SECRET?",
    ]
    assert all(w.filename == __file__ for w in rec)
    assert SECRET not in "".join(got)  # names only, never a value
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per variable: a second config is quiet
        LLMConfig()
