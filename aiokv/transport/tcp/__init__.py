"""TCP transport: non-blocking sockets driven straight from the running event loop.

Design, in short:

* Each link owns one connected non-blocking socket, one **reader task** and one
  **writer task**, both spawned and tracked by the :class:`TcpTransport`.
* Syscalls are tried first; only on ``EAGAIN`` (or, reading, after a read that left
  the socket empty) does a task wait, on a future woken by ``loop.add_reader`` /
  ``loop.add_writer`` (no polling). This works on asyncio and uvloop alike and avoids
  the copies and overhead of asyncio streams.
* The link's writer is the only one that sends. Everyone else hands it owned control
  frames (:meth:`TcpLink._post`, synchronous, never blocks) or *streams* of payload
  views. It sends with ``sendmsg`` scatter/gather straight from the source memory,
  building each batch from all pending control frames plus one chunk of each active
  stream in turn, so a huge transfer cannot starve small ones and frames never
  interleave. A batch posted while the writer task is parked is sent at once, in the
  posting call (one per loop iteration); what it leaves unsent is the writer task's.
* The reader reads ahead up to 16 KiB at a time, so the headers and meta of the
  frames that arrived together cost one ``recv_into``; it receives the rest of each
  ``DATA`` chunk (what was not read ahead, which it copies) with ``recvmsg_into``
  straight into the destination views of the request it belongs to, reading ahead
  behind the chunk in the same call; data of unknown, finished or cancelled requests
  is dropped. Mid-chunk it asks to be woken only once the rest of the chunk is there
  (``SO_RCVLOWAT``), not per segment.
* Because only the reader and the writer touch the socket, and a send at once is
  synchronous, a caller being cancelled can never cut a frame in half. Its clean-up is
  synchronous: it unregisters the request (the reader stops writing into its buffers
  at once), withdraws its stream from the writer
  (copying the unsent tail of a half-sent chunk so its memory is no longer read) and
  posts ``CANCEL`` so the peer lets go too.
* Readers never await sends, so two peers can never deadlock on full socket buffers.
* What a frame means is decided without I/O: the reader hands each control frame to the
  link's ``LinkProtocol`` (``_protocol.py``: request state, one handler per frame type,
  reply backpressure), which asks the link to post frames, withdraw streams, serve a
  request (in the reader when the handler answers at once, else in a handler task) or
  break (see docs/design.md).
"""

from __future__ import annotations

from ._transport import TcpTransport

__all__ = ["TcpTransport"]
