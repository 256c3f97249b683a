"""Statistics: cheap counters on the paths that already exist, read as typed snapshots.

A counter (:class:`OpCounter`, :class:`ServedCounter`) is updated once per operation —
never per byte — under a lock of its own, from whichever thread runs the operation;
``snapshot()`` returns a frozen dataclass (:class:`OpStats`, :class:`ServedStats`).
Counters only grow (except ``in_flight``): they are process-lifetime totals, as a
Prometheus scrape expects. Failures are keyed by the ``LLMStatusCode`` name of the
error, ``"CANCELLED"`` for a cancelled operation, ``"LLM_FAILED"`` for any other
exception.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field
from types import MappingProxyType
from typing import TYPE_CHECKING
from typing import Final

from ._enums import LLMStatusCode
from ._errors import code_of_failure

if TYPE_CHECKING:
    from ._pool import PoolStats
    from ._registry import RegistryStats

__all__ = [
    "LATENCY_BOUNDS",
    "OTHER_PEERS",
    "RECENT_PEERS",
    "CopyStats",
    "DataDistStats",
    "Histogram",
    "LinkStats",
    "NotificationStats",
    "OpCounter",
    "OpStats",
    "PeerCounters",
    "ServedCounter",
    "ServedStats",
    "code_name",
    "failure_name",
]

#: Upper bounds (seconds) of the latency histogram buckets; one more bucket counts
#: everything slower than the last bound.
LATENCY_BOUNDS: Final = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)


def failure_name(exc: BaseException) -> str:
    """The key an exception is counted under in ``failures``."""
    if isinstance(exc, asyncio.CancelledError):
        return "CANCELLED"
    return code_name(code_of_failure(exc))  # the code its caller sees (map_errors')


def code_name(code: LLMStatusCode | int) -> str:
    """The key a failure with ``code`` is counted under: its name; a code llm_datadist
    does not name (an ``LLMException`` made with a bare int keeps it) as
    ``LLM_FAILED``, so that the keys (and metric labels) stay the enum's names."""
    return code.name if isinstance(code, LLMStatusCode) else LLMStatusCode.LLM_FAILED.name


@dataclass(frozen=True, slots=True)
class Histogram:
    """Latencies of finished operations, in seconds.

    Attributes:
        bounds: the buckets' upper bounds (:data:`LATENCY_BOUNDS`).
        counts: operations per bucket, ``len(bounds) + 1`` of them (not cumulative):
            ``counts[i]`` took at most ``bounds[i]`` and more than ``bounds[i - 1]``;
            the last counts those slower than every bound.
        count: operations measured (the sum of ``counts``).
        sum: their total time.
    """

    bounds: tuple[float, ...] = LATENCY_BOUNDS
    counts: tuple[int, ...] = (0,) * (len(LATENCY_BOUNDS) + 1)
    count: int = 0
    sum: float = 0.0


@dataclass(frozen=True, slots=True)
class OpStats:
    """Operations of one kind (transfers to a peer, copy jobs, ...).

    Attributes:
        ops: finished operations, successful or not.
        bytes: payload bytes of the successful ones.
        failures: failed operations by error (see the module docstring).
        in_flight: operations started and not finished now.
        latency: how long the finished ones took, start to end.
    """

    ops: int = 0
    bytes: int = 0
    failures: Mapping[str, int] = field(default_factory=dict)
    in_flight: int = 0
    latency: Histogram = field(default_factory=Histogram)


