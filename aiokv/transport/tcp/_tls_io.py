"""TLS on one non-blocking socket: a :class:`SockIO` whose ``sock`` speaks TLS.

A link calls ``sendmsg``, ``send``, ``recv_into`` and ``recvmsg_into`` on ``io.sock`` and
waits for descriptor readiness through ``io``. A non-blocking ``ssl.SSLSocket`` has no
``sendmsg`` / ``recvmsg_into``, so :class:`TlsSock` offers those four calls over one:
``sendmsg`` encrypts up to :data:`_GATHER` bytes gathered from the buffers per call and
returns how many it took; the ``recv`` calls return decrypted bytes; "would block" is
``BlockingIOError``, as on a plain socket, so the link's loops run unchanged.

Each ``ssl`` write takes one TLS record at most (:data:`_RECORD`), so that "how many
bytes taken" is exact: OpenSSL without partial writes (as Python sets it up) hands a long
write's first records to the kernel, then reports "would block" for the whole write, and
the peer could read, and confirm, bytes this side counts unsent. A partly written record
is unreadable to the peer until its retry completes it.

Two rules keep it from stalling. A send that would block is retried by the link with
the same bytes (its unsent batch), which is what OpenSSL requires of a retried write.
And :meth:`TlsSockIO.readable` never waits while decrypted bytes sit inside the SSL
object (``pending()``), and never sets a receive low-water mark: the kernel holds
ciphertext, part of a record may already be inside OpenSSL, so "``n`` more bytes" of
plaintext says nothing exact about the kernel's queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket
import ssl
from collections.abc import Iterable
from typing import TYPE_CHECKING
from typing import Any
from typing import Final

from ..._enums import LLMStatusCode
from .. import _wire as wire
from .._tls import TlsContexts
from ._io import SockIO

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer
    from _typeshed import WriteableBuffer

__all__ = ["TlsError", "TlsRefused", "TlsSock", "TlsSockIO"]

# Most bytes one sendmsg encrypts and hands to the kernel (16 TLS records).
_GATHER: Final = 256 << 10
# A first buffer at least this long is encrypted in place rather than gathered (copied).
_DIRECT: Final = 64 << 10
# Most plaintext one ssl write takes: one TLS record (see the module docstring).
_RECORD: Final = 16 << 10
_PLAIN_REFUSAL: Final = wire.encode_frame(
    wire.FrameType.ERROR,
    status=LLMStatusCode.LLM_LINK_FAILED,
    meta=wire.encode_meta({"reason": "this listener requires TLS"}, wire.HANDSHAKE_META_CAP),
)


class TlsError(ConnectionError):
    """TLS failed: the handshake, a certificate, or a record; the connection is unusable."""


class TlsRefused(TlsError):
    """The TLS handshake refused: a certificate one side did not accept, or no protocol
    both speak (the peer got as far as speaking TLS: a misconfiguration, not a scan)."""


def _failed(exc: BaseException, hint: str = "") -> TlsError:
    return TlsError(f"TLS failed: {exc}{hint}")


class TlsSock:
    """The socket calls of a link over a non-blocking ``ssl.SSLSocket``."""

    __slots__ = ("_buf", "_ssl")

    def __init__(self, tls: ssl.SSLSocket) -> None:
        self._ssl = tls
        # made at the first gathering send, never before the link is up: an incoming
        # connection wraps its socket before it authenticated (docs/security.md: it
        # cannot make this side allocate more than a capped handshake)
        self._buf: bytearray | None = None

    def fileno(self) -> int:
        return self._ssl.fileno()

    def pending(self) -> int:
        """Decrypted bytes buffered inside the SSL object (0 once closed)."""
        return self._ssl.pending()

    def handshake(self) -> None:
        """One step of the TLS handshake; ``ssl.SSLWantReadError`` / ``WantWriteError``
        until it is done."""
        self._ssl.do_handshake()

    def send(self, data: ReadableBuffer, /) -> int:
        """Encrypt and send the first whole records of ``data``; returns how many bytes
        the peer can now read, or raises ``BlockingIOError`` having made none readable
        (then the next call must start with the same bytes)."""
        view = memoryview(data).cast("B")
        sent, n = 0, view.nbytes
        while sent < n:
            try:
                sent += self._ssl.send(view[sent : sent + _RECORD])
            except ssl.SSLWantWriteError:
                if sent:
                    return sent  # the record that would block is retried first
                raise BlockingIOError from None
            except ssl.SSLError as exc:  # WantRead included: no renegotiation in TLS 1.3
                raise _failed(exc) from None
        return sent

    def sendmsg(self, buffers: Iterable[ReadableBuffer], /) -> int:
        """Send the first up to :data:`_GATHER` bytes of ``buffers`` (as :meth:`send`);
        returns how many.

        Which bytes depends only on the buffers' lengths, so a retry after
        ``BlockingIOError`` (or after a short count) with the same buffers from where it
        stopped passes OpenSSL the same bytes.
        """
        it = iter(buffers)
        first = memoryview(next(it, b""))
        if first.nbytes >= _DIRECT:
            return self.send(first[:_GATHER])
        buf, pos = self._buf, 0
        if buf is None:
            buf = self._buf = bytearray(_GATHER)
        for b in itertools.chain((first,), it):
            v = memoryview(b)
            take = min(v.nbytes, _GATHER - pos)
            buf[pos : pos + take] = v[:take]
            pos += take
            if pos == _GATHER:
                break
        return self.send(memoryview(buf)[:pos])

    def recv_into(self, buffer: WriteableBuffer, nbytes: int = 0, /) -> int:
        """Decrypted bytes into ``buffer`` (at most ``nbytes`` when given); 0 at EOF."""
        try:
            return self._ssl.recv_into(buffer, nbytes or None)
        except ssl.SSLWantReadError:
            raise BlockingIOError from None
        except ssl.SSLZeroReturnError:
            return 0
        except ssl.SSLError as exc:  # WantWrite included: no renegotiation in TLS 1.3
            raise _failed(exc) from None

    def recvmsg_into(
        self, buffers: Iterable[WriteableBuffer], /
    ) -> tuple[int, list[Any], int, Any]:
        """Fill ``buffers`` in order with what can be decrypted now; ``(bytes, [], 0, None)``."""
        total = 0
        for b in buffers:
            view = memoryview(b)
            pos, n = 0, view.nbytes
            while pos < n:
                try:
                    k = self.recv_into(view[pos:])
                except BlockingIOError:
                    if total:
                        return total, [], 0, None
                    raise
                if not k:
                    return total, [], 0, None
                pos += k
                total += k
        return total, [], 0, None

    def getsockopt(self, level: int, optname: int, /) -> int:
        return self._ssl.getsockopt(level, optname)

    def setsockopt(self, level: int, optname: int, value: int, /) -> None:
        self._ssl.setsockopt(level, optname, value)

    def close(self) -> None:
        self._ssl.close()  # no close_notify: it could block; the peer reads EOF


class TlsSockIO(SockIO):
    """A :class:`SockIO` that runs a TLS handshake in :meth:`start`, then speaks TLS.

    The listening side first peeks at the connection's first bytes: a plain aiokv
    ``HELLO`` is answered with a plain ``ERROR`` frame ("this listener requires TLS"),
    so a participant without TLS learns why it was refused.
    """

    __slots__ = ("_contexts", "_host", "_raw", "_server_side", "_tls")

    SHORT_READ_EMPTIES = False  # OpenSSL returns one record per read

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: socket.socket,
        contexts: TlsContexts,
        *,
        server_side: bool,
        host: str,
    ) -> None:
        super().__init__(loop, sock)
        self._raw = sock
        self._contexts = contexts
        self._server_side = server_side
        self._host = host
        self._tls: TlsSock | None = None

    async def start(self) -> None:
        """Run the TLS handshake (both certificates checked).

        Raises:
            TlsError: the handshake failed; the message says why.
            ConnectionResetError: the peer or :meth:`close` closed the connection.
        """
        if self._server_side:
            await self._refuse_plain()
        try:
            tls = TlsSock(
                self._contexts.wrap(self._raw, server_side=self._server_side, host=self._host)
            )
        except (OSError, ValueError) as exc:
            raise _failed(exc) from None
        self.sock = self._tls = tls
        while True:
            if self.closed:
                raise ConnectionResetError("socket closed")
            try:
                tls.handshake()
                return
            except ssl.SSLWantReadError:
                await self.readable()
            except ssl.SSLWantWriteError:
                await self.writable()
            except (ssl.SSLEOFError, ssl.SSLZeroReturnError, ConnectionError) as exc:
                raise _failed(
                    exc,
                    " (the peer closed the connection during the TLS handshake: does "
                    "it use TLS, with a certificate from the same CA?)",
                ) from None
            except OSError as exc:  # ssl.SSLError: a certificate refused, a bad record
                raise TlsRefused(f"TLS failed: {exc}") from None

    async def _refuse_plain(self) -> None:
        while True:
            await super().readable()
            try:
                head = self._raw.recv(len(wire.MAGIC), socket.MSG_PEEK)
            except (BlockingIOError, InterruptedError):
                continue
            if not head:
                raise ConnectionResetError("connection closed by peer")
            if wire.MAGIC.startswith(head):
                with contextlib.suppress(OSError):
                    self._raw.send(_PLAIN_REFUSAL)
                raise TlsError("TLS failed: the peer connected without TLS")
            return

    async def readable(self, want: int = 1) -> None:
        """Return at once while decrypted bytes are buffered; otherwise wait for the
        descriptor to be readable (``want`` is ignored: see the module docstring)."""
        tls = self._tls
        if tls is not None and tls.pending():
            return
        await super().readable()
