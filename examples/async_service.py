"""An asyncio decode service on aiokv: many requests at once, each pulling its prompt's
KV blocks from a prefill peer, under a deadline, cancellable at any point.

Run: ``python examples/async_service.py``. The prefill peer lives in this process and
is reached over loopback TCP; in production it is another process or machine (give
``listen_ip_info`` an address the decoder can reach). ``--inline`` runs both engines
inline on this program's loop (``engine_thread=False``: no engine thread, no hop per
call; right for a service whose loop never blocks).

What it shows:

* one ``LLMDataDist`` serves every request concurrently: no lock, no thread per request;
* the service hands out its own KV blocks (a free list: bookkeeping, never awaited) and
  takes them back in ``finally`` — after a success, a timeout or a cancellation alike.
  aiokv guarantees that once ``pull_blocks`` returned or raised, no byte lands in the
  destination any more, so the blocks are safe to reuse at once
  (docs/cancellation.md);
* a deadline per request with ``asyncio.timeout``; a client that goes away cancels its
  task;
* admission control with a semaphore (at most ``MAX_IN_FLIGHT`` pulls in flight).
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from aiokv import BlocksCacheKey
from aiokv import CacheDesc
from aiokv import DataType
from aiokv import LLMClusterInfo
from aiokv import LLMConfig
from aiokv import LLMDataDist
from aiokv import LLMRole
from aiokv import LLMStatusCode

PREFILL, DECODE = 1, 2  # cluster ids
LAYERS, BLOCKS, BLOCK_TOKENS = 4, 256, 16
#: K and V per layer; block b of every tensor holds ``BLOCK_TOKENS`` tokens
DESC = CacheDesc(2 * LAYERS, [BLOCKS, BLOCK_TOKENS, 4, 32], DataType.DT_FLOAT16)
REQUESTS = 64
MAX_IN_FLIGHT = 16
#: Requests that wait for admission at first (all but the first ``MAX_IN_FLIGHT``): the
#: one with a deadline it cannot meet, and those whose clients go away. A request whose
#: pull is already in flight may finish before its cancellation or deadline reaches it,
#: and then ends "ok" (its result was ready first); these outcomes are certain.
LATE, GONE = 40, (42, 50, 61)


def config(inline: bool = False) -> LLMConfig:
    """A 32 MiB pool on the CPU (``device_type="auto"`` picks an NPU or a GPU); the
    engine on this loop with ``inline``, else on a thread of its own."""
    return LLMConfig(
        engine_thread=not inline,
        device_type="cpu",
        enable_cache_manager=True,
        listen_ip_info="127.0.0.1:0",
        mem_pool_cfg='{"memory_size": 33554432, "page_shift": 16}',
        sync_kv_timeout=10_000,
    )


@dataclass(frozen=True, slots=True)
class Request:
    """A request whose prompt the prefill wrote into ``prefill_blocks``."""

    rid: int
    prefill_blocks: tuple[int, ...]
    timeout_s: float


class OutOfBlocks(RuntimeError):
    """The service has no free KV blocks for a request (it would queue or reject it)."""


class BlockTable:
    """The service's free KV blocks. Synchronous: it never awaits, so a cancellation
    can never leave it half-updated."""

    def __init__(self, blocks: int) -> None:
        self._free = list(range(blocks))

    @property
    def free(self) -> int:
        """Blocks not held by any request."""
        return len(self._free)

    def take(self, n: int) -> list[int]:
        """``n`` blocks for a request; raises :class:`OutOfBlocks` if there are fewer."""
        if n > len(self._free):
            raise OutOfBlocks(f"{n} blocks wanted, {len(self._free)} free")
        taken, self._free = self._free[-n:], self._free[:-n]
        return taken

    def give_back(self, blocks: list[int]) -> None:
        """Return a request's blocks."""
        self._free.extend(blocks)


