"""The pytest plugin ``aiokv.testing`` (issue #12, testing support), run as a user's suite
would run it: in a pytest subprocess (pytester) on a test file of its own."""

from __future__ import annotations

import importlib.metadata
import os
import tomllib
from pathlib import Path

import pytest

import aiokv
from aiokv import LLMDataDist  # imports what an instance runs on
from aiokv import LLMException  # imports what an instance runs on
from aiokv import LLMStatusCode  # imports what an instance runs on
from aiokv._config import MemPoolConfig
from aiokv.testing import cluster_info
from aiokv.testing import linked_pair
from aiokv.testing import make_config
from aiokv.testing import pool_option
from aiokv.testing import requires_transport
from aiokv.testing import skip_unless_transport

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _same_aiokv(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pytest subprocess imports the aiokv this test imported."""
    where = str(Path(aiokv.__file__).resolve().parents[1])
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([where, os.environ.get("PYTHONPATH", "")]))


def _entry_point_installed() -> bool:
    eps = importlib.metadata.entry_points(group="pytest11")
    return any(ep.value == "aiokv.testing" for ep in eps)


# where aiokv is installed from a wheel (or a fresh editable install) the entry point
# loads the plugin; a checkout on PYTHONPATH over an older install names it
PLUGIN = () if _entry_point_installed() else ("-p", "aiokv.testing")

USER_TESTS = """
import threading

import pytest
import torch

from aiokv import BlocksCacheKey, CacheDesc, DataType, LLMDataDist, LLMRole

pytestmark = pytest.mark.asyncio
SEEN = []


def desc():
    return CacheDesc(2, [8, 64], DataType.DT_FLOAT)


async def test_datadist(aiokv_datadist, aiokv_config):
    assert isinstance(aiokv_datadist, LLMDataDist) and aiokv_datadist.initialized
    assert aiokv_datadist.role == LLMRole.PROMPT and aiokv_config.transfer_backend == "local"
    cache = await aiokv_datadist.cache_manager.allocate_blocks_cache(desc())
    await aiokv_datadist.cache_manager.deallocate_blocks_cache(cache)
    SEEN.append(aiokv_datadist)


@pytest.mark.parametrize("aiokv_transport", ["local", "tcp"])
async def test_pair_pulls(aiokv_pair, aiokv_transport):
    prompt, decoder = aiokv_pair
    assert prompt.config.transfer_backend == aiokv_transport
    assert decoder.linked_clusters() == [1]
    src = await prompt.cache_manager.allocate_blocks_cache(desc(), BlocksCacheKey(1, 0))
    dst = await decoder.cache_manager.allocate_blocks_cache(desc())
    for i, t in enumerate(src.tensors):
        t.copy_(torch.arange(t.numel(), dtype=t.dtype).reshape(t.shape) + i)
    await decoder.cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, [5, 6], [0, 1])
    for s, d in zip(src.tensors, dst.tensors):
        assert torch.equal(d[0:2], s[5:7])
    SEEN.extend(aiokv_pair)


def test_everything_was_finalised():
    assert len(SEEN) == 5
    assert not any(d.initialized for d in SEEN)
    left = [t.name for t in threading.enumerate() if t.name.startswith("aiokv")]
    assert not left, left
"""

BAD_TRANSPORT = """
import pytest

@pytest.mark.parametrize("aiokv_transport", ["rdma"])
def test_x(aiokv_config):
    pass
