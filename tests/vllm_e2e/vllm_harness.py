"""Drive real vLLM engines (``vllm.LLM``) in worker processes, one engine per process.

The vLLM end-to-end tests and ``aiokv bench vllm`` start a baseline, a prefill and a decode
engine ONCE each and send them many requests over a pipe: an engine starts in ~15 s here
(``enforce_eager``), so sharing them keeps the whole job to a few minutes.

Each engine runs vLLM's engine core in its own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
so that the worker can read its scheduler's free-block count directly, and it keeps
stepping the engine while it is idle but still holds finished requests' blocks (a prefill
waiting for its decode side's done notification), as ``vllm serve``'s busy loop does.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import time
import traceback
from collections.abc import Iterable
from collections.abc import Iterator
from collections.abc import Mapping
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

#: the connector under test: its class name and module, as ``kv_config`` takes them
CONNECTOR = ("AiokvConnector", "aiokv.integrations.vllm")
#: prompt lengths of a batch: >= 8 requests, one shorter than a block, several exactly on
#: and around block boundaries, some many blocks long (block size 32)
LENGTHS = [9, 31, 32, 33, 64, 95, 150, 257, 300]
#: tokens each request generates
MAX_TOKENS = 12
#: how long an instance gets to free every block after a test's requests ended
FREE_TIMEOUT_S = 60.0

# Engine arguments every engine here shares: token-id prompts (no tokenizer), greedy,
# small blocks, no prefix caching (a decode must get its prompt's KV from the prefill, not
# from its own cache), a small KV pool, no graph compilation.
BLOCK_SIZE = 32
ENGINE_ARGS: dict[str, Any] = {
    "skip_tokenizer_init": True,
    "block_size": BLOCK_SIZE,
    "max_model_len": 1024,
    "enable_prefix_caching": False,
    "kv_cache_memory_bytes": 64 << 20,
    "dtype": "float32",
    "max_num_seqs": 16,
    "enforce_eager": True,
    "seed": 0,
}
ENGINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "TOKENIZERS_PARALLELISM": "false",
}


@dataclass(frozen=True)
class Request:
    """One request: a token-id prompt, how many tokens to generate, the KV transfer params."""

    prompt: Sequence[int]
    max_tokens: int
    kv_transfer_params: Mapping[str, Any] | None = None


@dataclass
class Output:
    """What an engine returned for one request."""

    token_ids: list[int]
    finish_reason: str | None
    kv_transfer_params: dict[str, Any] | None
    seconds: float = 0.0


def _free_blocks(llm: Any) -> tuple[int, int]:
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    pool = scheduler.kv_cache_manager.block_pool
    return int(pool.get_num_free_blocks()), int(pool.num_gpu_blocks)


def _has_requests(llm: Any) -> bool:
    return bool(llm.llm_engine.engine_core.engine_core.scheduler.has_requests())


def _generate(llm: Any, requests: Sequence[Request]) -> list[Output]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=list(r.prompt)) for r in requests]
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=r.max_tokens,
            ignore_eos=True,
            detokenize=False,
            extra_args=(
                {"kv_transfer_params": dict(r.kv_transfer_params)}
                if r.kv_transfer_params is not None
                else None
            ),
        )
        for r in requests
    ]
    start = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return [
        Output(
            token_ids=list(r.outputs[0].token_ids),
            finish_reason=r.outputs[0].finish_reason,
            kv_transfer_params=r.kv_transfer_params,
            seconds=seconds,
        )
        for r in results
    ]


def _abort_waiting(llm: Any, request: Request, within_s: float) -> str | None:
    """Add ``request``, step until vLLM parks it waiting for its remote KV (or
    ``within_s`` passed), abort it there, and step until the engine holds nothing.
    Returns the status the request had when it was aborted."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    params = SamplingParams(
        max_tokens=request.max_tokens,
        detokenize=False,
        extra_args={"kv_transfer_params": dict(request.kv_transfer_params or {})},
    )
    rid = engine.add_request(
        "abort-me", TokensPrompt(prompt_token_ids=list(request.prompt)), params
    )
    scheduler = engine.engine_core.engine_core.scheduler
    status = None
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        engine.step()
        status = scheduler.requests[rid].status.name
        if status == "WAITING_FOR_REMOTE_KVS":
            break
    engine.abort_request([rid], internal=True)
    deadline = time.monotonic() + within_s
    while _has_requests(llm) and time.monotonic() < deadline:
        engine.step()
    return status


