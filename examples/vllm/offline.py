"""Prefill on one vLLM engine, decode on another; the KV moves with aiokv's AiokvConnector.

vLLM's offline API (``vllm.LLM``), two engines in two processes on one host, no extra
config: the prefill engine (``kv_producer``) computes each prompt with ``max_tokens=1``
and ``kv_transfer_params={"do_remote_decode": True}``; the decode engine
(``kv_consumer``) gets the prompt again with the prefill output's ``kv_transfer_params``,
verbatim, pulls the prompt's KV blocks from the prefill and generates the rest.

    python examples/vllm/offline.py --model Qwen/Qwen2.5-0.5B-Instruct
    python examples/vllm/offline.py --model DIR --token-ids '[[5, 6, 7], [8, 9]]' --json

``--token-ids`` runs without a tokenizer (``skip_tokenizer_init``); ``--json`` prints one
JSON object per prompt (``{"token_ids": [...], "text": ...}``). See docs/vllm.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
from multiprocessing.connection import Connection
from typing import Any

CONNECTOR = {
    "kv_connector": "AiokvConnector",
    "kv_connector_module_path": "aiokv.integrations.vllm",
}
PROMPTS = [
    "The capital of France is",
    "Disaggregated inference splits an LLM request into a prefill and a decode, which",
    "Write a haiku about key-value caches:",
]


def engine(conn: Connection, role: str, args: dict[str, Any]) -> None:
    """One engine's process: answer (prompts, sampling params) pairs until None."""
    from vllm import LLM
    from vllm import SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kv = KVTransferConfig(kv_role=role, **CONNECTOR)
    llm = LLM(kv_transfer_config=kv, **args)
    conn.send("ready")
    while (job := conn.recv()) is not None:
        prompts, max_tokens, params = job
        inputs = [TokensPrompt(prompt_token_ids=p) if isinstance(p, list) else p for p in prompts]
        sampling = [
            SamplingParams(
                temperature=0.0,
                max_tokens=max_tokens,
                ignore_eos=True,
                detokenize=not args.get("skip_tokenizer_init", False),
                extra_args={"kv_transfer_params": p},
            )
            for p in params
        ]
        outputs = llm.generate(inputs, sampling, use_tqdm=False)
        conn.send(
            [
                (list(o.outputs[0].token_ids), o.outputs[0].text, o.kv_transfer_params)
                for o in outputs
            ]
        )
    llm.llm_engine.engine_core.shutdown()  # stop the engine's own processes now


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--token-ids", help="JSON list of token-id prompts (no tokenizer)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--block-size", type=int)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--kv-cache-gib", type=float, help="KV cache size of each engine")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--json", action="store_true", help="one JSON object per prompt")
    ns = parser.parse_args()

    prompts: list[Any] = json.loads(ns.token_ids) if ns.token_ids else PROMPTS
    args: dict[str, Any] = {
        "model": ns.model,
        "dtype": ns.dtype,
        "enforce_eager": ns.enforce_eager,
        "skip_tokenizer_init": ns.token_ids is not None,
        "enable_prefix_caching": False,
    }
    if ns.block_size:
        args["block_size"] = ns.block_size
    if ns.max_model_len:
        args["max_model_len"] = ns.max_model_len
    if ns.kv_cache_gib:
        args["kv_cache_memory_bytes"] = int(ns.kv_cache_gib * 2**30)

    ctx = mp.get_context("spawn")
    pipes, procs = {}, []
    for role in ("kv_producer", "kv_consumer"):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=engine, args=(child, role, args))
        proc.start()
        pipes[role] = parent
        procs.append(proc)
    try:
        for role, pipe in pipes.items():
            try:
                assert pipe.recv() == "ready"
            except EOFError:
                raise SystemExit(f"the {role} engine did not start (its error is above)") from None
        # 1. prefill: one token, and keep the KV for a remote decode
        pipes["kv_producer"].send((prompts, 1, [{"do_remote_decode": True}] * len(prompts)))
        first = pipes["kv_producer"].recv()
        # 2. decode: the prefill output's kv_transfer_params, verbatim
        pipes["kv_consumer"].send((prompts, ns.max_tokens, [params for _, _, params in first]))
        for prompt, (token_ids, text, _) in zip(prompts, pipes["kv_consumer"].recv(), strict=True):
            if ns.json:
                print(json.dumps({"token_ids": token_ids, "text": text}))
            else:
                print(f"{prompt!r} -> {text or token_ids!r}")
    finally:
        for pipe in pipes.values():
            with contextlib.suppress(OSError):
                pipe.send(None)
        for proc in procs:
            proc.join(60)
            if proc.is_alive():
                proc.kill()


if __name__ == "__main__":  # vLLM on CPU spawns its processes: this guard is required
    main()