"""


def test_fixtures_in_a_users_suite(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_user=USER_TESTS, test_bad=BAD_TRANSPORT)
    result = pytester.runpytest_subprocess(*PLUGIN, "-p", "no:cacheprovider", "-q")
    result.assert_outcomes(passed=4, errors=1)
    result.stdout.fnmatch_lines(["*aiokv_transport must be one of ('local', 'tcp'), got 'rdma'*"])


WIDER_SCOPE = '''
import pytest
import pytest_asyncio

from aiokv import LLMRole

pytestmark = pytest.mark.asyncio  # each test on a function-scoped loop of its own


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def shared(aiokv_config):
    """A user's wider-scoped instance, built on the module's loop."""
    from aiokv import LLMDataDist
    async with LLMDataDist(LLMRole.DECODER, 9, aiokv_config) as d:
        yield d


@pytest.fixture(scope="module")
def aiokv_config():
    from aiokv import LLMConfig
    return LLMConfig(device_type="cpu", enable_cache_manager=True, transfer_backend="local",
                     mem_pool_cfg='{"memory_size": 1048576, "page_shift": 12}')


@pytest.mark.parametrize("round", range(3))
async def test_used_from_another_loop(shared, round):
    from aiokv import CacheDesc, DataType
    desc = CacheDesc(1, [4, 16], DataType.DT_FLOAT)
    cache = await shared.cache_manager.allocate_blocks_cache(desc)
    await shared.cache_manager.deallocate_blocks_cache(cache)
'''


def test_wider_scoped_instance_works_from_function_loops(pytester: pytest.Pytester) -> None:
    """The loop-scope mistake of the issue: an instance made on a module/session loop and
    awaited from function-scoped test loops. It works (the engine thread does the work)."""
    pytester.makepyfile(test_scope=WIDER_SCOPE)
    result = pytester.runpytest_subprocess(*PLUGIN, "-p", "no:cacheprovider", "-q")
    result.assert_outcomes(passed=3)


def test_entry_point_declared() -> None:
    """pyproject registers the plugin as a pytest11 entry point named ``aiokv``."""
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["entry-points"]["pytest11"] == {"aiokv": "aiokv.testing"}


# ---- the helpers the fixtures are made of, used directly -----------------------------------


def test_make_config_defaults_and_overrides() -> None:
    cfg = make_config()
    assert (cfg.device_type, cfg.transfer_backend, cfg.listen_ip_info) == (
        "cpu",
        "local",
        "127.0.0.1:0",
    )
    assert cfg.enable_cache_manager and cfg.enable_remote_cache_accessible
    assert cfg.sync_kv_timeout == 5000 and cfg.host_mem_pool_cfg is None
    assert cfg.mem_pool_cfg == MemPoolConfig(memory_size=64 << 20, page_shift=12)
    cfg = make_config(
        "tcp", pool=None, host_pool=1 << 20, page_shift=16, listen_ip_info=None, sync_kv_timeout=7
    )
    assert cfg.transfer_backend == "tcp" and cfg.mem_pool_cfg is None
    assert cfg.host_mem_pool_cfg == MemPoolConfig(memory_size=1 << 20, page_shift=16)
    assert cfg.listen_ip_info is None and cfg.sync_kv_timeout == 7


def test_helpers_refuse_bad_input() -> None:
    assert pool_option(4096, 12) == '{"memory_size": 4096, "page_shift": 12}'
    for bad_size in ("4096", 1.5, True):
        with pytest.raises(TypeError, match="size must be int"):
            pool_option(bad_size)  # type: ignore[arg-type]
    for size, shift in ((0, 12), (-1, 12), (4096, -1)):
        with pytest.raises(ValueError, match="size must be > 0"):
            pool_option(size, shift)
    with pytest.raises(ValueError, match="cluster 4 does not listen"):
        cluster_info(4, None)
    info = cluster_info(3, ("127.0.0.1", 5))
    assert (info.remote_cluster_id, info.remote_ip_info) == (3, [("127.0.0.1", 5)])
    assert info.local_ip_info == [("127.0.0.1", 0)]
    with pytest.raises(LLMException) as ei:  # a misspelt transport is a mistake, not a skip
        requires_transport("tpc")
    assert ei.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    assert requires_transport("local").args == (False,)
    skip_unless_transport("tcp")  # available: returns


@pytest.mark.asyncio
async def test_linked_pair_links_finalises_and_says_when_linking_failed() -> None:
    async with linked_pair(make_config("tcp")) as (prompt, decoder):
        assert isinstance(prompt, LLMDataDist) and isinstance(decoder, LLMDataDist)
        assert (prompt.cluster_id, decoder.cluster_id) == (1, 2)
        assert decoder.linked_clusters() == [1]
    assert not prompt.initialized and not decoder.initialized
    async with linked_pair(make_config(), link=False) as (prompt, decoder):
        assert decoder.linked_clusters() == []
    secret = {"link_secret": "a" * 16, "link_retry_count": 1}
    with pytest.raises(RuntimeError, match="linking the decoder to the prompt failed"):
        async with linked_pair(make_config("tcp", **secret), make_config("tcp")):
            pass
    with pytest.raises(ValueError, match="does not listen"):
        async with linked_pair(make_config(listen_ip_info=None)):
            pass
