"""A tiny decoder-only transformer over a paged KV cache, in plain torch: what the
``aiokv demo`` serves, prefill in one process and decode in another.

Pre-norm blocks (RMSNorm, multi-head attention with rotary position embeddings, a SiLU
MLP), random weights drawn from a fixed seed (nothing is
downloaded). The KV cache is paged as serving engines page it: ``kv[2 * i]`` and
``kv[2 * i + 1]`` are layer ``i``'s K and V, each ``[num_blocks, block_size, heads,
head_dim]``, and a request's *block table* lists which blocks hold its tokens (token
``t`` lives in block ``table[t // block_size]``, row ``t % block_size``). Those are the
tensors of an aiokv blocks cache (``CacheDesc(2 * layers, [num_blocks, block_size,
heads, head_dim], DataType.DT_FLOAT)``): the model reads and writes the cache in place.

Device-generic: the weights live on ``device`` (CPU, CUDA, NPU); the cache may live on
the same device or in host memory (each layer's rows are moved to ``device`` to compute).
Deterministic: the same weights, prompts, batch and shapes give the same bits, whichever
blocks hold the tokens, so a request decoded after its cache moved to other blocks (or
another process) yields exactly the tokens of one that never moved.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["ModelConfig", "TinyDecoder", "slots"]


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The shape of the model; ``seed`` fixes its weights."""

    layers: int = 4
    d_model: int = 256
    heads: int = 4
    ffn: int = 512
    vocab: int = 1024
    seed: int = 0
    rope_base: float = 10_000.0

    @property
    def head_dim(self) -> int:
        """``d_model // heads``."""
        return self.d_model // self.heads


