"""A gateway (with one OpenAI-shaped HTTP member that always answers), and optionally the accounting service
with its HTTP server, on their own event loop in a thread, so synchronous property-based tests (hypothesis)
can hammer them with a plain HTTP client."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from aiohttp import web

from services.accounting.service import AccountingConfig, AccountingService
from services.common.bus import connect, ensure_bus
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


def member_app() -> web.Application:
    """An OpenAI-shaped HTTP member that answers every chat, completion and embeddings request with 200."""
    app = web.Application()
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings"):
        app.router.add_post(path, _member_chat)
    return app


@dataclass
class ThreadedGateway:
    url: str
    gw: InProcessGateway
    loop: asyncio.AbstractEventLoop
    nats_url: str
    accounting_url: str | None = None

    def call(self, fn: Any) -> Any:
        """Run ``fn()`` on the gateway's loop and return its result (for inspecting the service)."""
        async def run() -> Any:
            return fn()
        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(10)


@contextlib.asynccontextmanager
async def _accounting(nats_url: str, tmp: Path) -> AsyncIterator[str]:
    """The accounting service in process with its HTTP server (``POST /sql``, ``GET /costs``) on port 0."""
    nc = await connect(nats_url, "accounting")
    try:
        await ensure_bus(nc)
        service = AccountingService(nc, AccountingConfig(db_path=tmp / "ledger.duckdb", port=0, query_timeout_s=2.0))
        task = asyncio.create_task(service.run())
        try:
            await asyncio.wait_for(service.ready.wait(), 30)
            assert service.url is not None
            yield service.url
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    finally:
        await nc.close()


T = TypeVar("T")


@contextlib.contextmanager
def in_thread(serve: Callable[[], contextlib.AbstractAsyncContextManager[T]], what: str,
              start_timeout_s: float = 60.0) -> Iterator[T]:
    """Enter ``serve()`` on its own event loop in a daemon thread (so a test's synchronous client can call
    it), yield what it yields, and leave it when the test is done. A failure to start is raised here."""
    ready: dict[str, Any] = {}
    started = threading.Event()
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()

    async def main() -> None:
        try:
            async with serve() as value:
                ready["value"] = value
                started.set()
                await stop.wait()
        except BaseException as exc:
            ready["error"] = exc
            started.set()
            raise

    thread = threading.Thread(target=lambda: loop.run_until_complete(main()), daemon=True)
    thread.start()
    assert started.wait(start_timeout_s), f"{what} thread did not start"
    if "error" in ready:
        raise ready["error"]
    try:
        yield ready["value"]
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)
        loop.close()


@contextlib.contextmanager
def threaded_gateway(tmp: Path, with_accounting: bool = False, **config: Any) -> Iterator[ThreadedGateway]:
    @contextlib.asynccontextmanager
    async def serve() -> AsyncIterator[ThreadedGateway]:
        async with contextlib.AsyncExitStack() as es:
            server = await es.enter_async_context(EmbeddedNatsServer(tmp / "nats"))
            member_url = await es.enter_async_context(serving(member_app(), "127.0.0.1", 0))
            raw = {"model_pools": {"m": {"members": [{"model_id": "m", "backend": member_url}]}}}
            gw = await es.enter_async_context(gateway_in_process(server.url, tmp / "gw", raw, **config))
            accounting_url = await es.enter_async_context(_accounting(server.url, tmp)) if with_accounting else None
            yield ThreadedGateway(gw.url, gw, asyncio.get_running_loop(), server.url, accounting_url)

    with in_thread(serve, "gateway") as tg:
        yield tg
