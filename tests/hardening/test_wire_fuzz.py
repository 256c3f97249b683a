"""Full-stack wire fuzz: mutated peer requests against a real ``LLMDataDist``, judged by
an independent model of what may be granted.

Two real servers (cluster ``SA`` with ``enable_remote_cache_accessible``, ``SB``
without) hold pool caches (a blocks cache bound to a ``BlocksCacheKey``, a contiguous
cache whose slots are bound to ``CacheKey`` s) and registered user memory (remote
accessible or not), all filled with known random bytes and shadowed here. An
authenticated raw transport link sends well-framed requests: valid ones
(``BlocksReq`` / ``ChunksReq`` / ``SlotReq`` / ``AddrsReq``, keyed every way) put
through random mutations of every field, of the envelope and of the size the link
announces.

The model below is written from the documents (docs/api.md "Grants", docs/security.md
"Grant lifetime", the ``PeerService`` and ``_protocol`` docstrings), not from the
service's code: for each request it parses the MessagePack itself and decides REFUSE or
the exact bytes — (cache, tensor, byte range) in wire order — a read returns or a write
changes. Each grant the service answers is observed at its boundary (status, buffer
addresses), before the transport compares sizes. Checked for every request: what the
model refuses is never granted; a grant covers exactly the model's ranges; a served read
returns exactly the model's bytes; after every request every cache equals its shadow
with exactly the model's bytes changed; the model never allows what the service refuses
(0 false refusals). Afterwards: no pins, pools as before, no ERROR logged, and a real
client still pulls correct blocks.

``AIOKV_FUZZ_SEED`` (tests/fuzzing.py) picks the run; every assertion names the seed.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import time
from collections.abc import AsyncIterator
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
from _helpers import Refusing
from _helpers import logged_errors
from fuzzing import fuzz_seed

from aiokv import BlocksCacheKey
from aiokv import CacheDesc
from aiokv import CacheKey
from aiokv import DataType
from aiokv import LLMConfig
from aiokv import LLMDataDist
from aiokv import LLMException
from aiokv import LLMRole
from aiokv import LLMStatusCode
from aiokv import Placement
from aiokv._cache import Cache
from aiokv._registry import CacheRegistry
from aiokv._remote._service import PeerService
from aiokv.testing import cluster_info
from aiokv.testing import make_config
from aiokv.transport import Grant
from aiokv.transport import Link
from aiokv.transport import PeerInfo
from aiokv.transport.tcp import TcpTransport

CODE = LLMStatusCode
HOST = "127.0.0.1"
SECRET = "wire-fuzz-secret"
SA, SB, FUZZER, CLIENT = 11, 12, 99, 13
REQUESTS = 3000  # per event loop (asyncio and uvloop: each its own stream)
WALL_S = 20.0  # a guard against a hung run, not the budget
U64 = 2**64 - 1
I64 = 2**63 - 1
MAX_BLOCKS = 1 << 20  # the protocol's caps (docs: "Limits per request")
MAX_TENSORS = 1 << 16
REFUSALS = {CODE.LLM_PARAM_INVALID, CODE.LLM_KV_CACHE_NOT_EXIST, CODE.LLM_FEATURE_NOT_ENABLED}
SLOT_KEYS = [(500, U64, 1), (501, U64, 1), (502, U64, 1), (U64, 77, 1)]  # req, prefix, model


# ---- the served memory, as the model knows it ---------------------------------------------
@dataclass
class Spec:
    """One cache a server holds."""

    name: str
    blocks: bool  # a blocks cache (dim 0 is the block index)
    pool: bool  # allocated from the host pool (else registered user memory)
    remote: bool | None  # remote_accessible given at registration (pool: the instance's)
    num_tensors: int
    shape: list[int]
    dtype: DataType
    batch_dim: int = 0
    blocks_key: int | None = None  # model id of its BlocksCacheKey
    slot_keys: bool = False  # slots bound to SLOT_KEYS


SPECS = [
    Spec("pool_blocks", True, True, None, 4, [16, 32], DataType.DT_FLOAT16, blocks_key=7),
    Spec("pool_slots", False, True, None, 4, [4, 128], DataType.DT_INT8, slot_keys=True),
    Spec("user_open", False, False, True, 2, [8, 64], DataType.DT_UINT8),
    Spec("user_closed", True, False, False, 2, [8, 32], DataType.DT_FLOAT, blocks_key=9),
    Spec("user_strided", False, False, True, 2, [4, 6, 8], DataType.DT_INT16, batch_dim=1),
]


@dataclass
class Mem:
    """A live cache: its memory (flat uint8 views) and the bytes it must hold."""

    spec: Spec
    cache: Cache
    access: bool  # remote accessible on this instance (docs: both settings)
    live: list[np.ndarray]
    shadow: list[np.ndarray]
    bases: list[int]

    @property
    def size(self) -> int:  # bytes of one tensor
        return self.live[0].size

    @property
    def batch(self) -> int:
        return self.spec.shape[self.spec.batch_dim]

    @property
    def unit(self) -> int:  # bytes of one dim-0 row (a block of a blocks cache)
        return self.size // self.spec.shape[0]


def flat(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.uint8).reshape(-1).numpy()


def adopt(spec: Spec, cache: Cache, enable: bool, rng: random.Random) -> Mem:
    live = [flat(t) for t in cache.tensors]
    for v in live:
        v[:] = np.frombuffer(rng.randbytes(v.size), np.uint8)
    access = enable and (enable if spec.remote is None else spec.remote)
    bases = [t.data_ptr() for t in cache.tensors]
    return Mem(spec, cache, access, live, [v.copy() for v in live], bases)


@dataclass
class Server:
    """One ``LLMDataDist`` under attack and the model's view of it."""

    cid: int
    enable: bool
    dd: LLMDataDist
    mems: list[Mem] = field(default_factory=list)
    keys: dict[tuple[int, int, int], tuple[Mem, int]] = field(default_factory=dict)
    blocks_keys: dict[int, Mem] = field(default_factory=dict)
    dead_ids: list[int] = field(default_factory=list)
    unread: dict[tuple[int, int, int], set[int]] = field(default_factory=dict)  # by key
    user_memory: list[torch.Tensor] = field(default_factory=list)
    link: Link | None = None

    def by_id(self, cache_id: int) -> Mem | None:
        return next((m for m in self.mems if m.cache.cache_id == cache_id), None)

    def desc(self, spec: Spec) -> CacheDesc:
        return CacheDesc(spec.num_tensors, spec.shape, spec.dtype, Placement.HOST, spec.batch_dim)

    async def add(self, spec: Spec, rng: random.Random) -> Mem:
        cm = self.dd.cache_manager
        desc = self.desc(spec)
        bkey = None if spec.blocks_key is None else BlocksCacheKey(self.cid, spec.blocks_key)
        keys = [CacheKey(self.cid, r, m, p) for r, p, m in SLOT_KEYS] if spec.slot_keys else []
        if spec.pool and spec.blocks:
            cache = await cm.allocate_blocks_cache(desc, bkey)
        elif spec.pool:
            cache = await cm.allocate_cache(desc, keys)
        else:
            dt = spec.dtype.torch_dtype
            mem = [torch.zeros(spec.shape, dtype=dt) for _ in range(spec.num_tensors)]
            self.user_memory += mem
            if spec.blocks:
                cache = await cm.register_blocks_cache(desc, mem, bkey, spec.remote)
            else:
                cache = await cm.register_cache(desc, mem, keys, spec.remote)
        m = adopt(spec, cache, self.enable, rng)
        self.mems.append(m)
        if spec.blocks_key is not None:
            self.blocks_keys[spec.blocks_key] = m
        if spec.slot_keys:
            self.keys.update({k: (m, i) for i, k in enumerate(SLOT_KEYS)})
        return m

    async def rebind_slot_keys(self, rng: random.Random) -> None:
        """Peers' pulls released keys: bind them all to a fresh cache, drop the old one."""
        old = next(m for m in self.mems if m.spec.slot_keys)
        self.mems.remove(old)
        await self.add(old.spec, rng)  # moves the keys still bound
        self.unread.clear()
        await self.dd.cache_manager.deallocate_cache(old.cache)
        self.dead_ids.append(old.cache.cache_id)

    def check_memory(self, seed: int, what: str) -> None:
        for m in self.mems:
            for t, (live, shadow) in enumerate(zip(m.live, m.shadow, strict=True)):
                if not np.array_equal(live, shadow):
                    bad = np.flatnonzero(live != shadow)
                    raise AssertionError(
                        f"seed {seed}: cluster {self.cid} {m.spec.name} tensor {t}: bytes "
                        f"{bad[:8].tolist()}... ({bad.size}) changed outside the model; {what}"
                    )


