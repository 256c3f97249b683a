"""What the transport tests share: span layouts over plain bytearrays and the data sets
of the scatter/gather and concurrency tests (made outside any event loop: generating
them would block it)."""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass
from typing import Any

from aiokv.transport import Link

KIB = 1 << 10


def js(obj: Any) -> bytes:
    """The fake cache layer's request encoding (transports carry opaque bytes)."""
    return json.dumps(obj).encode()


def layout(rng: random.Random, n: int, max_size: int, gap: int = 3) -> tuple[list[list[int]], int]:
    """``n`` spans of random sizes with guard gaps between them, in shuffled order."""
    spans, pos = [], gap
    for _ in range(n):
        size = rng.randint(1, max_size)
        spans.append([pos, size])
        pos += size + gap
    rng.shuffle(spans)
    return spans, pos


def views_of(buf: bytearray, spans: list[list[int]]) -> list[memoryview]:
    mv = memoryview(buf)
    return [mv[off : off + n] for off, n in spans]


def gather_spans(buf: bytes | bytearray, spans: list[list[int]]) -> bytes:
    return b"".join(bytes(buf[off : off + n]) for off, n in spans)


def outside_spans(buf: bytes | bytearray, spans: list[list[int]]) -> bytes:
    """Every byte not covered by ``spans`` (which must not overlap)."""
    out, pos = [], 0
    for off, n in sorted(spans):
        out.append(bytes(buf[pos:off]))
        pos = off + n
    out.append(bytes(buf[pos:]))
    return b"".join(out)


@dataclass
class Scatter:
    src: bytearray
    src_spans: list[list[int]]
    dst_len: int
    dst_spans: list[list[int]]


def make_scatter() -> Scatter:
    """1500 source buffers and 1100 destination buffers over ~6 MiB, split differently.

    Made outside the event loop: generating it would block the loop for a while.
    """
    rng = random.Random(1)
    src_spans, src_len = layout(rng, 1500, 8 * KIB)
    total = sum(n for _, n in src_spans)
    sizes = [total // 1100] * 1099 + [total - (total // 1100) * 1099]
    dst_spans, pos = [], 5
    for n in sizes:
        dst_spans.append([pos, n])
        pos += n + 5
    rng.shuffle(dst_spans)
    return Scatter(bytearray(rng.randbytes(src_len)), src_spans, pos, dst_spans)


@dataclass
class ManyOps:
    sizes: list[int]
    offsets: list[int]
    remote: bytearray
    locals_: list[bytearray]
    pushes: list[bytearray]


def make_many_ops() -> ManyOps:
    """Distinct random data for 200 ops, made outside the event loop."""
    rng = random.Random(4)
    sizes = [rng.randint(1, 120 * KIB) for _ in range(200)]
    offsets = [0]
    for s in sizes[:-1]:
        offsets.append(offsets[-1] + s)
    return ManyOps(
        sizes,
        offsets,
        bytearray(rng.randbytes(sum(sizes))),
        [bytearray(s) for s in sizes],
        [bytearray(rng.randbytes(s)) for s in sizes],
    )


async def run_many_ops(
    link_a: Link,
    link_b: Link,
    regions_a: dict[str, bytearray],
    regions_b: dict[str, bytearray],
    ops: ManyOps,
    op_timeout: float,
) -> None:
    """Issue every op of ``ops`` in the same loop iteration on one link: op ``i`` tagged
    ``i``, the odd ones reads by A from B's region ``"r"`` (set to ``ops.remote``), the even
    ones writes by B into A's region ``"w"`` (made here); each op bounded by ``op_timeout`` s, the
    whole by 60 s. Asserts that all were in flight at once and that every byte read or
    written is the op's own."""
    n, sizes, offsets = len(ops.sizes), ops.sizes, ops.offsets
    regions_b["r"] = ops.remote
    regions_a["w"] = bytearray(sum(sizes))
    start = asyncio.Barrier(n + 1)
    in_flight = peak = 0

    async def one(i: int) -> None:
        nonlocal in_flight, peak
        meta = js({"region": "r" if i % 2 else "w", "spans": [[offsets[i], sizes[i]]], "tag": i})
        await start.wait()  # every op is issued in the same loop iteration
        in_flight += 1
        peak = max(peak, in_flight)
        try:
            if i % 2:
                await link_a.read(meta, [memoryview(ops.locals_[i])], timeout=op_timeout)
            else:  # B pushes into A over the same link, concurrently
                await link_b.write(meta, [memoryview(ops.pushes[i])], timeout=op_timeout)
        finally:
            in_flight -= 1

    async with asyncio.timeout(60), asyncio.TaskGroup() as tg:
        for i in range(n):
            tg.create_task(one(i))
            if i % 10 == 9:  # debug mode makes task creation slow: do not block the loop
                await asyncio.sleep(0)
        await start.wait()
    assert peak == n
    for i in range(n):
        o, s = offsets[i], sizes[i]
        if i % 2:
            assert ops.locals_[i] == ops.remote[o : o + s], f"read {i} got foreign bytes"
        else:
            assert regions_a["w"][o : o + s] == ops.pushes[i], f"write {i} landed wrong"


async def assert_reads(link: Link, regions: dict[str, bytearray], data: bytes) -> None:
    """``link`` serves a pull: ``data``, put in the peer's region ``"r"`` (``regions``),
    is read back whole within 5 s."""
    regions["r"] = bytearray(data)
    got = bytearray(len(data))
    await link.read(js({"region": "r", "spans": [[0, len(data)]]}), [memoryview(got)], timeout=5)
    assert got == data
