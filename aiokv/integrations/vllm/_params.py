"""``kv_transfer_params``: what a finished prefill hands the decode side, through the
proxy, verbatim.

The prefill request carries ``{"do_remote_decode": True}``; its output carries the
params :func:`producer_params` makes; the proxy passes those unchanged as the decode
request's ``kv_transfer_params``, which :func:`parse_remote_prefill` checks — they come
from a client, so they are untrusted: anything malformed becomes an error message for
that one request, never an exception in the engine.

Fields (all present in what the prefill returns):

==========================  =====================================================
``do_remote_prefill``       True: the decode side loads this prompt's KV
``do_remote_decode``        False
``remote_engine_id``        the prefill's vLLM engine id
``remote_request_id``       the prefill's request id (what the done notice names)
``remote_block_ids``        the prefill's block ids holding the prompt, in order
``remote_num_tokens``       prompt tokens whose KV those blocks hold
``remote_block_size``       tokens per block on the prefill side
``remote_ranks``            per tensor-parallel rank ``[host, port, cluster_id]``
``remote_token``            a random token the done notice must repeat
``remote_lease_s``          how long the prefill holds the blocks for a decode side
``remote_issued_at``        when the prefill made these params (its wall clock, s)
``aiokv``                   the params' schema version (1)
==========================  =====================================================

Push mode (``mode="push"`` on both instances; see docs/vllm.md) uses three more shapes:

* the proxy asks a prefill instance where it listens with a one-token request carrying
  ``{"aiokv_discover": True}``; its output's params are :func:`endpoint_params`
  (``aiokv``, ``mode``, ``remote_engine_id``, ``remote_block_size``, ``remote_ranks``);
* the prefill request carries ``{"do_remote_decode": True, "transfer_id": T}``;
* the decode request carries those endpoint params plus ``"do_remote_prefill": True``
  and the same ``"transfer_id": T`` (:func:`parse_push_prefill`). ``T`` is the proxy's
  random id of the pair: the decode side reserves its blocks under it, and the prefill
  side pushes into the blocks reserved under its own request's ``T``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from typing import Final
from typing import TypeGuard

__all__ = [
    "MAX_PARAM_BLOCKS",
    "PARAMS_VERSION",
    "Endpoint",
    "PushPrefill",
    "RemotePrefill",
    "check_transfer_id",
    "endpoint_params",
    "issued_at",
    "parse_push_prefill",
    "parse_remote_prefill",
    "producer_params",
]

PARAMS_VERSION: Final = 1
#: Most block ids params may name (a bound on what a client can make us allocate).
MAX_PARAM_BLOCKS: Final = 1 << 20
_MAX_TEXT: Final = 1024
_MAX_RANKS: Final = 1024


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where one prefill worker rank listens, and its aiokv cluster id."""

    host: str
    port: int
    cluster_id: int


@dataclass(frozen=True, slots=True)
class RemotePrefill:
    """Checked params of a decode request whose prompt's KV is on a prefill instance."""

    engine_id: str
    request_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    block_size: int
    ranks: tuple[Endpoint, ...]
    token: str
    lease_s: float


@dataclass(frozen=True, slots=True)
class PushPrefill:
    """Checked push-mode params of a decode request: the prefill instance ``ranks``
    pushes the prompt's KV into the blocks this side reserves under ``transfer_id``."""

    engine_id: str
    transfer_id: str
    ranks: tuple[Endpoint, ...]


def endpoint_params(
    *, engine_id: str, block_size: int, ranks: list[Endpoint], mode: str
) -> dict[str, Any]:
    """What a discovery request (``{"aiokv_discover": True}``) returns: where this
    instance's worker ranks listen (plain JSON values)."""
    return {
        "aiokv": PARAMS_VERSION,
        "mode": mode,
        "remote_engine_id": engine_id,
        "remote_block_size": block_size,
        "remote_ranks": [[r.host, r.port, r.cluster_id] for r in ranks],
    }


def check_transfer_id(value: Any) -> str | None:
    """Why ``value`` is not a transfer id (a non-empty string of at most 1024
    characters), or ``None``."""
    return _text_error("transfer_id", value)


def parse_push_prefill(
    params: dict[str, Any], *, block_size: int, tp_size: int
) -> PushPrefill | str:
    """Push-mode ``params`` of a decode request checked against this instance, or why
    they are unusable (they come from a client: never an exception)."""
    why = _version_error(params)
    if why is None and params.get("mode") != "push":
        why = f"the prefill instance runs mode {params.get('mode')!r}, not 'push'"
    transfer_id: Any = params.get("transfer_id")
    engine_id: Any = params.get("remote_engine_id")
    why = (
        why
        or check_transfer_id(transfer_id)
        or _text_error("remote_engine_id", engine_id)
        or _block_size_error(params, block_size)
    )
    if why is not None:
        return why
    ranks = _ranks(params, tp_size)
    if isinstance(ranks, str):
        return ranks
    return PushPrefill(engine_id, transfer_id, ranks)


