"""Integrating aiokv into a serving engine other than vLLM (an SGLang-style engine, a
custom asyncio service): the engine keeps its own paged KV memory and block tables;
aiokv moves blocks between engines. docs/engines.md walks through it step by step; each
step is one marked section of this file.

Run: ``python examples/engine_integration.py``. Both engines live in this process and
talk over loopback TCP; in production they are two processes or machines, and the
metadata below travels over the engines' own control channel (HTTP, a router, ZMQ).
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Callable
from typing import Any

import torch

import aiokv.sync
from aiokv import BlocksCacheKey
from aiokv import Cache
from aiokv import CacheDesc
from aiokv import DataType
from aiokv import LayerSynchronizer
from aiokv import LLMClusterInfo
from aiokv import LLMConfig
from aiokv import LLMDataDist
from aiokv import LLMException
from aiokv import LLMRole
from aiokv import LLMStatusCode
from aiokv import TransferWithCacheKeyConfig

LAYERS, BLOCKS, BLOCK_TOKENS, HEADS, HEAD_DIM = 4, 64, 16, 4, 32


# --8<-- [start:engine]
class PagedKV:
    """The engine's own KV memory, as paged-attention engines lay it out: per layer one
    K and one V tensor of ``[num_blocks, block_tokens, heads, head_dim]``, and a free
    list of block ids. aiokv never allocates it: it registers it."""

    def __init__(self, seed: int, num_blocks: int = BLOCKS, device: str = "cpu") -> None:
        shape = (num_blocks, BLOCK_TOKENS, HEADS, HEAD_DIM)
        self.k = [torch.zeros(shape, dtype=torch.float16, device=device) for _ in range(LAYERS)]
        self.v = [torch.zeros(shape, dtype=torch.float16, device=device) for _ in range(LAYERS)]
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)  # block ids are each engine's own business

    def tensors(self) -> list[torch.Tensor]:
        """K and V of every layer in aiokv's order: layer i is tensors 2i (K), 2i+1 (V)."""
        return [t for pair in zip(self.k, self.v, strict=True) for t in pair]

    def allocate(self, tokens: int) -> list[int]:
        """A block table for ``tokens`` tokens (block ``table[t // BLOCK_TOKENS]``)."""
        n = -(-tokens // BLOCK_TOKENS)
        if n > len(self.free):
            raise RuntimeError(f"{n} blocks wanted, {len(self.free)} free")
        return [self.free.pop() for _ in range(n)]

    def release(self, table: list[int]) -> None:
        """Give a finished request's blocks back."""
        self.free.extend(table)


# --8<-- [end:engine]


def config() -> LLMConfig:
    """Cache manager on; peers may push into registered caches; listen on loopback."""
    return LLMConfig(
        device_type="cpu",  # "auto": the engine's NPU or GPU
        enable_cache_manager=True,
        enable_remote_cache_accessible=True,
        listen_ip_info="127.0.0.1:0",
        sync_kv_timeout=10_000,
    )


# --8<-- [start:register]
async def register(dd: LLMDataDist, kv: PagedKV) -> Cache:
    """Register the engine's KV tensors (no copy) as one blocks cache that peers can read
    and write by ``BlocksCacheKey(<this engine's cluster id>)``."""
    desc = CacheDesc(2 * LAYERS, list(kv.k[0].shape), DataType.DT_FLOAT16)
    return await dd.cache_manager.register_blocks_cache(
        desc, kv.tensors(), BlocksCacheKey(dd.cluster_id), remote_accessible=True
    )


# --8<-- [end:register]


# --8<-- [start:exchange]
def metadata(dd: LLMDataDist, kv: PagedKV) -> str:
    """What an engine publishes about itself (its control channel carries it)."""
    assert dd.listen_address is not None
    host, port = dd.listen_address
    layout = [LAYERS, *kv.k[0].shape[1:]]
    return json.dumps({"cluster": dd.cluster_id, "host": host, "port": port, "layout": layout})


async def connect(dd: LLMDataDist, kv: PagedKV, peer_metadata: str) -> int:
    """Link to the engine that published ``peer_metadata`` after checking that its KV
    layout matches ours (blocks are copied byte for byte: same shape, same dtype)."""
    peer = json.loads(peer_metadata)
    if peer["layout"] != [LAYERS, *kv.k[0].shape[1:]]:
        raise RuntimeError(f"KV layouts differ: {peer['layout']}")
    info = LLMClusterInfo(
        remote_cluster_id=peer["cluster"],
        remote_ip_info=[(peer["host"], peer["port"])],
        local_ip_info=[("127.0.0.1", 0)],  # this side's address (llm_datadist requires one)
    )
    code, _ = await dd.link_clusters([info], timeout=10_000)
    if code != LLMStatusCode.LLM_SUCCESS:
        raise RuntimeError(f"link to cluster {peer['cluster']} failed: {code}")
    return int(peer["cluster"])


# --8<-- [end:exchange]


def prefill_model(kv: PagedKV, table: list[int], rid: int, done: LayerEvents | None) -> None:
    """A stand-in for the model's prefill: writes each layer's K and V of the request's
    blocks, and marks each layer done as it goes."""
    for layer in range(LAYERS):
        for j, t in enumerate((kv.k[layer], kv.v[layer])):
            t[table] = float(rid * 100 + layer * 2 + j)
        if done is not None:
            done.mark(layer)


# --8<-- [start:pull]
async def pull_request(
    dd: LLMDataDist, cache: Cache, prefill: int, prefill_table: list[int], table: list[int]
) -> None:
    """Decode side, pull mode: the prefill finished the request and returned its block
    table; copy those blocks into the blocks this engine allocated for the request.
    ``prefill_table[i]`` lands in ``table[i]``, for every layer's K and V."""
    await dd.cache_manager.pull_blocks(BlocksCacheKey(prefill), cache, prefill_table, table)


# --8<-- [end:pull]


# --8<-- [start:push]
class LayerEvents(LayerSynchronizer):
    """The model marks a layer done; the transfer sends it while the next computes.
    ``mark`` may be called from the model's thread (it hops onto the loop)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.done = [asyncio.Event() for _ in range(LAYERS)]

    def mark(self, layer: int) -> None:
        """Layer ``layer``'s K and V are written (on a GPU: after its stream event)."""
        self.loop.call_soon_threadsafe(self.done[layer].set)

    async def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        """Wait until the model marked ``layer_index``; ``True``: send it."""
        await self.done[layer_index].wait()
        return True


async def push_request(
    dd: LLMDataDist, cache: Cache, kv: PagedKV, decoder: int, rid: int,
    table: list[int], decoder_table: list[int],
) -> list[LLMStatusCode | None]:  # fmt: skip
    """Prefill side, layer-wise push: the decoder allocated ``decoder_table`` and sent it
    with the request; start the transfer before the model runs, then run the model on a
    thread (as an engine's forward pass would run), marking each layer."""
    events = LayerEvents(asyncio.get_running_loop())
    task = dd.cache_manager.transfer_cache_async(
        cache, events, [TransferWithCacheKeyConfig(BlocksCacheKey(decoder))], table, decoder_table
    )
    await asyncio.to_thread(prefill_model, kv, table, rid, events)
    return await task


# --8<-- [end:push]


# --8<-- [start:lifecycle]
async def serve_decode(
    dd: LLMDataDist, cache: Cache, kv: PagedKV, prefill: int, prefill_table: list[int],
    tokens: int, recompute: Callable[[list[int]], None], deadline_s: float = 5.0,
) -> tuple[list[int], str]:  # fmt: skip
    """One request on the decode side: allocate, pull under a deadline, and on any
    failure fall back to computing the prefill here. The blocks are released by the
    caller when the request finishes, or here if nothing could fill them."""
    table = kv.allocate(tokens)
    try:
        async with asyncio.timeout(deadline_s):
            await pull_request(dd, cache, prefill, prefill_table, table)
        return table, "pulled"
    except (LLMException, TimeoutError) as exc:
        # the peer died, the link broke, or it was too slow: no byte lands after the
        # raise, so the blocks may be overwritten by a local prefill right away
        why = exc.status_code.name if isinstance(exc, LLMException) else "TIMEOUT"
        try:
            recompute(table)
        except BaseException:
            kv.release(table)
            raise
        return table, f"recomputed ({why})"
    except BaseException:  # cancelled: the request is gone
        kv.release(table)
        raise


# --8<-- [end:lifecycle]


# --8<-- [start:threads]
def threaded_engine(prefill: tuple[str, int], src: list[int]) -> tuple[PagedKV, list[int]]:
    """An engine whose scheduler is a plain thread loop uses ``aiokv.sync``: the same
    operations, blocking; they run on the instance's own engine thread, so any number
    of the engine's threads may call them at once."""
    kv = PagedKV(seed=3)
    with aiokv.sync.LLMDataDist(LLMRole.DECODER, 3, config()) as dd:
        cm: Any = dd.cache_manager  # generated blocking methods: Any for mypy
        desc = CacheDesc(2 * LAYERS, list(kv.k[0].shape), DataType.DT_FLOAT16)
        cache = cm.register_blocks_cache(desc, kv.tensors())
        info = LLMClusterInfo(
            remote_cluster_id=1, remote_ip_info=[prefill], local_ip_info=[("127.0.0.1", 0)]
        )
        code, _ = dd.link_clusters([info], timeout=10_000)
        if code != LLMStatusCode.LLM_SUCCESS:
            raise RuntimeError(f"link failed: {code}")
        table = kv.allocate(BLOCK_TOKENS * len(src))
        cm.pull_blocks(BlocksCacheKey(1), cache, src, table)
        dd.unlink_clusters([info], timeout=10_000)
    return kv, table


# --8<-- [end:threads]


def holds(kv: PagedKV, table: list[int], rid: int) -> bool:
    """Whether ``table`` holds what :func:`prefill_model` wrote for request ``rid``."""
    return all(
        bool((t[table] == float(rid * 100 + layer * 2 + j)).all())
        for layer in range(LAYERS)
        for j, t in enumerate((kv.k[layer], kv.v[layer]))
    )


def fail(table: list[int]) -> None:
    """A recompute that must not be needed."""
    raise RuntimeError("the pull should have worked")


async def main(say: Callable[..., Any] = print) -> None:
    """Prefill engine 1 and decode engine 2: pull, layer-wise push, a failed peer."""
    p_kv, d_kv = PagedKV(seed=1), PagedKV(seed=2)
    failed = 0

    def checked(ok: bool) -> bool:
        nonlocal failed
        failed += not ok
        return ok

    async with (
        LLMDataDist(LLMRole.PROMPT, 1, config()) as p_dd,
        LLMDataDist(LLMRole.DECODER, 2, config()) as d_dd,
    ):
        p_cache, d_cache = await register(p_dd, p_kv), await register(d_dd, d_kv)
        prefill = await connect(d_dd, d_kv, metadata(p_dd, p_kv))  # one link, both ways

        # 1. pull: the prefill computes, the decoder copies the blocks
        p_table = p_kv.allocate(40)
        prefill_model(p_kv, p_table, rid=1, done=None)
        d_table, how = await serve_decode(d_dd, d_cache, d_kv, prefill, p_table, 40, fail)
        say(f"pull: {how}, blocks {p_table} -> {d_table}: {checked(holds(d_kv, d_table, 1))}")
        p_kv.release(p_table)

        # 2. layer-wise push: the decoder's table travels with the request
        p_table, d_table = p_kv.allocate(64), d_kv.allocate(64)
        codes = await push_request(p_dd, p_cache, p_kv, 2, 2, p_table, d_table)
        if codes != [LLMStatusCode.LLM_SUCCESS]:
            raise RuntimeError(f"layer-wise push failed: {codes}")
        say(f"push layer by layer: {p_table} -> {d_table}: {checked(holds(d_kv, d_table, 2))}")

        # 3. threads: a third engine, blocking API, on a thread of its own
        assert p_dd.listen_address is not None
        t_kv, t_table = await asyncio.to_thread(threaded_engine, p_dd.listen_address, p_table)
        ok = checked(holds(t_kv, t_table, 2))
        say(f"pull from a scheduler thread: {p_table} -> {t_table}: {ok}")
        p_kv.release(p_table)

        # 4. failure: the prefill engine goes away; the decoder recomputes
        await p_dd.finalize()
        p_table = [0, 1]

        def recompute(table: list[int]) -> None:
            prefill_model(d_kv, table, rid=4, done=None)

        d_table, how = await serve_decode(d_dd, d_cache, d_kv, prefill, p_table, 32, recompute)
        say(f"prefill gone: {how}, holds: {checked(holds(d_kv, d_table, 4))}")
    if failed:
        raise RuntimeError(f"{failed} of the checks above found wrong bytes")


if __name__ == "__main__":
    asyncio.run(main())