# ---- the model ------------------------------------------------------------------------------
class Refuse(Exception):
    """The model refuses the request (the reason is for messages only)."""


class Undecided(Refuse):
    """A string that is not UTF-8 somewhere in the request. The service refuses it where
    it reads the string (a tag) and ignores it where it skips it unread (the name of an
    unknown field); this model does not locate it, so it only requires the request to
    move nothing when its size cannot match."""


MISSING = object()
Run = tuple[Mem, int, int, int]  # (cache, tensor, start, stop)


def _dict(x: Any, what: str) -> dict[str, Any]:
    if type(x) is not dict or not all(type(k) is str for k in x):
        raise Refuse(f"{what} is not a map with string keys")
    return x


def _int(d: dict[str, Any], name: str, lo: int, hi: int, default: Any = MISSING) -> Any:
    x = d.get(name, default)
    if x is MISSING:
        raise Refuse(f"{name} missing")
    if x is default:
        return x
    if type(x) is not int or not lo <= x <= hi:
        raise Refuse(f"{name}={x!r} is not an int in [{lo}, {hi}]")
    return x


def _bool(d: dict[str, Any], name: str, default: Any = MISSING) -> bool:
    x = d.get(name, default)
    if type(x) is not bool:
        raise Refuse(f"{name}={x!r} is not a bool")
    return x


def _bytes(d: dict[str, Any], name: str, *, optional: bool = False) -> bytes | None:
    x = d.get(name, None if optional else MISSING)
    if x is None and optional:
        return None
    if type(x) is not bytes or len(x) > 8 * MAX_BLOCKS:
        raise Refuse(f"{name} is not a byte string within the cap")
    return x


def _index_list(raw: bytes, limit: int, *, unique: bool) -> list[int]:
    """A peer's int64 LE list (docs: an entry ``-k`` after ``b`` names ``b+1 .. b+k``):
    whole entries, 1..limit of them unfolded, each in [0, limit)."""
    if len(raw) % 8:
        raise Refuse("a block list is not whole int64s")
    xs = np.frombuffer(raw, "<i8").tolist()
    if len(xs) > limit:
        raise Refuse(f"{len(xs)} entries for a limit of {limit}")
    out: list[int] = []
    for i, x in enumerate(xs):
        if x >= 0:
            out.append(x)
            continue
        if i == 0 or xs[i - 1] < 0:
            raise Refuse("a run entry that follows no block")
        if len(out) - x > limit:  # checked before the run is unfolded
            raise Refuse("more blocks than the limit")
        if xs[i - 1] - x > I64:
            raise Refuse("a run past the int64 range")
        out += range(xs[i - 1] + 1, xs[i - 1] - x + 1)
    if not out or len(out) > limit:
        raise Refuse(f"{len(out)} entries for a limit of {limit}")
    if max(out) >= limit:
        raise Refuse("an entry is out of range")
    if unique and len(set(out)) != len(out):
        raise Refuse("a destination entry is named twice")
    return out


