"""The peer protocol: the single definition of what a request carries over a link.

A request is a msgspec ``Struct`` encoded as MessagePack (:func:`encode`) and decoded
by the serving side with :func:`decode`, which enforces every type and bound here —
uint64 ranges, tagged unions, list and byte-string caps — in C, before any lookup,
allocation or per-block work. What a request *means* against this side's registry is
checked afterwards by the peer service.

Block lists travel as little-endian int64 byte strings, long ones with runs folded
(:func:`pack_blocks`): an entry ``b >= 0`` names block ``b``; an entry ``-k`` right
after the entry ``b`` names the ``k`` blocks after it, ``b+1 .. b+k``. A layer-wise
transfer of 4,096 consecutive blocks sends 16 bytes per layer instead of 32 KiB, and a
scattered list costs what it did. Both directions are numpy work on the whole list (no
per-block Python objects); :func:`blocks_of` checks the count a list unfolds to against
its cap before it builds anything.

Requests:
    * :class:`BlocksReq`: blocks of a blocks cache (pull_blocks / push_blocks).
    * :class:`ChunksReq`: block-sized chunks of one batch slot of a contiguous cache,
      read into blocks (pull_blocks from a ``CacheKey`` / ``CacheKeyByIdAndIndex``).
    * :class:`SlotReq`: the first ``size`` bytes of one batch slot (pull_cache /
      push_cache).
    * :class:`AddrsReq`: a write to raw addresses the peer registered (layer-wise
      ``TransferConfig``).
    * :class:`LeaseReq` / :class:`RevokeReq`: lend a blocks cache's memory by address to
      a one-sided link, and end that loan (:mod:`._leases`).
    * :class:`WhichReq`: which cache a ``CacheKey`` names (the parts of a pull by it
      then name that cache too).
    * :class:`NotifyReq`: a notification, a small message for the application
      (:mod:`._inbox`).
"""

from __future__ import annotations

from typing import Annotated
from typing import Final
from typing import Literal

import msgspec
import numpy as np

from .._checks import Blocks
from .._models import BlocksCacheKey
from .._models import CacheKey
from .._models import CacheKeyByIdAndIndex
from ._inbox import MAX_NOTIFICATION_BYTES

__all__ = [
    "FOLD_MIN",
    "MAX_BLOCKS",
    "MAX_TENSORS",
    "PROTOCOL",
    "AddrsReq",
    "BlocksReq",
    "ChunksReq",
    "KeyByBlocks",
    "KeyById",
    "KeyByReq",
    "LeaseReq",
    "Message",
    "NotifyReq",
    "Request",
    "RevokeReq",
    "SlotReq",
    "Tensors",
    "WhichReq",
    "blocks_of",
    "decode",
    "encode",
    "pack_blocks",
    "top_block",
    "wire_key",
]

#: Version of the request envelope; 2: block lists with folded runs (see above).
PROTOCOL: Final = 2
#: Most blocks one request may name (its int64 list: at most 8 bytes a block).
MAX_BLOCKS: Final = 1 << 20
#: Most tensors one request may select.
MAX_TENSORS: Final = 1 << 16

# MessagePack cannot encode an integer above 2**64-1, so ``ge=0`` bounds a uint64 fully
# (msgspec cannot state ``le`` beyond int64).
U64 = Annotated[int, msgspec.Meta(ge=0)]
Count = Annotated[int, msgspec.Meta(ge=1, le=2**63 - 1)]
BlockBytes = Annotated[bytes, msgspec.Meta(max_length=8 * MAX_BLOCKS)]
_INT64_MAX: Final = np.int64(2**63 - 1)
#: Shortest block list :func:`pack_blocks` folds (see there).
FOLD_MIN: Final = 1024


class KeyByBlocks(msgspec.Struct, frozen=True, tag="blocks"):
    """A ``BlocksCacheKey``."""

    cluster_id: U64
    model_id: U64


class KeyByReq(msgspec.Struct, frozen=True, tag="req"):
    """A ``CacheKey``; ``cache_id``: the cache it must name (None: any), so that the
    parts of one pull read one cache (a key rebound meanwhile is refused)."""

    cluster_id: U64
    req_id: U64
    model_id: U64
    prefix_id: U64
    cache_id: U64 | None = None


class KeyById(msgspec.Struct, frozen=True, tag="id"):
    """A ``CacheKeyByIdAndIndex``."""

    cluster_id: U64
    cache_id: U64
    batch_index: U64


Key = KeyByBlocks | KeyByReq | KeyById


