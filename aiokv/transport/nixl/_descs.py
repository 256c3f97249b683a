"""Descriptor lists: flat buffers as coalesced ``(address, length)`` runs, their wire
form in a ``NIXL_GRANT`` and the pairing of two lists of the same total."""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Sequence
from typing import Final

import numpy as np

__all__ = ["TAG_BYTES", "address_of", "decode_grant", "encode_grant", "pair", "runs_of"]

TAG_BYTES: Final = 8
_RUN = struct.Struct("<QQ")


def address_of(view: memoryview) -> int:
    """The address of a flat, non-empty ``'B'`` view (read-only ones too)."""
    if not view.readonly:  # ctypes: ~5x faster than numpy, which read-only views need
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def runs_of(views: Sequence[memoryview]) -> list[tuple[int, int]]:
    """``views`` as ``(address, length)`` runs in order, adjacent ones merged."""
    runs: list[tuple[int, int]] = []
    for v in views:
        addr, n = address_of(v), len(v)
        if runs and runs[-1][0] + runs[-1][1] == addr:
            runs[-1] = (runs[-1][0], runs[-1][1] + n)
        else:
            runs.append((addr, n))
    return runs


def encode_grant(tag: bytes, runs: Sequence[tuple[int, int]]) -> bytes:
    """The meta of a ``NIXL_GRANT``: the tag, then the runs as u64 pairs."""
    return tag + np.array(runs, dtype="<u8").tobytes()


def decode_grant(meta: bytes | bytearray, total: int) -> tuple[bytes, list[tuple[int, int]]] | None:
    """``(tag, runs)`` of a peer's ``NIXL_GRANT``, or None unless the runs are non-empty
    and total exactly ``total`` bytes (the addresses are the peer's own business: NIXL
    refuses any outside the memory it registered)."""
    body = len(meta) - TAG_BYTES
    if body <= 0 or body % _RUN.size:
        return None
    runs = [(a, n) for a, n in _RUN.iter_unpack(memoryview(meta)[TAG_BYTES:])]
    if any(n == 0 for _, n in runs) or sum(n for _, n in runs) != total:
        return None
    return bytes(meta[:TAG_BYTES]), runs


def pair(
    a: Sequence[tuple[int, int]], b: Sequence[tuple[int, int]]
) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """Two run lists of the same total, split at their common boundaries: descriptor i of
    the first and of the second have the same length (device id 0: host memory)."""
    if len(a) == len(b) and all(x[1] == y[1] for x, y in zip(a, b, strict=True)):
        return [(p, n, 0) for p, n in a], [(p, n, 0) for p, n in b]  # already paired
    out_a: list[tuple[int, int, int]] = []
    out_b: list[tuple[int, int, int]] = []
    i = j = ao = bo = 0
    while i < len(a) and j < len(b):
        n = min(a[i][1] - ao, b[j][1] - bo)
        out_a.append((a[i][0] + ao, n, 0))
        out_b.append((b[j][0] + bo, n, 0))
        ao += n
        bo += n
        if ao == a[i][1]:
            i, ao = i + 1, 0
        if bo == b[j][1]:
            j, bo = j + 1, 0
    return out_a, out_b
