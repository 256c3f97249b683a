"""``ConnectorOptions``: the connector's ``kv_connector_extra_config``, checked once.

Every key is optional; with none at all, a producer and a consumer on one host work.
An unknown key or a bad value raises ``ValueError`` naming it when the engine starts
(a typo never silently falls back to a default).
"""

from __future__ import annotations

import hashlib
from typing import Any
from typing import Final
from typing import Literal

from pydantic import BaseModel
from pydantic import ConfigDict
from pydantic import Field
from pydantic import ValidationError

__all__ = ["DEFAULT_KV_PORT", "ConnectorOptions", "derive_cluster_id", "load_deadline"]

#: ``KVTransferConfig.kv_port``'s default: a kv_port left at it does not pick a port.
DEFAULT_KV_PORT: Final = 14579


class ConnectorOptions(BaseModel):
    """The connector's options (keys of ``kv_connector_extra_config``).

    Attributes:
        mode: ``"pull"`` (the decode side pulls the prefill's blocks once the prefill
            finished) or ``"push"`` (the decode side reserves its blocks first and the
            prefill pushes each layer into them as it computes it; peers may then push
            into this instance's KV: set ``link_secret``). Both instances of a pair
            need the same mode; the proxy flows differ (docs/vllm.md).
        transfer_backend: aiokv's transport, ``"tcp"`` or ``"nixl"``.
        host: the address each worker listens on.
        advertise_host: the address the decode side connects to (default ``host``;
            needed when ``host`` is a wildcard such as ``0.0.0.0``).
        port: worker rank ``r`` listens on ``port + r``; 0: a free port each. Default:
            ``kv_port + r`` when ``KVTransferConfig.kv_port`` is not its default
            14579, else 0.
        cluster_id: worker rank ``r`` is aiokv cluster ``cluster_id + r``; default:
            derived from the engine id and the rank (64-bit hash).
        lease_timeout_s: the prefill side frees a finished request's blocks after this
            many seconds if no decode side said it has them (vLLM's
            ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT`` default, 480). Push mode: also how long
            a prefill request waits for its decode side's reservation (then it
            computes without handing anything over) and a decode request for its push.
        transfer_timeout_ms: bound of one pull (aiokv's ``sync_kv_timeout``).
        link_timeout_ms: bound of linking to a prefill worker.
        link_secret: the shared secret that authenticates links (aiokv's
            ``link_secret``); set the same on every instance.
        idle_wait_ms: in a step that runs no model (vLLM then steps again at once),
            how long a worker with transfers in flight waits for one to end before it
            answers vLLM, the GIL released: the transfers' threads then run instead of
            vLLM's empty steps. A load that ends wakes it at once. 0: never wait.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    mode: Literal["pull", "push"] = "pull"
    transfer_backend: Literal["tcp", "nixl"] = "tcp"
    host: str = Field(default="127.0.0.1", min_length=1)
    advertise_host: str | None = Field(default=None, min_length=1)
    port: int | None = Field(default=None, ge=0, le=65535)
    cluster_id: int | None = Field(default=None, ge=0, le=2**64 - 1)
    lease_timeout_s: float = Field(default=480.0, gt=0, lt=1e9, allow_inf_nan=False)
    transfer_timeout_ms: int = Field(default=30_000, ge=1, le=2**31 - 1)
    link_timeout_ms: int = Field(default=5_000, ge=1, le=2**31 - 1)
    link_secret: str | None = Field(default=None, min_length=1)
    idle_wait_ms: float = Field(default=2.0, ge=0, le=1000, allow_inf_nan=False)

    @classmethod
    def parse(cls, extra: dict[str, Any], kv_port: int = DEFAULT_KV_PORT) -> ConnectorOptions:
        """The options in ``extra`` (``kv_connector_extra_config``), with ``kv_port`` as
        the port when ``extra`` names none and it is not the default.

        Raises:
            ValueError: an unknown key, a value of the wrong type or out of range.
        """
        if not isinstance(extra, dict):
            raise ValueError(
                f"kv_connector_extra_config must be a dict, not {type(extra).__name__}"
            )
        values = dict(extra)
        if values.get("port") is None and kv_port != DEFAULT_KV_PORT:
            values["port"] = kv_port
        try:
            options = cls(**values)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(map(str, e['loc'])) or 'value'}: {e['msg']}" for e in exc.errors()
            )
            raise ValueError(f"AiokvConnector kv_connector_extra_config: {problems}") from None
        if options.host in ("0.0.0.0", "::") and options.advertise_host is None:
            raise ValueError(
                f"AiokvConnector: host {options.host!r} listens everywhere; set "
                "advertise_host to the address decode instances reach this one at"
            )
        return options

    def listen_port(self, rank: int) -> int:
        """The port worker rank ``rank`` listens on (0: a free one)."""
        return 0 if not self.port else self.port + rank

    def worker_cluster_id(self, engine_id: str, rank: int) -> int:
        """Worker rank ``rank``'s aiokv cluster id."""
        if self.cluster_id is not None:
            return (self.cluster_id + rank) % 2**64
        return derive_cluster_id(engine_id, rank)

    @property
    def public_host(self) -> str:
        """The host decode instances connect to."""
        return self.advertise_host or self.host


def derive_cluster_id(engine_id: str, rank: int) -> int:
    """A 64-bit cluster id from an engine id and a worker rank (BLAKE2b)."""
    digest = hashlib.blake2b(f"{engine_id}/{rank}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def load_deadline(lease_s: float) -> float:
    """Seconds within which a prefill's blocks may still be read or written by the
    decode side, counted from when that side's side of the lease began: the lease
    ``lease_s`` less a margin (a tenth of it plus a second, at most half of it) for the
    time between the two sides' starts of the lease and between their clocks.

    Pull mode: a decode request's load must begin within it of the request's arrival
    (the prefill frees the blocks ``lease_s`` after its end). Push mode: the prefill
    claims a reservation and ends its writes within it of the reservation's arrival
    (the decode side gives its blocks up ``lease_s`` after it sent the reservation)."""
    return lease_s - min(lease_s / 10 + 1.0, lease_s / 2)
