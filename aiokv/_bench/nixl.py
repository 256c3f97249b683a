"""The NIXL contenders of ``aiokv bench transfer --backend nixl``.

Per UCX setting (:data:`SETTINGS`: UCX's default, shared memory / CMA on one host, and
UCX over loopback TCP), four spawned processes, each with the setting's environment set
before NIXL is imported (UCX reads it when an agent is made):

* an aiokv pair: a :class:`~._harness.PromptPeer` and a :class:`NixlDecoder` linked to
  it, both ``transfer_backend="nixl"``; the decoder times its own ``pull_blocks`` /
  ``push_blocks`` and checks that each one moved over NIXL (not the TCP fallback): all
  its bytes counted by the transport's NIXL transfers. From the second transfer of a
  row on, they move under a lease (one one-sided transfer, no request; the first pull
  of a row asks for it);
* a raw NIXL pair (:class:`RawNixl`): two bare agents that load each other's metadata
  directly; the initiator READs / WRITEs the same scattered blocks with the same
  descriptors aiokv builds for them — one descriptor per block (scattered blocks are
  never neighbours, so aiokv merges none), local in destination order, remote in source
  order — and waits as aiokv does for transfers of 1 MiB and more: posted and polled
  from the calling thread, ``time.sleep`` back-off from 20 µs to 1 ms. Like aiokv, it
  builds the transfer (``initialize_xfer``) in every round and releases it after. Like
  the leased transfers timed on aiokv's side, neither a READ nor a WRITE carries a
  notification (one would also slow the pair's next transfer: on the 2-core VM the
  transfer after a notifying WRITE was left in flight by its post and took 0.5–1 ms
  more at one block, ~0.1 ms more at 4 MiB); the target polls notifications (UCX
  progress) with the same back-off.

Every timed call is measured in the process that makes it (:class:`~._harness.Elapsed`),
so no contender pays for the pipe that drives it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import statistics
import time
from collections.abc import AsyncIterator
from collections.abc import Callable
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from multiprocessing.connection import Connection
from typing import Any
from typing import Final
from typing import Literal

import torch

from .. import BlocksCacheKey
from .. import CacheDesc
from .. import DataType
from .. import LLMClusterInfo
from .. import LLMDataDist
from .. import LLMRole
from .. import LLMStatusCode
from ._harness import DECODER_ID
from ._harness import PEER_ID
from ._harness import DeviceKind
from ._harness import Elapsed
from ._harness import Peer
from ._harness import PromptPeer
from ._harness import apply_env
from ._harness import digest
from ._harness import participant_config
from ._harness import run_loop
from ._harness import serve_requests
from ._harness import spawned_all

__all__ = [
    "SETTINGS",
    "MemKind",
    "NixlContenders",
    "NixlDecoder",
    "RawNixl",
    "nixl_contenders",
    "ucx_over_tcp",
]

#: What the raw NIXL buffers are: host memory, or CUDA memory on ``cuda:0``.
MemKind = Literal["DRAM", "VRAM"]


def ucx_over_tcp() -> dict[str, str]:
    """The UCX environment that keeps NIXL's host-memory transfers on loopback TCP.

    On a host with a CUDA device NIXL's UCX backend refuses a ``UCX_TLS`` that names no
    CUDA transport ("NVIDIA GPU(s) are present, but this setting does not enable CUDA
    memory support"; seen on an H200 with nixl 1.5.1), so ``cuda_copy`` is added there:
    it serves only device memory, so host buffers still move over TCP.
    """
    tls = "tcp,self,cuda_copy" if torch.cuda.is_available() else "tcp,self"
    return {"UCX_TLS": tls, "UCX_NET_DEVICES": "lo"}


#: UCX settings by short name: the environment each side's processes start with
#: (``None``: the variable is removed, so UCX picks its default transports).
#: ``NIXL_LOG_LEVEL=WARN`` too: NIXL logs INFO lines to stdout, which ``--json`` owns.
SETTINGS: Final[dict[str, dict[str, str | None]]] = {
    "shm": {"UCX_TLS": None, "UCX_NET_DEVICES": None, "NIXL_LOG_LEVEL": "WARN"},
    "utcp": {**ucx_over_tcp(), "NIXL_LOG_LEVEL": "WARN"},
}


def _desc(block: int, nblocks: int) -> CacheDesc:
    return CacheDesc(1, [nblocks, block], DataType.DT_UINT8)


# -------------------------------------------------------------------- aiokv over NIXL


async def _decoder_main(
    conn: Connection, port: int, pool_bytes: int, device_type: DeviceKind
) -> None:
    config = participant_config(pool_bytes, backend="nixl", device_type=device_type)
    async with LLMDataDist(LLMRole.DECODER, DECODER_ID, config) as dd:
        info = LLMClusterInfo(
            remote_cluster_id=PEER_ID,
            local_ip_info=[("127.0.0.1", 0)],
            remote_ip_info=[("127.0.0.1", port)],
        )
        code, codes = await dd.link_clusters([info])
        if code != LLMStatusCode.LLM_SUCCESS:
            raise RuntimeError(f"link to the prompt peer failed: {code.name} {codes}")
        cm, key = dd.cache_manager, BlocksCacheKey(PEER_ID, 0)
        transport: Any = dd._transport  # its ``moved_bytes``: bytes NIXL moved
        state: dict[str, Any] = {}

        async def setup(block: int, srcs: list[int], dsts: list[int]) -> tuple[str, bool]:
            if "cache" in state:
                await cm.deallocate_blocks_cache(state.pop("cache"))
            dst = await cm.allocate_blocks_cache(_desc(block, 2 * len(srcs)))
            state.update(cache=dst, srcs=srcs, dsts=dsts, nbytes=block * len(srcs))
            ok, _ = await timed(pull)
            return digest(dst, dsts), ok

        async def pull() -> None:
            await cm.pull_blocks(key, state["cache"], state["srcs"], state["dsts"])

        async def push() -> None:
            await cm.push_blocks(key, state["cache"], state["dsts"], state["srcs"])

        async def timed(op: Callable[[], Any]) -> tuple[bool, float]:
            moved = transport.moved_bytes
            t0 = time.perf_counter()
            await op()
            t = time.perf_counter() - t0
            return transport.moved_bytes == moved + state["nbytes"] and direct(), t

        def direct() -> bool:
            """The cache is NIXL memory (a device pool: VRAM), so NIXL moved it directly."""
            return all(
                transport.addressable(str(t.device), t.data_ptr(), t.numel() * t.element_size())
                for t in state["cache"].tensors
            )

        conn.send("linked")
        await serve_requests(
            conn, {"setup": setup, "pull": lambda: timed(pull), "push": lambda: timed(push)}
        )


def _decoder(
    conn: Connection,
    env: dict[str, str | None],
    port: int,
    pool_bytes: int,
    device_type: DeviceKind,
) -> None:
    apply_env(env)
    run_loop(lambda: _decoder_main(conn, port, pool_bytes, device_type))


class NixlDecoder(Peer):
    """A ``transfer_backend="nixl"`` decoder in a spawned process with ``env``, its pool
    on ``device_type``, linked to the prompt peer listening on ``port``; one cache of
    scattered blocks at a time. An op counts as over NIXL only if NIXL moved every part
    and, with a device pool, that pool is registered with NIXL (no staging here)."""

    def __init__(
        self,
        env: dict[str, str | None],
        port: int,
        pool_bytes: int,
        device_type: DeviceKind = "cpu",
    ) -> None:
        super().__init__(_decoder, env, port, pool_bytes, device_type)

    async def setup(self, block: int, srcs: list[int], dsts: list[int]) -> tuple[str, bool]:
        """A new zeroed cache of ``2 * len(srcs)`` blocks, pulled once: its digest of
        ``dsts``, and whether that pull moved over NIXL."""
        got: tuple[str, bool] = await self.request("setup", block, srcs, dsts)
        return got

    async def op(self, name: str) -> Elapsed:
        """One timed ``pull`` (``srcs`` → ``dsts``) or ``push`` (back)."""
        ok, t = await self.request(name)
        if not ok:
            raise AssertionError(f"aiokv-nixl {name} did not move over NIXL")
        return Elapsed(t)


# ------------------------------------------------------------------------- raw NIXL


def _poll_bounds() -> tuple[float, float]:
    """aiokv's back-off bounds (imported late: NIXL loads after
    :func:`~._harness.apply_env`)."""
    from ..transport.nixl._plane import POLL_MAX_S
    from ..transport.nixl._plane import POLL_MIN_S

    return POLL_MIN_S, POLL_MAX_S


def _agent(name: str) -> Any:
    """A bare NIXL agent configured as aiokv's (UCX; no progress or listener thread;
    strict thread sync)."""
    from ..transport.nixl._agent import _nixl

    conf = _nixl.nixl_agent_config(
        enable_prog_thread=False,
        enable_listen_thread=False,
        backends=["UCX"],
        sync_mode=_nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
    )
    return _nixl.nixl_agent(name, conf)


def _buffer(nbytes: int, fill: int | None, mem: MemKind) -> Any:
    """A buffer of ``nbytes``, every page touched: random bytes, or ``fill``; as a torch
    ``uint8`` tensor. ``"DRAM"``: host memory allocated as aiokv's pools are
    (:func:`~aiokv._copy.host_empty`: the same pages, huge or not); ``"VRAM"``: on
    ``cuda:0``, filled through a host copy (done when this returns)."""
    import torch

    from .._copy import host_empty

    if mem == "VRAM":
        buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    else:
        buf = host_empty(nbytes, torch.device("cpu"))
    if fill is None:
        buf.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
    else:
        buf.fill_(fill)
    _settle(buf)
    return buf


def _settle(buf: Any) -> None:
    """Wait for the work queued on ``buf``'s device: NIXL knows no CUDA stream."""
    import torch

    if buf.is_cuda:
        torch.cuda.synchronize(buf.device)


