"""The arguments of a two-sided ``link``: who takes part, with which rank, reached where.

``cluster_rank_info`` maps each party's cluster id to its rank (2 to 4 parties, ranks in
ascending order, as llm_datadist checks). ``rank_table`` is the HCCL rank-table JSON
clients already build; aiokv reads only ``server_list[].device[]`` entries, and of
each: ``rank_id`` (which rank it describes), ``device_ip`` and ``device_port`` (where
that party's ``listen_ip_info`` listener is reached). Everything else is ignored. An
entry without ``device_port`` takes the ``AIOKV_DEVICE_PORT`` environment variable: one
port for every party, as HCCL reaches every device on one port (vLLM-Ascend's
connectors build tables without ports).

Who connects to whom: every party opens one link to each party of lower rank, so a
party is reached only by higher ranks — the highest rank needs no listener and its
entry no address. A party that must be reached reads its own entry's address too: it
listens there if it has no listener yet (llm_datadist's samples set no
``listen_ip_info`` for a two-sided link: HCCL reaches a party by its ``device_ip``).
"""

from __future__ import annotations

import ipaddress
import itertools
import os
from dataclasses import dataclass
from typing import Any

from .._checks import check_instance
from .._checks import check_int
from .._checks import param_invalid
from .._checks import parse_json

__all__ = ["LinkPlan", "Party", "parse_link"]

_MAX_NAME = 128
_MAX_PARTIES = 4
#: the environment variable naming the port of rank-table entries without ``device_port``
DEVICE_PORT_ENV = "AIOKV_DEVICE_PORT"


@dataclass(frozen=True, slots=True)
class Party:
    """Another party of a communicator.

    Attributes:
        cluster_id: its cluster id.
        rank: its rank.
        address: ``(host, port)`` this side connects to; None when it connects to us.
    """

    cluster_id: int
    rank: int
    address: tuple[str, int] | None


@dataclass(frozen=True, slots=True)
class LinkPlan:
    """What ``link`` must do.

    Attributes:
        parties: the other parties, by rank.
        own_address: ``(host, port)`` of this party's own rank-table entry when higher
            ranks will connect to it and the entry has both ``device_ip`` and
            ``device_port``; else None.
    """

    parties: list[Party]
    own_address: tuple[str, int] | None


def parse_link(
    op: str, comm_name: Any, cluster_rank_info: Any, rank_table: Any, own_cluster_id: int
) -> LinkPlan:
    """Check the arguments of ``link`` and return the other parties, by rank.

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: a cluster id outside uint64, a rank outside uint32.
        LLMException: ``LLM_PARAM_INVALID`` for everything else: an empty or long name,
            fewer than 2 or more than 4 parties, ranks not ascending, this side not a
            party, a rank table that is not JSON, lacks a party's rank or the address of
            a party this side must connect to.
    """
    check_instance(op, "comm_name", comm_name, str)
    if not 0 < len(comm_name) < _MAX_NAME:
        param_invalid(op, f"comm_name must have 1 to {_MAX_NAME - 1} characters")
    check_instance(op, "cluster_rank_info", cluster_rank_info, dict)
    ranks: dict[int, int] = {}
    for cid, rank in cluster_rank_info.items():
        check_int(op, "cluster_rank_info key", cid, 0, 2**64 - 1)
        ranks[cid] = check_int(op, "cluster_rank_info value", rank, 0, 2**32 - 1)
    if not 1 < len(ranks) <= _MAX_PARTIES:
        param_invalid(op, f"cluster_rank_info must name 2 to {_MAX_PARTIES} clusters")
    order = list(ranks.values())
    if any(a >= b for a, b in itertools.pairwise(order)):
        param_invalid(op, "the ranks in cluster_rank_info must be ascending and distinct")
    if own_cluster_id not in ranks:
        param_invalid(op, f"this cluster ({own_cluster_id}) is not in cluster_rank_info")
    devices = _devices(op, rank_table)
    own_rank = ranks[own_cluster_id]
    parties = []
    for cid, rank in ranks.items():
        if cid == own_cluster_id:
            continue
        device = devices.get(rank)
        if device is None:
            param_invalid(op, f"rank_table has no device with rank_id {rank}")
        address = _address(op, rank, device) if rank < own_rank else None
        parties.append(Party(cid, rank, address))
    own = devices.get(own_rank)
    reached = any(p.address is None for p in parties)
    own_address = None
    if reached and own is not None and "device_ip" in own and _port_of(own) is not None:
        own_address = _address(op, own_rank, own)
    return LinkPlan(parties, own_address)


def _devices(op: str, rank_table: Any) -> dict[int, dict[str, Any]]:
    """``rank_id`` → device entry of the rank table."""
    check_instance(op, "rank_table", rank_table, str)
    try:
        table = parse_json(rank_table)
    except ValueError as exc:
        param_invalid(op, f"rank_table is not JSON: {exc}")
    servers = table.get("server_list") if isinstance(table, dict) else None
    if not isinstance(servers, list):
        param_invalid(op, "rank_table has no server_list")
    out: dict[int, dict[str, Any]] = {}
    for server in servers:
        devices = server.get("device") if isinstance(server, dict) else None
        if not isinstance(devices, list):
            param_invalid(op, "every rank_table server needs a device list")
        for device in devices:
            rank = device.get("rank_id") if isinstance(device, dict) else None
            if not str(rank).isdigit():
                param_invalid(op, f"rank_table device {device!r} has no numeric rank_id")
            if int(str(rank)) in out:
                param_invalid(op, f"rank_table names rank_id {rank} twice")
            out[int(str(rank))] = device
    return out


def _port_of(device: dict[str, Any]) -> Any:
    port = device.get("device_port")
    return os.environ.get(DEVICE_PORT_ENV) if port is None else port


def _address(op: str, rank: int, device: dict[str, Any]) -> tuple[str, int]:
    host, port = device.get("device_ip"), _port_of(device)
    try:
        ipaddress.ip_address(str(host))
    except ValueError:
        param_invalid(op, f"rank {rank} needs a device_ip, got {host!r}")
    if not str(port).isdigit() or not 0 < int(str(port)) < 65536:
        param_invalid(
            op,
            f"rank {rank} needs a device_port (its listener's port; or set {DEVICE_PORT_ENV}),"
            f" got {port!r}",
        )
    return str(host), int(str(port))
