"""The route table both halves of a remote transfer use (``aiokv._remote._route``)."""

from __future__ import annotations

import pytest
import torch

from aiokv._remote._route import Route, route


def never_asked() -> bool:
    raise AssertionError("by_address must not be asked for host memory")


def test_host_memory_moves_as_views_without_asking_the_link() -> None:
    assert route(torch.device("cpu"), never_asked) is Route.HOST_VIEWS


@pytest.mark.parametrize("device", ["cuda:0", "meta"])
def test_accelerator_memory_moves_by_address_where_the_link_reaches_it(device: str) -> None:
    assert route(torch.device(device), lambda: True) is Route.BY_ADDRESS
    assert route(torch.device(device), lambda: False) is Route.STAGED
