"""A gateway (with one OpenAI-shaped HTTP member that always answers) on its own event loop in a thread, so
synchronous property-based tests (hypothesis) can hammer it with a plain HTTP client."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from services.common.http import serving
from services.common.nats_server import EmbeddedNatsServer
from tests.faults.conftest import InProcessGateway, gateway_in_process


async def _member_chat(request: web.Request) -> web.Response:
    body = await request.json()
    if body.get("stream"):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices":[{"index":0,"delta":{"content":"ok"},"finish_reason":"stop"}]}\n\n')
        await resp.write(b"data: [DONE]\n\n")
        return resp
    return web.json_response({"id": "c", "object": "chat.completion", "created": 0, "model": "m",
                              "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                                           "finish_reason": "stop"}],
                              "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})


def _member_app() -> web.Application:
    app = web.Application()
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings"):
        app.router.add_post(path, _member_chat)
    return app


@dataclass
class ThreadedGateway:
    url: str
    gw: InProcessGateway
    loop: asyncio.AbstractEventLoop

    def call(self, fn: Any) -> Any:
        """Run ``fn()`` on the gateway's loop and return its result (for inspecting the service)."""
        async def run() -> Any:
            return fn()
        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(10)


@contextlib.contextmanager
def threaded_gateway(tmp: Path, **config: Any) -> Iterator[ThreadedGateway]:
    ready: dict[str, Any] = {}
    started = threading.Event()
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()

    async def main() -> None:
        try:
            async with contextlib.AsyncExitStack() as es:
                server = await es.enter_async_context(EmbeddedNatsServer(tmp / "nats"))
                member_url = await es.enter_async_context(serving(_member_app(), "127.0.0.1", 0))
                raw = {"model_pools": {"m": {"members": [{"model_id": "m", "backend": member_url}]}}}
                gw = await es.enter_async_context(gateway_in_process(server.url, tmp / "gw", raw, **config))
                ready["tg"] = ThreadedGateway(gw.url, gw, loop)
                started.set()
                await stop.wait()
        except BaseException as exc:
            ready["error"] = exc
            started.set()
            raise

    thread = threading.Thread(target=lambda: loop.run_until_complete(main()), daemon=True)
    thread.start()
    assert started.wait(60), "gateway thread did not start"
    if "error" in ready:
        raise ready["error"]
    try:
        yield ready["tg"]
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)
        loop.close()
