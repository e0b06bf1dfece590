"""The engine's HTTP face: the OpenAI HTTP API, the telemetry endpoints, energy sampling and
``--metrics-state`` persistence, around one engine handle. The bus face is ``worker.py``; both translate
requests and outputs through ``frontend.py``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
from aiohttp import web
from aiohttp.typedefs import Handler
from nats.aio.client import Client

from proto import EnergySample, RequestTokens, TokenChunk, Usage, encode, subjects
from services.common import openai_api, openai_embeddings, openai_responses, openai_stream
from services.common.energy_counter import DEFAULT_MAX_RAPL_POWER_W, CounterLimits
from services.common.http import HTTPError, error_middleware, read_json_object, serving
from services.common.prom import CONTENT_TYPE
from services.common.runtime import new_session_id, raise_if_cancelling
from services.engine.errors import EngineError
from services.engine.outputs import RequestOutput
from services.engine.serve import openapi
from services.engine.serve.async_engine import EngineHandle
from services.engine.serve.choices import Choices, admit_first, admit_rest, choice_chunks, prepare_choices
from services.engine.serve.embedder import embed_reply
from services.engine.serve.energy import EnergyMeter, EnergyTracker, total_energy_j
from services.engine.serve.frontend import error_info
from services.engine.serve.usage_ledger import UsageLedger, load_state, save_state, utc_day
from services.engine.serve.views import RequestStats, metrics_text, slots_body, usage_body

log = logging.getLogger(__name__)

THROUGHPUT_WINDOW_S = 5.0


@dataclass(frozen=True)
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 8006
    api_key: str | None = None
    electricity_rate_usd_per_kwh: float = 0.125
    metrics_state: Path | None = None
    metrics_state_interval_s: float = 60.0
    energy_interval_s: float = 5.0
    max_body_bytes: int = 8 * 1024 * 1024
    # The counter rules' RAPL power ceiling (energy_counter.py); the same value as the accounting's
    # --max-rapl-power-w, so /usage and the ledger treat a long RAPL silence alike.
    max_rapl_power_w: float = DEFAULT_MAX_RAPL_POWER_W


class EngineService:
    def __init__(self, engine: EngineHandle, meter: EnergyMeter, config: ServeConfig,
                 worker_id: str = "") -> None:
        self.engine = engine
        self.core = engine.core
        self.meter = meter
        self.config = config
        self.worker_id = worker_id
        self.session_id = new_session_id()
        self.started_s = time.monotonic()
        self.requests = RequestStats()
        self.tracker = EnergyTracker(expected_interval_s=config.energy_interval_s,
                                     limits=CounterLimits(max_rapl_power_w=config.max_rapl_power_w))
        self.energy_j_total: float | None = None
        note = meter.describe()
        if config.metrics_state is not None:
            self.ledger = load_state(config.metrics_state, rate_usd_per_kwh=config.electricity_rate_usd_per_kwh,
                                     now_s=time.time(), note=note)
        else:
            self.ledger = UsageLedger(config.electricity_rate_usd_per_kwh, note=note)
        # Tokens each request produced since the last energy sample (for attribution downstream).
        self._tokens_since_sample: collections.Counter[str] = collections.Counter()
        self._prompt_since_sample: collections.Counter[str] = collections.Counter()
        self._energy_seq = 0
        self.nc: Client | None = None
        engine.on_outputs(self._observe)

    # ---- accounting of what the engine produced -----------------------------------------------------

    def _observe(self, outputs: list[RequestOutput]) -> None:
        day = utc_day(time.time())
        for out in outputs:
            if out.token_ids:
                self._tokens_since_sample[out.request_id] += len(out.token_ids)
            if out.num_output_tokens == len(out.token_ids) and out.token_ids:  # the request's first token
                self._prompt_since_sample[out.request_id] += out.num_prompt_tokens
            if out.finished:
                self.requests.observe(out)
                self.ledger.record_tokens(day, prompt_tokens=out.num_prompt_tokens,
                                          cached_tokens=out.num_cached_tokens, output_tokens=out.num_output_tokens)

    async def sample_energy(self) -> EnergySample:
        """Read the meter once, book measured energy into today's bucket, and build the bus sample."""
        now_wall = time.time()
        readings = await asyncio.to_thread(self.meter.read, now_wall)
        joules = total_energy_j(self.tracker.update(readings, now_wall))
        if joules is not None:
            self.ledger.add_energy(utc_day(now_wall), joules)
            self.energy_j_total = (self.energy_j_total or 0.0) + joules
        tokens = [RequestTokens(request_id=rid, output_tokens=n, prompt_tokens=self._prompt_since_sample.get(rid, 0))
                  for rid, n in self._tokens_since_sample.items()]
        self._tokens_since_sample.clear()
        self._prompt_since_sample.clear()
        self._energy_seq += 1
        return EnergySample(
            worker_id=self.worker_id or self.core.model_id, session_id=self.session_id, seq=self._energy_seq,
            ts_s=now_wall, model_id=self.core.model_id, readings=[r.to_message() for r in readings],
            request_tokens=tokens,
        )

    async def energy_loop(self) -> None:
        js = self.nc.jetstream() if self.nc is not None else None
        while True:
            raise_if_cancelling()
            sample = await self.sample_energy()
            if js is not None:
                try:
                    msg_id = f"energy-{sample.worker_id}-{sample.session_id}-{sample.seq}"
                    await js.publish(subjects.energy(sample.worker_id), encode(sample),
                                     headers={"Nats-Msg-Id": msg_id}, timeout=5.0)
                except Exception as exc:
                    # The counters are cumulative: the next sample carries this interval's energy too.
                    log.warning("energy sample %d not published: %s", sample.seq, exc)
            await asyncio.sleep(self.config.energy_interval_s)

    def save_metrics_state(self) -> None:
        if self.config.metrics_state is not None:
            save_state(self.config.metrics_state, self.ledger)

    async def metrics_state_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.metrics_state_interval_s)
            await asyncio.to_thread(self.save_metrics_state)

    # ---- HTTP ---------------------------------------------------------------------------------------

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if self.config.api_key and request.path.startswith("/v1/"):
            header = request.headers.get("Authorization", "")
            token = header.removeprefix("Bearer ").strip() if header.startswith("Bearer ") else ""
            if not hmac.compare_digest(token.encode(), self.config.api_key.encode()):
                raise HTTPError(401, "invalid or missing API key: send Authorization: Bearer <key>",
                                code="invalid_api_key")
        return await handler(request)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[error_middleware, self._auth], client_max_size=self.config.max_body_bytes)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/embeddings", self.embeddings)
        app.router.add_post("/v1/responses", self.responses)
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_get("/v1/models/{model_id}", self.get_model)
        app.router.add_get("/health", self.health)
        app.router.add_get("/slots", self.slots)
        app.router.add_get("/usage", self.usage)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/openapi.json", self.openapi)
        return app

    async def openapi(self, request: web.Request) -> web.Response:
        return web.json_response(openapi.document())

    def _model_card(self) -> dict[str, object]:
        return {"id": self.core.model_id, "object": "model", "created": int(time.time() - self.uptime_s),
                "owned_by": "ninfer", "max_model_len": self.core.max_context}

    @property
    def uptime_s(self) -> float:
        return time.monotonic() - self.started_s

    async def list_models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def get_model(self, request: web.Request) -> web.Response:
        if request.match_info["model_id"] != self.core.model_id:
            raise HTTPError(404, f"model '{request.match_info['model_id']}' does not exist", code="model_not_found")
        return web.json_response(self._model_card())

    async def health(self, request: web.Request) -> web.Response:
        if self.engine.step_error is not None:
            return web.json_response({"status": "error", "error": str(self.engine.step_error)}, status=503)
        return web.json_response({"status": "ok"})

    async def slots(self, request: web.Request) -> web.Response:
        return web.json_response(slots_body(self.core.model_id, self.engine.snapshot()))

    async def usage(self, request: web.Request) -> web.Response:
        return web.json_response(usage_body(self.core.model_id, self.engine.snapshot(), self.ledger,
                                            utc_day(time.time()), self.uptime_s, THROUGHPUT_WINDOW_S))

    async def metrics(self, request: web.Request) -> web.Response:
        text = metrics_text(self.core.model_id, self.engine.snapshot(), self.requests, self.uptime_s,
                            self.energy_j_total, self.core.config.block_size, self.engine.num_deadline_dropped)
        return web.Response(body=text.encode(), headers={"Content-Type": CONTENT_TYPE, "X-Prometheus-Format": "0.0.4"})

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "chat.completions")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "completions")

    async def responses(self, request: web.Request) -> web.StreamResponse:
        """The Responses API, translated onto the chat path (services/common/openai_responses.py)."""
        return await self._serve(request, "responses")

    async def embeddings(self, request: web.Request) -> web.Response:
        body = await read_json_object(request)
        try:
            parsed = openai_embeddings.parse_embeddings(body)
            if parsed.unsupported:
                name = parsed.unsupported[0]
                raise openai_api.InvalidRequest(f"'{name}' is not supported by ninfer-serve's embeddings", name,
                                                code="unsupported_parameter")
        except openai_api.InvalidRequest as exc:
            raise HTTPError.bad_request(exc) from None
        embed = msgspec.structs.replace(parsed.embed, request_id=f"emb-{uuid.uuid4().hex}", gateway_id="http")
        reply = await embed_reply(self.engine, embed, self.worker_id)
        if reply.error is not None:
            info = reply.error
            raise HTTPError(info.status, info.message, code=info.code, param=info.param, type=info.type,
                            retry_after_s=info.retry_after_s)
        if reply.usage is not None:
            self.ledger.record_tokens(utc_day(time.time()), prompt_tokens=reply.usage.prompt_tokens,
                                      cached_tokens=0, output_tokens=0)
        return web.json_response(openai_embeddings.embeddings_body(parsed.model, reply, parsed.encoding_format))

    async def _serve(self, request: web.Request, endpoint: str) -> web.StreamResponse:
        body = await read_json_object(request)
        try:
            parsed = (openai_responses.parse_responses(body) if endpoint == "responses"
                      else openai_api.parse_request(body, endpoint))
            if parsed.unsupported:
                raise openai_api.unsupported_error(parsed, "ninfer-serve")
        except openai_api.InvalidRequest as exc:
            raise HTTPError.bad_request(exc) from None
        if parsed.model != self.core.model_id:
            raise HTTPError(404, f"model '{parsed.model}' does not exist (this engine serves "
                                 f"'{self.core.model_id}')", code="model_not_found", param="model")
        parsed = dataclasses.replace(parsed, tool_format=self.core.tokenizer.tool_call_format)
        request_id = f"req-{uuid.uuid4().hex}"
        generate = msgspec.structs.replace(parsed.generate, request_id=request_id, gateway_id="http")
        choices: Choices | None = None
        try:
            try:
                prompt_ids, choice_params = prepare_choices(self.core, generate)
                choices = await admit_first(self.engine, request_id, prompt_ids, choice_params, "http")
                if choices.num_choices > 1:
                    # the other choices wait for the first one's prefill (choices.py): the prompt is computed once
                    choices.first = await choices.streams[0].next_output()
                    await admit_rest(self.engine, choices, prompt_ids, "http")
            except (EngineError, ValueError) as exc:
                info = error_info(exc)
                raise HTTPError(info.status, info.message, code=info.code, param=info.param, type=info.type,
                                retry_after_s=info.retry_after_s) from None
            return await openai_stream.respond(
                request, parsed, request_id,
                self._chunks(request_id, prompt_ids, choices, (generate.prompt or "") if generate.echo else None),
                on_final=lambda _c, _t: None, on_error=lambda _e: None)
        finally:
            if choices is not None:
                choices.close()  # a client that went away aborts the request in the engine (frees its blocks)

    async def _chunks(self, request_id: str, prompt_ids: list[int], choices: Choices, echo: str | None
                      ) -> AsyncIterator[TokenChunk]:
        """The reply's TokenChunks, the choices' interleaved as their outputs come (``choice`` says whose)."""
        # the acceptance, as on the bus: the prompt's token count (continuous_usage_stats reads it)
        yield TokenChunk(request_id=request_id, index=0, worker_id=self.worker_id, num_choices=choices.num_choices,
                         usage=Usage(prompt_tokens=len(prompt_ids), completion_tokens=0))
        async for chunk in choice_chunks(self.core.tokenizer, choices, self.worker_id, echo):
            yield chunk


def http_site(service: EngineService) -> contextlib.AbstractAsyncContextManager[str]:
    return serving(service.app(), service.config.host, service.config.port)
