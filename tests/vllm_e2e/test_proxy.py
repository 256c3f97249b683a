"""``examples/vllm/proxy.py``'s request flows, against two small HTTP servers that stand
in for the prefill and decode instances and record what they are sent (aiohttp comes
with vLLM: collected with the vLLM end-to-end tests). The real instances behind this
flow are tested in test_push.py / test_disaggregated.py through vLLM's ``LLM`` API."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from collections.abc import Awaitable
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402
from aiohttp.test_utils import TestClient  # noqa: E402
from aiohttp.test_utils import TestServer  # noqa: E402

ENDPOINTS = {
    "aiokv": 1,
    "mode": "push",
    "remote_engine_id": "p",
    "remote_block_size": 32,
    "remote_ranks": [["127.0.0.1", 9000, 7]],
}


def load_proxy() -> Any:
    path = Path(__file__).parents[2] / "examples" / "vllm" / "proxy.py"
    spec = importlib.util.spec_from_file_location("aiokv_example_proxy", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


Handler = Callable[[dict[str, Any]], Awaitable[web.Response]]


async def serve(handler: Handler, seen: list[dict[str, Any]]) -> TestServer:
    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append(body)
        return await handler(body)

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    server = TestServer(app)
    await server.start_server()
    return server


def run(coro: Awaitable[None]) -> None:
    asyncio.run(asyncio.wait_for(coro, 30))


def test_push_flow_discovers_once_and_sends_both_halves_at_once() -> None:
    proxy = load_proxy()

    async def main() -> None:
        prefills: list[dict[str, Any]] = []
        decodes: list[dict[str, Any]] = []
        decode_arrived = asyncio.Event()

        async def prefill(body: dict[str, Any]) -> web.Response:
            params = body["kv_transfer_params"]
            if params.get("aiokv_discover"):
                return web.json_response({"kv_transfer_params": ENDPOINTS})
            # a push prefill waits for its decode's reservation: here, for its request
            await asyncio.wait_for(decode_arrived.wait(), 10)
            return web.json_response({"kv_transfer_params": {"pushed": True}})

        async def decode(body: dict[str, Any]) -> web.Response:
            decode_arrived.set()
            return web.json_response({"choices": [{"text": "decoded"}]})

        p, d = await serve(prefill, prefills), await serve(decode, decodes)
        app = proxy.make_app(
            [str(p.make_url("")).rstrip("/")], [str(d.make_url("")).rstrip("/")], "push"
        )
        async with TestClient(TestServer(app)) as client:
            for _ in range(2):
                decode_arrived.clear()
                answer = await client.post(
                    "/v1/completions", json={"model": "m", "prompt": [1, 2], "max_tokens": 5}
                )
                assert answer.status == 200
                assert (await answer.json())["choices"][0]["text"] == "decoded"
        await p.close()
        await d.close()
        discovery, first, second = prefills
        assert discovery["kv_transfer_params"] == {"aiokv_discover": True}  # once
        for sent, got in zip((first, second), decodes, strict=True):
            transfer = sent["kv_transfer_params"]["transfer_id"]
            assert sent["max_tokens"] == 1 and sent["kv_transfer_params"]["do_remote_decode"]
            assert got["max_tokens"] == 5
            assert got["kv_transfer_params"] == {
                **ENDPOINTS,
                "do_remote_prefill": True,
                "transfer_id": transfer,
            }
        assert (
            first["kv_transfer_params"]["transfer_id"]
            != second["kv_transfer_params"]["transfer_id"]
        )

    run(main())


def test_push_flow_relays_a_failed_prefill_and_rediscovers() -> None:
    proxy = load_proxy()

    async def main() -> None:
        prefills: list[dict[str, Any]] = []
        decodes: list[dict[str, Any]] = []
        decode_cancelled = asyncio.Event()

        async def prefill(body: dict[str, Any]) -> web.Response:
            if body["kv_transfer_params"].get("aiokv_discover"):
                return web.json_response({"kv_transfer_params": ENDPOINTS})
            return web.json_response({"error": "bad prompt"}, status=400)

        async def decode(body: dict[str, Any]) -> web.Response:
            try:
                await asyncio.sleep(20)  # waits for a push that never comes
            except asyncio.CancelledError:
                decode_cancelled.set()
                raise
            return web.json_response({})

        p, d = await serve(prefill, prefills), await serve(decode, decodes)
        app = proxy.make_app(
            [str(p.make_url("")).rstrip("/")], [str(d.make_url("")).rstrip("/")], "push"
        )
        async with TestClient(TestServer(app)) as client:
            for _ in range(2):
                answer = await client.post("/v1/completions", json={"model": "m", "prompt": [1]})
                assert answer.status == 400
                assert (await answer.json()) == {"error": "bad prompt"}
        await asyncio.wait_for(decode_cancelled.wait(), 10)  # the proxy dropped it
        await p.close()
        await d.close()
        discoveries = [b for b in prefills if b["kv_transfer_params"].get("aiokv_discover")]
        assert len(discoveries) == 2  # asked again after the failure

    run(main())


def test_push_flow_refuses_a_pull_mode_prefill() -> None:
    proxy = load_proxy()

    async def main() -> None:
        seen: list[dict[str, Any]] = []

        async def prefill(body: dict[str, Any]) -> web.Response:
            return web.json_response({"kv_transfer_params": {**ENDPOINTS, "mode": "pull"}})

        p = await serve(prefill, seen)
        url = str(p.make_url("")).rstrip("/")
        async with TestClient(TestServer(proxy.make_app([url], [url], "push"))) as client:
            answer = await client.post("/v1/completions", json={"model": "m", "prompt": [1]})
            assert answer.status == 502
            assert '"mode": "push"' in await answer.text()
        await p.close()
        assert len(seen) == 1  # only the discovery: nothing was sent on

    run(main())


def test_an_instance_that_is_down_is_a_502_naming_it() -> None:
    """A prefill nobody listens on: the client gets 502 and the address, not a bare 500."""
    proxy = load_proxy()

    async def main() -> None:
        closed = TestServer(web.Application())
        await closed.start_server()
        down = str(closed.make_url("")).rstrip("/")
        address = f"{closed.host}:{closed.port}"
        await closed.close()  # its port now refuses connections
        app = proxy.make_app([down], [down])
        async with TestClient(TestServer(app)) as client:
            answer = await client.post("/v1/completions", json={"model": "m", "prompt": [1]})
            assert answer.status == 502
            text = await answer.text()
            assert address in text and "is that vLLM instance up?" in text

    run(main())
