"""pytest plugin for suites that use aiokv: fixtures for an initialised ``LLMDataDist`` and
a linked prompt/decoder pair, each finalised after its test.

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

An ``LLMDataDist`` runs its work on its own engine thread, so the instances may be awaited
from any event loop, also one other than the fixture's (a wider-scoped fixture used from
function-scoped test loops).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from . import LLMConfig, LLMDataDist

# aiokv proper (and torch with it) is imported inside the fixtures that use it: pytest
# registers this plugin in every run of an environment that has aiokv installed, and that
# registration must cost nothing to suites that never ask for an aiokv fixture.

__all__ = [
    "aiokv_config",
    "aiokv_datadist",
    "aiokv_pair",
    "aiokv_transport",
]

#: the transports the fixtures can run over
TRANSPORTS = ("local", "tcp")

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
    """The configuration of ``aiokv_datadist`` and ``aiokv_pair`` (cpu, cache manager)."""
    from . import LLMConfig

    if aiokv_transport not in TRANSPORTS:
        raise pytest.UsageError(
            f"aiokv_transport must be one of {TRANSPORTS}, got {aiokv_transport!r}"
        )
    return LLMConfig(
        device_type="cpu",
        transfer_backend=aiokv_transport,  # type: ignore[arg-type]
        enable_cache_manager=True,
        enable_remote_cache_accessible=True,
        listen_ip_info="127.0.0.1:0",
        mem_pool_cfg='{"memory_size": 67108864, "page_shift": 12}',
        host_mem_pool_cfg='{"memory_size": 16777216, "page_shift": 12}',
        sync_kv_timeout=5000,
    )


@_async_fixture
async def aiokv_datadist(aiokv_config: LLMConfig) -> AsyncIterator[LLMDataDist]:
    """An initialised ``LLMDataDist`` (prompt, cluster 1), finalised after the test."""
    from . import LLMDataDist, LLMRole

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
    from . import LLMClusterInfo, LLMDataDist, LLMRole, LLMStatusCode

    prompt, decoder = LLMDataDist(LLMRole.PROMPT, 1), LLMDataDist(LLMRole.DECODER, 2)
    try:
        await prompt.init(aiokv_config)
        await decoder.init(aiokv_config)
        address = prompt.listen_address
        assert address is not None  # aiokv_config listens
        peer = LLMClusterInfo(
            remote_cluster_id=1, local_ip_info=[("127.0.0.1", 0)], remote_ip_info=[address]
        )
        code, codes = await decoder.link_clusters([peer])
        if code != LLMStatusCode.LLM_SUCCESS:
            raise RuntimeError(f"aiokv_pair: linking the decoder to the prompt failed: {codes}")
        yield prompt, decoder
    finally:
        await decoder.finalize()
        await prompt.finalize()
