"""Layer-wise push mode and ``kv_both`` through ``AiokvConnector`` under real vLLM.

Two engines, each ``kv_role="kv_both"`` with ``"mode": "push"`` (a short lease, for the
failure scenarios), each in its own process: ``a`` prefills and ``b`` decodes in push
mode; the roles swap for a pull through the same pair. The single-instance tokens come
from plain requests (no ``kv_transfer_params``: the connector takes no part) on ``a``;
test_disaggregated.py checks such tokens against an engine without any connector.

The push flow is the proxy's (docs/vllm.md): discover the prefill's endpoints once, then
send the prefill request and the decode request at once, tied by a fresh transfer id.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from tiny_model import make_tiny_llama
from vllm_harness import BLOCK_SIZE
from vllm_harness import CONNECTOR
from vllm_harness import LENGTHS
from vllm_harness import MAX_TOKENS
from vllm_harness import EngineProcess
from vllm_harness import Output
from vllm_harness import Request
from vllm_harness import assert_freed
from vllm_harness import kv_config
from vllm_harness import prompts
from vllm_harness import running
from vllm_harness import single_tokens

pytestmark = pytest.mark.timeout(900)

LEASE_S = 15.0


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, EngineProcess]]:
    model = str(make_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))
    name, module = CONNECTOR
    both = kv_config("kv_both", name, module, mode="push", lease_timeout_s=LEASE_S)
    with running({key: (model, {"kv_transfer_config": both}) for key in ("a", "b")}) as started:
        yield started


@pytest.fixture(scope="module")
def baseline(engines: dict[str, EngineProcess]) -> dict[tuple[int, ...], list[int]]:
    every = prompts(LENGTHS) + prompts([96, 96], seed=1) + prompts([40, 100], seed=2)
    return single_tokens(engines["a"], every)


def discover(prefill: EngineProcess) -> dict[str, Any]:
    """The proxy's first step, once per prefill instance: where its ranks listen."""
    (out,) = prefill.generate([Request([5, 6, 7], 1, {"aiokv_discover": True})])
    assert out.kv_transfer_params is not None and out.kv_transfer_params["mode"] == "push"
    return out.kv_transfer_params


def push(
    prefill: EngineProcess,
    decode: EngineProcess,
    on_prefill: list[list[int]],
    on_decode: list[list[int]],
    *,
    decode_first: bool = True,
) -> tuple[list[Output], list[Output]]:
    """The proxy's push flow: both requests at once, tied by a fresh transfer id each."""
    endpoints = discover(prefill)
    ids = [uuid.uuid4().hex for _ in on_decode]
    decode_requests = [
        Request(p, MAX_TOKENS, {**endpoints, "do_remote_prefill": True, "transfer_id": t})
        for p, t in zip(on_decode, ids, strict=True)
    ]
    prefill_requests = [
        Request(p, 1, {"do_remote_decode": True, "transfer_id": t})
        for p, t in zip(on_prefill, ids, strict=True)
    ]
    first, second = (decode, prefill) if decode_first else (prefill, decode)
    first.submit(decode_requests if decode_first else prefill_requests)
    second.submit(prefill_requests if decode_first else decode_requests)
    return prefill.collect(), decode.collect()


def shuffle_free_blocks(engine: EngineProcess) -> None:
    """Local requests of 40 blocks on ``engine``, freed in reverse order: its next blocks
    are not the ids (in the order) its partner uses first, so equal ids on both sides
    cannot pass for a transfer."""
    engine.generate([Request(p, 1) for p in prompts([639, 639], seed=99)])


def all_freed(*engines: EngineProcess) -> None:
    for engine in engines:
        assert_freed(engine)