class Tensors(msgspec.Struct, frozen=True):
    """Which tensors of the served cache: all (``layers`` None) or a layer range.

    Attributes:
        count: how many tensors the requester moves; must equal the selection.
        layers: ``(start, stop)`` of a layer range, or None for every tensor.
        per_layer: tensors per layer (layer ``i`` = tensors ``[i*n, (i+1)*n)``).
        dtype: the requester's cache data type (a ``DataType`` value): the served cache
            must have the same (None: not checked).
        whole: set on a part of a transfer of every tensor (no layer range) that was
            cut by layers, or inside them (``layers`` then names single tensors,
            ``per_layer`` 1): how many tensors the whole transfer moves; the served cache
            must have as many, as the whole request would be checked (None: not a part).
        span: set on a part of a transfer of a layer range: that range and its
            tensors per layer, ``(start, stop, per_layer)``; the served cache must hold
            it, as the whole request would be checked, and the part must lie inside it
            (None: not a part).
    """

    count: Annotated[int, msgspec.Meta(ge=1, le=MAX_TENSORS)]
    layers: tuple[U64, U64] | None = None
    per_layer: Annotated[int, msgspec.Meta(ge=1, le=MAX_TENSORS)] = 2
    dtype: Annotated[int, msgspec.Meta(ge=0, le=255)] | None = None
    whole: Annotated[int, msgspec.Meta(ge=1, le=MAX_TENSORS)] | None = None
    span: tuple[U64, U64, Annotated[int, msgspec.Meta(ge=1, le=MAX_TENSORS)]] | None = None


class BlocksReq(msgspec.Struct, frozen=True, tag="blocks"):
    """Blocks ``blocks`` (int64 LE) of a blocks cache, ``block_bytes`` each; ``top``: on
    a part, the highest block of the whole transfer (the served cache must hold it)."""

    key: Key
    tensors: Tensors
    blocks: BlockBytes
    block_bytes: Count
    release: bool = False
    top: U64 | None = None


class _OfSlot(msgspec.Struct, frozen=True):
    """What every request into one batch slot names first: the slot and its tensors."""

    key: KeyByReq | KeyById
    tensors: Tensors


class ChunksReq(_OfSlot, frozen=True, tag="chunks"):
    """Chunks ``chunks`` (int64 LE) of ``chunk_bytes`` each of one batch slot; ``top``:
    on a part, the highest chunk of the whole transfer (the slot must hold it)."""

    chunks: BlockBytes
    chunk_bytes: Count
    release: bool = False
    top: U64 | None = None


class SlotReq(_OfSlot, frozen=True, tag="slot"):
    """The first ``size`` bytes of one batch slot; ``exact``: the slots must be equal."""

    size: Count
    exact: bool
    release: bool = False


class AddrsReq(msgspec.Struct, frozen=True, tag="addrs"):
    """A write into raw addresses: for each base address (one per tensor), blocks
    ``blocks`` of ``block_bytes`` at ``base + b * stride`` — or, with ``blocks`` None,
    ``block_bytes`` bytes at ``base``."""

    bases: Annotated[list[U64], msgspec.Meta(min_length=1, max_length=MAX_TENSORS)]
    block_bytes: Count
    stride: Count
    blocks: BlockBytes | None = None


class LeaseReq(msgspec.Struct, frozen=True, tag="lease"):
    """Lend the memory of ``tensors`` of a blocks cache by address, for reads (and for
    writes with ``write``), until revoked: a one-sided link (NIXL) then moves blocks of
    it with no request per transfer (:mod:`aiokv._remote._leases`). Sent as a read of
    the lease's description."""

    key: KeyByBlocks
    tensors: Tensors
    block_bytes: Count
    write: bool = False


class RevokeReq(msgspec.Struct, frozen=True, tag="revoke"):
    """The lease ``lease`` that the sender granted ends (a write of 0 bytes, answered
    once the holder no longer uses it)."""

    lease: U64


class WhichReq(msgspec.Struct, frozen=True, tag="which"):
    """Which cache ``key`` names now: a read of its cache id (8 bytes, uint64 LE), that
    the parts of a pull by ``key`` then pin (:attr:`KeyByReq.cache_id`)."""

    key: KeyByReq


class NotifyReq(msgspec.Struct, frozen=True, tag="notify"):
    """A notification for the peer's application (a write of 0 bytes, answered once
    the peer filed it, or refused when its queue is full)."""

    payload: Annotated[bytes, msgspec.Meta(max_length=MAX_NOTIFICATION_BYTES)]


#: A transfer's request.
Request = BlocksReq | ChunksReq | SlotReq | AddrsReq
#: Anything a peer may send: a transfer's request, a lease's, or a notification.
Message = Request | LeaseReq | RevokeReq | NotifyReq | WhichReq


class _Envelope(msgspec.Struct, frozen=True, array_like=True):
    v: Literal[2]
    req: Message


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(_Envelope)


def encode(req: Message) -> bytes:
    """The wire form of ``req`` (MessagePack, with the protocol version)."""
    return _encoder.encode(_Envelope(PROTOCOL, req))


