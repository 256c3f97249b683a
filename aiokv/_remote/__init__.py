"""Remote transfers over links: the protocol, the link table, both halves of a transfer.

* :mod:`._protocol` — what a request carries (the single definition, with its caps).
* :mod:`._links` — the live links of one ``LLMDataDist``.
* :mod:`._linker` — opening and closing them: ``link_clusters``, two-sided ``link``.
* :mod:`._ranktable` — the arguments of a two-sided ``link``.
* :mod:`._route` — how a transfer's bytes move (host views, by address, staged; a part
  also by the peer's grant), for both halves.
* :mod:`._client` — the local half of pulls and pushes.
* :mod:`._service` — the serving half: answers peers against the registry.
* :mod:`._leases` — a blocks cache's memory lent by address over one-sided links.
* :mod:`._inbox` — notifications received from peers, bounded.
"""

from ._client import Move
from ._client import RemoteClient
from ._inbox import MAX_NOTIFICATION_BYTES
from ._inbox import NOTIFICATION_QUEUE
from ._inbox import Inbox
from ._leases import Leases
from ._linker import Linker
from ._links import LinkTable
from ._parts import Part
from ._parts import Transfer
from ._ranktable import Party
from ._ranktable import parse_link
from ._service import PeerService

__all__ = [
    "MAX_NOTIFICATION_BYTES",
    "NOTIFICATION_QUEUE",
    "Inbox",
    "Leases",
    "LinkTable",
    "Linker",
    "Move",
    "Part",
    "Party",
    "PeerService",
    "RemoteClient",
    "Transfer",
    "parse_link",
]