def slots(table: Sequence[int], start: int, stop: int, block_size: int) -> list[int]:
    """Rows of the flattened cache (``block * block_size + offset``) of positions
    ``start .. stop - 1`` of a request with block table ``table``."""
    return [table[p // block_size] * block_size + p % block_size for p in range(start, stop)]


class TinyDecoder:
    """The model. ``prefill`` fills a batch's cache and returns each request's first
    token; ``decode`` appends one token per request (greedy)."""

    def __init__(self, config: ModelConfig, device: torch.device) -> None:
        if config.d_model % config.heads or config.head_dim % 2:
            raise ValueError(f"d_model {config.d_model} must split into even-sized heads")
        self.config = config
        self.device = device
        g = torch.Generator().manual_seed(config.seed)

        def w(*shape: int, scale: float) -> torch.Tensor:  # drawn on CPU: same on any device
            return (torch.randn(*shape, generator=g) * scale).to(device)

        d, f = config.d_model, config.ffn
        self.embed = w(config.vocab, d, scale=1.0)
        self.head = w(d, config.vocab, scale=d**-0.5)
        self.layers = [
            (
                w(d, 3 * d, scale=2 * d**-0.5),  # q, k, v (sharp attention)
                w(d, d, scale=d**-0.5),  # attention out
                w(d, 2 * f, scale=d**-0.5),  # gate, up
                w(f, d, scale=f**-0.5),  # down
            )
            for _ in range(config.layers)
        ]
        inv = config.rope_base ** (-torch.arange(0, config.head_dim, 2).double() / config.head_dim)
        self._inv_freq = inv.float().to(device)

    # ------------------------------------------------------------------------- parts
    @staticmethod
    def _norm(x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` ``[tokens, heads, head_dim]`` by each token's position."""
        angles = positions.float()[:, None] * self._inv_freq[None, :]  # [tokens, head_dim/2]
        cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)

    def _qkv(
        self, layer: int, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = self.config
        q, k, v = torch.split(self._norm(x) @ self.layers[layer][0], c.d_model, dim=-1)
        shape = (x.shape[0], c.heads, c.head_dim)
        return (
            self._rope(q.reshape(shape), positions),
            self._rope(k.reshape(shape), positions),
            v.reshape(shape),
        )

    def _store(
        self,
        kv: Sequence[torch.Tensor],
        layer: int,
        rows: list[int],
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """Write K, V of some tokens into their cache rows (in place)."""
        for t, x in ((kv[2 * layer], k), (kv[2 * layer + 1], v)):
            index = torch.tensor(rows, device=t.device)
            t.view(-1, *t.shape[2:]).index_copy_(0, index, x.to(t.device, t.dtype))

    def _load(
        self, kv: Sequence[torch.Tensor], layer: int, table: Sequence[int], length: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of the first ``length`` tokens of a request, ``[heads, length, head_dim]``."""
        out = []
        for t in (kv[2 * layer], kv[2 * layer + 1]):
            blocks = torch.tensor(list(table[: math.ceil(length / t.shape[1])]), device=t.device)
            rows = t.index_select(0, blocks).flatten(0, 1)[:length]
            out.append(rows.to(self.device, torch.float32).transpose(0, 1))
        return out[0], out[1]

    def _finish(self, layer: int, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        _, wo, w_in, w_out = self.layers[layer]
        x = x + attn @ wo
        gate, up = (self._norm(x) @ w_in).chunk(2, dim=-1)
        return x + (F.silu(gate) * up) @ w_out

    def _layers(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rows: list[int],
        spans: Sequence[tuple[Sequence[int], int, int]],
        kv: Sequence[torch.Tensor],
        on_layer: Callable[[int], None] = lambda layer: None,
    ) -> torch.Tensor:
        """Every layer over the packed tokens ``x`` (at ``positions``; their K, V go to
        cache ``rows``). Request ``j``'s ``spans[j] = (table, queries, cached)``: its next
        ``queries`` tokens of ``x`` attend to its first ``cached`` tokens in the cache
        (itself included; causally among themselves). ``on_layer(i)``: after layer
        ``i``'s K, V are stored."""
        for layer in range(self.config.layers):
            q, k, v = self._qkv(layer, x, positions)
            self._store(kv, layer, rows, k, v)
            on_layer(layer)
            parts, start = [], 0
            for table, queries, cached in spans:
                kk, vv = self._load(kv, layer, table, cached)
                o = F.scaled_dot_product_attention(
                    q[start : start + queries].transpose(0, 1), kk, vv, is_causal=queries > 1
                )
                parts.append(o.transpose(0, 1).reshape(queries, -1))
                start += queries
            x = self._finish(layer, x, torch.cat(parts))
        return x

    def _logits_argmax(self, h: torch.Tensor) -> list[int]:
        return [int(t) for t in (self._norm(h) @ self.head).argmax(-1).tolist()]

    # ------------------------------------------------------------------------- passes
    @torch.inference_mode()
    def prefill(
        self,
        prompts: Sequence[Sequence[int]],
        tables: Sequence[Sequence[int]],
        kv: Sequence[torch.Tensor],
        on_layer: Callable[[int], None] = lambda layer: None,
    ) -> list[int]:
        """Run the prompts (packed, no padding) through every layer, writing each
        token's K and V into the cache rows its block table names; return each prompt's
        first generated token.

        ``on_layer(i)`` is called as soon as layer ``i``'s K and V of every prompt are in
        the cache (work queued on an accelerator may still be running: record an event
        there): from then on layer ``i``'s blocks may be sent.
        """
        bs = kv[0].shape[1]
        lens = [len(p) for p in prompts]
        tokens = torch.tensor([t for p in prompts for t in p], device=self.device)
        positions = torch.cat([torch.arange(n) for n in lens]).to(self.device)
        rows = [r for tab, n in zip(tables, lens, strict=True) for r in slots(tab, 0, n, bs)]
        spans = [(tab, n, n) for tab, n in zip(tables, lens, strict=True)]
        x = self._layers(self.embed[tokens], positions, rows, spans, kv, on_layer)
        last = torch.tensor([sum(lens[: i + 1]) - 1 for i in range(len(lens))], device=self.device)
        return self._logits_argmax(x[last])

    @torch.inference_mode()
    def decode(
        self,
        tokens: Sequence[int],
        lengths: Sequence[int],
        tables: Sequence[Sequence[int]],
        kv: Sequence[torch.Tensor],
    ) -> list[int]:
        """One greedy step for a batch: ``tokens[j]`` goes at position ``lengths[j]`` of
        request ``j`` (its K, V written into the cache), attending to the request's
        ``lengths[j]`` cached tokens and itself; returns the next token of each."""
        bs = kv[0].shape[1]
        positions = torch.tensor(list(lengths), device=self.device)
        rows = [slots(tab, n, n + 1, bs)[0] for tab, n in zip(tables, lengths, strict=True)]
        x = self.embed[torch.tensor(list(tokens), device=self.device)]
        spans = [(tab, 1, n + 1) for tab, n in zip(tables, lengths, strict=True)]
        return self._logits_argmax(self._layers(x, positions, rows, spans, kv))

    def generate(
        self,
        first: Sequence[int],
        prompt_lens: Sequence[int],
        tables: Sequence[Sequence[int]],
        kv: Sequence[torch.Tensor],
        steps: int,
        on_token: Callable[[int], None] = lambda step: None,
    ) -> list[list[int]]:
        """Decode ``steps`` tokens per request after prefill: ``first[j]`` (prefill's
        token) is fed back at position ``prompt_lens[j]``, and so on. Each table must
        cover ``prompt_lens[j] + steps`` tokens. ``on_token(step)`` follows every step.
        Returns each request's ``steps`` new tokens."""
        out: list[list[int]] = [[] for _ in first]
        tokens, lengths = list(first), list(prompt_lens)
        for step in range(steps):
            tokens = self.decode(tokens, lengths, tables, kv)
            on_token(step)
            for j, t in enumerate(tokens):
                out[j].append(t)
            lengths = [n + 1 for n in lengths]
        return out
