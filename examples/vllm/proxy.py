"""A small disaggregating proxy for two ``vllm serve`` instances joined by AiokvConnector.

Pull mode (default): each ``POST /v1/completions`` goes first to the prefill instance
with ``max_tokens=1`` and ``kv_transfer_params={"do_remote_decode": true}`` (no
streaming), then to the decode instance with the prompt again and the
``kv_transfer_params`` the prefill returned, verbatim.

Push mode (``--mode push``; both instances started with ``"mode": "push"``): the proxy
asks each prefill instance once where its workers listen (a one-token request with
``{"aiokv_discover": true}``), then sends each request to the prefill
(``{"do_remote_decode": true, "transfer_id": T}``) and to the decode (those endpoints,
``"do_remote_prefill": true`` and the same ``T``) at once, ``T`` a fresh random id: the
decode reserves its blocks and the prefill pushes each layer into them as it computes.

Either way the decode's answer (streamed or not, as the client asked) goes back to the
client. Several prefill or decode URLs are used round-robin.

    python examples/vllm/proxy.py --prefill http://127.0.0.1:8100 \\
        --decode http://127.0.0.1:8200 --port 8000 [--mode push]

Needs ``aiohttp`` (installed with vLLM). See docs/vllm.md.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import uuid
from typing import Any

from aiohttp import ClientConnectionError
from aiohttp import ClientSession
from aiohttp import ClientTimeout
from aiohttp import web

#: The proxy's HTTP client session, kept on its application.
SESSION = web.AppKey("session", ClientSession)


def prefill_body(body: dict[str, Any], transfer_id: str | None = None) -> dict[str, Any]:
    """The prefill request: one token, no streaming, KV kept for a remote decode (push
    mode: pushed to the decode that reserved blocks under ``transfer_id``)."""
    params: dict[str, Any] = {"do_remote_decode": True}
    if transfer_id is not None:
        params["transfer_id"] = transfer_id
    out = {
        **body,
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": params,
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


def push_decode_body(
    body: dict[str, Any], endpoints: dict[str, Any], transfer_id: str
) -> dict[str, Any]:
    """Push mode: the decode request, with the prefill's endpoints and the transfer id."""
    params = {**endpoints, "do_remote_prefill": True, "transfer_id": transfer_id}
    return {**body, "kv_transfer_params": params}


async def discover(session: ClientSession, prefill: str, model: Any) -> dict[str, Any]:
    """Push mode: where the prefill instance's workers listen (one tiny request)."""
    probe = {
        "model": model,
        "prompt": [1],
        "max_tokens": 1,
        "kv_transfer_params": {"aiokv_discover": True},
    }
    async with session.post(prefill + "/v1/completions", json=probe) as answer:
        found = (await answer.json()).get("kv_transfer_params") if answer.status == 200 else None
    if not isinstance(found, dict) or found.get("mode") != "push":
        raise web.HTTPBadGateway(
            text=f"{prefill} gave no push-mode endpoints ({found!r}): is it started with "
            'kv_connector "AiokvConnector" and "mode": "push" in kv_connector_extra_config?'
        )
    return found


async def relay(request: web.Request, answer: Any) -> web.StreamResponse:
    """Stream ``answer`` (the decode's) back to the client."""
    response = web.StreamResponse(status=answer.status)
    response.content_type = answer.content_type
    await response.prepare(request)
    async for chunk in answer.content.iter_any():
        await response.write(chunk)
    await response.write_eof()
    return response


@web.middleware
async def unreachable(request: web.Request, handler: Any) -> web.StreamResponse:
    """An instance the proxy cannot reach: 502 naming it, not aiohttp's bare 500."""
    try:
        response: web.StreamResponse = await handler(request)
    except ClientConnectionError as exc:
        raise web.HTTPBadGateway(text=f"proxy: {exc} (is that vLLM instance up?)") from None
    return response


def make_app(prefill: list[str], decode: list[str], mode: str = "pull") -> web.Application:
    prefills, decodes = itertools.cycle(prefill), itertools.cycle(decode)
    endpoints: dict[str, dict[str, Any]] = {}  # push mode: per prefill URL

    async def completions(request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except json.JSONDecodeError:
            raise web.HTTPBadRequest(text="the body must be a JSON object") from None
        if not isinstance(body, dict):
            raise web.HTTPBadRequest(text="the body must be a JSON object")
        session = request.app[SESSION]
        path = request.path
        if mode == "push":
            return await push(request, session, body, next(prefills), next(decodes))
        async with session.post(next(prefills) + path, json=prefill_body(body)) as answer:
            if answer.status != 200:
                return await relay(request, answer)
            first = await answer.json()
        async with session.post(next(decodes) + path, json=decode_body(body, first)) as answer:
            return await relay(request, answer)

    async def push(
        request: web.Request,
        session: ClientSession,
        body: dict[str, Any],
        prefill_url: str,
        decode_url: str,
    ) -> web.StreamResponse:
        if prefill_url not in endpoints:
            endpoints[prefill_url] = await discover(session, prefill_url, body.get("model"))
        transfer_id = uuid.uuid4().hex
        path = request.path
        decode_body_ = push_decode_body(body, endpoints[prefill_url], transfer_id)
        # both at once: the decode reserves its blocks, the prefill waits for them
        decoding = asyncio.ensure_future(session.post(decode_url + path, json=decode_body_))
        try:
            async with session.post(
                prefill_url + path, json=prefill_body(body, transfer_id)
            ) as answer:
                if answer.status != 200:  # the decode would wait for its lease: drop it
                    decoding.cancel()
                    endpoints.pop(prefill_url, None)  # rediscover: it may have restarted
                    return await relay(request, answer)
                await answer.read()
        except BaseException:
            decoding.cancel()
            raise
        answer = await decoding
        try:
            return await relay(request, answer)
        finally:
            answer.release()

    async def session_ctx(app: web.Application) -> Any:
        async with ClientSession(timeout=ClientTimeout(total=None)) as session:
            app[SESSION] = session
            yield

    app = web.Application(middlewares=[unreachable])
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
    parser.add_argument(
        "--mode",
        choices=["pull", "push"],
        default="pull",
        help="the instances' AiokvConnector mode (push: layer-wise push)",
    )
    ns = parser.parse_args()
    strip = [u.rstrip("/") for u in ns.prefill], [u.rstrip("/") for u in ns.decode]
    web.run_app(make_app(*strip, mode=ns.mode), host=ns.host, port=ns.port)


if __name__ == "__main__":
    main()
