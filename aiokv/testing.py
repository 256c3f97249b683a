"""pytest plugin for suites that use aiokv: fixtures for an initialised ``LLMDataDist`` and
a linked prompt/decoder pair, each finalised after its test, and the helpers they are made
of, for tests that need another configuration or more than one pair.

Registered as a ``pytest11`` entry point (named ``aiokv``), so installing aiokv makes the
fixtures available; the async ones need pytest-asyncio (``pip install 'aiokv[testing]'``).

Fixtures (all function-scoped):

* ``aiokv_transport`` -- the ``transfer_backend`` of the fixtures below: ``"local"`` (in
  memory, the default) or ``"tcp"`` (loopback, 127.0.0.1 port 0). Override the fixture, or
  ``@pytest.mark.parametrize("aiokv_transport", ["local", "tcp"])``.
* ``aiokv_config`` -- the ``LLMConfig`` both use: cpu, cache-manager mode, remote access,
  a 64 MiB device pool and 16 MiB host pool in 4 KiB pages, listening on 127.0.0.1:0.
  Override it to change anything.
* ``aiokv_datadist`` -- an initialised ``LLMDataDist`` (``LLMRole.PROMPT``, cluster 1).
* ``aiokv_pair`` -- ``(prompt, decoder)``: clusters 1 and 2, the decoder linked to the
  prompt (``decoder.cache_manager.pull_blocks(BlocksCacheKey(1, ...), ...)`` works).

Helpers (plain functions, usable from any test or fixture):

* ``make_config(transport, pool=..., host_pool=..., **overrides)`` -- an ``LLMConfig`` for a
  test participant (cpu, cache manager, remote access, listening on 127.0.0.1 port 0).
* ``pool_option(size, page_shift)`` -- the ``mem_pool_cfg`` / ``host_mem_pool_cfg`` string.
* ``cluster_info(cluster_id, address)`` -- the ``LLMClusterInfo`` that links to a listening
  peer from 127.0.0.1 port 0.
* ``linked_pair(prompt_config, decoder_config)`` -- an async context manager: a prompt
  (cluster 1) and a decoder (cluster 2) linked to it, both finalised on exit.
* ``requires_transport(name)`` / ``skip_unless_transport(name)`` -- skip a test (a mark, or
  from inside it) where a transport cannot be used, e.g. ``"nixl"`` without NIXL installed.

An ``LLMDataDist`` runs its work on its own engine thread, so the instances may be awaited
from any event loop, also one other than the fixture's (a wider-scoped fixture used from
function-scoped test loops).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from collections.abc import Callable
from typing import TYPE_CHECKING
from typing import Any

import pytest

if TYPE_CHECKING:
    from . import LLMClusterInfo
    from . import LLMConfig
    from . import LLMDataDist

# aiokv proper (and torch with it) is imported inside the fixtures that use it: pytest
# registers this plugin in every run of an environment that has aiokv installed, and that
# registration must cost nothing to suites that never ask for an aiokv fixture.

__all__ = [
    "aiokv_config",
    "aiokv_datadist",
    "aiokv_pair",
    "aiokv_transport",
    "cluster_info",
    "linked_pair",
    "make_config",
    "pool_option",
    "requires_transport",
    "skip_unless_transport",
]

#: the transports the fixtures can run over
TRANSPORTS = ("local", "tcp")

MiB = 1 << 20

#: where test participants listen and link from: loopback, a port the system picks
LOOPBACK = "127.0.0.1"


def pool_option(size: int, page_shift: int = 12) -> str:
    """The ``mem_pool_cfg`` / ``host_mem_pool_cfg`` option of a pool of ``size`` bytes in
    pages of ``2**page_shift`` bytes.

    Raises:
        TypeError: ``size`` or ``page_shift`` is not an ``int``.
        ValueError: ``size`` is not positive, or ``page_shift`` is negative.
    """
    for name, value in (("size", size), ("page_shift", page_shift)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"pool_option: {name} must be int, got {type(value).__name__}")
    if size <= 0 or page_shift < 0:
        raise ValueError(
            f"pool_option: size must be > 0 and page_shift >= 0, got {size}, {page_shift}"
        )
    return f'{{"memory_size": {size}, "page_shift": {page_shift}}}'


def make_config(
    transport: str = "local",
    *,
    pool: int | None = 64 * MiB,
    host_pool: int | None = None,
    page_shift: int = 12,
    **overrides: Any,
) -> LLMConfig:
    """An ``LLMConfig`` for a test participant: cpu, cache-manager mode, remote cache access
    on, listening on 127.0.0.1 port 0, ``sync_kv_timeout`` 5 s, over ``transport``.

    ``pool`` / ``host_pool``: the device / host pool in bytes (pages of ``2**page_shift``
    bytes), ``None`` for none. ``overrides``: any other ``LLMConfig`` option (keyword
    arguments of ``LLMConfig``); they win over everything above.

    Raises:
        TypeError, ValueError: as ``pool_option`` for a pool size, as ``LLMConfig`` for
            an option.
    """
    from . import LLMConfig

    options: dict[str, Any] = {
        "device_type": "cpu",
        "transfer_backend": transport,
        "enable_cache_manager": True,
        "enable_remote_cache_accessible": True,
        "listen_ip_info": f"{LOOPBACK}:0",
        "sync_kv_timeout": 5000,
    }
    if pool is not None:
        options["mem_pool_cfg"] = pool_option(pool, page_shift)
    if host_pool is not None:
        options["host_mem_pool_cfg"] = pool_option(host_pool, page_shift)
    return LLMConfig(**(options | overrides))


def cluster_info(cluster_id: int, address: tuple[str, int] | None) -> LLMClusterInfo:
    """The ``LLMClusterInfo`` that links to cluster ``cluster_id`` listening at ``address``
    (an ``LLMDataDist.listen_address``), from 127.0.0.1 port 0.

    Raises:
        ValueError: ``address`` is ``None`` (the peer does not listen).
    """
    from . import LLMClusterInfo

    if address is None:
        raise ValueError(f"cluster_info: cluster {cluster_id} does not listen (address None)")
    return LLMClusterInfo(
        remote_cluster_id=cluster_id, local_ip_info=[(LOOPBACK, 0)], remote_ip_info=[address]
    )


@contextlib.asynccontextmanager
async def linked_pair(
    prompt_config: LLMConfig, decoder_config: LLMConfig | None = None, *, link: bool = True
) -> AsyncIterator[tuple[LLMDataDist, LLMDataDist]]:
    """``(prompt, decoder)``: an initialised ``LLMDataDist`` of ``LLMRole.PROMPT`` (cluster
    1, ``prompt_config``, which must listen) and one of ``LLMRole.DECODER`` (cluster 2,
    ``decoder_config``, by default ``prompt_config``), the decoder linked to the prompt
    (unless ``link`` is false); both finalised on exit, also when the body raises.

    Raises:
        RuntimeError: linking failed (the per-cluster codes in the message).
        ValueError: the prompt does not listen.
    """
    from . import LLMDataDist
    from . import LLMRole
    from . import LLMStatusCode

    async with (
        LLMDataDist(LLMRole.PROMPT, 1, prompt_config) as prompt,
        LLMDataDist(LLMRole.DECODER, 2, decoder_config or prompt_config) as decoder,
    ):
        if link:
            code, codes = await decoder.link_clusters([cluster_info(1, prompt.listen_address)])
            if code != LLMStatusCode.LLM_SUCCESS:
                raise RuntimeError(
                    f"linked_pair: linking the decoder to the prompt failed: {codes}"
                )
        yield prompt, decoder


def _unavailable(transport: str) -> str | None:
    """Why ``transport`` cannot be used here, or ``None`` when it can."""
    from . import LLMException
    from . import LLMStatusCode
    from .transport import get_transport

    try:
        get_transport(transport)
    except LLMException as exc:
        if exc.status_code != LLMStatusCode.LLM_FEATURE_NOT_ENABLED:
            raise  # an unknown name is a mistake, not a reason to skip
        return str(exc)
    return None


def requires_transport(transport: str) -> pytest.MarkDecorator:
    """A mark that skips its test (or module, as ``pytestmark``) where ``transport`` cannot
    be used (e.g. ``"nixl"`` without NIXL installed); the skip says why.

    Raises:
        TypeError: ``transport`` is not a string.
        LLMException: ``LLM_PARAM_INVALID``, ``transport`` names no registered transport.
    """
    reason = _unavailable(transport)
    return pytest.mark.skipif(reason is not None, reason=f"{transport}: {reason}")


def skip_unless_transport(transport: str) -> None:
    """Skip the running test where ``transport`` cannot be used; the skip says why.

    Raises:
        TypeError: ``transport`` is not a string.
        LLMException: ``LLM_PARAM_INVALID``, ``transport`` names no registered transport.
    """
    reason = _unavailable(transport)
    if reason is not None:
        pytest.skip(f"{transport}: {reason}")


try:
    import pytest_asyncio

    _async_fixture: Callable[..., Any] = pytest_asyncio.fixture
except ImportError:  # the fixtures below then say what to install

    def _async_fixture(fn: Callable[..., Any]) -> Any:
        def missing(*args: Any, **kwargs: Any) -> None:
            raise pytest.UsageError(
                f"the {fn.__name__} fixture (aiokv.testing) needs pytest-asyncio: "
                "pip install 'aiokv[testing]'"
            )

        missing.__name__ = fn.__name__
        missing.__doc__ = fn.__doc__
        return pytest.fixture(name=fn.__name__)(missing)


@pytest.fixture
def aiokv_transport() -> str:
    """The ``transfer_backend`` of ``aiokv_config``: ``"local"``; override or parametrize
    with ``"tcp"`` for loopback TCP."""
    return "local"


@pytest.fixture
def aiokv_config(aiokv_transport: str) -> LLMConfig:
    """The configuration of ``aiokv_datadist`` and ``aiokv_pair``: ``make_config`` over
    ``aiokv_transport`` with a 16 MiB host pool."""
    if aiokv_transport not in TRANSPORTS:
        raise pytest.UsageError(
            f"aiokv_transport must be one of {TRANSPORTS}, got {aiokv_transport!r}"
        )
    return make_config(aiokv_transport, host_pool=16 * MiB)


@_async_fixture
async def aiokv_datadist(aiokv_config: LLMConfig) -> AsyncIterator[LLMDataDist]:
    """An initialised ``LLMDataDist`` (prompt, cluster 1), finalised after the test."""
    from . import LLMDataDist
    from . import LLMRole

    datadist = LLMDataDist(LLMRole.PROMPT, 1)
    await datadist.init(aiokv_config)
    try:
        yield datadist
    finally:
        await datadist.finalize()


@_async_fixture
async def aiokv_pair(aiokv_config: LLMConfig) -> AsyncIterator[tuple[LLMDataDist, LLMDataDist]]:
    """``(prompt, decoder)``, clusters 1 and 2, the decoder linked to the prompt; both
    finalised after the test."""
    async with linked_pair(aiokv_config) as pair:
        yield pair