class OpCounter:
    """Counts operations: ``with counter.measure(nbytes):`` around each one (any thread).

    The cost is two lock round trips, a clock read and a bisect per operation.
    """

    __slots__ = ("_buckets", "_bytes", "_failures", "_in_flight", "_lock", "_ops", "_sum")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ops = 0
        self._bytes = 0
        self._failures: dict[str, int] = {}
        self._in_flight = 0
        self._buckets = [0] * (len(LATENCY_BOUNDS) + 1)
        self._sum = 0.0

    def measure(self, nbytes: int) -> _Measure:
        """A context manager counting one operation of ``nbytes`` payload bytes: in
        flight while inside, then finished (failed if it raises, by its error)."""
        return _Measure(self, nbytes)

    def start(self, nbytes: int) -> _Measure:
        """An operation of ``nbytes`` payload bytes started now, in flight until its
        :meth:`_Measure.end` (one that does not end in the block it starts in)."""
        m = _Measure(self, nbytes)
        m.__enter__()
        return m

    def _start(self) -> None:
        with self._lock:
            self._in_flight += 1

    def _void(self) -> None:
        """An operation started and did not happen (it goes on elsewhere): no longer in
        flight, and counted nowhere else."""
        with self._lock:
            self._in_flight -= 1

    def _end(self, nbytes: int, seconds: float, failure: str | None) -> None:
        i = bisect.bisect_left(LATENCY_BOUNDS, seconds)
        with self._lock:
            self._in_flight -= 1
            self._ops += 1
            self._buckets[i] += 1
            self._sum += seconds
            if failure is None:
                self._bytes += nbytes
            else:
                self._failures[failure] = self._failures.get(failure, 0) + 1

    def absorb(self, other: OpCounter) -> None:
        """Add ``other``'s finished operations to this counter (``other`` is idle)."""
        with other._lock:
            ops, nbytes, failures = other._ops, other._bytes, dict(other._failures)
            buckets, total = list(other._buckets), other._sum
        with self._lock:
            self._ops += ops
            self._bytes += nbytes
            for name, n in failures.items():
                self._failures[name] = self._failures.get(name, 0) + n
            self._buckets = [a + b for a, b in zip(self._buckets, buckets, strict=True)]
            self._sum += total

    def snapshot(self) -> OpStats:
        """A consistent copy of the counts."""
        with self._lock:
            return OpStats(
                ops=self._ops,
                bytes=self._bytes,
                failures=MappingProxyType(dict(self._failures)),
                in_flight=self._in_flight,
                latency=Histogram(LATENCY_BOUNDS, tuple(self._buckets), self._ops, self._sum),
            )


class _Measure:
    __slots__ = ("_counter", "_ended", "_nbytes", "_t0", "_void")

    def __init__(self, counter: OpCounter, nbytes: int) -> None:
        self._counter = counter
        self._nbytes = nbytes
        self._t0 = 0.0
        self._void = False
        self._ended = False

    def __enter__(self) -> _Measure:
        self._counter._start()
        self._t0 = time.perf_counter()
        return self

    def void(self) -> None:
        """Inside the block: the operation did not happen here (nothing moved; it is
        done another way, and counted there). Leaving the block then counts nothing."""
        self._void = True

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if self._void and exc is None:
            self._counter._void()
            return
        self.end(None if exc is None else failure_name(exc))

    def end(self, failure: str | None) -> None:
        """End the operation (entered, not left as a ``with`` block: one that ends
        elsewhere): succeeded (``None``) or failed, counted under ``failure``. Only the
        first call counts."""
        if self._ended:
            return
        self._ended = True
        self._counter._end(self._nbytes, time.perf_counter() - self._t0, failure)


@dataclass(frozen=True, slots=True)
class ServedStats:
    """Requests a peer made of this side (pulls from it, pushes into it).

    Attributes:
        granted: requests granted.
        bytes: payload bytes of the grants whose transfer completed.
        completed: grants whose transfer completed.
        refused: requests refused, by the ``LLMStatusCode`` name sent back.
        in_flight: grants not over yet (memory pinned for a peer).
    """

    granted: int = 0
    bytes: int = 0
    completed: int = 0
    refused: Mapping[str, int] = field(default_factory=dict)
    in_flight: int = 0


