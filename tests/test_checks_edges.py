"""Argument checks at their edges (SPEC §1.2: a clear TypeError / ValueError /
LLM_PARAM_INVALID, nothing changed): huge layer ranges, falsy values of a wrong type,
deeply nested JSON. Found in review; each test fails before its fix."""

from __future__ import annotations

import asyncio

import pytest
import torch

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
from aiokv.testing import linked_pair
from aiokv.testing import make_config

HUGE = range(0, 2**64)  # more layers than a C ssize_t counts: len() overflows


def _state(*dds: LLMDataDist) -> list[object]:
    return [(dd.cache_manager.statistics(), dd.cache_manager.get_pool_stats()) for dd in dds]


def _is_spec_error(exc: BaseException) -> bool:
    """SPEC §1.2: TypeError, ValueError or LLMException(LLM_PARAM_INVALID)."""
    if isinstance(exc, LLMException):
        return exc.status_code == LLMStatusCode.LLM_PARAM_INVALID
    return isinstance(exc, TypeError | ValueError)


@pytest.mark.parametrize(
    "layers",
    [
        {"src_layer_range": HUGE},
        {"dst_layer_range": HUGE},
        {"src_layer_range": range(0, 1), "dst_layer_range": range(2**63, 2**64)},
        {"src_layer_range": range(2**64, 2**64 + 1), "dst_layer_range": range(0, 1)},
    ],
)
async def test_a_huge_layer_range_is_an_argument_error_not_overflow(
    layers: dict[str, range],
) -> None:
    """A layer range past any cache is refused as one (``LLM_PARAM_INVALID``), naming
    the op; today ``len(range)`` / the wire encoder raise a raw ``OverflowError``."""
    desc = CacheDesc(4, [8, 16], DataType.DT_FLOAT16)
    async with linked_pair(make_config("tcp")) as (p, d):
        src = await p.cache_manager.allocate_blocks_cache(desc, BlocksCacheKey(1, 0))
        dst = await d.cache_manager.allocate_blocks_cache(desc)
        before, data = _state(p, d), [t.clone() for t in dst.tensors]
        for call in (
            d.cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, [0], [0], **layers),
            d.cache_manager.push_blocks(
                BlocksCacheKey(1, 0),
                dst,
                [0],
                [0],
                layers.get("dst_layer_range"),
                layers.get("src_layer_range"),
            ),
        ):
            with pytest.raises(Exception) as got:
                await call
            assert _is_spec_error(got.value), repr(got.value)
            assert "_blocks" in str(got.value)
        await asyncio.sleep(0.05)  # the peer's grant (if any) ends after its reply
        assert _state(p, d) == before
        assert all(torch.equal(a, b) for a, b in zip(data, dst.tensors, strict=True))
        del src


def test_a_huge_layer_range_in_a_transfer_config_is_a_value_error() -> None:
    """The configs' layer ranges: ``ValueError`` (pydantic-translated), at construction
    and at assignment (which leaves the config unchanged)."""
    with pytest.raises(ValueError, match="TransferConfig"):
        TransferConfig(1, [1, 2], HUGE)
    with pytest.raises(ValueError, match="TransferWithCacheKeyConfig"):
        TransferWithCacheKeyConfig(BlocksCacheKey(1, 0), range(0, 1), range(2**63, 2**64))
    cfg = TransferConfig(1, [1, 2], range(0, 1))
    with pytest.raises(ValueError, match="TransferConfig"):
        cfg.src_layer_range = HUGE
    assert cfg.src_layer_range == range(0, 1)


class _Ready:
    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        return True


@pytest.mark.parametrize("bad", [False, 0.0, "", 32.0, "32"])
async def test_dst_block_memory_size_of_a_wrong_type_is_a_type_error(bad: object) -> None:
    """``dst_block_memory_size`` is ``int | None``: anything else is a ``TypeError``
    before anything is sent; today a falsy one (``False``, ``0.0``, ``""``) is taken as
    "not given" and the transfer runs (``True`` and ``32.0`` are refused)."""
    desc = CacheDesc(2, [8, 16], DataType.DT_FLOAT16)
    async with linked_pair(make_config("tcp")) as (p, d):
        await p.cache_manager.allocate_blocks_cache(desc, BlocksCacheKey(1, 0))
        src = await d.cache_manager.allocate_blocks_cache(desc)
        cfg = TransferWithCacheKeyConfig(BlocksCacheKey(1, 0))
        with pytest.raises(TypeError, match="dst_block_memory_size"):
            d.cache_manager.transfer_cache_async(src, _Ready(), [cfg], [0], [0], bad)  # type: ignore[arg-type]


DEEP = "[" * 100_000 + "]" * 100_000  # JSON nested past the decoder's recursion limit


@pytest.mark.parametrize("field", ["mem_pool_cfg", "host_mem_pool_cfg", "cluster_info"])
def test_deeply_nested_json_option_is_a_value_error(field: str) -> None:
    """Bad JSON in an option is a ``ValueError`` (SPEC §1.3; ``MemPoolConfig.parse``
    documents it); nested too deep, json raises ``RecursionError``, which escapes raw."""
    with pytest.raises(ValueError, match=field):
        LLMConfig(**{field: DEEP})


async def test_deeply_nested_rank_table_is_param_invalid() -> None:
    """``link``'s rank table that is not usable JSON: ``LLM_PARAM_INVALID`` (as for any
    other bad JSON there), not a raw ``RecursionError``."""
    async with LLMDataDist(LLMRole.PROMPT, 1, make_config("tcp")) as dd:
        with pytest.raises(LLMException) as got:
            await dd.link("comm", {1: 0, 2: 1}, DEEP)
        assert got.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