def producer_params(
    *,
    engine_id: str,
    request_id: str,
    block_ids: list[int],
    num_tokens: int,
    block_size: int,
    ranks: list[Endpoint],
    token: str,
    lease_s: float,
    issued_at: float,
) -> dict[str, Any]:
    """The params a finished prefill returns (plain JSON values); ``issued_at``: now,
    by the wall clock (``time.time()``)."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_block_ids": list(block_ids),
        "remote_num_tokens": num_tokens,
        "remote_block_size": block_size,
        "remote_ranks": [[r.host, r.port, r.cluster_id] for r in ranks],
        "remote_token": token,
        "remote_lease_s": lease_s,
        "remote_issued_at": issued_at,
        "aiokv": PARAMS_VERSION,
    }


def parse_remote_prefill(
    params: dict[str, Any], *, block_size: int, tp_size: int
) -> RemotePrefill | str:
    """``params`` checked against this decode instance, or why they are unusable.

    Args:
        params: a request's ``kv_transfer_params`` with ``do_remote_prefill`` set.
        block_size: this instance's tokens per block (must equal the prefill's).
        tp_size: this instance's tensor-parallel size (must equal the prefill's).
    """
    engine_id: Any = params.get("remote_engine_id")
    request_id: Any = params.get("remote_request_id")
    token: Any = params.get("remote_token")
    blocks: Any = params.get("remote_block_ids")
    num_tokens: Any = params.get("remote_num_tokens")
    lease_s: Any = params.get("remote_lease_s")
    why = (
        _version_error(params)
        or _text_error("remote_engine_id", engine_id)
        or _text_error("remote_request_id", request_id)
        or _text_error("remote_token", token)
        or _blocks_error(blocks, num_tokens)
        or _block_size_error(params, block_size)
        or _covered_error(blocks, num_tokens, block_size)
        or _lease_error(lease_s)
        or _issued_error(params.get("remote_issued_at"))
    )
    if why is not None:
        return why
    ranks = _ranks(params, tp_size)
    if isinstance(ranks, str):
        return ranks
    return RemotePrefill(
        engine_id, request_id, tuple(blocks), num_tokens, block_size, ranks, token, float(lease_s)
    )


def _version_error(params: dict[str, Any]) -> str | None:
    if params.get("aiokv") != PARAMS_VERSION:
        return (
            f"not AiokvConnector params of version {PARAMS_VERSION} (aiokv={params.get('aiokv')!r})"
        )
    return None


def _text_error(name: str, value: Any) -> str | None:
    """Why ``value`` (the param ``name``) is not a non-empty string of at most 1024
    characters, or ``None``."""
    if not isinstance(value, str) or not 0 < len(value) <= _MAX_TEXT:
        return f"{name} must be a non-empty string of at most {_MAX_TEXT} characters"
    return None


def _blocks_error(blocks: Any, num_tokens: Any) -> str | None:
    if not isinstance(blocks, list) or not 0 < len(blocks) <= MAX_PARAM_BLOCKS:
        return f"remote_block_ids must be a list of 1 to {MAX_PARAM_BLOCKS} block ids"
    if not all(_is_int(b) and 0 <= b < 2**63 for b in blocks):
        return "remote_block_ids must hold block ids (ints >= 0)"
    if not _is_int(num_tokens) or num_tokens <= 0:
        return "remote_num_tokens must be an int > 0"
    return None


def _block_size_error(params: dict[str, Any], block_size: int) -> str | None:
    remote_block_size = params.get("remote_block_size")
    if remote_block_size != block_size or not _is_int(remote_block_size):
        return f"remote_block_size {remote_block_size!r} differs from this instance's {block_size}"
    return None


def _covered_error(blocks: list[int], num_tokens: int, block_size: int) -> str | None:
    """Why ``blocks`` cannot hold ``num_tokens`` tokens, or ``None``."""
    if -(-num_tokens // block_size) > len(blocks):
        return f"{num_tokens} tokens need more than the {len(blocks)} remote_block_ids given"
    return None


def _lease_error(lease_s: Any) -> str | None:
    if not isinstance(lease_s, int | float) or isinstance(lease_s, bool) or not 0 < lease_s < 1e9:
        return "remote_lease_s must be a number of seconds > 0 and < 1e9"
    return None


def issued_at(params: dict[str, Any]) -> float | None:
    """The wall-clock time the prefill made ``params`` (``remote_issued_at``); None when
    absent (params of an earlier aiokv) or not a finite number."""
    value = params.get("remote_issued_at")
    return None if _issued_error(value) is not None or value is None else float(value)


def _issued_error(value: Any) -> str | None:
    """Why ``value`` is not a ``remote_issued_at`` (absent is fine), or ``None``."""
    if value is None:
        return None
    if not isinstance(value, int | float) or isinstance(value, bool) or not 0 <= value < 1e11:
        return "remote_issued_at must be a wall-clock time in seconds (>= 0)"
    return None


def _ranks(params: dict[str, Any], tp_size: int) -> tuple[Endpoint, ...] | str:
    """The prefill's ``remote_ranks``, one a tensor-parallel rank of this instance's
    ``tp_size``, or why not."""
    ranks = _endpoints(params.get("remote_ranks"))
    if isinstance(ranks, str) or len(ranks) == tp_size:
        return ranks
    return (
        f"the prefill has {len(ranks)} tensor-parallel ranks and this instance {tp_size}: "
        "AiokvConnector needs the same tensor-parallel size on both sides"
    )


def _endpoints(value: Any) -> tuple[Endpoint, ...] | str:
    why = "remote_ranks must be a list of [host, port, cluster_id]"
    if not isinstance(value, list) or not 0 < len(value) <= _MAX_RANKS:
        return why
    out = []
    for entry in value:
        if not isinstance(entry, list | tuple) or len(entry) != 3:
            return why
        host, port, cid = entry
        if not isinstance(host, str) or not 0 < len(host) <= 255:
            return why
        if not _is_int(port) or not 0 < port <= 65535:
            return why
        if not _is_int(cid) or not 0 <= cid < 2**64:
            return why
        out.append(Endpoint(host, port, cid))
    return tuple(out)


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)