@dataclass
class Parsed:
    kind: str
    d: dict[str, Any]
    key: tuple[str, dict[str, Any]] | None
    tensors: dict[str, Any] | None


KEY_FIELDS = {
    "blocks": ("cluster_id", "model_id"),
    "req": ("cluster_id", "req_id", "model_id", "prefix_id"),
    "id": ("cluster_id", "cache_id", "batch_index"),
}


def parse(raw: bytes) -> Parsed:
    """The wire format (docs: MessagePack ``[version, request]``; tagged maps; strict
    types; unknown fields and trailing array items ignored)."""
    try:
        env = msgspec.msgpack.decode(raw)
    except UnicodeDecodeError as exc:
        raise Undecided(f"not UTF-8: {exc}") from None
    except (msgspec.DecodeError, TypeError, ValueError) as exc:
        raise Refuse(f"not MessagePack: {exc}") from None
    if type(env) is not list or len(env) < 2:
        raise Refuse("not an envelope")
    if type(env[0]) is not int or env[0] != 2:
        raise Refuse(f"protocol version {env[0]!r}")
    d = _dict(env[1], "request")
    kind = d.get("type", MISSING)
    if kind not in ("blocks", "chunks", "slot", "addrs") or type(kind) is not str:
        raise Refuse(f"request tag {kind!r}")
    if kind == "addrs":
        bases = d.get("bases", MISSING)
        if type(bases) is not list or not 1 <= len(bases) <= MAX_TENSORS:
            raise Refuse("bases")
        for b in bases:
            if type(b) is not int or not 0 <= b <= U64:
                raise Refuse("a base")
        _int(d, "block_bytes", 1, I64)
        _int(d, "stride", 1, I64)
        _bytes(d, "blocks", optional=True)
        return Parsed(kind, d, None, None)
    k = _dict(d.get("key"), "key")
    ktag = k.get("type", MISSING)
    allowed = ("blocks", "req", "id") if kind == "blocks" else ("req", "id")
    if type(ktag) is not str or ktag not in allowed:
        raise Refuse(f"key tag {ktag!r} for a {kind} request")
    for name in KEY_FIELDS[ktag]:
        _int(k, name, 0, U64)
    t = _dict(d.get("tensors"), "tensors")
    _int(t, "count", 1, MAX_TENSORS)
    layers = t.get("layers", None)
    if layers is not None and (
        type(layers) is not list
        or len(layers) != 2
        or any(type(x) is not int or not 0 <= x <= U64 for x in layers)
    ):
        raise Refuse("layers")
    _int(t, "per_layer", 1, MAX_TENSORS, 2)
    _int(t, "dtype", 0, 255, None)
    if kind == "blocks":
        _bytes(d, "blocks")
        _int(d, "block_bytes", 1, I64)
    elif kind == "chunks":
        _bytes(d, "chunks")
        _int(d, "chunk_bytes", 1, I64)
    else:
        _int(d, "size", 1, I64)
        _bool(d, "exact")
    _bool(d, "release", False)
    return Parsed(kind, d, (ktag, k), t)


def _select(t: dict[str, Any], m: Mem) -> range:
    """Layer ``i`` is tensors ``[i*n, (i+1)*n)`` (docs: "Layers"); no range: all of them."""
    n = m.spec.num_tensors
    layers, per = t.get("layers"), t.get("per_layer", 2)
    if layers is None:
        sel = range(n)
    else:
        start, stop = layers
        if n % per or stop <= start or stop * per > n:
            raise Refuse(f"layers {layers} x {per} outside {n} tensors")
        sel = range(start * per, stop * per)
    if t["count"] != len(sel):
        raise Refuse("tensor counts differ")
    dtype = t.get("dtype")
    if dtype is not None and dtype != int(m.spec.dtype):
        raise Refuse("data types differ")
    return sel


def _lookup(srv: Server, ktag: str, k: dict[str, Any]) -> tuple[Mem, int | None]:
    if k["cluster_id"] != srv.cid:
        raise Refuse("another cluster's key")
    if ktag == "blocks":
        m = srv.blocks_keys.get(k["model_id"])
        if m is None:
            raise Refuse("no such BlocksCacheKey")
        return m, None
    if ktag == "req":
        hit = srv.keys.get((k["req_id"], k["prefix_id"], k["model_id"]))
        if hit is None:
            raise Refuse("no such CacheKey")
        return hit
    m = srv.by_id(k["cache_id"])
    if m is None:
        raise Refuse("no such cache id")
    if k["batch_index"] >= m.batch:
        raise Refuse("batch_index out of range")
    return m, k["batch_index"]


