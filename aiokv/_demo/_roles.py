"""The demo's two kinds of process, each its own ``LLMDataDist``: the prefill (PROMPT)
and a decoder (DECODER). Only aiokv's public API is used.

The prefill runs the model over the whole batch; as each layer's K and V are written it
tells its :class:`LayerEvents` (the ``LayerSynchronizer`` of ``transfer_cache_async``),
which lets that layer's blocks go to every decoder while the next layer computes. A
decoder links to the prefill, owns its own blocks (different ids), is told when its
requests' cache has landed and decodes greedily from it.

Both are driven by the parent (:mod:`._run`) over a pipe of plain tuples; each sends
``(name, kind, payload)`` back, ``(name, "error", message)`` on failure. The prefill's
``kv`` notes (a decoder's blocks have landed) go through the parent to that decoder.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Coroutine
from typing import Any

import torch

from .. import BlocksCacheKey
from .. import Cache
from .. import CacheDesc
from .. import CacheManager
from .. import CacheTask
from .. import DataType
from .. import LLMClusterInfo
from .. import LLMConfig
from .. import LLMDataDist
from .. import LLMException
from .. import LLMRole
from .. import LLMStatusCode
from .. import TransferWithCacheKeyConfig
from ..examples.tiny_model import ModelConfig
from ..examples.tiny_model import TinyDecoder
from ._plan import PROMPT_ID
from ._plan import BlockPool
from ._plan import DemoOptions
from ._plan import Request
from ._plan import decoder_id
from ._plan import requests

__all__ = ["LayerEvents", "decode_process", "prefill_process"]

Conn = Any  # a multiprocessing Connection carrying tuples
Message = tuple[Any, ...]


def model_config(opts: DemoOptions) -> ModelConfig:
    """The model both sides build (same seed: same weights)."""
    return ModelConfig(layers=opts.layers, d_model=opts.d_model, heads=opts.heads, seed=opts.seed)


def cache_desc(opts: DemoOptions, num_blocks: int) -> CacheDesc:
    """K and V per layer, ``[num_blocks, block_size, heads, head_dim]`` float32."""
    mc = model_config(opts)
    shape = [num_blocks, opts.block_size, mc.heads, mc.head_dim]
    return CacheDesc(2 * opts.layers, shape, DataType.DT_FLOAT)


def participant_config(opts: DemoOptions, desc: CacheDesc) -> LLMConfig:
    """A participant on loopback whose device pool just fits ``desc`` (pages of 64 KiB)."""
    page = 1 << 16
    tensor = -(-desc.size // page) * page
    pool = desc.num_tensors * tensor + (1 << 20)
    return LLMConfig(
        device_type=opts.device,
        transfer_backend=opts.backend,
        enable_cache_manager=True,
        enable_remote_cache_accessible=True,
        listen_ip_info="127.0.0.1:0",
        mem_pool_cfg=f'{{"memory_size": {pool}, "page_shift": 16}}',
        sync_kv_timeout=30_000,
        link_secret="aiokv-demo",
    )


class LayerEvents:
    """A ``LayerSynchronizer``: layer ``i`` may be sent once the model has written its K
    and V (:meth:`done`, called on the model's thread) and, on an accelerator, once the
    device has run that far (a device event recorded then, waited for here).

    ``synchronize_layer`` is a plain ``def``: aiokv runs it on a worker thread, where it
    may block. :meth:`fail` releases every waiter with ``False`` (the model failed).
    """

    def __init__(self, layers: int, device: torch.device) -> None:
        self._ready = [threading.Event() for _ in range(layers)]
        self._device_events: list[torch.Event | None] = [None] * layers
        self._device = device
        self._failed = False

    def done(self, layer: int) -> None:
        """Layer ``layer``'s K and V are queued (CPU: written)."""
        if self._device.type != "cpu":
            event = torch.Event(device=self._device)
            event.record()
            self._device_events[layer] = event
        self._ready[layer].set()

    def fail(self) -> None:
        """Release every waiting layer with ``False``."""
        self._failed = True
        for ready in self._ready:
            ready.set()

    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        """Block until layer ``layer_index`` is complete; ``False`` if the model failed."""
        self._ready[layer_index].wait()
        event = self._device_events[layer_index]
        if event is not None:
            event.synchronize()
        return not self._failed


# ------------------------------------------------------------------------ both sides


def _child(name: str, conn: Conn, main: Coroutine[Any, Any, None]) -> None:
    """Run a role's ``main`` on a new loop; report a failure as an ``error`` message.

    Ctrl-C belongs to the parent (it stops the children): SIGINT is ignored here, as
    it was already while the process started (inherited from the parent).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL logs INFO to stdout otherwise
    torch.set_num_threads(1)  # 2+ processes share the cores; also: the same kernels
    try:
        asyncio.run(main)
    except BaseException as exc:
        if not isinstance(exc, LLMException | RuntimeError | ValueError):
            traceback.print_exc()
        with contextlib.suppress(OSError):  # the parent is gone
            conn.send((name, "error", f"{type(exc).__name__}: {exc}"))
        sys.exit(1)


async def _next(conn: Conn) -> Message:
    """The next message for this process; ``("stop",)`` once the parent is gone."""

    def get() -> Message:
        parent = mp.parent_process()
        try:
            while not conn.poll(0.25):
                if parent is not None and not parent.is_alive():
                    return ("stop",)
            msg: Message = conn.recv()
        except (EOFError, OSError):
            return ("stop",)
        return msg

    return await asyncio.to_thread(get)


# --------------------------------------------------------------------------- prefill


def prefill_process(conn: Conn, opts: DemoOptions) -> None:
    """Spawn target of the prefill process."""
    _child("prefill", conn, _prefill(conn, opts))


async def _prefill(conn: Conn, opts: DemoOptions) -> None:
    mc = model_config(opts)
    reqs = requests(opts, mc.vocab)
    bs = opts.block_size
    pool = BlockPool(sum(BlockPool.blocks_for(len(r.tokens), bs) for r in reqs), seed=None)
    tables = [pool.table(len(r.tokens), bs) for r in reqs]
    desc = cache_desc(opts, pool.num_blocks)
    async with LLMDataDist(LLMRole.PROMPT, PROMPT_ID, participant_config(opts, desc)) as dd:
        cm = dd.cache_manager
        model = TinyDecoder(mc, cm.device)
        cache = await cm.allocate_blocks_cache(desc, BlocksCacheKey(PROMPT_ID))
        conn.send(
            (
                "prefill",
                "ready",
                {
                    "addr": dd.listen_address,
                    "device": str(cm.device),
                    "tables": tables,
                },
            )
        )
        while (msg := await _next(conn))[0] != "stop":
            if msg[0] == "run":
                stats = await _round(cm, model, cache, reqs, tables, msg[1], msg[2], conn)
                conn.send(("prefill", "round", stats))
            elif msg[0] == "reference":
                conn.send(
                    ("prefill", "reference", await asyncio.to_thread(_colocated, model, reqs, opts))
                )


async def _round(
    cm: CacheManager,
    model: TinyDecoder,
    cache: Cache,
    reqs: list[Request],
    tables: list[list[int]],
    mode: str,
    dst_tables: dict[int, list[int]],
    conn: Conn,
) -> dict[str, Any]:
    """Prefill the batch and send its cache to the decoders: ``layerwise`` (layer i goes
    while layer i + 1 computes) or ``serial`` (everything after the prefill). Each decoder
    is told as soon as its blocks have landed."""
    bs = cache.cache_desc.shape[1]
    events = LayerEvents(len(model.layers), model.device)
    sends: dict[int, tuple[list[int], list[int]]] = {}
    for r in reqs:  # prompt blocks only: the decoder's extra blocks are for new tokens
        n = BlockPool.blocks_for(len(r.tokens), bs)
        src, dst = sends.setdefault(r.decoder, ([], []))
        src += tables[r.index]
        dst += dst_tables[r.index][:n]

    def start() -> dict[int, CacheTask]:
        return {
            k: cm.transfer_cache_async(
                cache,
                events,
                [TransferWithCacheKeyConfig(BlocksCacheKey(decoder_id(k)))],
                src_block_indices=src,
                dst_block_indices=dst,
            )
            for k, (src, dst) in sends.items()
        }

    sent: dict[int, float] = {}
    first: list[int] = []

    async def deliver(k: int, task: CacheTask) -> None:
        code = await task.synchronize()
        if code != LLMStatusCode.LLM_SUCCESS:
            raise LLMException(f"transfer to decoder {k}: {code.name}", status_code=code)
        sent[k] = time.monotonic()
        mine = {r.index: first[r.index] for r in reqs if r.decoder == k}
        conn.send(("prefill", "kv", (k, ("kv", mode, mine, t0))))

    prompts = [r.tokens for r in reqs]
    t0 = time.monotonic()
    tasks = start() if mode == "layerwise" else {}
    try:
        first[:] = await asyncio.to_thread(
            model.prefill, prompts, tables, cache.tensors, events.done
        )
    except BaseException:
        events.fail()
        for task in tasks.values():
            task.cancel()
        raise
    computed = time.monotonic()
    tasks = tasks or start()
    await asyncio.gather(*(deliver(k, t) for k, t in tasks.items()))
    return {
        "mode": mode,
        "t0": t0,
        "computed": computed,
        "sent": sent,
        "bytes": {
            k: len(src) * cache.block_bytes * len(cache.tensors) for k, (src, _) in sends.items()
        },
        "first": first,
    }


def _colocated(model: TinyDecoder, reqs: list[Request], opts: DemoOptions) -> dict[str, Any]:
    """The reference: the same batch prefilled and decoded in this one process, in a
    plain torch paged cache with blocks of its own; decoded per decoder group, as the
    decoders batch it."""
    bs = opts.block_size
    pool = BlockPool(sum(BlockPool.blocks_for(len(r.tokens) + opts.steps, bs) for r in reqs), 7)
    tables = [pool.table(len(r.tokens) + opts.steps, bs) for r in reqs]
    c = model.config
    kv = [
        torch.zeros(pool.num_blocks, bs, c.heads, c.head_dim, device=model.device)
        for _ in range(2 * c.layers)
    ]
    t0 = time.monotonic()
    first = model.prefill([r.tokens for r in reqs], tables, kv)
    tokens: dict[int, list[int]] = {}
    ttft = 0.0
    for k in range(opts.decoders):
        group = [r for r in reqs if r.decoder == k]

        def stamp(step: int) -> None:
            nonlocal ttft
            if step == 0 and not ttft:
                ttft = time.monotonic() - t0

        out = model.generate(
            [first[r.index] for r in group],
            [len(r.tokens) for r in group],
            [tables[r.index] for r in group],
            kv,
            opts.steps,
            stamp,
        )
        tokens.update({r.index: [first[r.index], *o] for r, o in zip(group, out, strict=True)})
    return {"tokens": tokens, "ttft": ttft}


# ---------------------------------------------------------------------------- decode


def decode_process(conn: Conn, k: int, opts: DemoOptions) -> None:
    """Spawn target of decoder ``k``."""
    _child(f"decoder {k}", conn, _decode(conn, k, opts))


def _rotated(tables: dict[int, list[int]]) -> dict[int, list[int]]:
    """The same blocks, each request's table shifted one block along the batch: every
    request reads another's (or shifted) K and V. For the broken-mapping test."""
    flat = [b for t in tables.values() for b in t]
    flat = flat[1:] + flat[:1]
    out, i = {}, 0
    for r, t in tables.items():
        out[r] = flat[i : i + len(t)]
        i += len(t)
    return out


async def _decode(conn: Conn, k: int, opts: DemoOptions) -> None:
    name = f"decoder {k}"
    mc = model_config(opts)
    mine = [r for r in requests(opts, mc.vocab) if r.decoder == k]
    bs, steps = opts.block_size, opts.steps
    need = sum(BlockPool.blocks_for(len(r.tokens) + steps, bs) for r in mine)
    pool = BlockPool(need + len(mine), seed=opts.seed + 1 + k)  # a few spare: other ids
    tables = {r.index: pool.table(len(r.tokens) + steps, bs) for r in mine}
    reads = _rotated(tables) if opts.corrupt else tables
    desc = cache_desc(opts, pool.num_blocks)
    async with LLMDataDist(LLMRole.DECODER, decoder_id(k), participant_config(opts, desc)) as dd:
        cm = dd.cache_manager
        model = TinyDecoder(mc, cm.device)
        cache = await cm.allocate_blocks_cache(desc, BlocksCacheKey(decoder_id(k)))
        conn.send((name, "ready", {}))
        scrub = torch.Generator(device=cache.tensors[0].device).manual_seed(k)
        while (msg := await _next(conn))[0] != "stop":
            if msg[0] == "link":
                peer = LLMClusterInfo(
                    remote_cluster_id=PROMPT_ID,
                    local_ip_info=[("127.0.0.1", 0)],
                    remote_ip_info=[tuple(msg[1])],
                )
                code, _ = await dd.link_clusters([peer], timeout=10_000)
                if code != LLMStatusCode.LLM_SUCCESS:
                    raise LLMException(f"link to the prefill: {code.name}", status_code=code)
                conn.send((name, "linked", {"tables": tables}))
            elif msg[0] == "scrub":  # garbage in every block: only what arrives counts
                for t in cache.tensors:
                    t.normal_(generator=scrub)
                conn.send((name, "scrubbed", {}))
            elif msg[0] == "kv":
                _, mode, first, t0 = msg
                got = time.monotonic()
                stamps: list[float] = []

                def stamp(step: int, stamps: list[float] = stamps) -> None:
                    stamps.append(time.monotonic())

                out = await asyncio.to_thread(
                    model.generate,
                    [first[r.index] for r in mine],
                    [len(r.tokens) for r in mine],
                    [reads[r.index] for r in mine],
                    cache.tensors,
                    steps,
                    stamp,
                )
                tokens = {r.index: [first[r.index], *o] for r, o in zip(mine, out, strict=True)}
                conn.send(
                    (
                        name,
                        "tokens",
                        {
                            "mode": mode,
                            "tokens": tokens,
                            "t0": t0,
                            "got": got,
                            "first": stamps[0],
                            "done": stamps[-1],
                        },
                    )
                )
