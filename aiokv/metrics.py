"""Prometheus exporter (optional): ``pip install 'aiokv[metrics]'`` (prometheus-client).

:class:`Collector` reads ``statistics()`` of the ``LLMDataDist`` instances it watches at
each scrape — nothing is counted twice and nothing runs between scrapes;
:func:`start_metrics_server` serves it over HTTP (``/metrics``) from a thread of its
own. Every series carries ``cluster`` (the watched instance's cluster id); per-peer
series also ``peer``. The series (``docs/api.md``, "Observability"):

=====================================  =========  ======================================
series                                 type       labels
=====================================  =========  ======================================
``aiokv_up``                           gauge      cluster (1 while initialized)
``aiokv_links_up_total``               counter    cluster
``aiokv_links_down_total``             counter    cluster
``aiokv_link_up``                      gauge      cluster, peer
``aiokv_transfer_ops_total``           counter    cluster, peer
``aiokv_transfer_bytes_total``         counter    cluster, peer
``aiokv_transfer_failures_total``      counter    cluster, peer, code
``aiokv_transfer_in_flight``           gauge      cluster, peer
``aiokv_transfer_latency_seconds``     histogram  cluster, peer
``aiokv_served_grants_total``          counter    cluster, peer
``aiokv_served_bytes_total``           counter    cluster, peer
``aiokv_served_refusals_total``        counter    cluster, peer, code
``aiokv_served_in_flight``             gauge      cluster, peer
``aiokv_copy_jobs_total``              counter    cluster
``aiokv_copy_bytes_total``             counter    cluster
``aiokv_copy_failures_total``          counter    cluster, code
``aiokv_copy_in_flight``               gauge      cluster
``aiokv_copy_queue_depth``             gauge      cluster
``aiokv_copy_latency_seconds``         histogram  cluster
``aiokv_copy_inline_total``            counter    cluster
``aiokv_copy_inline_bytes_total``      counter    cluster
``aiokv_copy_inline_failures_total``   counter    cluster, code
``aiokv_pool_bytes``                   gauge      cluster, pool, state
``aiokv_pool_allocations``             gauge      cluster, pool
``aiokv_pool_failed_allocations_total`` counter   cluster, pool
``aiokv_caches``                       gauge      cluster
``aiokv_cache_keys``                   gauge      cluster
``aiokv_cache_pins``                   gauge      cluster
``aiokv_cache_leases``                 gauge      cluster
``aiokv_cache_quarantined_bytes``      gauge      cluster
=====================================  =========  ======================================

``peer`` is a cluster id, or ``other`` for the peers folded together (the per-peer
series cover the peers linked now, those with an operation in flight and the 64 most
recently active others; ``docs/api.md``, ``statistics()``). ``pool`` is ``device`` or
``host``; ``state`` is ``total``, ``used``, ``free``,
``largest_free`` or ``peak_used``; ``code`` an ``LLMStatusCode`` name (or ``CANCELLED``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from collections.abc import Mapping
from typing import TYPE_CHECKING
from typing import Any
from typing import Protocol

from ._stats import OTHER_PEERS
from ._stats import DataDistStats
from ._stats import Histogram
from ._stats import OpStats

if TYPE_CHECKING:
    from ._pool import PoolStats

__all__ = ["Collector", "HasStatistics", "MetricsServer", "start_metrics_server"]

_HINT = "the Prometheus exporter needs prometheus-client: pip install 'aiokv[metrics]'"


#: every series :class:`Collector` exports: (type, name)
SERIES: tuple[tuple[str, str], ...] = (
    ("gauge", "aiokv_up"),
    ("counter", "aiokv_links_up_total"),
    ("counter", "aiokv_links_down_total"),
    ("counter", "aiokv_notifications_total"),
    ("gauge", "aiokv_notifications_queued"),
    ("gauge", "aiokv_link_up"),
    ("counter", "aiokv_transfer_ops_total"),
    ("counter", "aiokv_transfer_bytes_total"),
    ("counter", "aiokv_transfer_failures_total"),
    ("gauge", "aiokv_transfer_in_flight"),
    ("histogram", "aiokv_transfer_latency_seconds"),
    ("counter", "aiokv_served_grants_total"),
    ("counter", "aiokv_served_bytes_total"),
    ("counter", "aiokv_served_refusals_total"),
    ("gauge", "aiokv_served_in_flight"),
    ("counter", "aiokv_copy_jobs_total"),
    ("counter", "aiokv_copy_bytes_total"),
    ("counter", "aiokv_copy_failures_total"),
    ("gauge", "aiokv_copy_in_flight"),
    ("gauge", "aiokv_copy_queue_depth"),
    ("histogram", "aiokv_copy_latency_seconds"),
    ("counter", "aiokv_copy_inline_total"),
    ("counter", "aiokv_copy_inline_bytes_total"),
    ("counter", "aiokv_copy_inline_failures_total"),
    ("gauge", "aiokv_pool_bytes"),
    ("gauge", "aiokv_pool_allocations"),
    ("counter", "aiokv_pool_failed_allocations_total"),
    ("gauge", "aiokv_caches"),
    ("gauge", "aiokv_cache_keys"),
    ("gauge", "aiokv_cache_pins"),
    ("gauge", "aiokv_cache_leases"),
    ("gauge", "aiokv_cache_quarantined_bytes"),
)


class HasStatistics(Protocol):
    """What a :class:`Collector` watches: an ``LLMDataDist`` (async or ``aiokv.sync``)."""

    def statistics(self) -> DataDistStats:
        """A snapshot of the instance."""
        ...


def _prom() -> Any:
    try:
        from prometheus_client import metrics_core
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(_HINT) from exc
    return metrics_core


class Collector:
    """A Prometheus collector over ``statistics()`` of the watched instances.

    Register it with a ``prometheus_client.CollectorRegistry`` (``registry.register(
    Collector(dd))``) or let :func:`start_metrics_server` do it. :meth:`watch` /
    :meth:`unwatch` change the set from any thread.

    Raises:
        ImportError: prometheus-client is not installed (the message says how).
    """

    def __init__(self, *instances: HasStatistics) -> None:
        _prom()
        self._lock = threading.Lock()
        self._instances: list[HasStatistics] = list(instances)

    def watch(self, instance: HasStatistics) -> None:
        """Export ``instance`` too."""
        with self._lock:
            if all(i is not instance for i in self._instances):
                self._instances.append(instance)

    def unwatch(self, instance: HasStatistics) -> None:
        """Stop exporting ``instance`` (no-op if not watched)."""
        with self._lock:
            self._instances = [i for i in self._instances if i is not instance]

    def describe(self) -> list[Any]:
        """Every family :meth:`collect` may yield (empty): a registry refuses a second
        collector of these names at ``register`` (two of them would repeat every family
        in one scrape, which OpenMetrics refuses)."""
        m = _prom()
        kinds = {
            "counter": m.CounterMetricFamily,
            "gauge": m.GaugeMetricFamily,
            "histogram": m.HistogramMetricFamily,
        }
        return [kinds[kind](name, "") for kind, name in SERIES]

    def collect(self) -> Iterator[Any]:
        """The metric families, read now from every watched instance; of instances with
        one cluster id (an old one finalized, a new one watched too) only one is
        exported, the initialized one (else the last watched): the same labels twice
        would be duplicate samples."""
        with self._lock:
            snaps = [i.statistics() for i in self._instances]
        by_cluster: dict[int, DataDistStats] = {}
        for snap in snaps:
            kept = by_cluster.get(snap.cluster_id)
            if kept is None or snap.initialized or not kept.initialized:
                by_cluster[snap.cluster_id] = snap
        yield from _Families(_prom(), list(by_cluster.values())).build()


class _Families:
    """Builds the families of one scrape from snapshots."""

    def __init__(self, m: Any, snaps: list[DataDistStats]) -> None:
        self.m = m
        self.snaps = snaps
        self.fams: dict[str, Any] = {}

    def _fam(self, kind: str, name: str, doc: str, labels: list[str]) -> Any:
        fam = self.fams.get(name)
        if fam is None:
            cls = {
                "counter": self.m.CounterMetricFamily,
                "gauge": self.m.GaugeMetricFamily,
                "histogram": self.m.HistogramMetricFamily,
            }[kind]
            fam = self.fams[name] = cls(name, doc, labels=labels)
        return fam

    def counter(self, name: str, doc: str, labels: dict[str, str], value: float) -> None:
        self._fam("counter", name, doc, list(labels)).add_metric(list(labels.values()), value)

    def gauge(self, name: str, doc: str, labels: dict[str, str], value: float) -> None:
        self._fam("gauge", name, doc, list(labels)).add_metric(list(labels.values()), value)

    def by_code(
        self, name: str, doc: str, labels: dict[str, str], counts: Mapping[str, int]
    ) -> None:
        """One counter series per status code in ``counts`` (label ``code``)."""
        for code, n in sorted(counts.items()):
            self.counter(name, doc, {**labels, "code": code}, n)

    def histogram(self, name: str, doc: str, labels: dict[str, str], h: Histogram) -> None:
        buckets, running = [], 0
        for bound, n in zip(h.bounds, h.counts, strict=False):
            running += n
            buckets.append((repr(float(bound)), running))
        buckets.append(("+Inf", h.count))
        fam = self._fam("histogram", name, doc, list(labels))
        fam.add_metric(list(labels.values()), buckets, h.sum)

    def ops(self, prefix: str, what: str, labels: dict[str, str], s: OpStats) -> None:
        self.counter(f"{prefix}_ops_total", f"{what}: finished", labels, s.ops)
        self.counter(f"{prefix}_bytes_total", f"{what}: payload bytes moved", labels, s.bytes)
        self.by_code(f"{prefix}_failures_total", f"{what}: failed, by code", labels, s.failures)
        self.gauge(f"{prefix}_in_flight", f"{what}: running now", labels, s.in_flight)
        self.histogram(f"{prefix}_latency_seconds", f"{what}: duration", labels, s.latency)

    def pool(self, c: dict[str, str], name: str, p: PoolStats | None) -> None:
        if p is None:
            return
        labels = {**c, "pool": name}
        for state in ("total", "used", "free", "largest_free", "peak_used"):
            value = getattr(p, state)
            self.gauge("aiokv_pool_bytes", "memory pool bytes", {**labels, "state": state}, value)
        self.gauge("aiokv_pool_allocations", "live allocations", labels, p.allocations)
        self.counter(
            "aiokv_pool_failed_allocations_total",
            "allocations refused (out of memory)",
            labels,
            p.failed_allocations,
        )

    def build(self) -> list[Any]:
        for s in self.snaps:
            c = {"cluster": str(s.cluster_id)}
            self.gauge("aiokv_up", "1 while the LLMDataDist is initialized", c, s.initialized)
            self.counter("aiokv_links_up_total", "links filed", c, s.links_up)
            self.counter("aiokv_links_down_total", "filed links lost or closed", c, s.links_down)
            notes = s.notifications
            for state, value in (
                ("sent", notes.sent),
                ("received", notes.received),
                ("refused", notes.refused),
            ):
                self.counter(
                    "aiokv_notifications_total",
                    "notifications sent, received, refused (receive queue full)",
                    {**c, "state": state},
                    value,
                )
            self.gauge("aiokv_notifications_queued", "notifications not yet taken", c, notes.queued)
            for cid, link in s.links.items():
                p = {**c, "peer": "other" if cid == OTHER_PEERS else str(cid)}
                self.gauge("aiokv_link_up", "1 while a link to the peer is filed", p, link.linked)
                self.ops("aiokv_transfer", "this side's pulls and pushes", p, link.requests)
                sv = link.served
                self.counter("aiokv_served_grants_total", "peer requests granted", p, sv.granted)
                self.counter("aiokv_served_bytes_total", "bytes served to the peer", p, sv.bytes)
                self.by_code(
                    "aiokv_served_refusals_total", "peer requests refused, by code", p, sv.refused
                )
                self.gauge("aiokv_served_in_flight", "grants not over", p, sv.in_flight)
            jobs = s.copies.jobs
            self.counter("aiokv_copy_jobs_total", "copy jobs finished", c, jobs.ops)
            self.counter("aiokv_copy_bytes_total", "bytes copied by jobs", c, jobs.bytes)
            self.by_code("aiokv_copy_failures_total", "copy jobs failed", c, jobs.failures)
            self.gauge("aiokv_copy_in_flight", "copy jobs running or queued", c, jobs.in_flight)
            self.gauge("aiokv_copy_queue_depth", "copy jobs waiting", c, s.copies.queue_depth)
            self.histogram("aiokv_copy_latency_seconds", "copy job duration", c, jobs.latency)
            inline = s.copies.inline
            self.counter("aiokv_copy_inline_total", "inline host copies", c, inline.ops)
            self.counter("aiokv_copy_inline_bytes_total", "inline bytes copied", c, inline.bytes)
            self.by_code(
                "aiokv_copy_inline_failures_total", "inline host copies failed", c, inline.failures
            )
            self.pool(c, "device", s.device_pool)
            self.pool(c, "host", s.host_pool)
            if s.caches is not None:
                self.gauge("aiokv_caches", "caches holding memory", c, s.caches.caches)
                self.gauge("aiokv_cache_keys", "bound cache keys", c, s.caches.keys)
                self.gauge("aiokv_cache_pins", "operations pinning caches", c, s.caches.pins)
                self.gauge("aiokv_cache_leases", "caches lent to peers", c, s.caches.leases)
                self.gauge(
                    "aiokv_cache_quarantined_bytes",
                    "pool memory kept from reuse: a transfer on it could not be stopped",
                    c,
                    s.caches.quarantined_bytes,
                )
        return list(self.fams.values())


class MetricsServer:
    """A running ``/metrics`` endpoint (from :func:`start_metrics_server`).

    Attributes:
        address: the bound ``(host, port)``.
        collector: the :class:`Collector` it serves (``watch`` more instances on it).
    """

    def __init__(self, server: Any, thread: threading.Thread, collector: Collector) -> None:
        self._server = server
        self._thread = thread
        self.collector = collector
        host, port = server.server_address[:2]
        self.address: tuple[str, int] = (str(host), int(port))

    def close(self) -> None:
        """Stop serving and join the server thread. Idempotent."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_metrics_server(
    *instances: HasStatistics, host: str = "127.0.0.1", port: int = 0
) -> MetricsServer:
    """Serve the metrics of ``instances`` at ``http://host:port/metrics`` (a thread).

    Binds loopback by default: exposing the endpoint is a deliberate choice (``host=
    "0.0.0.0"``). ``port=0`` picks a free port (see ``MetricsServer.address``). Uses a
    registry of its own (not prometheus-client's global one).

    Raises:
        ImportError: prometheus-client is not installed.
        OSError: the address cannot be bound.
    """
    _prom()
    from prometheus_client import CollectorRegistry
    from prometheus_client import start_http_server

    collector = Collector(*instances)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    server, thread = start_http_server(port, addr=host, registry=registry)
    return MetricsServer(server, thread, collector)
