"""What the demo serves, decided from its options alone: every process derives the same
prompts, the same split of requests among decoders and the same cache shapes.

Block tables are NOT decided here: each side allocates its own blocks from its own pool
(:class:`BlockPool`), and the decoder tells the prefill where to put each request.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Literal

__all__ = ["PROMPT_ID", "BlockPool", "DemoOptions", "Request", "decoder_id", "requests"]

#: The prefill participant's cluster id; decoder ``k`` is :func:`decoder_id` ``(k)``.
PROMPT_ID = 1


def decoder_id(k: int) -> int:
    """Cluster id of decoder ``k`` (its blocks cache is ``BlocksCacheKey(decoder_id(k))``)."""
    return 100 + k


@dataclass(frozen=True, slots=True)
class DemoOptions:
    """The demo's knobs (``aiokv demo --help``).

    Attributes:
        prompts: requests in the batch.
        prompt_len: the longest prompt; the others are shorter (down to half).
        layers: transformer layers (the cache has K and V per layer).
        block_size: tokens per KV block.
        steps: tokens each decoder generates per request after the prefill's first one.
        backend: the transport between the processes (``tcp``, or ``nixl`` when installed).
        decoders: decode processes; requests are dealt round-robin among them.
        device: ``auto`` (npu, cuda, cpu, as ``LLMConfig.device_type``) or one of them.
        rounds: timed rounds of each kind (serial, layer-wise); every figure is the
            median over them.
        d_model / heads: the model's width and attention heads.
        seed: fixes the weights and the prompts.
        corrupt: test only: decoders read their cache through a wrong block table (a
            rotation of their blocks), so their tokens must differ from the colocated run.
    """

    prompts: int = 4
    prompt_len: int = 96
    layers: int = 4
    block_size: int = 16
    steps: int = 16
    backend: Literal["tcp", "nixl"] = "tcp"
    decoders: int = 1
    device: Literal["auto", "cpu", "cuda", "npu"] = "auto"
    rounds: int = 3
    d_model: int = 256
    heads: int = 4
    seed: int = 0
    corrupt: bool = False

    def check(self) -> None:
        """Raise ``ValueError`` naming the first option out of range."""
        limits = {
            "prompts": (self.prompts, 1, 256),
            "prompt_len": (self.prompt_len, 1, 8192),
            "layers": (self.layers, 1, 64),
            "block_size": (self.block_size, 1, 1024),
            "steps": (self.steps, 1, 1024),
            "decoders": (self.decoders, 1, 8),
            "rounds": (self.rounds, 2, 50),
            "heads": (self.heads, 1, 64),
            "d_model": (self.d_model, 2, 8192),
        }
        for name, (value, lo, hi) in limits.items():
            if not lo <= value <= hi:
                raise ValueError(f"--{name.replace('_', '-')} {value} is not in [{lo}, {hi}]")
        if self.d_model % self.heads or (self.d_model // self.heads) % 2:
            raise ValueError(f"--d-model {self.d_model} must split into {self.heads} even heads")
        if self.decoders > self.prompts:
            raise ValueError(
                f"{self.decoders} decoders for {self.prompts} prompts: some would idle"
            )


@dataclass(frozen=True, slots=True)
class Request:
    """One prompt: its tokens and the decoder that generates its continuation."""

    index: int
    tokens: tuple[int, ...]
    decoder: int


def requests(opts: DemoOptions, vocab: int) -> list[Request]:
    """The batch: ``opts.prompts`` prompts of different lengths (from ``prompt_len`` down
    to about half of it), random tokens from ``opts.seed``, dealt round-robin to the
    decoders."""
    rng = random.Random(opts.seed)
    out = []
    for i in range(opts.prompts):
        n = max(1, opts.prompt_len - (i * opts.prompt_len) // (2 * opts.prompts))
        out.append(Request(i, tuple(rng.randrange(vocab) for _ in range(n)), i % opts.decoders))
    return out


class BlockPool:
    """A participant's free blocks, handed out in a shuffled order of its own (as a
    serving engine's block manager does after a while): its block ids are its business.
    """

    def __init__(self, num_blocks: int, seed: int | None) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks))
        if seed is not None:
            random.Random(seed).shuffle(self._free)
        self._free.reverse()  # pop() from the end hands them out in the order above

    @staticmethod
    def blocks_for(tokens: int, block_size: int) -> int:
        """Blocks that hold ``tokens`` tokens."""
        return math.ceil(tokens / block_size)

    def table(self, tokens: int, block_size: int) -> list[int]:
        """A block table for ``tokens`` tokens.

        Raises:
            RuntimeError: the pool is out of blocks.
        """
        n = self.blocks_for(tokens, block_size)
        if n > len(self._free):
            raise RuntimeError(f"{n} blocks wanted, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]
