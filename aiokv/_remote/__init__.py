"""Remote transfers over links: the protocol, the link table, both halves of a transfer.

* :mod:`._protocol` — what a request carries (the single definition, with its caps).
* :mod:`._links` — the live links of one ``LLMDataDist``.
* :mod:`._client` — the local half of pulls and pushes.
* :mod:`._service` — the serving half: answers peers against the registry.
"""

from ._client import RemoteClient
from ._links import LinkTable
from ._service import PeerService

__all__ = ["LinkTable", "PeerService", "RemoteClient"]
