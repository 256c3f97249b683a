"""``AiokvConnector`` against the installed vLLM's ``KVConnectorBase_V1`` (skipped
without vLLM): every method it overrides keeps the base's signature, and vLLM's
factory loads it by module path."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

from aiokv.integrations.vllm import AiokvConnector


def test_overrides_keep_the_base_signatures() -> None:
    overridden = [
        name
        for name, member in vars(AiokvConnector).items()
        if callable(member) and not name.startswith("_") and hasattr(KVConnectorBase_V1, name)
    ]
    assert {"get_num_new_matched_tokens", "request_finished", "get_transfer_results"} <= set(
        overridden
    )
    for name in overridden:
        ours = inspect.signature(getattr(AiokvConnector, name))
        base = inspect.signature(getattr(KVConnectorBase_V1, name))
        assert list(ours.parameters) == list(base.parameters), name


def test_every_abstract_method_is_implemented() -> None:
    assert not getattr(AiokvConnector, "__abstractmethods__", frozenset())


def test_the_factory_finds_it_by_module_path() -> None:
    import importlib

    module = importlib.import_module("aiokv.integrations.vllm")
    assert module.AiokvConnector is AiokvConnector


def test_a_step_without_model_work_is_marked_idle() -> None:
    """The workers wait for transfers only in steps that ran no model: the scheduler
    side marks exactly those (no tokens scheduled) in the step's metadata."""
    from types import SimpleNamespace

    from aiokv.integrations.vllm._connector import AiokvMetadata
    from aiokv.integrations.vllm._scheduler import SchedulerSide

    sched = SchedulerSide(engine_id="e", block_size=16, tp_size=1, lease_s=60.0, push=False)
    fake: Any = SimpleNamespace(_sched=lambda: sched, _push_requests={})
    for tokens, idle in ((0, True), (7, False)):
        out: Any = SimpleNamespace(num_scheduled_tokens={}, total_num_scheduled_tokens=tokens)
        meta = AiokvConnector.build_connector_meta(fake, out)
        assert isinstance(meta, AiokvMetadata) and meta.idle is idle