def _record_blocks(llm: Any, records: dict[str, dict[tuple[int, ...], list[int]]]) -> None:
    """Record, per prompt, the block ids the scheduler gave the connector.

    "loaded": a request that loads external KV (``update_state_after_alloc`` with
    external tokens: the decode side's own blocks); "finished": a request handed to
    ``request_finished`` with its blocks (the prefill side's blocks it keeps for the decode).
    The hooks only observe: each calls the connector's own method with the same arguments.
    """
    connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
    if connector is None:
        return
    after_alloc = connector.update_state_after_alloc
    finished = connector.request_finished

    def on_alloc(request: Any, blocks: Any, num_external_tokens: int) -> Any:
        if num_external_tokens > 0:
            ids = blocks.get_block_ids()[0]
            records["loaded"][tuple(request.prompt_token_ids)] = list(ids)
        return after_alloc(request, blocks, num_external_tokens)

    def on_finished(request: Any, block_ids: Any) -> Any:
        records["finished"][tuple(request.prompt_token_ids)] = list(block_ids)
        return finished(request, block_ids)

    connector.update_state_after_alloc = on_alloc
    connector.request_finished = on_finished
    all_groups = getattr(connector, "request_finished_all_groups", None)
    if all_groups is not None:  # connectors that support several KV cache groups

        def on_finished_all(request: Any, block_ids: Any) -> Any:
            records["finished"][tuple(request.prompt_token_ids)] = list(block_ids[0])
            return all_groups(request, block_ids)

        connector.request_finished_all_groups = on_finished_all


def _serve(conn: Connection, model: str, env: dict[str, str], options: dict[str, Any]) -> None:
    """The worker process: build the engine, then answer commands until "stop"."""
    os.environ.update({**ENGINE_ENV, **env})
    from vllm import LLM

    try:
        kv = options.pop("kv_transfer_config", None)
        if kv is not None:
            from vllm.config import KVTransferConfig

            options["kv_transfer_config"] = KVTransferConfig(**kv)
        llm = LLM(model=model, **{**ENGINE_ARGS, **options})
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise
    records: dict[str, dict[tuple[int, ...], list[int]]] = {"loaded": {}, "finished": {}}
    _record_blocks(llm, records)
    conn.send(("ready", _free_blocks(llm)))
    while True:
        # idle but holding finished requests' blocks: keep stepping, like vllm serve
        while _has_requests(llm) and not conn.poll(0.01):
            llm.llm_engine.step()
        try:
            command, args = conn.recv()
        except EOFError:
            return
        try:
            if command == "stop":
                conn.send(("ok", None))
                return
            if command == "generate":
                result: Any = _generate(llm, args)
            elif command == "blocks":
                result = {key: dict(value) for key, value in records.items()}
            elif command == "abort_waiting":
                result = _abort_waiting(llm, *args)
            elif command == "free_blocks":
                result = _free_blocks(llm)
            elif command == "wait_free":
                deadline = time.monotonic() + args[1]
                while _free_blocks(llm)[0] != args[0] and time.monotonic() < deadline:
                    if _has_requests(llm):
                        llm.llm_engine.step()
                    time.sleep(0.01)
                result = _free_blocks(llm)
            else:
                raise ValueError(f"unknown command {command!r}")
            conn.send(("ok", result))
        except Exception:
            conn.send(("error", traceback.format_exc()))


class EngineProcess:
    """A ``vllm.LLM`` in a spawned process, driven over a pipe."""

    def __init__(
        self, name: str, model: str, env: Mapping[str, str] | None = None, **options: Any
    ) -> None:
        self.name = name
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(
            target=_serve,
            args=(child, model, dict(env or {}), options),
            name=f"vllm-{name}",
            daemon=False,
        )
        self._process.start()
        child.close()
        self.start_blocks: tuple[int, int] | None = None
        self._stopping = False

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def _reply(self, timeout: float) -> Any:
        if not self._conn.poll(timeout):
            raise TimeoutError(f"engine {self.name}: no answer in {timeout} s")
        try:
            status, value = self._conn.recv()
        except EOFError:
            raise RuntimeError(f"engine {self.name} died (exit {self._process.exitcode})") from None
        if status == "error":
            raise RuntimeError(f"engine {self.name} failed:\n{value}")
        return value

    def wait_ready(self, timeout: float = 300.0) -> tuple[int, int]:
        """Wait for the engine to start; return its (free, total) block counts."""
        self.start_blocks = self._reply(timeout)
        return self.start_blocks

    def call(self, command: str, args: Any = None, timeout: float = 180.0) -> Any:
        self._conn.send((command, args))
        return self._reply(timeout)

    def generate(self, requests: Sequence[Request], timeout: float = 180.0) -> list[Output]:
        result: list[Output] = self.call("generate", list(requests), timeout)
        return result

    def submit(self, requests: Sequence[Request]) -> None:
        """Start generating ``requests`` without waiting (:meth:`collect` waits): two
        engines then work at once (push mode: a prefill and its decode)."""
        self._conn.send(("generate", list(requests)))

    def collect(self, timeout: float = 180.0) -> list[Output]:
        """The outputs of the last :meth:`submit`."""
        result: list[Output] = self._reply(timeout)
        return result

    def blocks(self) -> dict[str, dict[tuple[int, ...], list[int]]]:
        """Block ids per prompt: "loaded" (decode side), "finished" (prefill side)."""
        result: dict[str, dict[tuple[int, ...], list[int]]] = self.call("blocks")
        return result

    def abort_waiting(self, request: Request, within_s: float) -> str | None:
        """Abort ``request`` once it waits for its remote KV (see ``_abort_waiting``):
        the status it had then."""
        result: str | None = self.call("abort_waiting", (request, within_s), within_s * 3)
        return result

    def free_blocks(self) -> tuple[int, int]:
        result: tuple[int, int] = self.call("free_blocks")
        return result

    def wait_free(self, count: int, timeout: float) -> tuple[int, int]:
        """Step until ``count`` blocks are free or ``timeout`` passes; return (free, total)."""
        result: tuple[int, int] = self.call("wait_free", (count, timeout), timeout + 60)
        return result

    def kill(self) -> None:
        """Kill the engine at once (a dead peer)."""
        if self._process.is_alive():
            self._process.kill()
        self._process.join(30)

    def request_stop(self) -> None:
        """Ask the engine to stop, without waiting (see :meth:`stop`)."""
        if self._process.is_alive() and not self._stopping:
            with contextlib.suppress(OSError):
                self._conn.send(("stop", None))
            self._stopping = True

    def stop(self) -> None:
        """Stop the engine: ask, wait up to 30 s for it to exit, then kill it."""
        self.request_stop()
        self._process.join(30)
        self.kill()
        self._conn.close()


