"""How a remote transfer's bytes move: one table for both halves (the requester in
:mod:`._client`, the serving side in :mod:`._service`).

==============  ================  =========================  ========================
memory here     link by address?  the peer's grant           route
==============  ================  =========================  ========================
host            (not asked)       (any)                      :attr:`Route.HOST_VIEWS`
an accelerator  yes               by address, or none yet    :attr:`Route.BY_ADDRESS`
an accelerator  yes               not reachable by address   :attr:`Route.STAGED`
an accelerator  no                (any)                      :attr:`Route.STAGED`
==============  ================  =========================  ========================

"By address" is the link's ``BY_ADDRESS`` capability on the requester's side, the
transport's ``direct`` check of the granted memory on the serving side: :func:`route`
decides from the first two columns, before a transfer is cut into parts. The third is
the requester's alone, and :func:`part_route` decides it for each part as it starts:
a grant of memory the link cannot reach by address (a peer whose memory NIXL could not
register, say) comes back as a refusal that moved nothing, and from then on the
transfer's parts move staged — the refused one and every later one, those on their
first try. On top of the table, the requester moves blocks of a blocks cache under a
lease (:mod:`._leases`) when the route is not :attr:`Route.STAGED` and the link is
one-sided.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

import torch

from .._copy import is_staged

__all__ = ["Route", "part_route", "route"]


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


def part_route(way: Route, *, unreachable_grant: bool) -> Route:
    """The route of one part of a requester's transfer that :func:`route` routed
    ``way``: ``way`` itself, but :attr:`Route.STAGED` for a transfer routed
    :attr:`Route.BY_ADDRESS` once the peer granted a part of it memory the link cannot
    reach by address (``unreachable_grant``: the transport's ``DIRECT_REFUSED``, that
    part moved nothing)."""
    if way is Route.BY_ADDRESS and unreachable_grant:
        return Route.STAGED
    return way
