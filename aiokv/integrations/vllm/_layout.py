"""vLLM's KV tensors as one aiokv blocks cache: which layouts move, and how they are
viewed (blocks first, K and V halves apart), without copying."""

from __future__ import annotations

import torch

from ... import CacheDesc
from ... import Placement

__all__ = ["blocks_desc", "logical_blocks", "split_kv"]


def split_kv(tensors: list[torch.Tensor], num_blocks: int | None) -> tuple[list[torch.Tensor], int]:
    """vLLM's per-layer KV tensors as tensors with the blocks first, and how many of them
    each layer gives: FlashAttention's layout ``[2, num_blocks, ...]`` (K and V apart,
    the blocks second) gives each layer's K and V halves, two per layer, each a view
    ``[num_blocks, ...]`` of the same memory; layouts with the blocks first (vLLM's CPU
    layout, FlashInfer's ``[num_blocks, 2, ...]``) are one per layer, as they are.
    Without ``num_blocks`` the blocks are taken to come first."""
    if not num_blocks or not tensors:
        return tensors, 1
    n = num_blocks
    if all(t.dim() >= 3 and t.shape[0] == 2 and n > 2 and t.shape[1] % n == 0 for t in tensors):
        return [half for t in tensors for half in t.unbind(0)], 2
    return tensors, 1


def logical_blocks(tensors: list[torch.Tensor], num_blocks: int | None) -> list[torch.Tensor]:
    """``tensors`` viewed with vLLM's (logical) blocks first: a contiguous tensor of
    ``r * num_blocks`` kernel blocks (a kernel block size ``r`` times smaller than the
    scheduler's) becomes ``[num_blocks, r, ...]`` over the same memory; others are
    returned as they are (and checked by :func:`blocks_desc`)."""
    if num_blocks is None or num_blocks <= 0:
        return tensors
    out = []
    for t in tensors:
        rows = t.shape[0] if t.dim() else 0
        if t.is_contiguous() and rows > num_blocks and rows % num_blocks == 0:
            t = t.view(num_blocks, rows // num_blocks, *t.shape[1:])
        out.append(t)
    return out


def blocks_desc(tensors: list[torch.Tensor], num_blocks: int | None = None) -> CacheDesc:
    """The ``CacheDesc`` of vLLM's per-layer KV tensors as one blocks cache: every
    tensor the same shape, dtype and device, contiguous, blocks along dimension 0
    (vLLM's CPU layout ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]``, or
    any other whose first dimension is the blocks).

    Raises:
        ValueError: no tensors, or tensors that do not form one blocks cache (with
            ``num_blocks``: whose first dimension is not ``num_blocks``).
    """
    if not tensors:
        raise ValueError("AiokvConnector: no KV cache tensors to register")
    first = tensors[0]
    if num_blocks is not None and first.shape[0] != num_blocks:
        raise ValueError(
            f"AiokvConnector: KV tensors of shape {tuple(first.shape)} for {num_blocks} "
            "blocks: this KV layout does not put the blocks first or second (supported: "
            "[num_blocks, ...] per layer, as vLLM's CPU and FlashInfer layouts, and "
            "FlashAttention's [2, num_blocks, ...])"
        )
    for i, t in enumerate(tensors):
        if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
            raise ValueError(
                f"AiokvConnector: KV tensor {i} is {tuple(t.shape)} {t.dtype} on {t.device}, "
                f"tensor 0 {tuple(first.shape)} {first.dtype} on {first.device}: layers of "
                "different shapes (hybrid models) are not supported"
            )
        if not t.is_contiguous() or t.dim() < 2:
            raise ValueError(
                f"AiokvConnector: KV tensor {i} ({tuple(t.shape)}, strides {t.stride()}) is "
                "not a contiguous tensor whose first dimension is the blocks"
            )
    return CacheDesc(len(tensors), list(first.shape), first.dtype, Placement.DEVICE)