def _rows(buf: Any, block: int, blocks: Sequence[int]) -> tuple[Any, Any]:
    """``buf`` as rows of ``block`` bytes, and ``blocks`` as an index on its device."""
    import torch

    n = buf.numel() // block
    return buf[: n * block].view(n, block), torch.tensor(list(blocks), device=buf.device)


def _raw_digest(buf: Any, block: int, blocks: Sequence[int]) -> str:
    """A hash of ``blocks`` of ``buf``, in that order (a device buffer: through a host copy)."""
    rows, index = _rows(buf, block, blocks)
    return hashlib.blake2b(rows[index].cpu().numpy().data).hexdigest()


def _raw_target(conn: Connection, env: dict[str, str | None], nbytes: int, mem: MemKind) -> None:
    """Child: a registered random buffer of kind ``mem``; polls notifications with
    back-off between requests (``add`` a peer's metadata, ``digest``) until ``stop``."""
    apply_env(env)
    agent = _agent(f"raw-target-{os.getpid()}")
    buf = _buffer(nbytes, None, mem)
    agent.register_memory([(buf.data_ptr(), nbytes, 0, "")], mem)
    conn.send((agent.get_agent_metadata(), buf.data_ptr()))
    lo, hi = _poll_bounds()
    delay = lo
    while True:
        if conn.poll(delay):
            name, *args = conn.recv()
            if name == "stop":
                return
            if name == "add":
                conn.send(agent.add_remote_agent(args[0]))
            else:
                conn.send(_raw_digest(buf, *args))
        got = agent.get_new_notifs()
        delay = lo if got else min(delay * 2, hi)


