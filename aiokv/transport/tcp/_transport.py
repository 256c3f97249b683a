"""TcpTransport: listens, connects, runs handshakes and owns every link and task."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
from collections.abc import Iterator
from typing import Any
from typing import Final

from ..._enums import LLMStatusCode
from ..._errors import LLMException
from ..._errors import warn
from .. import _wire as wire
from .._base import AUTH_FAILED
from .._base import Link
from .._base import LinkCallback
from .._base import PeerInfo
from .._base import RequestHandler
from .._base import Transport
from .._base import check_address
from .._base import check_connect_timeout
from .._tls import TlsContexts
from ._handshake import ACCEPTED
from ._handshake import AuthError
from ._handshake import HandshakeError
from ._handshake import client_handshake
from ._handshake import server_handshake
from ._io import SockIO
from ._link import TcpLink
from ._plane import STREAM
from ._plane import DataPlane
from ._tls_io import TlsRefused
from ._tls_io import TlsSockIO

__all__ = ["TcpTransport"]

_log = logging.getLogger("aiokv.transport.tcp")
_S = LLMStatusCode
_SCRATCH_BYTES: Final = 256 << 10
# What a failed handshake raises (besides TimeoutError).
_HANDSHAKE_ERRORS = (OSError, wire.WireError, wire.MetaError, HandshakeError)


class TcpTransport(Transport):
    """The built-in transport: links over TCP, zero-copy scatter/gather on both ends.

    Args (beyond :class:`Transport`'s):
        chunk_bytes: largest DATA frame this side sends (at most
            :data:`~aiokv.transport._wire.MAX_CHUNK`); smaller chunks interleave
            concurrent transfers more finely.
        sock_buf_bytes: ``SO_SNDBUF`` / ``SO_RCVBUF`` for every socket; ``None`` keeps
            the kernel's auto-tuning.
        max_handshakes: most incoming connections that may be unauthenticated (still
            in the handshake) at once; a new one beyond it closes the oldest.
        max_handshakes_per_host: the same cap per remote address, so one flooding
            host cannot take every slot; a new one beyond it closes that host's oldest.
        tls: run every link over TLS with these contexts (:func:`~aiokv.transport._tls.load_tls`):
            the TLS handshake, within the handshake's time, before aiokv's own.
        max_links: most incoming links (handshake done) at once.
        max_links_per_host: most incoming links from one remote address at once.
        idle_link_timeout: seconds an incoming link may stay *quiet* (no frame from
            the peer since the handshake) before it is closed; ``None``: never. Not
            applied with ``secret`` or ``tls``: such peers proved who they are.

    Pre-authentication work is bounded: an incoming connection costs one socket and
    one small task until it authenticates or ``handshake_timeout`` passes, at most
    ``max_handshakes`` of them exist, and the oldest goes first. So a flood of idle
    connections cannot exhaust descriptors, and a legitimate peer, whose handshake
    takes one round trip, still links while it lasts.

    Links are bounded too: at most ``max_links`` incoming links, ``max_links_per_host``
    from one address. The connecting side sends a PING as soon as it linked, so a link
    in use is never *quiet*; a quiet incoming link (a peer that completed the
    handshake and said nothing since) is closed after ``idle_link_timeout``, and a new
    link beyond a cap closes the oldest quiet link of that address (or overall). When
    none is quiet, the new link is refused inside its handshake (its ``connect`` fails
    with the reason). So a flood of idle handshaked connections holds at most
    ``max_links_per_host`` descriptors per address, for a while, and never keeps a
    legitimate peer out.
    """

    def __init__(
        self,
        local_cluster_id: int,
        handler: RequestHandler,
        *,
        secret: bytes | None = None,
        max_meta_bytes: int = 1 << 20,
        on_link: LinkCallback | None = None,
        on_link_lost: LinkCallback | None = None,
        chunk_bytes: int = wire.MAX_CHUNK,
        handshake_timeout: float = 10.0,
        sock_buf_bytes: int | None = None,
        max_handshakes: int = 256,
        max_handshakes_per_host: int = 64,
        tls: TlsContexts | None = None,
        max_links: int = 512,
        max_links_per_host: int = 64,
        idle_link_timeout: float | None = 30.0,
    ) -> None:
        super().__init__(
            local_cluster_id,
            handler,
            secret=secret,
            max_meta_bytes=max_meta_bytes,
            on_link=on_link,
            on_link_lost=on_link_lost,
            handshake_timeout=handshake_timeout,
        )
        for name, value in (("chunk_bytes", chunk_bytes), ("sock_buf_bytes", sock_buf_bytes)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise TypeError(f"{name} must be int, got {value!r}")  # not a broken link later
        if not 1 <= chunk_bytes <= wire.MAX_CHUNK:
            raise ValueError(f"chunk_bytes={chunk_bytes} is out of range [1, {wire.MAX_CHUNK}]")
        for name, cap in (
            ("max_handshakes", max_handshakes),
            ("max_handshakes_per_host", max_handshakes_per_host),
            ("max_links", max_links),
            ("max_links_per_host", max_links_per_host),
        ):
            if isinstance(cap, bool) or not isinstance(cap, int):
                raise TypeError(f"{name} must be int")
            if cap < 1:
                raise ValueError(f"{name}={cap} must be >= 1")
        self.chunk_bytes = chunk_bytes
        self.sock_buf_bytes = sock_buf_bytes
        self.max_handshakes = max_handshakes
        self.max_handshakes_per_host = max_handshakes_per_host
        if idle_link_timeout is not None and not idle_link_timeout > 0:
            raise ValueError(f"idle_link_timeout={idle_link_timeout} must be > 0 or None")
        self.max_links = max_links
        self.max_links_per_host = max_links_per_host
        self.idle_link_timeout = idle_link_timeout
        self.tls = tls

    def _init_state(self) -> None:
        self._listeners: dict[tuple[str, int], tuple[socket.socket, asyncio.Task[None]]] = {}
        self._handshaking: set[SockIO] = set()
        # incoming connections not yet authenticated, oldest first, with their host
        self._unauthenticated: dict[SockIO, str] = {}
        self._links: dict[TcpLink, None] = {}  # insertion-ordered set
        # incoming connections admitted past authentication, oldest first: their host,
        # and their link once adopted (None while the last handshake frame goes out)
        self._incoming: dict[SockIO, tuple[str, TcpLink | None]] = {}
        self._idle_timers: dict[TcpLink, asyncio.TimerHandle] = {}
        self._scratch = bytearray(_SCRATCH_BYTES)  # sink for data nobody wants

    # ----------------------------------------------------------------------- public API

    async def listen(self, host: str, port: int) -> tuple[str, int]:
        check_address("listen", host, port)
        loop = self._bind_loop("listen")
        try:
            infos = await loop.getaddrinfo(
                host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )
            family, type_, proto, _, addr = infos[0]
            sock = socket.socket(family, type_, proto)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(addr)
                sock.listen(128)
                sock.setblocking(False)
            except BaseException:
                sock.close()
                raise
        except OSError as exc:
            raise LLMException(
                f"listen on {host}:{port}: {exc}", status_code=_S.LLM_LINK_FAILED
            ) from exc
        bound = sock.getsockname()
        address = (str(bound[0]), int(bound[1]))
        self._listeners[address] = (sock, self._spawn(self._accept_loop(sock), "aiokv-tcp-accept"))
        self._warn_if_open(address[0])
        return address

    def _warn_if_open(self, host: str) -> None:
        """Warn (``UserWarning`` and a log record) when listening beyond loopback with
        neither TLS nor a secret: anyone who reaches the port can link."""
        if self.tls is not None or self.secret is not None:
            return
        with contextlib.suppress(ValueError):
            if ipaddress.ip_address(host.split("%", 1)[0]).is_loopback:
                return
        msg = (
            f"aiokv listens on {host} (not loopback) with neither link_secret nor TLS: "
            "anyone who can reach the port can link and read the caches it grants; set "
            "link_secret, or tls_* options where the network is not trusted "
            "(docs/security.md)"
        )
        _log.warning("%s", msg)
        warn(msg, UserWarning)

    async def unlisten(self, address: tuple[str, int]) -> None:
        entry = self._listeners.pop(address, None)
        if entry is None:
            return
        sock, task = entry
        task.cancel()  # the accept task unregisters the socket from the loop as it unwinds
        await asyncio.wait([task])
        sock.close()

    async def connect(self, host: str, port: int, *, timeout: float) -> Link:
        check_address("connect", host, port)
        check_connect_timeout("connect", timeout)
        loop = self._bind_loop("connect")
        where = f"connect to {host}:{port}"
        try:
            async with asyncio.timeout(timeout):
                sock = await self._open(loop, host, port)  # closes the socket if it fails
                io = self._sock_io(loop, sock, server_side=False, host=host)
                with self._handshaking_on(io):
                    address = sock.getpeername()  # before TLS takes the socket over
                    await io.start()
                    peer_id = await client_handshake(io, self.local_cluster_id, self.secret)
        except TimeoutError:
            raise LLMException(
                f"{where}: timed out after {timeout:.3g} s", status_code=_S.LLM_TIMEOUT
            ) from None
        except AuthError as exc:
            raise LLMException(
                f"{where}: {exc}", status_code=_S.LLM_LINK_FAILED, context=AUTH_FAILED
            ) from exc
        except _HANDSHAKE_ERRORS as exc:
            raise LLMException(f"{where}: {exc}", status_code=_S.LLM_LINK_FAILED) from exc
        if self._closed:
            io.close()
            raise LLMException(f"{where}: transport closed", status_code=_S.LLM_LINK_FAILED)
        return self._adopt(
            io, PeerInfo(peer_id, (str(address[0]), int(address[1]))), initiator=True
        )

    def links(self) -> list[Link]:
        return list(self._links)

    async def aclose(self) -> None:
        self._closed = True
        for io in list(self._handshaking):
            io.close()
        self._handshaking.clear()
        self._unauthenticated.clear()
        self._incoming.clear()
        for timer in self._idle_timers.values():
            timer.cancel()
        self._idle_timers.clear()
        for link in list(self._links):
            link._break("transport closed")
        # Accept tasks unregister their listener from the loop as they unwind, so the
        # listeners are closed only after every task has finished.
        await self._end_tasks()
        for sock, _ in self._listeners.values():
            sock.close()
        self._listeners.clear()

    # ------------------------------------------------------------------------ internals

    def _sock_io(
        self, loop: asyncio.AbstractEventLoop, sock: socket.socket, *, server_side: bool, host: str
    ) -> SockIO:
        if self.tls is None:
            return SockIO(loop, sock)
        return TlsSockIO(loop, sock, self.tls, server_side=server_side, host=host)

    def _configure(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.sock_buf_bytes:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.sock_buf_bytes)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.sock_buf_bytes)

    async def _open(self, loop: asyncio.AbstractEventLoop, host: str, port: int) -> socket.socket:
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        error: OSError = OSError(f"no address for {host}:{port}")
        for family, type_, proto, _, addr in infos:
            sock = socket.socket(family, type_, proto)
            try:
                self._configure(sock)
                await loop.sock_connect(sock, addr)
                return sock
            except OSError as exc:
                sock.close()
                error = exc
            except BaseException:
                sock.close()
                raise
        raise error

    @contextlib.contextmanager
    def _handshaking_on(self, io: SockIO) -> Iterator[None]:
        """Track ``io`` while its handshake runs: closed if it fails or is cancelled
        (or by :meth:`aclose`), handed over to the caller if it succeeds."""
        self._handshaking.add(io)
        try:
            yield
        except BaseException:
            io.close()
            raise
        finally:
            self._handshaking.discard(io)

    def _adopt(self, io: SockIO, peer: PeerInfo, *, initiator: bool) -> TcpLink:
        # The accepting side's last handshake frame is the link's first, queued before
        # on_link registers the link: the peer sees it accepted only once it is.
        link = TcpLink(
            self,
            io,
            peer,
            initiator=initiator,
            plane=self._new_plane(),
            first_frame=None if initiator else ACCEPTED,
        )
        self._links[link] = None
        if initiator:
            link._greet()
        else:
            entry = self._incoming.get(io)
            if entry is not None:
                self._incoming[io] = (entry[0], link)
            if self.idle_link_timeout is not None and self.secret is None and self.tls is None:
                self._idle_timers[link] = self._loop_or_raise().call_later(
                    self.idle_link_timeout, self._quiet_check, link
                )
        self._notify(self.on_link, link)
        return link

    def _new_plane(self) -> DataPlane:
        """The data plane of a link being made: here the stream plane (every payload as
        DATA frames); a transport with another medium hands its own (:mod:`._plane`)."""
        return STREAM

    def _link_lost(self, link: TcpLink) -> None:
        self._incoming.pop(link._io, None)
        timer = self._idle_timers.pop(link, None)
        if timer is not None:
            timer.cancel()
        if self._links.pop(link, False) is None:
            self._notify(self.on_link_lost, link)

    def _quiet_check(self, link: TcpLink) -> None:
        self._idle_timers.pop(link, None)
        if not link.heard and not link.broken:
            _log.info(
                "closing the link from %s:%d (cluster %d): nothing sent within %.3g s of linking",
                *link.peer.address,
                link.peer.cluster_id,
                self.idle_link_timeout,
            )
            link._break("quiet since the handshake")

    def _admit(self, io: SockIO, host: str) -> str | None:
        """Make room for one more incoming link from ``host`` (authenticated, its last
        handshake frame not sent yet): ``None`` and counted, or why it is refused.

        Beyond ``max_links_per_host`` (or ``max_links``), the oldest quiet link of that
        host (or overall) is closed; when none is quiet, the new one is refused."""
        same = [i for i, (h, _) in self._incoming.items() if h == host]
        if len(same) >= self.max_links_per_host:
            pool, what = same, f"{self.max_links_per_host} links from {host}"
        elif len(self._incoming) >= self.max_links:
            pool, what = list(self._incoming), f"{self.max_links} incoming links"
        else:
            self._incoming[io] = (host, None)
            return None
        victim = next(
            (
                link
                for link in (self._incoming[i][1] for i in pool)
                if link is not None and not link.heard and not link.broken
            ),
            None,
        )
        if victim is None:
            _log.warning("refused a link from %s: %s are in use", host, what)
            return f"too many links: {what} are in use"
        _log.info("%s: closing the oldest quiet one, from %s:%d", what, *victim.peer.address)
        victim._break("quiet, replaced by a new link")  # drops it from _incoming
        self._incoming[io] = (host, None)
        return None

    async def _accept_loop(self, lsock: socket.socket) -> None:
        loop = self._loop_or_raise()
        while True:
            try:
                sock, addr = await loop.sock_accept(lsock)
            except OSError as exc:
                # EMFILE and friends: back off instead of spinning; the listener stays.
                _log.warning("accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            try:
                self._configure(sock)
            except OSError:
                sock.close()
                continue
            io = self._sock_io(loop, sock, server_side=True, host=str(addr[0]))
            self._make_room(str(addr[0]))
            self._unauthenticated[io] = str(addr[0])
            self._handshaking.add(io)  # from now on: aclose closes it, even before the task runs
            self._spawn(self._accept_one(io, addr), "aiokv-tcp-handshake")

    def _make_room(self, host: str) -> None:
        """Close the oldest unauthenticated connection if one more from ``host`` would
        exceed ``max_handshakes_per_host`` or ``max_handshakes``."""
        pending = self._unauthenticated
        same = [io for io, h in pending.items() if h == host]
        if len(same) >= self.max_handshakes_per_host:
            victim = same[0]
        elif len(pending) >= self.max_handshakes:
            victim = next(iter(pending))
        else:
            return
        _log.debug("too many unauthenticated connections: closing the oldest from %s", host)
        del pending[victim]
        victim.close()  # its handshake task wakes, fails and ends

    async def _accept_one(self, io: SockIO, addr: Any) -> None:
        host = str(addr[0])
        try:
            with self._handshaking_on(io):
                async with asyncio.timeout(self.handshake_timeout):
                    await io.start()  # TLS, when set, within the same time
                    peer_id = await server_handshake(
                        io, self.local_cluster_id, self.secret, lambda _: self._admit(io, host)
                    )
        except (AuthError, TlsRefused) as exc:  # authentication failed: the peer's, or ours
            _log.warning("refused a link from %s: %s", addr, exc)
            self._incoming.pop(io, None)
            return
        except (TimeoutError, *_HANDSHAKE_ERRORS) as exc:
            _log.info("handshake with %s failed: %s", addr, exc)
            self._incoming.pop(io, None)
            return
        except BaseException:
            self._incoming.pop(io, None)
            raise
        finally:
            self._unauthenticated.pop(io, None)
        if self._closed:
            self._incoming.pop(io, None)
            io.close()
            return
        self._adopt(io, PeerInfo(peer_id, (host, int(addr[1]))), initiator=False)
