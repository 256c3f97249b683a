"""``StepPlan``: what the scheduler side tells every worker for one engine step.

Plain frozen values (picklable, no vLLM types): the loads to start (decode side),
the prefill requests whose blocks are to be released without a load (a decode request
aborted before it was scheduled), and the finished prefill requests whose blocks the
workers now hold for a decode side (prefill side). Push mode adds the blocks a decode
request reserves for its prefill to push into (:class:`Reserve`, decode side), the
requests whose KV the workers push layer by layer as this step computes it
(:class:`Push`, prefill side), reservations the prefill will not fill
(:class:`Cancel`, prefill side) and reservations of aborted decode requests
(:class:`Withdraw`, decode side).
"""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field

from ._params import Endpoint

__all__ = ["Cancel", "Hold", "Load", "Push", "Release", "Reserve", "StepPlan", "Withdraw"]


@dataclass(frozen=True, slots=True)
class Load:
    """Pull ``remote_blocks`` of the prefill into ``local_blocks`` (same length), then
    tell the prefill it may free them; or, with ``error``, report the request failed
    at once (its params were unusable) without touching the network."""

    request_id: str
    local_blocks: tuple[int, ...]
    remote_blocks: tuple[int, ...]
    remote_request_id: str
    token: str
    ranks: tuple[Endpoint, ...]
    error: str | None = None
    #: seconds (from when it was planned) within which the pull must end: the
    #: prefill's lease less a margin; ``None``: unbounded by a lease
    within_s: float | None = None


@dataclass(frozen=True, slots=True)
class Release:
    """Tell the prefill it may free ``remote_request_id``'s blocks (nothing to load)."""

    remote_request_id: str
    token: str
    ranks: tuple[Endpoint, ...]


@dataclass(frozen=True, slots=True)
class Hold:
    """A finished prefill request whose blocks wait for a decode side: until its done
    notice with ``token`` arrives, or ``lease_s`` seconds pass. With ``pushed``: until
    the workers' push of its KV (a :class:`Push` of an earlier or the same step) ended."""

    request_id: str
    token: str
    lease_s: float
    pushed: bool = False


@dataclass(frozen=True, slots=True)
class Reserve:
    """Push mode, decode side: ask the prefill (``ranks``) to push the blocks of the
    prompt's tokens from its block ``first_block`` on into ``local_blocks``, under
    ``transfer_id``; the load ends when the prefill says its push ended."""

    request_id: str
    transfer_id: str
    local_blocks: tuple[int, ...]
    first_block: int
    num_tokens: int
    ranks: tuple[Endpoint, ...]


@dataclass(frozen=True, slots=True)
class Push:
    """Push mode, prefill side: this step computes the rest of ``request_id``'s prompt
    (``num_tokens`` tokens in ``blocks``); push each layer into the blocks reserved
    under ``transfer_id`` as soon as it is computed."""

    request_id: str
    transfer_id: str
    blocks: tuple[int, ...]
    num_tokens: int


@dataclass(frozen=True, slots=True)
class Cancel:
    """Push mode, prefill side: nothing will be pushed under ``transfer_id`` (the
    prefill request was aborted or gave up waiting); tell the decode side why."""

    transfer_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class Withdraw:
    """Push mode, decode side: ``request_id`` ended (aborted) while it may still wait for
    the push under ``transfer_id``: withdraw the reservation. Its load still ends only
    when the prefill answers (a push in flight keeps writing into its blocks until then)."""

    request_id: str
    transfer_id: str


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One step's work for the workers."""

    loads: tuple[Load, ...] = ()
    releases: tuple[Release, ...] = ()
    holds: tuple[Hold, ...] = field(default=())
    reserves: tuple[Reserve, ...] = ()
    pushes: tuple[Push, ...] = ()
    cancels: tuple[Cancel, ...] = ()
    withdrawals: tuple[Withdraw, ...] = ()
