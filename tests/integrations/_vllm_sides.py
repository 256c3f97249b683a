"""Shared set-up for the vLLM connector's worker-side tests: KV tensors in vLLM's CPU
layout, a linked prefill/decode pair of real ``WorkerSide`` instances, and a poll of
``WorkerSide.results()`` the way vLLM calls it each step."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from aiokv import LLMException
from aiokv.integrations.vllm import ConnectorOptions, WorkerSide
from aiokv.integrations.vllm._worker import TransferResults
from aiokv.transport import get_transport

LAYERS, BLOCKS, SHAPE = 3, 24, (2, 32, 2 * 16)  # CPU layout: [blocks, heads, bs, 2*head_dim]

Pair = tuple[WorkerSide, dict[str, torch.Tensor], WorkerSide, dict[str, torch.Tensor]]


def kv(seed: int) -> dict[str, torch.Tensor]:
    """One worker's KV tensors (``LAYERS`` layers), random but fixed by ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return {f"layer.{i}": torch.randn(BLOCKS, *SHAPE, generator=g) for i in range(LAYERS)}


@contextlib.contextmanager
def worker_pair(opts: ConnectorOptions) -> Iterator[Pair]:
    """A started prefill worker ("P") and decode worker ("D") with their KV
    tensors (seeds 1 and 2); skips the test when ``opts``' backend is nixl and nixl is
    unavailable; closes both workers afterwards."""
    if opts.transfer_backend == "nixl":
        try:
            get_transport("nixl")
        except LLMException as exc:
            pytest.skip(f"nixl: {exc}")
    p, d = WorkerSide(opts, engine_id="P", rank=0), WorkerSide(opts, engine_id="D", rank=0)
    pkv, dkv = kv(1), kv(2)
    p.start(pkv)
    try:
        d.start(dkv)
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
        assert torch.equal(dst_kv[name][dst], src_kv[name][src])
        rest = [b for b in range(BLOCKS) if b not in dst]
        assert torch.equal(dst_kv[name][rest], before[name][rest])
