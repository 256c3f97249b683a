"""How a remote transfer's bytes move: one table for both halves (the requester in
:mod:`._client`, the serving side in :mod:`._service`).

=======================  ===================================  ======================
memory of the transfer   the link moves it by address?         route
=======================  ===================================  ======================
host                     (not asked)                          :attr:`Route.HOST_VIEWS`
an accelerator           yes                                  :attr:`Route.BY_ADDRESS`
an accelerator           no                                   :attr:`Route.STAGED`
=======================  ===================================  ======================

"By address" is the link's ``BY_ADDRESS`` capability on the requester's side, the
transport's ``direct`` check of the granted memory on the serving side. On top of the
table, the requester moves blocks of a blocks cache under a lease (:mod:`._leases`)
when the route is not :attr:`Route.STAGED` and the link is one-sided; and a transfer
routed :attr:`Route.BY_ADDRESS` whose peer answers from memory the link cannot reach
(its grant says so) moves that part :attr:`Route.STAGED`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

import torch

from .._copy import is_staged

__all__ = ["Route", "route"]


class Route(enum.Enum):
    """How one side's memory of a transfer meets the link."""

    HOST_VIEWS = "host views"
    """Host memory: the link reads or writes it in place, as buffers."""
    BY_ADDRESS = "device by address"
    """Accelerator memory the link moves by address, once queued work is done."""
    STAGED = "staged parts"
    """Accelerator memory copied through host staging buffers, in pipelined parts."""


def route(device: torch.device, by_address: Callable[[], bool]) -> Route:
    """The route of memory on ``device``; ``by_address()`` (asked only for accelerator
    memory) says whether the link reaches all of it by address."""
    if not is_staged(device):
        return Route.HOST_VIEWS
    if device.type != "cpu" and by_address():
        return Route.BY_ADDRESS
    return Route.STAGED
