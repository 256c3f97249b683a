"""Leases: a blocks cache's memory lent by address over a one-sided link (NIXL).

Every pull or push over NIXL otherwise costs a request and its grant — a round trip on
the link, and the granter's checks — before the bytes move: a fixed ~1 ms per
operation on a 2-core VM, which is most of a shared-memory transfer of a few MiB
(docs/design.md, "Leases"). A lease pays that once per cache: the granter lends the
memory of a blocks cache, and the holder moves blocks of it with one one-sided NIXL
READ or WRITE each (:meth:`~aiokv.transport.Link.move_at`), the granter's code not
involved, until the granter takes it back.

* **Asking.** After a pull or push of blocks of a blocks cache (by ``BlocksCacheKey``:
  ``pull_blocks``, ``push_blocks``, layer-wise pushes) moved over a one-sided link, the
  holder asks for a lease on the same cache, tensors, block size and direction, in the
  background (that transfer pays nothing): a :class:`~._protocol.LeaseReq`, read like a
  transfer.
* **Lending.** The granter checks it as it checks a transfer of those blocks (the key,
  the access a pull or push needs, the tensors, data type and block size), and that the
  link reaches that memory by address; then it pins the cache and answers with the
  lease: its id, the memory's device, the number of blocks, whether it may be written,
  and one base address per tensor (:func:`encode_reply`). Only host memory is lent:
  before device memory moves by address, its owner waits for the work queued on the
  device's stream (docs/api.md, "Device memory over NIXL"), which a transfer the owner
  does not see cannot do. The holder's own memory may be on a device (it settles its
  stream itself before each transfer).
* **Using.** The holder checks each transfer against the lease — every block index in
  range, the destination blocks of a write distinct — and moves it with one one-sided
  transfer. A transfer the lease does not cover takes the request path, where the
  granter's checks decide and produce the error.
* **Ending.** ``deallocate_blocks_cache`` and ``unregister_cache`` of a lent cache
  revoke its leases: a :class:`~._protocol.RevokeReq` (a write of 0 bytes) to each
  holder, which answers once its transfers on the lease are over. Only then does the
  call return and the memory go back, so nothing the granter does afterwards (reuse the
  memory, bind the key to another cache) can meet a transfer of the holder's. A holder
  that does not answer within :func:`revoke_timeout` loses the link. A link that ends
  ends its leases on both sides (the granter unpins at once).

What a lease hands out is what a linked NIXL peer can reach anyway (docs/security.md:
its registered memory); the holder's checks keep an honest holder inside the cache.
The granter does not see lease transfers: its ``statistics()`` count the lease, not
the transfers made under it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
from collections.abc import Callable
from collections.abc import Coroutine
from collections.abc import Iterator
from dataclasses import dataclass
from dataclasses import field
from typing import Any
from typing import Final

import numpy as np
import numpy.typing as npt

from .._checks import duplicated
from .._config import LLMConfig
from .._engine import completing
from .._enums import LLMStatusCode
from .._errors import LLMException
from .._registry import CacheRegistry
from .._registry import Entry
from .._threads import on_loop
from ..transport import BY_ADDRESS
from ..transport import ONE_SIDED
from ..transport import Link
from ..transport import PeerInfo
from ._protocol import KeyByBlocks
from ._protocol import RevokeReq
from ._protocol import Tensors
from ._protocol import encode

__all__ = [
    "MAX_LEASES",
    "Held",
    "LeaseKey",
    "Leases",
    "decode_reply",
    "encode_reply",
    "paired_rows",
]

log = logging.getLogger("aiokv.remote")

#: Most leases one link holds, or is lent, at once (each pins a cache on the granter).
MAX_LEASES: Final = 1024
#: Seconds before the holder asks again for a lease it was refused.
RETRY_S: Final = 10.0
# u64 words of a lease reply before its base addresses: id, blocks, device, flags
_HEAD: Final = 4


@dataclass(frozen=True, slots=True)
class LeaseKey:
    """What a lease covers, as the holder names it: the cache, its tensors, the block
    size and whether it may be written."""

    key: KeyByBlocks
    tensors: Tensors
    block_bytes: int
    write: bool


@dataclass(eq=False, slots=True)
class Held:
    """A lease this side holds. Made on the engine loop; its transfers may run on any
    thread (a leased move on the caller's own loop), so ``busy`` and ``dead`` change
    under ``lock`` and ``idle`` is set on the engine loop (``loop``).

    Attributes:
        lease: the granter's id of it.
        link: the link it was lent on (and is only valid on).
        device: where the memory lives on the granter (``"cpu"``, ``"cuda:N"``).
        bases: the address of each leased tensor there, in wire order.
        num_blocks: blocks in each tensor.
        block_bytes: bytes of one block.
        writable: whether it was lent for writes.
        busy: transfers on it now.
        dead: no transfer may start on it any more (revoked, dropped, link lost).
        idle: set on ``loop`` once it is dead and no transfer on it is left.
        loop: the engine loop, which owns ``idle`` (None: the loop it is set from).
    """

    lease: int
    link: Link
    device: str
    bases: npt.NDArray[np.uint64]
    num_blocks: int
    block_bytes: int
    writable: bool
    busy: int = 0
    dead: bool = False
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    loop: asyncio.AbstractEventLoop | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def rows(
        self,
        blocks: npt.NDArray[np.int64],
        local: npt.NDArray[np.int64],
        local_bases: npt.NDArray[np.uint64],
        *,
        write: bool,
    ) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]] | None:
        """``(local rows, granter's rows)`` of a transfer between blocks ``local`` of the
        holder's buffers at ``local_bases`` (``block_bytes`` each, validated by the
        caller) and ``blocks`` of the lease (validated here: as many, in range, distinct
        for a write): :func:`paired_rows`; None when the lease does not cover them."""
        if self.dead or (write and not self.writable) or blocks.size != local.size:
            return None
        # one reduction for both bounds: a negative index's bits as uint64 are >= 2**63
        if not blocks.size or int(blocks.view(np.uint64).max()) >= self.num_blocks:
            return None
        if write and duplicated(blocks):
            return None
        return paired_rows(local_bases, local, self.bases, blocks, self.block_bytes)

    @contextlib.contextmanager
    def using(self) -> Iterator[bool]:
        """A transfer on the lease, from any thread: yields whether it may go on (False:
        the lease ended before it started, use nothing of it). A revocation waits until
        every transfer that was told True is over (:meth:`end`)."""
        with self.lock:
            ok = not self.dead
            self.busy += ok
        try:
            yield ok
        finally:
            if ok:
                with self.lock:
                    self.busy -= 1
                    idle = not self.busy and self.dead
                if idle:
                    self._set_idle()

    def end(self) -> bool:
        """No transfer starts on the lease from now on (any thread); returns whether some
        are still running (``idle`` is set once the last one is over)."""
        with self.lock:
            self.dead = True
            busy = self.busy > 0
        if not busy:
            self._set_idle()
        return busy

    def _set_idle(self) -> None:
        on_loop(self.loop, self.idle.set)


#: Up to this many rows (blocks x tensors), :func:`paired_rows` builds a leased
#: transfer's rows from Python ints instead of numpy calls.
_FEW_ROWS: Final = 32


def paired_rows(
    a_bases: npt.NDArray[np.uint64],
    a_blocks: npt.NDArray[np.int64],
    b_bases: npt.NDArray[np.uint64],
    b_blocks: npt.NDArray[np.int64],
    block_bytes: int,
) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]:
    """Block ``a_blocks[i]`` of each buffer at ``a_bases`` and block ``b_blocks[i]`` of the
    same buffer's counterpart at ``b_bases`` (block ``k`` at byte ``k * block_bytes``;
    indices validated, non-negative) as ``(address, length)`` rows, buffer by buffer, in
    list order: row ``j`` of both the same length (already paired, as NIXL descriptors
    must be). Blocks that follow each other on *both* sides share a row. A few numpy
    operations whatever the block count: a leased transfer's descriptors without a
    layout, run list or re-pairing; up to :data:`_FEW_ROWS` rows, Python ints and one
    array per side (numpy's ~20 calls, ~1 µs each on the VM and 3-4x that with cold
    caches, cost more than the work for a few blocks)."""
    if a_blocks.size * a_bases.size <= _FEW_ROWS:
        runs = _joined(a_blocks.tolist(), b_blocks.tolist())
        return _few_rows(a_bases, runs, 0, block_bytes), _few_rows(b_bases, runs, 1, block_bytes)
    lens: npt.NDArray[np.uint64] | int = block_bytes
    joined = a_blocks[1:] - a_blocks[:-1] == 1  # (np.diff costs twice as much)
    if joined.any():
        joined &= b_blocks[1:] - b_blocks[:-1] == 1
        if joined.any():
            first = np.concatenate(([0], np.flatnonzero(~joined) + 1))
            lens = np.diff(np.append(first, a_blocks.size)).astype(np.uint64) * block_bytes
            a_blocks, b_blocks = a_blocks[first], b_blocks[first]
    return _rows(a_bases, a_blocks, lens, block_bytes), _rows(b_bases, b_blocks, lens, block_bytes)


def _joined(a_blocks: list[int], b_blocks: list[int]) -> list[tuple[int, int, int]]:
    """Runs ``(first block of a, first block of b, count)`` of the pairs whose blocks
    follow each other on both sides, in list order."""
    runs: list[tuple[int, int, int]] = []
    for a, b in zip(a_blocks, b_blocks, strict=True):
        if runs and a == runs[-1][0] + runs[-1][2] and b == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((a, b, 1))
    return runs


def _few_rows(
    bases: npt.NDArray[np.uint64], runs: list[tuple[int, int, int]], side: int, block_bytes: int
) -> npt.NDArray[np.uint64]:
    """The rows of :func:`paired_rows` of side ``side`` (0: a, 1: b) of ``runs``."""
    rows = [
        (base + run[side] * block_bytes, run[2] * block_bytes)
        for base in bases.tolist()
        for run in runs
    ]
    return np.array(rows, dtype=np.uint64).reshape(-1, 2)


def _rows(
    bases: npt.NDArray[np.uint64],
    blocks: npt.NDArray[np.int64],
    lens: npt.NDArray[np.uint64] | int,
    block_bytes: int,
) -> npt.NDArray[np.uint64]:
    out = np.empty((bases.size, blocks.size, 2), dtype=np.uint64)
    # non-negative offsets: their int64 bits are their uint64 value
    np.add(bases[:, None], (blocks * block_bytes).view(np.uint64), out=out[:, :, 0])
    out[:, :, 1] = lens
    return out.reshape(-1, 2)


def reply_size(count: int) -> int:
    """Bytes of the reply to a lease on ``count`` tensors."""
    return 8 * (_HEAD + count)


def encode_reply(
    lease: int, num_blocks: int, device: str, writable: bool, bases: list[int]
) -> bytes:
    """The lease as the holder reads it: little-endian u64 words ``lease, num_blocks,
    device (0: cpu, N + 1: cuda:N), flags (1: writable)`` and one base per tensor."""
    head = [lease, num_blocks, _device_code(device), int(writable)]
    return np.asarray(head + bases, dtype="<u8").tobytes()


def decode_reply(
    raw: bytes | bytearray, count: int
) -> tuple[int, int, str, bool, npt.NDArray[np.uint64]] | None:
    """``(lease, num_blocks, device, writable, bases)`` of a reply for ``count`` tensors,
    or None if malformed."""
    if len(raw) != reply_size(count):
        return None
    words = np.frombuffer(bytes(raw), dtype="<u8").astype(np.uint64)
    lease, num_blocks, code, flags = (int(w) for w in words[:_HEAD])
    if code > 1 << 16 or flags > 1 or num_blocks == 0:
        return None
    device = "cpu" if code == 0 else f"cuda:{code - 1}"
    return lease, num_blocks, device, bool(flags), words[_HEAD:].copy()


def _device_code(device: str) -> int:
    if device == "cpu":
        return 0
    kind, _, index = device.partition(":")
    if kind != "cuda" or not index.isdigit():
        raise ValueError(f"no lease of {device} memory")
    return int(index) + 1


def revoke_timeout(config: LLMConfig) -> float:
    """Seconds a holder has to answer a revocation: ``sync_kv_timeout``, at least 0.5 s
    and at most 5 s (its transfers on the lease are bounded by their own timeouts)."""
    return min(max(config.sync_kv_timeout / 1000, 0.5), 5.0)


@dataclass(eq=False, slots=True)
class _Lent:
    link: Link
    entry: Entry
    release: Callable[[], None]  # the link's lend()


class Leases:
    """Both halves of one ``LLMDataDist``'s leases: those it lent (granter) and those it
    holds (holder). The tables change on the engine loop only; :meth:`held` (single
    dict reads), :meth:`forget` and a :class:`Held`'s ``using`` / ``end`` may be called
    from any thread (a leased move on the caller's loop). The registry lock guards
    lending.

    Args:
        registry: the caches (a lease pins its cache).
        config: read for ``sync_kv_timeout``.
    """

    def __init__(self, registry: CacheRegistry, config: LLMConfig) -> None:
        self._registry = registry
        self._config = config
        self._links: dict[PeerInfo, Link] = {}
        self._ids = itertools.count(1)
        self._lent: dict[int, _Lent] = {}
        self._lent_by_cache: dict[int, set[int]] = {}
        self._held: dict[Link, dict[LeaseKey, Held]] = {}
        self._held_ids: dict[Link, dict[int, Held]] = {}
        self._asked: dict[tuple[Link, LeaseKey], float | None] = {}  # None: pending
        self._revoked_unknown: dict[Link, int] = {}  # revocations of leases not held
        self._closing: set[Link] = set()  # links this side is unlinking: nothing lent on them
        self._tasks: set[asyncio.Task[None]] = set()

    # ---- links ------------------------------------------------------------------------
    def on_link(self, link: Link) -> None:
        """A link came up (the transport's ``on_link``)."""
        self._links[link.peer] = link

    def on_link_lost(self, link: Link) -> None:
        """A link ended: its leases end, both ways (the granter unpins at once)."""
        if self._links.get(link.peer) is link:
            del self._links[link.peer]
        for lid in [i for i, lent in self._lent.items() if lent.link is link]:
            self._end_lent(lid)
        for held in self._held_ids.pop(link, {}).values():
            held.end()
            held.idle.set()  # the link is gone: its transfers end with it
        self._held.pop(link, None)
        self._revoked_unknown.pop(link, None)
        self._closing.discard(link)
        for k in [k for k in self._asked if k[0] is link]:
            del self._asked[k]

    async def end_link(self, link: Link) -> None:
        """Before this side closes ``link`` (unlink): end the leases on it while it still
        works. Those it lent are revoked (each holder answers once its transfers on them
        are over); those it holds are dropped once this side's transfers on them are
        over. So no one-sided transfer under a lease of the link crosses after the
        unlink, whatever the peer does with the memory once it sees the link end. Not
        cancellable; bounded by :func:`revoke_timeout` and the transfers' timeouts."""
        self._closing.add(link)  # lent no more: it closes next
        lent = [lid for lid, x in self._lent.items() if x.link is link]
        held = list(self._held_ids.get(link, {}).values())
        busy = [h.idle.wait() for h in held if self._drop(h)]
        await completing(asyncio.gather(*(self._revoke_one(lid) for lid in lent), *busy))

    # ---- granter ----------------------------------------------------------------------
    def lend(
        self, peer: PeerInfo, entry: Entry, tensors: range, *, write: bool
    ) -> tuple[int, bytes]:
        """Lend ``tensors`` of ``entry``'s (checked) blocks cache to ``peer``: pins it.
        Call under the registry lock. Returns ``(lease id, reply)``.

        Raises:
            LLMException: ``LLM_FEATURE_NOT_ENABLED`` when the link is not one-sided or
                does not reach that memory by address; ``LLM_LINK_BUSY`` past
                :data:`MAX_LEASES`; ``LLM_KV_CACHE_NOT_EXIST`` for a released cache.
        """
        link = self._links.get(peer)
        one_sided = None if link is None else link.extra(ONE_SIDED)
        by_address = None if link is None else link.extra(BY_ADDRESS)
        if link is None or one_sided is None or by_address is None:
            raise LLMException(
                "leases need a one-sided link (NIXL)",
                status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
            )
        if link in self._closing:
            raise LLMException(
                "the link is being unlinked", status_code=LLMStatusCode.LLM_LINK_BUSY
            )
        if sum(1 for lent in self._lent.values() if lent.link is link) >= MAX_LEASES:
            raise LLMException(
                f"at most {MAX_LEASES} leases per link", status_code=LLMStatusCode.LLM_LINK_BUSY
            )
        cache = entry.cache
        chosen = [cache.tensors[t] for t in tensors]
        device = str(chosen[0].device)
        if device != "cpu":
            raise LLMException(
                f"cache {cache.cache_id} is in {device} memory: it is lent per request, so "
                "that work queued on its stream is waited for before each transfer",
                status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
            )
        if not all(
            by_address.addressable(device, t.data_ptr(), t.numel() * t.element_size())
            for t in chosen
        ):
            raise LLMException(
                f"cache {cache.cache_id} is not in memory the link moves by address",
                status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
            )
        if not entry.id_held or not entry.lendable:
            why = "was released" if not entry.id_held else "is losing its key"
            raise LLMException(
                f"cache {cache.cache_id} {why}", status_code=LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
            )
        self._registry.pin(entry, lease=True)
        lid = next(self._ids)
        self._lent[lid] = _Lent(link, entry, one_sided.lend())
        self._lent_by_cache.setdefault(cache.cache_id, set()).add(lid)
        one_sided.publish()  # before the reply: the holder must know the memory it names
        reply = encode_reply(lid, cache.num_blocks, device, write, [t.data_ptr() for t in chosen])
        return lid, reply

    def lent(self, entry: Entry) -> bool:
        """Whether ``entry``'s cache is lent now."""
        return bool(self._lent_by_cache.get(entry.cache.cache_id))

    def cancel(self, lid: int) -> None:
        """The reply of lease ``lid`` did not reach its holder: it never started."""
        self._end_lent(lid)

    async def revoke(self, entry: Entry) -> None:
        """End every lease of ``entry``'s cache: each holder is told and answers once
        its transfers on it are over; one that does not answer in time (or fails to)
        loses the link. Returns when no lease of the cache is left.

        Not cancellable (:func:`~aiokv._engine.completing`): a revocation cut short
        would leave a holder writing into memory its owner thinks is back; it is bounded
        by :func:`revoke_timeout`."""
        lids = self._lent_by_cache.get(entry.cache.cache_id, set())
        await completing(asyncio.gather(*(self._revoke_one(lid) for lid in list(lids))))

    async def _revoke_one(self, lid: int) -> None:
        lent = self._lent.get(lid)
        if lent is None:
            return
        link = lent.link
        try:
            await link.write(encode(RevokeReq(lid)), [], timeout=revoke_timeout(self._config))
        except LLMException as exc:
            if not link.broken:
                log.warning("%r did not end lease %d (%s): dropping the link", link, lid, exc)
                await link.aclose()
        finally:
            self._end_lent(lid)

    def _end_lent(self, lid: int) -> None:
        lent = self._lent.pop(lid, None)
        if lent is None:
            return
        ids = self._lent_by_cache.get(lent.entry.cache.cache_id)
        if ids is not None:
            ids.discard(lid)
            if not ids:
                del self._lent_by_cache[lent.entry.cache.cache_id]
        lent.release()
        self._registry.unpin(lent.entry, lease=True)

    # ---- holder -----------------------------------------------------------------------
    def holding(self) -> int:
        """Leases this side holds now (live links only)."""
        return sum(
            1 for link, m in self._held.items() if not link.broken for h in m.values() if not h.dead
        )

    def held(self, link: Link, key: LeaseKey) -> Held | None:
        """The live lease for ``key`` on ``link``, if this side holds one."""
        got = self._held.get(link, {}).get(key)
        return None if got is None or got.dead or link.broken else got

    def want(
        self, link: Link, key: LeaseKey, ask: Coroutine[Any, Any, bytes | None], count: int
    ) -> None:
        """Ask for a lease on ``key`` in the background unless held, pending, refused
        less than :data:`RETRY_S` ago or over :data:`MAX_LEASES`: ``ask`` reads the
        reply (None: refused) of a lease on ``count`` tensors. Closes ``ask`` if not."""
        loop = asyncio.get_running_loop()
        asked = self._asked.get((link, key), -RETRY_S)
        if (
            link.broken
            or link in self._closing
            or self.held(link, key) is not None
            or asked is None
            or loop.time() - asked < RETRY_S
            or len(self._held.get(link, {})) >= MAX_LEASES
        ):
            ask.close()
            return
        self._asked[(link, key)] = None
        task = loop.create_task(self._adopt(link, key, ask, count), name="aiokv-lease")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _adopt(
        self, link: Link, key: LeaseKey, ask: Coroutine[Any, Any, bytes | None], count: int
    ) -> None:
        epoch = self._revoked_unknown.get(link, 0)
        reply = None
        try:
            reply = await ask
        finally:
            parsed = None if reply is None else decode_reply(reply, count)
            if link.broken or (link, key) not in self._asked:
                pass  # the link ended meanwhile: nothing to keep
            elif parsed is None or self._revoked_unknown.get(link, 0) != epoch:
                # refused, or a revocation came that may have been this lease's
                self._asked[(link, key)] = asyncio.get_running_loop().time()
            else:
                lease, num_blocks, device, writable, bases = parsed
                held = Held(lease, link, device, bases, num_blocks, key.block_bytes, writable)
                held.loop = asyncio.get_running_loop()
                self._held.setdefault(link, {})[key] = held
                self._held_ids.setdefault(link, {})[lease] = held
                del self._asked[(link, key)]

    def forget(self, held: Held) -> None:
        """Stop using ``held`` (a transfer under it failed), from any thread: no transfer
        starts on it from now on, and it leaves the tables on the engine loop. The
        granter keeps it lent until it revokes it or the link ends."""
        held.end()
        on_loop(held.loop, self._drop, held)

    def _drop(self, held: Held) -> bool:
        """End ``held`` and remove it from the tables (engine loop); whether transfers
        on it are still running."""
        busy = held.end()
        self._held_ids.get(held.link, {}).pop(held.lease, None)
        leases = self._held.get(held.link, {})
        for k in [k for k, h in leases.items() if h is held]:
            del leases[k]
        return busy

    async def release(self, peer: PeerInfo, lid: int) -> None:
        """The granter ``peer`` revokes lease ``lid``: stop using it; returns once no
        transfer on it is left (each is bounded by its own timeout)."""
        link = self._links.get(peer)
        if link is None:
            return
        held = self._held_ids.get(link, {}).pop(lid, None)
        if held is None:  # not adopted yet (its reply still on the way) or unknown
            self._revoked_unknown[link] = self._revoked_unknown.get(link, 0) + 1
            return
        if self._drop(held):
            await held.idle.wait()

    async def aclose(self) -> None:
        """``finalize``: stop asking (pending requests are cancelled and awaited), then
        end the leases of every link still up (:meth:`end_link`) before the links close
        and the memory goes: a one-sided write may reach memory NIXL no longer knows."""
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        links = {lent.link for lent in self._lent.values()} | set(self._held_ids)
        await asyncio.gather(*(self.end_link(link) for link in links if not link.broken))