class DecodeService:
    """Admits requests: takes blocks, pulls the prompt's KV into them, checks them."""

    def __init__(self, dd: LLMDataDist, cache: Any, expected: Callable[[int, int], float]):
        self.dd, self.cache, self.expected = dd, cache, expected
        self.blocks = BlockTable(cache.num_blocks)
        self.admission = asyncio.Semaphore(MAX_IN_FLIGHT)

    async def handle(self, req: Request) -> str:
        """Serve ``req``: ``"ok"``, or ``"timeout"`` after ``req.timeout_s`` (waiting for
        admission included, as a client's deadline). Cancelling the caller's task cancels
        the wait or the pull; the blocks are returned in every case."""
        try:
            async with asyncio.timeout(req.timeout_s), self.admission:
                mine = self.blocks.take(len(req.prefill_blocks))
                try:
                    await self.dd.cache_manager.pull_blocks(
                        BlocksCacheKey(PREFILL), self.cache, list(req.prefill_blocks), mine
                    )
                    # a real engine would now decode from blocks `mine`
                    for src, dst in zip(req.prefill_blocks, mine, strict=True):
                        if float(self.cache.tensors[0][dst, 0, 0, 0]) != self.expected(0, src):
                            raise RuntimeError(f"request {req.rid}: block {dst} holds wrong bytes")
                finally:
                    self.blocks.give_back(mine)
        except TimeoutError:
            return "timeout"
        return "ok"


def fill(cache: Any) -> Callable[[int, int], float]:
    """Write a value per (tensor, block) into ``cache``; return how to recompute it."""

    def value(tensor: int, block: int) -> float:
        return float((tensor * 1000 + block) % 2048)

    for i, t in enumerate(cache.tensors):
        t.copy_(torch.tensor([value(i, b) for b in range(BLOCKS)]).view(-1, 1, 1, 1).expand_as(t))
    return value


async def main(say: Callable[..., Any] = print, *, inline: bool = False) -> None:
    """Serve ``REQUESTS`` requests at once; cancel a few, give one an impossible
    deadline; check every block came back and every delivered block holds its bytes.
    ``inline``: the engines run on this loop (``engine_thread=False``)."""
    rng = random.Random(0)
    async with (
        LLMDataDist(LLMRole.PROMPT, PREFILL, config(inline)) as prefill,
        LLMDataDist(LLMRole.DECODER, DECODE, config(inline)) as decode,
    ):
        src = await prefill.cache_manager.allocate_blocks_cache(DESC, BlocksCacheKey(PREFILL))
        expected = fill(src)
        assert prefill.listen_address is not None
        peer = LLMClusterInfo(
            remote_cluster_id=PREFILL,
            remote_ip_info=[prefill.listen_address],
            local_ip_info=[("127.0.0.1", 0)],  # this side's address (llm_datadist requires one)
        )
        code, _ = await decode.link_clusters([peer], timeout=10_000)
        if code != LLMStatusCode.LLM_SUCCESS:
            raise RuntimeError(f"link_clusters: {code}")
        dst = await decode.cache_manager.allocate_blocks_cache(DESC)
        service = DecodeService(decode, dst, expected)

        requests = [
            Request(
                rid,
                tuple(rng.sample(range(BLOCKS), rng.randint(1, 12))),
                # one request, queued behind others, gets a deadline it cannot meet
                timeout_s=1e-6 if rid == LATE else 10.0,
            )
            for rid in range(REQUESTS)
        ]
        t0 = time.perf_counter()
        tasks = [asyncio.create_task(service.handle(r)) for r in requests]
        await asyncio.sleep(0)  # every task started: a few clients now go away
        for rid in GONE:
            tasks[rid].cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        took = time.perf_counter() - t0

        outcome = {"ok": 0, "timeout": 0, "cancelled": 0}
        for res in results:
            if isinstance(res, asyncio.CancelledError):
                outcome["cancelled"] += 1
            elif isinstance(res, BaseException):
                raise res
            else:
                outcome[res] += 1
        say(f"{REQUESTS} requests in {took * 1e3:.0f} ms: {outcome}")
        say(f"every block back in the free list: {service.blocks.free == BLOCKS}")
        say(f"timed out: request {LATE} only: {results[LATE] == 'timeout'}")
        if service.blocks.free != BLOCKS or outcome["ok"] < REQUESTS - 1 - len(GONE):
            raise RuntimeError(f"the service leaked blocks or failed requests: {outcome}")
        await decode.unlink_clusters([peer], timeout=10_000)


if __name__ == "__main__":
    asyncio.run(main(inline="--inline" in sys.argv[1:]))
