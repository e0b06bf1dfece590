"""The gateway's I/O shell: aiohttp handlers, heartbeat intake, the bus hop to workers, usage records."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import TimeoutError as NatsTimeout

from proto import (
    ProtoDecodeError,
    SlotHeartbeat,
    TokenChunk,
    Usage,
    UsageRecord,
    decode,
    encode,
    subjects,
)
from services.common import openai_api, openai_stream
from services.common.http import HTTPError, error_middleware, read_json_object
from services.common.runtime import new_session_id
from services.gateway.fleet import Fleet
from services.gateway.router import Pick, pick_member

log = logging.getLogger(__name__)
access_log = logging.getLogger("llmgw.access")

_json = msgspec.json.Encoder()


@dataclass(frozen=True)
class GatewayConfig:
    gateway_id: str
    host: str = "127.0.0.1"
    port: int = 8080
    stale_after_s: float = 3.0
    first_chunk_timeout_s: float = 5.0  # worker silence before its first chunk → next member
    chunk_timeout_s: float = 300.0  # silence between chunks once a worker accepted the request
    max_body_bytes: int = 4 * 1024 * 1024
    usage_buffer: int = 100_000


class WorkerUnavailable(Exception):
    """The worker did not accept the request (no responder, silence, or an error before any token)."""

    def __init__(self, worker_id: str, reason: str, error: HTTPError | None = None) -> None:
        super().__init__(f"{worker_id}: {reason}")
        self.worker_id = worker_id
        self.reason = reason
        self.error = error


@dataclass
class _Outcome:
    """What one request produced, for its UsageRecord and access line."""

    worker_id: str = ""
    status: str = "ok"
    http_status: int = 200
    finish_reason: str | None = None
    error_code: str | None = None
    usage: Usage | None = None
    ttft_ms: float | None = None
    routing_reason: str = ""


@dataclass
class GatewayService:
    nc: Client
    config: GatewayConfig
    session_id: str = field(default_factory=new_session_id)
    fleet: Fleet = field(init=False)
    _usage_queue: asyncio.Queue[UsageRecord] = field(init=False)
    _seq: int = 0
    usage_published: int = 0

    def __post_init__(self) -> None:
        self.fleet = Fleet(self.config.gateway_id)
        self._usage_queue = asyncio.Queue(maxsize=self.config.usage_buffer)

    # ---- lifecycle -------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        sub = await self.nc.subscribe(subjects.HEARTBEAT_ALL, cb=self._on_heartbeat)
        await self._load_known_workers()
        publisher = asyncio.create_task(self._publish_usage(), name="usage-publisher")
        try:
            yield
        finally:
            await sub.unsubscribe()
            await self._flush_usage(timeout_s=5.0)
            publisher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await publisher

    async def _load_known_workers(self) -> None:
        """A new gateway knows the fleet at once from the KV bucket's last heartbeat per worker."""
        try:
            kv = await self.nc.jetstream().key_value(subjects.KV_WORKERS)
            keys = await kv.keys()
        except Exception as exc:  # empty bucket raises NoKeysError; a missing one NotFound
            log.debug("no known workers in KV: %s", exc)
            return
        now_mono, now_wall = time.monotonic(), time.time()
        for key in keys:
            with contextlib.suppress(Exception):
                entry = await kv.get(key)
                if entry.value:
                    hb = decode(entry.value, SlotHeartbeat)
                    self.fleet.observe(hb, now_mono - max(0.0, now_wall - hb.ts_s))

    async def _on_heartbeat(self, msg: Msg) -> None:
        try:
            hb = decode(msg.data, SlotHeartbeat)
        except ProtoDecodeError as exc:
            log.warning("dropped heartbeat on %s: %s", msg.subject, exc.reason)
            return
        self.fleet.observe(hb, time.monotonic())

    # ---- usage records ----------------------------------------------------------------------------

    def _record_usage(self, parsed: openai_api.ParsedRequest, request_id: str, api_key_id: str | None,
                      outcome: _Outcome, started_s: float, wall_s: float) -> None:
        self._seq += 1
        usage = outcome.usage
        record = UsageRecord(
            gateway_id=self.config.gateway_id, session_id=self.session_id, seq=self._seq, ts_s=wall_s,
            request_id=request_id, model=parsed.model, pool=parsed.model, member=outcome.worker_id,
            worker_id=outcome.worker_id, api_key_id=api_key_id, endpoint=parsed.endpoint,
            stream=parsed.stream, status=outcome.status,  # type: ignore[arg-type]
            http_status=outcome.http_status, finish_reason=outcome.finish_reason,
            error_code=outcome.error_code,
            prompt_tokens=usage.prompt_tokens if usage else 0,
            cached_tokens=usage.cached_tokens if usage else 0,
            output_tokens=usage.completion_tokens if usage else 0,
            ttft_ms=outcome.ttft_ms, latency_ms=(time.monotonic() - started_s) * 1000.0,
            routing_reason=outcome.routing_reason,
        )
        try:
            self._usage_queue.put_nowait(record)
        except asyncio.QueueFull:
            log.error("usage buffer full (%d records): dropping usage of %s", self._usage_queue.maxsize, request_id)
        access_log.info(
            "request_id=%s endpoint=%s model=%s member=%s status=%s http=%s prompt=%s output=%s ms=%.1f reason=%s",
            request_id, parsed.endpoint, parsed.model, outcome.worker_id or "-", outcome.status,
            outcome.http_status, record.prompt_tokens, record.output_tokens, record.latency_ms,
            outcome.routing_reason or "-",
        )

    async def _publish_usage(self) -> None:
        js = self.nc.jetstream()
        while True:
            record = await self._usage_queue.get()
            delay = 0.2
            while True:
                try:
                    # Nats-Msg-Id lets the stream drop a duplicate when we retry after a lost ack.
                    await js.publish(
                        subjects.usage(self.config.gateway_id), encode(record),
                        headers={"Nats-Msg-Id": f"usage-{record.request_id}"}, timeout=5.0,
                    )
                    self.usage_published += 1
                    break
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    log.warning("usage publish failed (%s); retrying in %.1fs", exc, delay)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 5.0)
            self._usage_queue.task_done()

    async def _flush_usage(self, timeout_s: float) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._usage_queue.join()

    # ---- HTTP -------------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(middlewares=[error_middleware], client_max_size=self.config.max_body_bytes)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_get("/v1/models/{model_id}", self.get_model)
        app.router.add_get("/health", self.health)
        return app

    def _live_models(self) -> dict[str, int | None]:
        now = time.monotonic()
        out: dict[str, int | None] = {}
        for model in self.fleet.models():
            members = self.fleet.members_for(model)
            if any(now - m.received_s <= self.config.stale_after_s and m.heartbeat.state == "ready"
                   for m in members):
                out[model] = self.fleet.max_context(model)
        return out

    @staticmethod
    def _model_card(model: str, max_context: int | None) -> dict[str, Any]:
        return {"id": model, "object": "model", "created": 0, "owned_by": "llmgw", "max_model_len": max_context}

    async def list_models(self, request: web.Request) -> web.Response:
        data = [self._model_card(m, ctx) for m, ctx in self._live_models().items()]
        return web.json_response({"object": "list", "data": data})

    async def get_model(self, request: web.Request) -> web.Response:
        model = request.match_info["model_id"]
        models = self._live_models()
        if model not in models:
            raise HTTPError(404, f"model '{model}' does not exist or has no live engine", code="model_not_found",
                            param="model")
        return web.json_response(self._model_card(model, models[model]))

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "gateway_id": self.config.gateway_id,
                                  "nats_connected": self.nc.is_connected, "models": list(self._live_models())})

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "chat.completions")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "completions")

    async def _serve(self, request: web.Request, endpoint: str) -> web.StreamResponse:
        body = await read_json_object(request)
        try:
            parsed = openai_api.parse_request(body, endpoint)
        except openai_api.InvalidRequest as exc:
            raise HTTPError(400, str(exc), param=exc.param, code=exc.code) from None
        if parsed.model not in self.fleet.models():
            raise HTTPError(404, f"model '{parsed.model}' does not exist", code="model_not_found", param="model")
        request_id = f"req-{uuid.uuid4().hex}"
        api_key_id = None
        started, wall = time.monotonic(), time.time()
        outcome = _Outcome()
        try:
            return await self._forward(request, parsed, request_id, api_key_id, outcome)
        except HTTPError as err:
            outcome.status, outcome.http_status, outcome.error_code = "error", err.status, err.code
            raise
        except (asyncio.CancelledError, ConnectionResetError):
            outcome.status, outcome.http_status, outcome.finish_reason = "aborted", 499, "abort"
            raise
        finally:
            self._record_usage(parsed, request_id, api_key_id, outcome, started, wall)

    def _candidates(self, model: str, tried: set[str]) -> Pick:
        members = [m for m in self.fleet.members_for(model) if m.worker_id not in tried]
        return pick_member(members, time.monotonic(), self.config.stale_after_s)

    async def _forward(self, request: web.Request, parsed: openai_api.ParsedRequest, request_id: str,
                       api_key_id: str | None, outcome: _Outcome) -> web.StreamResponse:
        tried: set[str] = set()
        last_error: HTTPError | None = None
        while True:
            pick = self._candidates(parsed.model, tried)
            if pick.worker_id is None:
                if last_error is not None and last_error.status < 500:
                    raise last_error  # e.g. 400 context_length_exceeded, 429 queue full
                raise HTTPError(503, f"no engine for model '{parsed.model}' is available right now; retry shortly",
                                code="no_backend_available", retry_after_s=5)
            worker_id = pick.worker_id
            tried.add(worker_id)
            outcome.routing_reason = pick.reason if not last_error else f"failover:{pick.reason}"
            try:
                sub, first = await self._start(worker_id, parsed, request_id, api_key_id)
            except WorkerUnavailable as exc:
                log.warning("worker %s unavailable for %s: %s", worker_id, request_id, exc.reason)
                last_error = exc.error
                # A 4xx from the engine is about the request itself: another member would say the same.
                if exc.error is not None and exc.error.status in (400, 413):
                    raise exc.error from None
                continue
            outcome.worker_id = worker_id

            def on_final(chunk: TokenChunk, ttft_ms: float | None) -> None:
                outcome.finish_reason, outcome.usage, outcome.ttft_ms = chunk.finish_reason, chunk.usage, ttft_ms
                if chunk.error is not None:
                    outcome.status, outcome.http_status = "error", chunk.error.status
                    outcome.error_code = chunk.error.code
                elif chunk.finish_reason == "abort":
                    outcome.status = "aborted"

            def on_error(err: HTTPError) -> None:
                outcome.status, outcome.http_status, outcome.error_code = "error", err.status, err.code

            try:
                return await openai_stream.respond(request, parsed, request_id, self._chunks(sub, first),
                                                   on_final, on_error)
            except (asyncio.CancelledError, ConnectionResetError):
                # The client went away: stop the engine's work too.
                with contextlib.suppress(Exception):
                    await self.nc.publish(subjects.cancel(worker_id), request_id.encode())
                raise
            finally:
                self.fleet.release(worker_id)
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()

    async def _start(self, worker_id: str, parsed: openai_api.ParsedRequest, request_id: str,
                     api_key_id: str | None) -> tuple[Subscription, TokenChunk]:
        """Send the request to one worker and wait for its acceptance (chunk 0) or refusal."""
        generate = msgspec.structs.replace(
            parsed.generate, request_id=request_id, gateway_id=self.config.gateway_id, api_key_id=api_key_id,
        )
        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox)
        self.fleet.book(worker_id)
        try:
            await self.nc.publish(subjects.gen(worker_id), encode(generate), reply=inbox)
            try:
                msg = await sub.next_msg(timeout=self.config.first_chunk_timeout_s)
            except (NatsTimeout, TimeoutError):
                raise WorkerUnavailable(worker_id, "silent past the first-chunk deadline") from None
            if msg.headers and msg.headers.get("Status") == "503":
                raise WorkerUnavailable(worker_id, "no responder on its subject")
            try:
                first = decode(msg.data, TokenChunk)
            except ProtoDecodeError as exc:
                raise WorkerUnavailable(worker_id, exc.reason) from None
            if first.error is not None:
                raise WorkerUnavailable(worker_id, first.error.message, openai_stream.chunk_error(first))
            return sub, first
        except BaseException:
            self.fleet.release(worker_id)
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
            raise

    async def _chunks(self, sub: Subscription, first: TokenChunk) -> AsyncIterator[TokenChunk]:
        yield first
        expected = first.index + 1
        chunk = first
        while not chunk.is_final:
            try:
                msg = await sub.next_msg(timeout=self.config.chunk_timeout_s)
            except (NatsTimeout, TimeoutError):
                raise HTTPError(503, "the engine stopped responding mid-request", code="upstream_timeout",
                                retry_after_s=5) from None
            chunk = decode(msg.data, TokenChunk)
            if chunk.index != expected:
                raise HTTPError(503, f"lost part of the engine's reply (chunk {expected} missing)",
                                code="upstream_gap", retry_after_s=1)
            expected += 1
            yield chunk