class ServedCounter:
    """Counts what this side serves to one peer (``PeerService``, any thread)."""

    __slots__ = ("_bytes", "_completed", "_granted", "_in_flight", "_lock", "_refused")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._granted = 0
        self._bytes = 0
        self._completed = 0
        self._refused: dict[str, int] = {}
        self._in_flight = 0

    def refused(self, code: LLMStatusCode) -> None:
        """One request refused with ``code``."""
        name = code_name(code)
        with self._lock:
            self._refused[name] = self._refused.get(name, 0) + 1

    def granted(self) -> None:
        """One request granted; :meth:`over` follows when its transfer ends."""
        with self._lock:
            self._granted += 1
            self._in_flight += 1

    def over(self, nbytes: int, ok: bool) -> None:
        """A grant ended; ``ok``: its ``nbytes`` moved."""
        with self._lock:
            self._in_flight -= 1
            if ok:
                self._completed += 1
                self._bytes += nbytes

    def absorb(self, other: ServedCounter) -> None:
        """Add ``other``'s counts to this counter (``other`` has nothing in flight)."""
        with other._lock:
            granted, nbytes, done, refused = (
                other._granted,
                other._bytes,
                other._completed,
                dict(other._refused),
            )
        with self._lock:
            self._granted += granted
            self._bytes += nbytes
            self._completed += done
            for name, n in refused.items():
                self._refused[name] = self._refused.get(name, 0) + n

    def snapshot(self) -> ServedStats:
        """A consistent copy of the counts."""
        with self._lock:
            return ServedStats(
                granted=self._granted,
                bytes=self._bytes,
                completed=self._completed,
                refused=MappingProxyType(dict(self._refused)),
                in_flight=self._in_flight,
            )


#: Peers without a live link whose counters ``statistics()`` keeps apart: the most
#: recently active ones. Older ones are folded into one entry (:data:`OTHER_PEERS`), so
#: the per-peer entries and metric series stay bounded however many cluster ids come
#: and go, while every total stays exact.
RECENT_PEERS: Final = 64
#: The key (and ``cluster_id``) of the entry that aggregates the folded peers: not a
#: uint64, so never a real cluster id. Prometheus labels it ``peer="other"``.
OTHER_PEERS: Final = -1


class _Peer:
    __slots__ = ("requests", "served")

    def __init__(self) -> None:
        self.requests = OpCounter()
        self.served = ServedCounter()

    def busy(self) -> bool:
        return bool(self.requests._in_flight or self.served._in_flight)


class PeerCounters:
    """The per-peer counters of one ``LLMDataDist``, kept across ``init`` cycles: its
    requests to each cluster, what it served each cluster, links up and down.

    Bounded: counters are kept per peer for the peers linked now, those with an
    operation in flight, and the :data:`RECENT_PEERS` most recently active others; a
    less recent idle one is folded into the :data:`OTHER_PEERS` entry (its counts added
    there; a peer that comes back starts a fresh entry). Lookups, links up/down and
    folding happen on the engine thread, and an operation is counted in flight before
    that thread runs anything else, so a counter is never folded while in use;
    :meth:`snapshot` may run on any thread (one lock).
    """

    __slots__ = (
        "_folded",
        "_linked",
        "_lock",
        "_other",
        "_peers",
        "_recent",
        "links_down",
        "links_up",
    )

    def __init__(self, recent: int = RECENT_PEERS) -> None:
        self._lock = threading.Lock()
        self._recent = recent
        self._peers: collections.OrderedDict[int, _Peer] = collections.OrderedDict()
        self._linked: set[int] = set()  # peers with a filed link (told by the link table)
        self._other = _Peer()
        self._folded = 0
        self.links_up = 0  # changed on the engine thread only
        self.links_down = 0

    def requests(self, cluster_id: int) -> OpCounter:
        """The counter of this side's requests (pulls, pushes) to ``cluster_id``."""
        return self._peer(cluster_id).requests

    def served(self, cluster_id: int) -> ServedCounter:
        """The counter of what this side serves to ``cluster_id``."""
        return self._peer(cluster_id).served

    def up(self, cluster_id: int) -> None:
        """A link to ``cluster_id`` was filed."""
        with self._lock:
            self.links_up += 1
            self._linked.add(cluster_id)

    def down(self, cluster_id: int) -> None:
        """The link filed for ``cluster_id`` is gone."""
        with self._lock:
            self.links_down += 1
            self._linked.discard(cluster_id)
            if cluster_id in self._peers:
                self._peers.move_to_end(cluster_id)
            self._fold()

    def _peer(self, cluster_id: int) -> _Peer:
        with self._lock:
            peer = self._peers.get(cluster_id)
            if peer is None:
                peer = self._peers[cluster_id] = _Peer()
                self._fold()
            else:
                self._peers.move_to_end(cluster_id)
            return peer

    def _fold(self) -> None:
        """Fold the idle unlinked peers beyond the ``_recent`` most recently active."""
        idle = 0
        victims = []
        for cid in reversed(self._peers):
            if cid not in self._linked and not self._peers[cid].busy():
                idle += 1
                if idle > self._recent:
                    victims.append(cid)
        for cid in victims:
            peer = self._peers.pop(cid)
            self._other.requests.absorb(peer.requests)
            self._other.served.absorb(peer.served)
            self._folded += 1

    def snapshot(self, linked: list[int]) -> dict[int, LinkStats]:
        """Per peer kept (or linked now), its :class:`LinkStats`; the folded ones under
        :data:`OTHER_PEERS`."""
        up = set(linked)
        with self._lock:
            kept = dict(self._peers)
            out = {
                cid: LinkStats(
                    cluster_id=cid,
                    linked=cid in up,
                    requests=kept[cid].requests.snapshot() if cid in kept else OpStats(),
                    served=kept[cid].served.snapshot() if cid in kept else ServedStats(),
                )
                for cid in sorted({*kept, *up})
            }
            if self._folded:
                out[OTHER_PEERS] = LinkStats(
                    OTHER_PEERS,
                    False,
                    self._other.requests.snapshot(),
                    self._other.served.snapshot(),
                )
        return out