def model(srv: Server, raw: bytes, write: bool) -> list[Run]:
    """What the service may grant for ``raw``: the runs in wire order, or ``Refuse``."""
    p = parse(raw)
    d = p.d
    if p.kind == "addrs":
        return _model_addrs(srv, d, write)
    assert p.key is not None and p.tensors is not None
    ktag, k = p.key
    m, slot = _lookup(srv, ktag, k)
    # pushes need a remote-accessible cache on an enabled instance; reads by cache id
    # too on an enabled instance, and nothing on another (llm_datadist's rules)
    if (write or (ktag == "id" and srv.enable)) and not m.access:
        raise Refuse("not remote accessible")
    if write and ktag == "req":
        raise Refuse("a push needs a cache id")
    sel = _select(p.tensors, m)
    if p.kind == "blocks":
        if not m.spec.blocks or d["block_bytes"] != m.unit:
            raise Refuse("not a blocks cache of that block size")
        idx = _index_list(d["blocks"], m.spec.shape[0], unique=write)
        spans = [(b * m.unit, (b + 1) * m.unit) for b in idx]
    else:
        if slot is None or m.spec.batch_dim != 0:
            raise Refuse("slots are not contiguous")
        per_slot = m.size // m.batch
        base = slot * per_slot
        if p.kind == "chunks":
            cb = d["chunk_bytes"]
            if cb > per_slot or per_slot % cb:
                raise Refuse("not whole chunks")
            idx = _index_list(d["chunks"], per_slot // cb, unique=write)
            spans = [(base + c * cb, base + (c + 1) * cb) for c in idx]
        else:
            if d["size"] > per_slot or (d["exact"] and d["size"] != per_slot):
                raise Refuse("slot sizes differ")
            spans = [(base, base + d["size"])]
    return [(m, t, a, b) for t in sel for a, b in spans]


def _model_addrs(srv: Server, d: dict[str, Any], write: bool) -> list[Run]:
    """Raw destinations: each region inside ONE registered, remote-accessible tensor;
    regions of different addresses disjoint; destination blocks distinct."""
    if not write:
        raise Refuse("address reads are not served")
    bb = d["block_bytes"]
    raw = d.get("blocks")
    offsets = [0]
    if raw is not None:
        if d["stride"] < bb:
            raise Refuse("stride below block size")
        idx = _index_list(raw, MAX_BLOCKS, unique=True) if len(raw) % 8 == 0 else []
        if not idx:
            raise Refuse("blocks")
        offsets = [b * d["stride"] for b in idx]
    extent = max(offsets) + bb
    regions = sorted(d["bases"])
    if any(b - a < extent for a, b in itertools.pairwise(regions)):
        raise Refuse("regions overlap")
    runs: list[Run] = []
    for base in d["bases"]:
        hit = next(
            (
                (m, t, base - start)
                for m in srv.mems
                for t, start in enumerate(m.bases)
                if start <= base and base + extent <= start + m.size
            ),
            None,
        )
        if hit is None:
            raise Refuse(f"[{base}, +{extent}) is not inside one registered tensor")
        m, t, off = hit
        if not m.access:
            raise Refuse("not remote accessible")
        runs += [(m, t, off + o, off + o + bb) for o in offsets]
    return runs


# ---- the generator -------------------------------------------------------------------------
def i64s(xs: list[int]) -> bytes:
    return np.array(xs, dtype="<i8").tobytes()


def folded(xs: list[int]) -> list[int]:
    """``xs`` with each run ``b, b+1, .., b+k`` (k >= 1) written ``b, -k``, as peers send."""
    out: list[int] = []
    for x in xs:
        if out and (out[-1] + 1 == x if out[-1] >= 0 else out[-2] - out[-1] + 1 == x):
            out[-1:] = [out[-1], -1] if out[-1] >= 0 else [out[-1] - 1]
        else:
            out.append(x)
    return out


def block_list(rng: random.Random, n: int, k: int, *, unique: bool) -> bytes:
    """A valid list of ``k`` entries in [0, n): random, or a run; folded or not."""
    k = max(1, min(k, n))
    start = rng.randrange(n - k + 1)
    xs = list(range(start, start + k)) if rng.random() < 0.3 else some(rng, n, k, unique=unique)
    return i64s(folded(xs) if rng.random() < 0.5 else xs)


def some(rng: random.Random, n: int, k: int, *, unique: bool) -> list[int]:
    k = max(1, min(k, n))
    return rng.sample(range(n), k) if unique else [rng.randrange(n) for _ in range(k)]


def tensors_sel(rng: random.Random, m: Mem) -> dict[str, Any]:
    n = m.spec.num_tensors
    sel: dict[str, Any] = {"count": n}
    if rng.random() < 0.5:
        per = rng.choice([d for d in (1, 2, 4) if n % d == 0])
        start = rng.randrange(n // per)
        stop = rng.randint(start + 1, n // per)
        sel = {"count": (stop - start) * per, "layers": [start, stop], "per_layer": per}
    if rng.random() < 0.5:
        sel["dtype"] = int(m.spec.dtype)
    return sel


def key_of(rng: random.Random, srv: Server, m: Mem, *, write: bool) -> dict[str, Any]:
    slot_keys = SLOT_KEYS if m.spec.slot_keys else []  # bound, or released by a pull
    if m.spec.blocks_key is not None and rng.random() < 0.6:
        return {"type": "blocks", "cluster_id": srv.cid, "model_id": m.spec.blocks_key}
    if slot_keys and rng.random() < (0.1 if write else 0.7):
        r, p, mid = rng.choice(slot_keys)
        return {"type": "req", "cluster_id": srv.cid, "req_id": r, "model_id": mid, "prefix_id": p}
    bi = rng.randrange(m.batch)
    return {"type": "id", "cluster_id": srv.cid, "cache_id": m.cache.cache_id, "batch_index": bi}


def valid_request(rng: random.Random, srv: Server, write: bool) -> dict[str, Any]:
    """A request a correct peer could send (before mutation)."""
    if rng.random() < (0.3 if write else 0.05):  # address reads are never served
        return addrs_request(rng, srv)
    m = rng.choice(srv.mems)
    key = key_of(rng, srv, m, write=write)
    req: dict[str, Any] = {"key": key, "tensors": tensors_sel(rng, m)}
    if m.spec.blocks and (key["type"] == "blocks" or rng.random() < 0.5):
        nb = m.spec.shape[0]
        blocks = block_list(rng, nb, rng.randint(1, 6), unique=write or rng.random() < 0.5)
        req.update(type="blocks", blocks=blocks, block_bytes=m.unit)
    else:
        if key["type"] == "blocks":
            key = key_of(rng, srv, m, write=True)  # a slot needs a slot key
            req["key"] = key
        per_slot = m.size // m.batch
        if rng.random() < 0.5:
            cb = rng.choice([c for c in (1, 2, 8, 16, 64) if per_slot % c == 0])
            cb = rng.choice([3, 24]) if rng.random() < 0.1 else cb  # not a whole chunk
            chunks = block_list(rng, per_slot // cb, rng.randint(1, 5), unique=write)
            req.update(type="chunks", chunks=chunks, chunk_bytes=cb)
        else:
            size = per_slot if rng.random() < 0.5 else rng.randint(1, per_slot)
            req.update(type="slot", size=size, exact=size == per_slot and rng.random() < 0.5)
    if rng.random() < 0.3:
        req["release"] = rng.random() < 0.7
    return req


def addrs_request(rng: random.Random, srv: Server) -> dict[str, Any]:
    mems = [m for m in srv.mems if m.access] or srv.mems
    places = [(m, t) for m in mems for t in range(m.spec.num_tensors)]
    chosen = rng.sample(places, rng.randint(1, min(3, len(places))))
    size = min(m.size for m, _ in chosen)
    bb = rng.choice([1, 4, 16, 32])
    req: dict[str, Any] = {"type": "addrs", "block_bytes": bb, "stride": bb}
    extent = bb
    if rng.random() < 0.6:
        stride = bb * rng.choice([1, 1, 2, 3])
        nb = max(1, (size - bb) // stride + 1)
        blocks = some(rng, min(nb, 8), rng.randint(1, 4), unique=True)
        req.update(stride=stride, blocks=i64s(blocks))
        extent = max(blocks) * stride + bb
    req["bases"] = [m.bases[t] + rng.randrange(size - extent + 1) for m, t in chosen]
    if rng.random() < 0.1:  # a second region overlapping the first
        req["bases"].append(req["bases"][0] + rng.randrange(extent))
    return req


INTS = [0, 1, -1, 2, 7, 2**31, I64, 2**63, U64, -(2**63)]
ODD = [True, False, 1.0, None, "1", b"\x01", [], {}]


def paths(x: Any, out: list[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
    """Every (container, key) under ``x``."""
    items = x.items() if isinstance(x, dict) else enumerate(x) if isinstance(x, list) else []
    for k, v in items:
        out.append((x, k))
        paths(v, out)
    return out


def limits(req: dict[str, Any], srv: Server) -> list[int]:
    """The entry counts of the served caches: block counts, chunks per slot."""
    out = [m.spec.shape[0] for m in srv.mems]
    cb = req.get("chunk_bytes")
    if type(cb) is int and cb > 0:
        out += [m.size // m.batch // cb for m in srv.mems if m.size // m.batch >= cb]
    return out


def mutate_list(rng: random.Random, raw: bytes, limit: int) -> bytes:
    xs = np.frombuffer(raw[: len(raw) // 8 * 8], "<i8").tolist() or [0]
    choice = rng.randrange(14)
    if choice in (0, 9):
        xs.insert(rng.randrange(len(xs) + 1), rng.choice(xs))  # a duplicate
    elif choice == 1:
        xs[rng.randrange(len(xs))] = limit + rng.choice([0, 0, 1, 1000])  # out of range
    elif choice == 2:
        xs[rng.randrange(len(xs))] = rng.choice([-1, -(2**63), I64, 2**40])
    elif choice == 3:
        xs = []
    elif choice == 4:
        return raw[: max(0, len(raw) - rng.randint(1, 7))]  # not whole int64s
    elif choice == 5:
        return rng.randbytes(8 * rng.randint(1, 4))
    elif choice == 6:
        xs = xs * rng.choice([limit // len(xs) + 1, 2000])  # too many
    elif choice == 7:
        xs = [limit - 1]
    elif choice == 11:  # a run after some entry: short, to the cap, past it, past int64
        i = rng.randrange(len(xs))
        k = rng.choice([1, 2, limit - 1 - abs(xs[i]), limit, 1 << 20, 2**63 - 1, 2**63])
        xs.insert(i + 1, -max(1, k))
    elif choice == 12:  # a run entry first, or two in a row
        xs = [-rng.randint(1, 3), *xs] if rng.random() < 0.5 else [*xs, -1, -1]
    elif choice == 13:  # one run that unfolds to the cap, or one more
        xs = [0, -(limit - 1 + rng.choice([0, 0, 1]))]
    elif choice == 10:  # as many as the cap allows, or one more
        xs = [rng.randrange(max(limit, 1)) for _ in range(limit + rng.choice([0, 0, 1]))]
    else:
        xs = [*reversed(xs), rng.randrange(max(limit, 1))]
    return i64s(xs[:20_000])  # the meta stays far below the link's 1 MiB cap


def mutate(rng: random.Random, srv: Server, other: Server, req: dict[str, Any]) -> str:
    """One random mutation of ``req`` in place; returns what it did."""
    choice = rng.randrange(14)
    choice = 3 if choice >= 12 else choice  # block lists: a quarter of all mutations
    ps = paths(req, [])
    if choice <= 2:  # a number
        nums = [(c, k) for c, k in ps if type(c[k]) is int]
        if nums:
            c, k = rng.choice(nums)
            v = c[k]
            c[k] = rng.choice([v + 1, v - 1, v * 2, rng.getrandbits(64), *INTS])
            if not -(2**63) <= c[k] <= U64:
                c[k] = U64
            return f"{k}: {v} -> {c[k]}"
    if choice == 3:  # a block list
        lists = [(c, k) for c, k in ps if type(c[k]) is bytes]
        if lists:
            c, k = rng.choice(lists)
            c[k] = mutate_list(rng, c[k], rng.choice(limits(req, srv)))
            return f"{k} list"
    if choice == 4:  # a value of another type
        c, k = rng.choice(ps)
        c[k] = rng.choice([*ODD, rng.choice(INTS)])
        return f"{k} -> {c[k]!r}"
    if choice == 5:  # a field dropped, or one added
        maps = [c[k] for c, k in ps if type(c[k]) is dict] + [req]
        mp = rng.choice(maps)
        if mp and rng.random() < 0.6:
            k = rng.choice(list(mp))
            del mp[k]
            return f"dropped {k}"
        mp[rng.choice(["zz", "type", "release", "dtype", "layers"])] = rng.choice(INTS)
        return "added a field"
    if choice == 6:  # another request or key tag
        if type(req.get("key")) is dict and rng.random() < 0.5:
            req["key"]["type"] = rng.choice(["blocks", "req", "id", "x"])
        else:
            req["type"] = rng.choice(["blocks", "chunks", "slot", "addrs", "nope"])
        return "tag"
    if choice == 7 and "key" in req:  # another cache's key, a stale id, another cluster
        m = rng.choice(srv.mems + other.mems)
        host = srv if m in srv.mems else other
        req["key"] = key_of(rng, host, m, write=rng.random() < 0.5)
        if srv.dead_ids and rng.random() < 0.3:
            req["key"] = {"type": "id", "cluster_id": srv.cid, "cache_id": srv.dead_ids[-1]}
            req["key"]["batch_index"] = 0
        return "key"
    if choice == 8 and type(req.get("tensors")) is dict:
        t = req["tensors"]
        what = rng.randrange(4)
        if what == 0:
            t["layers"] = [rng.randint(0, 5), rng.randint(0, 5)]
        elif what == 1:
            t["per_layer"] = rng.randint(1, 5)
        elif what == 2:
            t["count"] = rng.randint(1, 9)
        else:
            t["dtype"] = int(rng.choice(SPECS).dtype)
        return "tensors"
    if choice == 9 and type(req.get("bases")) is list and req["bases"]:
        # raw addresses: shifted, straddling a tensor's end, another tensor, duplicated
        bases = req["bases"]
        i = rng.randrange(len(bases))
        m = rng.choice(srv.mems + other.mems)
        what = rng.randrange(5)
        if type(bases[i]) is not int:
            bases[i] = 0
        if what == 0:
            bases[i] += rng.choice([-64, -8, -1, 1, 8, 64, 1024])
        elif what == 1:
            bases[i] = rng.choice(m.bases) + m.size - rng.randint(0, 32)
        elif what == 2:
            bases.append(min(bases[i] + rng.randint(0, 16), U64))
        elif what == 3:
            bases[i] = rng.choice(m.bases)
        else:
            req["stride"] = rng.randint(1, 64)
        bases[i] = min(max(bases[i], 0), U64)
        return "bases"
    if choice == 10:  # a flag
        name = rng.choice(["release", "exact"])
        req[name] = rng.choice([True, False, True, 0, 1, None])
        return f"{name} flag"
    c, k = rng.choice(ps)
    if type(c[k]) is int:
        c[k] = rng.choice(INTS)
    return f"{k} value"


def encode(rng: random.Random, req: dict[str, Any]) -> tuple[bytes, str]:
    """The wire bytes of ``req``, sometimes with the envelope mutated."""
    env: list[Any] = [2, req]
    choice = rng.randrange(40)
    if choice == 0:
        env[0] = rng.choice([0, 1, 3, True, 2.0, "2", None, -1])
    elif choice == 1:
        env.append(rng.choice([0, "x", None]))  # trailing items are ignored
    elif choice == 2:
        return msgspec.msgpack.encode({"v": 2, "req": req}), "map envelope"
    raw = msgspec.msgpack.encode(env)
    if choice == 3:
        return raw[: rng.randrange(len(raw))], "truncated"
    if choice == 4:
        b = bytearray(raw)
        b[rng.randrange(len(b))] = rng.randrange(256)
        return bytes(b), "byte flipped"
    if choice == 5:
        return rng.randbytes(rng.randint(1, 64)), "random bytes"
    return raw, "" if choice > 1 else f"envelope v={env[0]!r}, {len(env)} items"


# ---- the run ---------------------------------------------------------------------------------
def config(enable: bool) -> LLMConfig:
    options = {"enable_remote_cache_accessible": enable, "link_secret": SECRET}
    return make_config("tcp", pool=None, host_pool=1 << 20, sync_kv_timeout=10000, **options)


@contextlib.asynccontextmanager
async def serving(cid: int, enable: bool, rng: random.Random) -> AsyncIterator[Server]:
    async with LLMDataDist(LLMRole.PROMPT, cid, config(enable)) as dd:
        srv = Server(cid, enable, dd)
        for spec in SPECS:
            await srv.add(spec, rng)
        yield srv


@pytest.fixture
def aiokv_errors(caplog: pytest.LogCaptureFixture) -> Callable[[], list[str]]:
    """The ERROR messages logged by ``aiokv`` so far in the test."""
    return logged_errors(caplog, "aiokv")


@dataclass
class Tally:
    granted: int = 0
    refused: int = 0
    false_refusals: list[str] = field(default_factory=list)
    kinds: dict[str, int] = field(default_factory=dict)
    released: int = 0
    undecided: int = 0


KINDS = ["r:blocks:blocks", "r:blocks:id", "r:chunks:req", "r:chunks:id", "r:slot:req", "r:slot:id"]
KINDS += ["w:blocks:blocks", "w:blocks:id", "w:chunks:id", "w:slot:id", "w:addrs"]


async def one(
    rng: random.Random, seed: int, n: int, srv: Server, other: Server, tally: Tally
) -> None:
    """Send one (mutated) request to ``srv`` and judge the outcome against the model."""
    assert srv.link is not None
    write = rng.random() < 0.5
    req = valid_request(rng, srv, write)
    did = [mutate(rng, srv, other, req) for _ in range(rng.choice([0, 0, 1, 1, 2, 3]))]
    raw, env = encode(rng, req)
    if env:
        did.append(env)
    try:
        runs: list[Run] | None = model(srv, raw, write)
    except Refuse as r:
        runs, why, undecided = None, str(r), isinstance(r, Undecided)
    else:
        undecided = False
    total = sum(b - a for _, _, a, b in runs) if runs else 0
    nbytes = total
    if runs is None or rng.random() < 0.2:  # the size the link announces
        nbytes = max(1, total + rng.choice([-1, 1, 7, -total // 2, 4096]))
    if undecided:  # more than any grant can total: it must fail, whatever was granted
        nbytes = sum(m.size * m.spec.num_tensors for m in srv.mems) + 1
    allowed = runs is not None and nbytes == total
    what = f"seed {seed}, request {n} to cluster {srv.cid}: {'write' if write else 'read'} "
    shown = repr(raw[:300]) + (f"... ({len(raw)} B)" if len(raw) > 300 else "")
    what += f"{nbytes} B of {shown} (mutations {did}); model: "
    what += f"{total} B" if runs is not None else f"refuse ({why})"
    payload = rng.randbytes(nbytes)
    into = bytearray(nbytes)
    seen = len(GRANTS)
    failed: LLMException | None = None
    try:
        if write:
            await srv.link.write(raw, [memoryview(payload)], timeout=5)
        else:
            await srv.link.read(raw, [memoryview(into)], timeout=5)
    except LLMException as exc:
        failed = exc
    # What the service granted (observed at its boundary), against the model.
    answers = [g for g in GRANTS[seen:] if g[0] == srv.cid]
    assert len(answers) == 1, f"{what}; {len(answers)} grants"
    _, status, spans = answers[0]
    if undecided:
        tally.undecided += 1
    elif runs is None:
        assert status != CODE.LLM_SUCCESS, f"{what}; but the service granted {spans}"
    elif status != CODE.LLM_SUCCESS:
        # a size other than the grant's is refused by the service itself, before it
        # stages or pins anything (else the transport refuses the grant)
        if allowed or status != CODE.LLM_PARAM_INVALID:
            tally.false_refusals.append(f"{what}; service: {status!r}")
    else:
        want = merged([(m.bases[t] + a, m.bases[t] + b) for m, t, a, b in runs])
        assert merged(spans) == want, f"{what}; service granted {spans}, not {want}"
    if failed is not None:
        assert failed.status_code in REFUSALS, f"{what}; unexpected {failed!r}"
        assert not (allowed and status == CODE.LLM_SUCCESS), f"{what}; granted but {failed!r}"
        tally.refused += 1
        srv.check_memory(seed, what)  # a refusal changes nothing
        return
    assert allowed and runs is not None, f"{what}; but the transfer succeeded"
    tally.granted += 1
    p = parse(raw)
    kind = f"{'w' if write else 'r'}:{p.kind}" + (f":{p.key[0]}" if p.key else "")
    tally.kinds[kind] = tally.kinds.get(kind, 0) + 1
    pos = 0
    for m, t, a, b in runs:
        if write:
            m.shadow[t][a:b] = np.frombuffer(payload, np.uint8, b - a, pos)
        else:
            want = m.shadow[t][a:b].tobytes()
            assert into[pos : pos + b - a] == want, f"{what}; wrong bytes at {pos}"
        pos += b - a
    srv.check_memory(seed, what)
    if not write and _read_by_key(srv, p):
        tally.released += 1


def _read_by_key(srv: Server, p: Parsed) -> bool:
    """A read succeeded: as llm_datadist, it releases the request key it went through
    (by that key, or by id of the slot it is bound to; never a prefix key, nor one of
    registered memory) once every tensor was read by reads asking for it (only they
    count). True if it released one."""
    if p.key is None or p.tensors is None or p.key[0] == "blocks":
        return False
    ktag, k = p.key
    if ktag == "req":
        named = (k["req_id"], k["prefix_id"], k["model_id"])
        kid: tuple[int, int, int] | None = named
        m = srv.keys[named][0]
    else:
        m = srv.by_id(k["cache_id"])
        assert m is not None
        bound = (key for key, (mm, i) in srv.keys.items() if mm is m and i == k["batch_index"])
        kid = next((key for key in bound if key[1] == U64), None)
    if kid is None or kid[1] != U64 or not m.spec.pool:
        return False
    if not p.d.get("release", False):  # (a part of a pull, not its last: nothing read)
        return False
    if p.tensors.get("layers") is not None:
        pending = srv.unread.setdefault(kid, set(range(m.spec.num_tensors)))
        pending.difference_update(_select(p.tensors, m))
        if pending:
            return False
    del srv.keys[kid]
    srv.unread.pop(kid, None)
    return True


GRANTS: list[tuple[int, LLMStatusCode, list[tuple[int, int]]]] = []  # (cluster, status, spans)


def merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Byte ranges in wire order, ranges that continue each other joined."""
    out: list[tuple[int, int]] = []
    for a, b in spans:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


@pytest.fixture
def observed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Record every grant a ``PeerService`` answers: its status and the address ranges of
    its buffers (what the service decided, before the transport checks sizes)."""

    def record(service: PeerService, grant: Grant) -> None:
        spans = [(a := np.frombuffer(v, np.uint8).ctypes.data, a + v.nbytes) for v in grant.buffers]
        GRANTS.append((service._cluster_id, grant.status, spans))

    def spy(orig: Any) -> Any:
        async def granting(self: PeerService, peer: PeerInfo, meta: bytes, *args: Any) -> Grant:
            grant: Grant = await orig(self, peer, meta, *args)
            record(self, grant)
            return grant

        return granting

    def spy_now(orig: Any) -> Any:  # what the transport serves without awaiting
        def granting(self: PeerService, *args: Any, **kwargs: Any) -> Grant | None:
            grant: Grant | None = orig(self, *args, **kwargs)
            if grant is not None:
                record(self, grant)
            return grant

        return granting

    GRANTS.clear()
    monkeypatch.setattr(PeerService, "grant_read", spy(PeerService.grant_read))
    monkeypatch.setattr(PeerService, "grant_write", spy(PeerService.grant_write))
    monkeypatch.setattr(PeerService, "grant_now", spy_now(PeerService.grant_now))


async def settle(srv: Server) -> None:
    """The last grants' ``done`` runs when the peer's confirmation arrives: wait for it."""
    cm = srv.dd.cache_manager
    for _ in range(500):
        if cm.statistics().pins == 0:
            return
        await asyncio.sleep(0.01)


async def test_mutated_peer_requests_get_exactly_what_the_model_grants(
    aiokv_errors: Callable[[], list[str]], observed: None
) -> None:
    seed = fuzz_seed()
    # each event loop (the test's parameter) runs its own stream of the seed
    rng = random.Random(f"{seed}/{type(asyncio.get_running_loop()).__module__}")
    fuzzer = TcpTransport(FUZZER, Refusing(CODE.LLM_PARAM_INVALID), secret=SECRET.encode())
    async with serving(SA, True, rng) as a, serving(SB, False, rng) as b:
        try:
            for srv in (a, b):
                assert srv.dd.listen_address is not None
                srv.link = await fuzzer.connect(*srv.dd.listen_address, timeout=5)
            used = {s.cid: s.dd.cache_manager.get_pool_stats(Placement.HOST) for s in (a, b)}
            tally = Tally()
            t0 = time.monotonic()
            loop = asyncio.get_running_loop()
            debug = loop.get_debug()
            loop.set_debug(False)  # its stack captures cost 3/4 of the run; back on below
            try:
                for n in range(REQUESTS):
                    assert time.monotonic() - t0 < WALL_S, f"seed {seed}: {n} requests, {WALL_S} s"
                    srv, other = (a, b) if rng.random() < 0.75 else (b, a)
                    await one(rng, seed, n, srv, other, tally)
                    if len(srv.keys) < 2:
                        await settle(srv)
                        await srv.rebind_slot_keys(rng)
            finally:
                loop.set_debug(debug)
            elapsed = time.monotonic() - t0
            assert not tally.false_refusals, (
                f"seed {seed}: {len(tally.false_refusals)} false refusals; first: "
                f"{tally.false_refusals[0]}"
            )
            assert tally.granted > REQUESTS // 10, f"seed {seed}: only {tally.granted} granted"
            for kind in KINDS:  # every request kind, keyed every way, was served
                assert tally.kinds.get(kind, 0) > 0, f"seed {seed}: no {kind} granted {tally}"
            assert tally.released > 0, f"seed {seed}: no pull released its CacheKey {tally}"
            for srv in (a, b):
                await settle(srv)
                cm = srv.dd.cache_manager
                stats = cm.statistics()
                assert stats.pins == 0, f"seed {seed}: pins left on {srv.cid}: {stats}"
                pool = cm.get_pool_stats(Placement.HOST)
                assert pool is not None and used[srv.cid] is not None
                assert pool.used == used[srv.cid].used, f"seed {seed}: pool {pool}"
                srv.check_memory(seed, "after the fuzz")
            assert aiokv_errors() == [], f"seed {seed}: ERROR logged: {aiokv_errors()[:3]}"
            await a.link.aclose()  # type: ignore[union-attr]
            await a_real_client_still_pulls(a, seed)
            print(f"seed {seed}: {elapsed:.1f} s, {tally}")
        finally:
            await fuzzer.aclose()


async def a_real_client_still_pulls(srv: Server, seed: int) -> None:
    m = srv.blocks_keys[7]
    cfg = config(True)
    async with LLMDataDist(LLMRole.DECODER, CLIENT, cfg) as dd:
        cm = dd.cache_manager
        dst = await cm.allocate_blocks_cache(srv.desc(m.spec))
        assert srv.dd.listen_address is not None
        info = cluster_info(srv.cid, srv.dd.listen_address)
        assert (await dd.link_clusters([info], timeout=5000))[0] == CODE.LLM_SUCCESS
        await cm.pull_blocks(BlocksCacheKey(srv.cid, 7), dst, [5, 2, 9], [0, 1, 2])
        for t, got in enumerate(dst.tensors):
            rows = flat(got)[: 3 * m.unit].tobytes()
            want = b"".join(m.shadow[t][b * m.unit : (b + 1) * m.unit].tobytes() for b in (5, 2, 9))
            assert rows == want, f"seed {seed}: a real pull_blocks got wrong bytes"
        await cm.deallocate_blocks_cache(dst)


# ---- what the fuzz found, pinned down ------------------------------------------------------
def _registered_service() -> tuple[PeerService, Cache]:
    reg = CacheRegistry()
    desc = CacheDesc(1, [4, 64], DataType.DT_UINT8, Placement.HOST)
    cache = Cache(desc, [torch.zeros(4, 64, dtype=torch.uint8)], is_blocks_cache=False)
    reg.add(cache, [], remote_accessible=True)
    return PeerService(SA, reg, config(True)), cache


async def test_a_request_string_that_is_not_utf8_is_refused_as_invalid(
    aiokv_errors: Callable[[], list[str]],
) -> None:
    service, _ = _registered_service()
    meta = b"\x92\x01\x81\xa4type\xa4sl\xfft"  # the request tag is not UTF-8
    grant = await service.grant_read(PeerInfo(FUZZER, (HOST, 1)), meta)
    assert grant.status == CODE.LLM_PARAM_INVALID  # it escaped as UnicodeDecodeError
    assert aiokv_errors() == []


async def test_one_raw_block_at_any_stride_is_granted() -> None:
    service, cache = _registered_service()
    blocks = np.array([0], "<i8").tobytes()
    base = cache.tensors[0].data_ptr()
    req = {"type": "addrs", "bases": [base], "block_bytes": 32, "stride": I64, "blocks": blocks}
    meta = msgspec.msgpack.encode([2, req])
    grant = await service.grant_write(PeerInfo(FUZZER, (HOST, 1)), meta, 32)
    assert grant.status == CODE.LLM_SUCCESS, "block 0 lies at the base whatever the stride"
    assert grant.done is not None
    grant.done(False)
