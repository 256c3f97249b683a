"""Data, references and job bodies shared by the copy-engine tests."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest
import torch

CPU = torch.device("cpu")
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def rand_tensor(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random bytes seen as ``dtype``: NaN payloads and denormals included on purpose."""
    *lead, last = shape
    raw = torch.randint(0, 256, (*lead, last * dtype.itemsize), dtype=torch.uint8, generator=gen)
    return raw.view(dtype)


def expected(
    src: list[torch.Tensor], dst: list[torch.Tensor], pairs: list[tuple[int, int]]
) -> list[torch.Tensor]:
    """Reference result, one block at a time: reads all sources before any write."""
    out = [d.clone() for d in dst]
    for s, o in zip(src, out, strict=True):
        snap = s.clone()
        for a, b in pairs:
            o[b] = snap[a]
    return out


def assert_bytes_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape
    assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


PAIR_KINDS = ["random", "contiguous", "dst_consecutive", "src_consecutive", "mixed"]


def make_pairs(kind: str, n: int, rows: int, rng: random.Random) -> list[tuple[int, int]]:
    if kind == "random":
        return list(zip(rng.sample(range(rows), n), rng.sample(range(rows), n), strict=True))
    if kind == "contiguous":
        return [(i, rows - n + i) for i in range(n)]
    if kind == "dst_consecutive":
        return list(zip(rng.sample(range(rows), n), range(3, 3 + n), strict=True))
    if kind == "src_consecutive":
        return list(zip(range(2, 2 + n), rng.sample(range(rows), n), strict=True))
    assert kind == "mixed"  # a few long runs plus scattered singles
    long_runs = [(i, i + 40) for i in range(0, 12)] + [(20 + i, 70 + i) for i in range(9)]
    singles = list(zip(rng.sample(range(30, 40), 5), rng.sample(range(0, 30), 5), strict=True))
    return long_runs + singles


WITHIN_ONE_TENSOR = {
    # copy-on-write forks: 0..9 -> 20..29 (a slice) and scattered singles
    "disjoint": [(i, 20 + i) for i in range(10)] + [(40, 50), (41, 60), (40, 61)],
    "dst_consecutive": [(50, 3), (45, 4), (60, 5), (41, 6)],
    "src_consecutive": [(3, 50), (4, 45), (5, 60), (6, 41)],
    "chained": [(i, i + 1) for i in range(30)],  # a destination is also a source
}


class Gate:
    """A job body that reports its start to the loop and blocks until released."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.started = asyncio.Event()
        self.release = threading.Event()
        self.finished = False

    def __call__(self) -> str:
        self.loop.call_soon_threadsafe(self.started.set)
        self.release.wait()
        self.finished = True
        return "done"


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