class _Initiator:
    """The raw initiator's state: its agent and buffer, the target's, one row's blocks;
    both buffers of kind ``mem``."""

    def __init__(
        self, env: dict[str, str | None], nbytes: int, target: tuple[bytes, int], mem: MemKind
    ):
        apply_env(env)
        self.agent = _agent(f"raw-initiator-{os.getpid()}")
        self.lo, self.hi = _poll_bounds()
        self.mem = mem
        self.buf = _buffer(nbytes, 0, mem)
        self.base = int(self.buf.data_ptr())
        self.agent.register_memory([(self.base, nbytes, 0, "")], mem)
        self.peer = self.agent.add_remote_agent(target[0])
        self.peer_base = target[1]
        self.local: list[tuple[int, int, int]] = []
        self.remote: list[tuple[int, int, int]] = []
        self.block, self.dsts, self.build_s = 0, list[int](), list[float]()

    def row(self, block: int, srcs: list[int], dsts: list[int]) -> str:
        """The descriptors of a new row; zero ``dsts``, READ once, return their digest."""
        self.block, self.dsts, self.build_s = block, dsts, []
        self.local = [(self.base + d * block, block, 0) for d in dsts]
        self.remote = [(self.peer_base + s * block, block, 0) for s in srcs]
        rows, index = _rows(self.buf, block, dsts)
        rows.index_fill_(0, index, 0)
        _settle(self.buf)
        self.move("READ")
        return _raw_digest(self.buf, block, dsts)

    def move(self, kind: str) -> float:
        """One transfer as aiokv makes it: build, post, poll with back-off, release."""
        a = self.agent
        t0 = time.perf_counter()
        xfer = a.initialize_xfer(
            kind,
            a.get_xfer_descs(self.local, self.mem),
            a.get_xfer_descs(self.remote, self.mem),
            self.peer,
            b"",  # as a leased transfer: no notification
        )
        t1 = time.perf_counter()
        state, delay = a.transfer(xfer), self.lo
        while state == "PROC":
            time.sleep(delay)
            delay = min(delay * 2, self.hi)
            state = a.check_xfer_state(xfer)
        a.release_xfer_handle(xfer)
        t = time.perf_counter() - t0
        if state != "DONE":
            raise RuntimeError(f"raw NIXL {kind} ended {state}")
        self.build_s.append(t1 - t0)
        return t


def _raw_initiator(
    conn: Connection,
    env: dict[str, str | None],
    nbytes: int,
    target: tuple[bytes, int],
    mem: MemKind,
) -> None:
    """Child: answers ``row``, ``READ``, ``WRITE`` (seconds) and ``build_ms`` until ``stop``."""
    me = _Initiator(env, nbytes, target, mem)
    conn.send(me.agent.get_agent_metadata())
    while True:
        name, *args = conn.recv()
        if name == "stop":
            return
        if name == "row":
            conn.send(me.row(*args))
        elif name == "build_ms":
            conn.send(statistics.median(me.build_s) * 1e3)
        else:
            conn.send(me.move(name))


