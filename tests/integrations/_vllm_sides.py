"""Shared set-up for the vLLM connector's worker-side tests: KV tensors in vLLM's CPU
layout, a linked prefill/decode pair of real ``WorkerSide`` instances, and a poll of
``WorkerSide.results()`` the way vLLM calls it each step."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from aiokv import LLMException
from aiokv.integrations.vllm import ConnectorOptions
from aiokv.integrations.vllm import WorkerSide
from aiokv.integrations.vllm._plan import Reserve
from aiokv.integrations.vllm._worker import TransferResults
from aiokv.transport import get_transport

LAYERS, BLOCKS, SHAPE = 3, 24, (2, 32, 2 * 16)  # CPU layout: [blocks, heads, bs, 2*head_dim]
BS = SHAPE[1]  # tokens per block

Pair = tuple[WorkerSide, dict[str, torch.Tensor], WorkerSide, dict[str, torch.Tensor]]


#: FlashAttention's layout: K and V apart, then the blocks: [2, blocks, bs, heads, head_dim]
FLASH_SHAPE = (2, BLOCKS, BS, 2, 16)


def kv(seed: int, device: str = "cpu", layout: str = "blocks") -> dict[str, torch.Tensor]:
    """One worker's KV tensors (``LAYERS`` layers) on ``device``, random but fixed by
    ``seed``; ``layout`` "blocks" (vLLM's CPU layout) or "flash" (FlashAttention's)."""
    g = torch.Generator().manual_seed(seed)
    shape = FLASH_SHAPE if layout == "flash" else (BLOCKS, *SHAPE)
    return {f"layer.{i}": torch.randn(*shape, generator=g).to(device) for i in range(LAYERS)}


def blockwise(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed with the blocks first (FlashAttention's layout: the blocks second)."""
    return t.transpose(0, 1) if tuple(t.shape) == FLASH_SHAPE else t


@contextlib.contextmanager
def worker_pair(
    opts: ConnectorOptions, device: str = "cpu", layout: str = "blocks"
) -> Iterator[Pair]:
    """A started prefill worker ("P") and decode worker ("D") with their KV
    tensors on ``device`` in ``layout`` (seeds 1 and 2; see :func:`kv`), started as
    vLLM starts them (with its block count); skips the test when ``opts``' backend is
    nixl and nixl is unavailable; closes both workers afterwards."""
    if opts.transfer_backend == "nixl":
        try:
            get_transport("nixl")
        except LLMException as exc:
            pytest.skip(f"nixl: {exc}")
    p, d = WorkerSide(opts, engine_id="P", rank=0), WorkerSide(opts, engine_id="D", rank=0)
    pkv, dkv = kv(1, device, layout), kv(2, device, layout)
    p.start(pkv, BLOCKS)
    try:
        d.start(dkv, BLOCKS)
        try:
            yield p, pkv, d, dkv
        finally:
            d.close()
    finally:
        p.close()


def wait_for(
    side: WorkerSide, pred: Any, timeout: float = 20.0, also: WorkerSide | None = None
) -> TransferResults:
    """Poll ``side.results()`` (as vLLM does each step) until ``pred(accumulated)``;
    ``also``: another side stepping meanwhile (its results are dropped). Fails the test
    after ``timeout`` seconds."""
    acc = TransferResults()
    end = time.monotonic() + timeout
    while True:
        if also is not None:
            also.results()
        got = side.results()
        acc.finished_sending |= got.finished_sending
        acc.finished_recving |= got.finished_recving
        acc.failed_recving |= got.failed_recving
        if pred(acc):
            return acc
        assert time.monotonic() < end, f"not within {timeout} s: {acc}"
        time.sleep(0.01)


def assert_copied(
    src_kv: dict[str, torch.Tensor],
    src: list[int],
    dst_kv: dict[str, torch.Tensor],
    dst: list[int],
    before: dict[str, torch.Tensor],
) -> None:
    """Every layer's blocks ``src`` of ``src_kv`` stand in blocks ``dst`` of ``dst_kv``,
    and every other block of ``dst_kv`` is as it was in ``before`` (nothing else written)."""
    for name in src_kv:
        into, was = blockwise(dst_kv[name]), blockwise(before[name])
        assert torch.equal(into[dst], blockwise(src_kv[name])[src])
        rest = [b for b in range(BLOCKS) if b not in dst]
        assert torch.equal(into[rest], was[rest])


def options(backend: str = "tcp", **extra: Any) -> ConnectorOptions:
    """Push-mode connector options over ``backend`` with short test bounds."""
    return ConnectorOptions.parse(
        {
            "mode": "push",
            "transfer_timeout_ms": 3000,
            "link_timeout_ms": 2000,
            "transfer_backend": backend,
            **extra,
        }
    )


def reserved(p: WorkerSide, transfer: str, timeout: float = 20.0) -> None:
    """Poll the prefill (as vLLM does each step) until its rank reports ``transfer``."""
    end = time.monotonic() + timeout
    seen: dict[str, int] = {}
    while transfer not in seen:
        p.results()
        seen.update(p.take_reserved())
        assert time.monotonic() < end, f"no reservation {transfer!r} within {timeout} s"
        time.sleep(0.01)
    assert seen == {transfer: 1}


def reserve(p: WorkerSide, rid: str, transfer: str, local: list[int], **kw: Any) -> Reserve:
    """The decode's reservation of ``local`` blocks with prefill ``p`` (``first``,
    ``tokens``: optional)."""
    assert p.endpoint is not None
    first = kw.get("first", 0)
    tokens = kw.get("tokens", (first + len(local)) * BS)
    return Reserve(rid, transfer, tuple(local), first, tokens, (p.endpoint,))


def stuck_pushes(monkeypatch: pytest.MonkeyPatch, p: WorkerSide) -> list[float]:
    """Make every layer push of ``p`` a link that moves nothing (for 30 s); returns
    the start times of the pushes in flight (empty once every one has ended)."""
    writing: list[float] = []

    async def stuck(*args: Any, **kwargs: Any) -> None:
        writing.append(time.monotonic())
        try:
            await asyncio.sleep(30)
        finally:
            writing.pop()

    assert p._dd is not None
    monkeypatch.setattr(p._dd.cache_manager, "push_blocks", stuck)
    return writing
