"""A small disaggregating proxy for two ``vllm serve`` instances joined by AiokvConnector.

Each ``POST /v1/completions`` goes first to the prefill instance with ``max_tokens=1``
and ``kv_transfer_params={"do_remote_decode": true}`` (no streaming), then to the decode
instance with the prompt again and the ``kv_transfer_params`` the prefill returned,
verbatim; the decode's answer (streamed or not, as the client asked) goes back to the
client. Several prefill or decode URLs are used round-robin.

    python examples/vllm/proxy.py --prefill http://127.0.0.1:8100 \\
        --decode http://127.0.0.1:8200 --port 8000

Needs ``aiohttp`` (installed with vLLM). See docs/vllm.md.
"""

from __future__ import annotations

import argparse
import itertools
import json
from typing import Any

from aiohttp import ClientSession, ClientTimeout, web


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill request: one token, no streaming, KV kept for a remote decode."""
    out = {
        **body,
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    if "max_completion_tokens" in body:  # chat completions
        out["max_completion_tokens"] = 1
    out.pop("stream_options", None)
    return out


def decode_body(body: dict[str, Any], prefill_answer: dict[str, Any]) -> dict[str, Any]:
    """The decode request: the client's, with the prefill answer's kv_transfer_params."""
    params = prefill_answer.get("kv_transfer_params")
    if not isinstance(params, dict):
        raise web.HTTPBadGateway(
            text="the prefill instance returned no kv_transfer_params: is it started with "
            'kv_role "kv_producer" and kv_connector "AiokvConnector"?'
        )
    return {**body, "kv_transfer_params": params}


def make_app(prefill: list[str], decode: list[str]) -> web.Application:
    prefills, decodes = itertools.cycle(prefill), itertools.cycle(decode)

    async def completions(request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except json.JSONDecodeError:
            raise web.HTTPBadRequest(text="the body must be a JSON object") from None
        if not isinstance(body, dict):
            raise web.HTTPBadRequest(text="the body must be a JSON object")
        session: ClientSession = request.app["session"]
        path = request.path
        async with session.post(next(prefills) + path, json=prefill_body(body)) as answer:
            if answer.status != 200:
                return web.Response(status=answer.status, body=await answer.read())
            first = await answer.json()
        async with session.post(next(decodes) + path, json=decode_body(body, first)) as answer:
            response = web.StreamResponse(status=answer.status)
            response.content_type = answer.content_type
            await response.prepare(request)
            async for chunk in answer.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    async def session_ctx(app: web.Application) -> Any:
        async with ClientSession(timeout=ClientTimeout(total=None)) as session:
            app["session"] = session
            yield

    app = web.Application()
    app.cleanup_ctx.append(session_ctx)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", completions)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prefill", action="append", required=True, help="prefill base URL")
    parser.add_argument("--decode", action="append", required=True, help="decode base URL")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    ns = parser.parse_args()
    strip = [u.rstrip("/") for u in ns.prefill], [u.rstrip("/") for u in ns.decode]
    web.run_app(make_app(*strip), host=ns.host, port=ns.port)


if __name__ == "__main__":
    main()
