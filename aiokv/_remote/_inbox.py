"""``Inbox``: the notifications one ``LLMDataDist`` received, bounded, in arrival order.

A notification is a small message (at most :data:`MAX_NOTIFICATION_BYTES`) that a peer
sends over an existing link (:class:`~._protocol.NotifyReq`, a write of 0 bytes). The
peer service files it with :meth:`Inbox.put` on the engine thread; the application
takes it with :meth:`Inbox.drain` or :meth:`Inbox.pop` (any thread, never blocks),
after :meth:`Inbox.wait` (on the engine loop) when it waits for one. At most
:data:`NOTIFICATION_QUEUE` notifications wait at once: one more is *refused* — the
sender's ``send_notification`` fails with ``LLM_LINK_BUSY``, nothing is dropped silently
— and counted.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from typing import Final

from .._stats import NotificationStats

__all__ = ["MAX_NOTIFICATION_BYTES", "NOTIFICATION_QUEUE", "Inbox"]

#: Most bytes of one notification's payload.
MAX_NOTIFICATION_BYTES: Final = 64 << 10
#: Most notifications received and not yet taken, per ``LLMDataDist`` (so at most
#: 64 MiB of payload waits).
NOTIFICATION_QUEUE: Final = 1024


class Inbox:
    """Received notifications, oldest first, at most ``capacity`` waiting.

    Counters are totals over the inbox's life; :meth:`close` drops what waits (at
    ``finalize``) and :meth:`open` takes notifications again (at ``init``).
    """

    def __init__(self, capacity: int = NOTIFICATION_QUEUE) -> None:
        self._capacity = capacity
        self._lock = threading.Lock()
        self._queue: deque[tuple[int, bytes]] = deque()
        self._open = False
        self._wake: asyncio.Event | None = None  # of the engine loop, made by the first next()
        self._sent = self._received = self._refused = 0

    def open(self) -> None:
        """Take notifications from now on (waiters then run on the new engine loop)."""
        with self._lock:
            self._open = True
            self._wake = None

    def close(self) -> None:
        """Drop what waits, refuse what comes, and end every :meth:`wait` (on the engine
        loop, where :meth:`wait` runs)."""
        with self._lock:
            self._open = False
            self._queue.clear()
        if self._wake is not None:
            self._wake.set()

    def put(self, cluster_id: int, payload: bytes) -> bool:
        """File a notification from ``cluster_id``; False (and counted) when the queue is
        full or the inbox is closed. On the engine loop."""
        with self._lock:
            if not self._open or len(self._queue) >= self._capacity:
                self._refused += 1
                return False
            self._queue.append((cluster_id, payload))
            self._received += 1
        if self._wake is not None:
            self._wake.set()
        return True

    def sent(self) -> None:
        """Count one notification this side sent and the peer accepted."""
        with self._lock:
            self._sent += 1

    def drain(self) -> list[tuple[int, bytes]]:
        """Take every waiting notification, oldest first (``[]`` when none). Any thread."""
        with self._lock:
            out = list(self._queue)
            self._queue.clear()
        return out

    def pop(self) -> tuple[int, bytes] | None:
        """Take the oldest waiting notification; None when none waits. Any thread."""
        with self._lock:
            return self._queue.popleft() if self._queue else None

    async def wait(self) -> bool:
        """Until a notification waits (True) or the inbox is closed (False). On the
        engine loop (one event, woken by :meth:`put` and :meth:`close`). Takes nothing:
        a waiter cancelled at any point loses no notification."""
        if self._wake is None:
            self._wake = asyncio.Event()
        while True:
            with self._lock:
                if self._queue:
                    return True
                if not self._open:
                    return False
                self._wake.clear()
            await self._wake.wait()

    def statistics(self) -> NotificationStats:
        """A snapshot of the counters and the queue length."""
        with self._lock:
            return NotificationStats(self._sent, self._received, self._refused, len(self._queue))