class RawNixl:
    """A raw NIXL target and initiator (two spawned processes with ``env``) over
    ``nbytes`` buffers of kind ``mem`` (``"DRAM"``: host memory; ``"VRAM"``: ``cuda:0``
    on both sides), each having loaded the other's metadata."""

    def __init__(self, env: dict[str, str | None], nbytes: int, mem: MemKind = "DRAM") -> None:
        self.target = Peer(_raw_target, env, nbytes, mem)
        try:
            self.initiator = Peer(_raw_initiator, env, nbytes, self.target.hello, mem)
        except BaseException:
            self.target.stop()
            raise
        self.target.conn.send(("add", self.initiator.hello))
        self.target.conn.recv()

    async def row(self, block: int, srcs: list[int], dsts: list[int]) -> bool:
        """New descriptors; True if a READ into zeroed blocks delivered the right bytes."""
        got = await self.initiator.request("row", block, srcs, dsts)
        want: str = await self.target.request("digest", block, srcs)
        return bool(got == want)

    async def move(self, kind: str) -> Elapsed:
        """One timed ``READ`` or ``WRITE``."""
        return Elapsed(await self.initiator.request(kind))

    async def build_ms(self) -> float:
        """Median time of building one transfer this row (descriptors, ``initialize_xfer``)."""
        got: float = await self.initiator.request("build_ms")
        return got

    def stop(self) -> None:
        self.initiator.stop()
        self.target.stop()


# ---------------------------------------------------------------------- the contenders


@dataclass(slots=True)
class _Side:
    """One UCX setting: an aiokv pair and a raw pair."""

    peer: PromptPeer
    decoder: NixlDecoder
    raw: RawNixl


@dataclass(slots=True)
class NixlContenders:
    """Both UCX settings' contenders; :meth:`row` readies (and checks) one grid row."""

    sides: dict[str, _Side]

    async def row(self, block: int, srcs: list[int], dsts: list[int]) -> None:
        """Fresh caches, new raw descriptors; every pull checked byte for byte.

        Raises:
            AssertionError: a pull delivered wrong bytes or did not move over NIXL.
        """
        for name, side in self.sides.items():
            await side.peer.cache(_desc(block, 2 * len(srcs)))
            got, over_nixl = await side.decoder.setup(block, srcs, dsts)
            if got != await side.peer.digest(srcs) or not over_nixl:
                raise AssertionError(f"aiokv-nixl ({name}) pull delivered wrong bytes")
            if not await side.raw.row(block, srcs, dsts):
                raise AssertionError(f"raw NIXL ({name}) READ delivered wrong bytes")

    def contenders(self) -> dict[str, Callable[[], Any]]:
        """``<setting>_pull``, ``_push``, ``_raw_read``, ``_raw_write``, per setting."""
        out: dict[str, Callable[[], Any]] = {}
        for name, s in self.sides.items():
            out[f"{name}_pull"] = partial(s.decoder.op, "pull")
            out[f"{name}_push"] = partial(s.decoder.op, "push")
            out[f"{name}_raw_read"] = partial(s.raw.move, "READ")
            out[f"{name}_raw_write"] = partial(s.raw.move, "WRITE")
        return out

    async def build_ms(self) -> dict[str, float]:
        """Per setting, the raw side's median transfer-building time this row."""
        return {name: await s.raw.build_ms() for name, s in self.sides.items()}


@contextlib.asynccontextmanager
async def nixl_contenders(pool_bytes: int, raw_bytes: int) -> AsyncIterator[NixlContenders]:
    """Every process of :class:`NixlContenders` (``pool_bytes`` pools for aiokv,
    ``raw_bytes`` buffers for raw NIXL), started at once, stopped afterwards."""
    names = list(SETTINGS)
    async with (
        spawned_all([partial(_nixl_peer, pool_bytes, SETTINGS[n]) for n in names]) as peers,
        spawned_all([partial(RawNixl, SETTINGS[n], raw_bytes) for n in names]) as raws,
        spawned_all(
            [
                partial(NixlDecoder, SETTINGS[n], p.port, pool_bytes)
                for n, p in zip(names, peers, strict=True)
            ]
        ) as decoders,
    ):
        yield NixlContenders(
            {n: _Side(p, d, r) for n, p, d, r in zip(names, peers, decoders, raws, strict=True)}
        )


def _nixl_peer(pool_bytes: int, env: dict[str, str | None]) -> PromptPeer:
    return PromptPeer(pool_bytes, backend="nixl", env=env)