@dataclass(frozen=True, slots=True)
class LinkStats:
    """One peer cluster, as this side sees it.

    Attributes:
        cluster_id: the peer.
        linked: whether a live link to it is filed now.
        requests: this side's pulls from and pushes to it (``bytes``: payload moved).
        served: its pulls from and pushes into this side.
    """

    cluster_id: int
    linked: bool
    requests: OpStats
    served: ServedStats


@dataclass(frozen=True, slots=True)
class CopyStats:
    """The local copy engine (``CopyScheduler``).

    Attributes:
        jobs: copy jobs run on the worker threads (``bytes``: bytes copied).
        inline: small host copies done on the caller's thread, without a job.
        queue_depth: jobs waiting for a worker thread now.
        threads: worker threads started.
    """

    jobs: OpStats
    inline: OpStats
    queue_depth: int
    threads: int


@dataclass(frozen=True, slots=True)
class NotificationStats:
    """Notifications of one ``LLMDataDist`` (``DataDistStats.notifications``).

    Attributes:
        sent: notifications this side sent that the peer accepted.
        received: notifications peers sent that this side accepted.
        refused: notifications refused because the queue was full (``LLM_LINK_BUSY``
            on the sender).
        queued: received and not yet taken (now).
    """

    sent: int = 0
    received: int = 0
    refused: int = 0
    queued: int = 0


@dataclass(frozen=True, slots=True)
class DataDistStats:
    """A snapshot of one ``LLMDataDist`` (``LLMDataDist.statistics()``).

    Counters are totals since the instance was created (they survive ``finalize`` and
    a new ``init``); gauges (``in_flight``, ``queue_depth``, pools, registry) are now.

    Attributes:
        cluster_id: this participant.
        initialized: whether it is initialized (else the gauges below are ``None``/0).
        links_up: links filed since creation (incoming and outgoing).
        links_down: filed links lost since creation.
        links: per peer cluster seen: :class:`LinkStats`.
        copies: the copy engine: :class:`CopyStats`.
        device_pool: the device pool's usage, ``None`` without one.
        host_pool: the host pool's usage, ``None`` without one.
        caches: the registry's bookkeeping, ``None`` when not initialized.
        notifications: notifications sent, received, refused and queued:
            :class:`NotificationStats`.
    """

    cluster_id: int
    initialized: bool
    links_up: int
    links_down: int
    links: Mapping[int, LinkStats]
    copies: CopyStats
    device_pool: PoolStats | None
    host_pool: PoolStats | None
    caches: RegistryStats | None
    notifications: NotificationStats = NotificationStats()
