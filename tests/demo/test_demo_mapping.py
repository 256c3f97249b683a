"""The demo's "tokens identical" cannot pass vacuously: a decoder that reads its cache
through a wrong block table decodes other tokens, and the demo says so and fails."""

from __future__ import annotations

import io
import random

import pytest
import torch
from rich.console import Console

from aiokv._demo import DemoMismatch
from aiokv._demo import DemoOptions
from aiokv._demo import run_demo
from aiokv._demo._roles import _rotated
from aiokv.examples.tiny_model import ModelConfig
from aiokv.examples.tiny_model import TinyDecoder


def _generate(
    model: TinyDecoder, tables: list[list[int]], reads: list[list[int]]
) -> list[list[int]]:
    c, bs, steps = model.config, 8, 4
    rng = random.Random(1)
    prompts = [[rng.randrange(c.vocab) for _ in range(n)] for n in (20, 13)]
    kv = [torch.randn(32, bs, c.heads, c.head_dim) for _ in range(2 * c.layers)]  # garbage
    first = model.prefill(prompts, tables, kv)
    return model.generate(first, [len(p) for p in prompts], reads, kv, steps)


def test_the_model_decodes_the_same_tokens_from_any_blocks_and_others_from_wrong_ones() -> None:
    model = TinyDecoder(ModelConfig(layers=2, d_model=64, heads=2), torch.device("cpu"))
    a = [[0, 1, 2], [3, 4, 5]]
    b = [[17, 5, 30], [9, 22, 11]]
    assert _generate(model, a, a) == _generate(model, b, b)
    wrong = list(_rotated(dict(enumerate(b))).values())
    assert wrong != b
    assert sorted(x for t in wrong for x in t) == sorted(x for t in b for x in t)
    assert _generate(model, b, wrong) != _generate(model, b, b)


def test_a_wrong_block_table_on_the_decoder_is_reported_as_a_mismatch() -> None:
    opts = DemoOptions(prompts=2, prompt_len=40, layers=2, steps=4, corrupt=True)
    out = io.StringIO()
    with pytest.raises(DemoMismatch, match="differ from the colocated run"):
        run_demo(opts, Console(file=out, width=160))
    report = out.getvalue()
    assert "tokens DIFFER" in report
    assert "MISMATCH" in report
    assert "tokens identical" not in report