def decode(raw: bytes) -> Message:
    """Parse and bound-check a peer's request.

    Raises:
        msgspec.ValidationError / msgspec.DecodeError: anything malformed: wrong
            version, unknown tag, a type or bound violated, a string that is not UTF-8;
            a malformed block string is caught later by :func:`blocks_of`.
    """
    try:
        return _decoder.decode(raw).req
    except UnicodeDecodeError as exc:  # msgspec lets it escape from a tag string
        raise msgspec.DecodeError(f"a string is not UTF-8: {exc}") from None
    except msgspec.ValidationError as exc:
        if str(exc).endswith("`$[0]`") and type(v := _version_of(raw)) is int:
            raise msgspec.ValidationError(
                f"request protocol version {v}; this side speaks version {PROTOCOL} "
                "(both sides must run aiokv releases of the same request protocol)"
            ) from None
        raise


def _version_of(raw: bytes) -> object:
    """The version a refused envelope states (None if it states none): errors only."""
    try:
        env = msgspec.msgpack.decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError):
        return None
    return env[0] if type(env) is list and env else None


def pack_blocks(blocks: Blocks) -> bytes:
    """A validated block list (entries >= 0) in its wire form: int64 little-endian; in a
    list of at least :data:`FOLD_MIN` blocks, each run of two or more consecutive
    ascending blocks ``b .. b+k`` folded into ``b, -k`` (a shorter list is sent as it is:
    folding it would save a few bytes and cost both sides more than it saves)."""
    arr = np.ascontiguousarray(blocks, dtype="<i8")
    if arr.size < FOLD_MIN:
        return arr.tobytes()
    step = np.diff(arr) == 1
    if not step.any():
        return arr.tobytes()
    first = np.flatnonzero(np.concatenate(([True], ~step)))  # where each run starts
    more = np.diff(np.append(first, arr.size)) - 1  # blocks after each run's first
    folded = more > 0
    at = np.cumsum(1 + folded) - 1 - folded  # each run's first entry in the output
    out = np.empty(first.size + int(folded.sum()), dtype="<i8")
    out[at] = arr[first]
    out[at[folded] + 1] = -more[folded]
    return out.tobytes()


def blocks_of(raw: bytes, most: int = MAX_BLOCKS) -> Blocks:
    """A block list from its wire form (see :func:`pack_blocks`), unfolded.

    The count it unfolds to is checked against ``most`` before anything of that size is
    built, so a 16-byte list cannot make this side allocate more than ``most`` entries.

    Raises:
        ValueError: malformed: not whole int64s; a run entry (< 0) first, after another
            run entry, longer than ``most``, or past the int64 range; more than ``most``
            blocks in all.
    """
    if len(raw) % 8:
        raise ValueError("is not a list of int64")
    arr = np.frombuffer(raw, dtype="<i8").astype(np.int64, copy=False)
    if arr.size > most:
        raise ValueError(f"names {arr.size} entries; at most {most}")
    run = arr < 0
    if not run.any():
        return arr
    if run[0] or (run[1:] & run[:-1]).any():
        raise ValueError("has a run entry (< 0) that does not follow a block")
    if int(arr.min()) < -most:
        raise ValueError(f"has a run of more than {most} blocks")
    firsts = arr[~run]
    more = np.zeros(firsts.size, dtype=np.int64)
    more[np.cumsum(~run)[run] - 1] = -arr[run]
    total = firsts.size + int(more.sum())
    if total > most:
        raise ValueError(f"names {total} blocks; at most {most}")
    if (firsts > _INT64_MAX - more).any():
        raise ValueError("has a run past the int64 range")
    lens = more + 1
    at = np.cumsum(lens) - lens  # where each run starts in the unfolded list
    out = np.arange(total, dtype=np.int64)
    out += np.repeat(firsts - at, lens)
    return out


def top_block(raw: bytes) -> int:
    """The highest block a block list in its wire form names, found without unfolding it
    (numpy over the list as sent: work bounded by its bytes, not by what it names), so a
    request's extent can be checked against registered memory before anything of its
    size is built.

    Raises:
        ValueError: empty, or malformed as :func:`blocks_of` says (its count is not
            checked here).
    """
    if len(raw) % 8:
        raise ValueError("is not a list of int64")
    arr = np.frombuffer(raw, dtype="<i8").astype(np.int64, copy=False)
    if not arr.size:
        raise ValueError("is empty")
    run = arr < 0
    if not run.any():
        return int(arr.max())
    if run[0] or (run[1:] & run[:-1]).any():
        raise ValueError("has a run entry (< 0) that does not follow a block")
    firsts, lengths = arr[:-1][run[1:]], arr[1:][run[1:]]  # each run's block and -k
    if (firsts > _INT64_MAX + lengths).any():
        raise ValueError("has a run past the int64 range")
    return max(int(arr[~run].max()), int((firsts - lengths).max()))


def wire_key(key: BlocksCacheKey | CacheKey | CacheKeyByIdAndIndex) -> Key:
    """The wire form of a key."""
    if isinstance(key, BlocksCacheKey):
        return KeyByBlocks(key.cluster_id, key.model_id)
    if isinstance(key, CacheKey):
        return KeyByReq(key.prompt_cluster_id, key.req_id, key.model_id, key.prefix_id)
    return KeyById(key.cluster_id, key.cache_id, key.batch_index)