def assert_freed(*engines: EngineProcess, timeout: float = FREE_TIMEOUT_S) -> None:
    """Each of ``engines``, in turn, has every block it had free at start free again
    within ``timeout`` s (its own wait): nothing a request held is left held."""
    for engine in engines:
        assert engine.start_blocks is not None, f"{engine.name} has not started"
        assert engine.wait_free(engine.start_blocks[0], timeout) == engine.start_blocks


def stop_engines(engines: Iterable[EngineProcess]) -> None:
    """Stop several engines at once (they shut down in parallel)."""
    engines = list(engines)
    for engine in engines:
        engine.request_stop()
    for engine in engines:
        engine.stop()


def start_engines(specs: Mapping[str, tuple[str, dict[str, Any]]]) -> dict[str, EngineProcess]:
    """Start several engines at once ({name: (model, options)}); wait for all of them."""
    engines = {name: EngineProcess(name, model, **opts) for name, (model, opts) in specs.items()}
    try:
        for engine in engines.values():
            engine.wait_ready()
    except BaseException:
        stop_engines(engines.values())
        raise
    return engines


@contextlib.contextmanager
def running(
    specs: Mapping[str, tuple[str, dict[str, Any]]], *, warm: Iterable[str] = ()
) -> Iterator[dict[str, EngineProcess]]:
    """The engines of ``specs`` (:func:`start_engines`), all stopped on exit.

    Each engine named in ``warm`` first serves local requests of 40 blocks in all, freed
    in reverse order: a decode's next blocks are then not the ids (in the order) its
    prefill uses first, so equal ids on both sides cannot pass for a transfer."""
    started = start_engines(specs)
    try:
        for key in warm:
            started[key].generate([Request(p, 1) for p in prompts([639, 639], seed=99)])
        yield started
    finally:
        stop_engines(started.values())


def single_tokens(
    engine: EngineProcess, every: Sequence[list[int]]
) -> dict[tuple[int, ...], list[int]]:
    """What ``engine`` alone decodes for each prompt of ``every`` (``MAX_TOKENS`` each)."""
    outputs = engine.generate([Request(p, MAX_TOKENS) for p in every])
    assert all(len(o.token_ids) == MAX_TOKENS for o in outputs)
    return {tuple(p): o.token_ids for p, o in zip(every, outputs, strict=True)}


def prompts(lengths: Sequence[int], seed: int = 0) -> list[list[int]]:
    """Token-id prompts of the given lengths (deterministic, ids in [3, 500))."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in lengths]


def kv_config(role: str, connector: str, module: str | None, **extra: Any) -> dict[str, Any]:
    """A ``kv_transfer_config`` (as a dict) for LLM(kv_transfer_config=...)."""
    config: dict[str, Any] = {"kv_connector": connector, "kv_role": role}
    if module is not None:
        config["kv_connector_module_path"] = module
    policy = extra.pop("kv_load_failure_policy", None)
    if policy is not None:
        config["kv_load_failure_policy"] = policy
    if extra:
        config["kv_connector_extra_config"] = extra
    return config