@pytest.mark.parametrize("decode_first", [True, False], ids=["decode-first", "prefill-first"])
def test_push_gives_the_single_instance_tokens(
    engines: dict[str, EngineProcess],
    baseline: dict[tuple[int, ...], list[int]],
    decode_first: bool,
) -> None:
    pre, dec = engines["a"], engines["b"]
    batch = prompts(LENGTHS)
    shuffle_free_blocks(dec)
    first, out = push(pre, dec, batch, batch, decode_first=decode_first)
    for p, o in zip(batch, first, strict=True):
        assert o.token_ids == baseline[tuple(p)][:1]
        assert o.kv_transfer_params is not None and o.kv_transfer_params["pushed"] is True
    assert [o.token_ids for o in out] == [baseline[tuple(p)] for p in batch]
    assert all(o.finish_reason == "length" for o in out)
    # the prefill pushed into the decode's OWN blocks, not into its own block ids
    held, loaded = pre.blocks()["finished"], dec.blocks()["loaded"]
    for p in batch:
        assert len(loaded[tuple(p)]) >= -(-len(p) // BLOCK_SIZE)
        if len(p) > BLOCK_SIZE:
            n = len(loaded[tuple(p)])
            assert loaded[tuple(p)] != held[tuple(p)][:n], (loaded[tuple(p)], held[tuple(p)])
    all_freed(pre, dec)


def test_push_negative_control_other_prompt_other_tokens(
    engines: dict[str, EngineProcess], baseline: dict[tuple[int, ...], list[int]]
) -> None:
    """The prefill computes B under A's transfer id: the decode of A gets B's KV, so not
    A's tokens; the decode of B through a proper pair gets B's."""
    pre, dec = engines["a"], engines["b"]
    a, b = prompts([96, 96], seed=1)
    _, (out_a,) = push(pre, dec, [b], [a])
    assert out_a.token_ids != baseline[tuple(a)]
    _, (out_b,) = push(pre, dec, [b], [b])
    assert out_b.token_ids == baseline[tuple(b)]
    all_freed(pre, dec)


def test_kv_both_pulls_in_the_other_direction(
    engines: dict[str, EngineProcess], baseline: dict[tuple[int, ...], list[int]]
) -> None:
    """The same kv_both pair, roles swapped, in pull mode (no transfer id)."""
    pre, dec = engines["b"], engines["a"]
    batch = prompts(LENGTHS)[2:7]
    first = pre.generate([Request(p, 1, {"do_remote_decode": True}) for p in batch])
    assert all(o.kv_transfer_params is not None for o in first)
    out = dec.generate(
        [Request(p, MAX_TOKENS, o.kv_transfer_params) for p, o in zip(batch, first, strict=True)]
    )
    assert [o.token_ids for o in out] == [baseline[tuple(p)] for p in batch]
    all_freed(pre, dec)


def test_push_halves_without_their_partner_end_within_the_lease(
    engines: dict[str, EngineProcess], baseline: dict[tuple[int, ...], list[int]]
) -> None:
    """A decode whose prefill never comes fails (policy "fail"); a prefill whose decode
    never comes computes after the lease and hands nothing over; all blocks are freed,
    and the pair then serves a push as before."""
    pre, dec = engines["a"], engines["b"]
    x, y = prompts([40, 100], seed=2)
    endpoints = discover(pre)
    start = time.monotonic()
    decode_params = {**endpoints, "do_remote_prefill": True, "transfer_id": uuid.uuid4().hex}
    dec.submit([Request(x, MAX_TOKENS, decode_params)])
    pre.submit([Request(y, 1, {"do_remote_decode": True, "transfer_id": uuid.uuid4().hex})])
    (lonely_prefill,) = pre.collect(timeout=LEASE_S + 120)
    (lonely_decode,) = dec.collect(timeout=LEASE_S + 120)
    assert time.monotonic() - start >= LEASE_S * 0.9
    assert lonely_decode.finish_reason == "error", lonely_decode
    assert lonely_prefill.token_ids == baseline[tuple(y)][:1]
    params = lonely_prefill.kv_transfer_params
    assert params is not None and params["pushed"] is False and "no decode side" in params["error"]
    all_freed(pre, dec)
    _, out = push(pre, dec, [x], [x])
    assert [o.token_ids for o in out] == [baseline[tuple(x)]]
