"""The Prometheus exposition stays valid (OpenMetrics, what Prometheus asks for first):
a second Collector in one registry is refused at register, and instances sharing a
cluster id export one set of series (found in review)."""

from __future__ import annotations

from typing import Any

import pytest

# ---- 7. metrics: an exposition with clashing families / duplicate series ----------------


def _openmetrics(registry: Any) -> list[Any]:
    """The registry's scrape as Prometheus asks for it first (OpenMetrics), parsed."""
    from prometheus_client.openmetrics.exposition import generate_latest
    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    return list(text_string_to_metric_families(generate_latest(registry).decode()))


def test_a_collector_per_instance_in_one_registry_is_refused_or_valid() -> None:
    """docs/observability.md: ``prometheus_client.REGISTRY.register(Collector(dd))``.
    Done once per instance, the scrape repeats every family (``# TYPE aiokv_up`` twice):
    the OpenMetrics parser refuses it (``Clashing name: aiokv_up``). Collector.describe
    returns [] so the registry's duplicate check, which would refuse the second
    Collector at register(), never runs."""
    pytest.importorskip("prometheus_client")
    from prometheus_client import CollectorRegistry

    import aiokv.sync as aiokv_sync
    from aiokv.metrics import Collector

    registry = CollectorRegistry()
    registry.register(Collector(aiokv_sync.LLMDataDist(aiokv_sync.LLMRole.PROMPT, 1)))
    second = Collector(aiokv_sync.LLMDataDist(aiokv_sync.LLMRole.DECODER, 2))
    try:
        registry.register(second)
    except ValueError:
        return  # refused at once, with prometheus-client's "Duplicated timeseries": fine
    _openmetrics(registry)


def test_two_watched_instances_with_one_cluster_id_scrape_valid() -> None:
    """A notebook re-run (an old instance finalized, a new one with the same cluster id
    watched too: the Collector keeps the old one) gives every series twice with the
    same labels (``aiokv_up{cluster="1"}`` 0 and 1): duplicate samples, which the
    OpenMetrics parser refuses and Prometheus drops."""
    pytest.importorskip("prometheus_client")
    from prometheus_client import CollectorRegistry

    import aiokv.sync as aiokv_sync
    from aiokv.metrics import Collector

    old = aiokv_sync.LLMDataDist(aiokv_sync.LLMRole.PROMPT, 1)
    new = aiokv_sync.LLMDataDist(aiokv_sync.LLMRole.PROMPT, 1)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(Collector(old, new))
    families = _openmetrics(registry)
    samples = [(s.name, tuple(sorted(s.labels.items()))) for f in families for s in f.samples]
    assert len(samples) == len(set(samples))


def test_describe_names_every_family_collect_yields() -> None:
    """(For the fix) describe() and collect() agree."""
    pytest.importorskip("prometheus_client")
    import aiokv.sync as aiokv_sync
    from aiokv import LLMRole
    from aiokv.metrics import Collector
    from aiokv.testing import make_config

    with aiokv_sync.LLMDataDist(LLMRole.PROMPT, 1, make_config("tcp", host_pool=1 << 20)) as d:
        c = Collector(d)
        described = {f.name for f in c.describe()}
        assert {f.name for f in c.collect()} <= described
