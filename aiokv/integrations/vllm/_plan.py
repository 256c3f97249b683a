"""``StepPlan``: what the scheduler side tells every worker for one engine step.

Plain frozen values (picklable, no vLLM types): the loads to start (decode side),
the prefill requests whose blocks are to be released without a load (a decode request
aborted before it was scheduled), and the finished prefill requests whose blocks the
workers now hold for a decode side (prefill side).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ._params import Endpoint

__all__ = ["Hold", "Load", "Release", "StepPlan"]


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


@dataclass(frozen=True, slots=True)
class Release:
    """Tell the prefill it may free ``remote_request_id``'s blocks (nothing to load)."""

    remote_request_id: str
    token: str
    ranks: tuple[Endpoint, ...]


@dataclass(frozen=True, slots=True)
class Hold:
    """A finished prefill request whose blocks wait for a decode side: until its done
    notice with ``token`` arrives, or ``lease_s`` seconds pass."""

    request_id: str
    token: str
    lease_s: float


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One step's work for the workers."""

    loads: tuple[Load, ...] = ()
    releases: tuple[Release, ...] = ()
    holds: tuple[Hold, ...] = field(default=())
