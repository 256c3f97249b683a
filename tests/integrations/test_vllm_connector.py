"""``AiokvConnector`` against the installed vLLM's ``KVConnectorBase_V1`` (skipped
without vLLM): every method it overrides keeps the base's signature, and vLLM's
factory loads it by module path."""

from __future__ import annotations

import inspect

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
