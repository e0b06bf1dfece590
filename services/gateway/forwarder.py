"""The failover loop: rank a request's pool members with the router, then try them in order — each once —
until one accepts (bus: chunk 0 and its first text; HTTP: a status line that is not 5xx/408).

A member that does not take the request raises :class:`services.gateway.errors.MemberFailure` (never
after anything reached the client); the loop books, unbooks and marks members down in the fleet,
counts decisions and failovers in :class:`GatewayMetrics`, and fills the request's :class:`Outcome`
(member, status, tokens, first-token time) for its usage record. All down → 503 + Retry-After (502 naming
the member when a member refused the gateway's own key, errors.CREDENTIALS_REJECTED).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import logging
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import msgspec
from aiohttp import web
from nats.aio.client import Client

from proto import TokenChunk
from services.common import openai_api, openai_embeddings, openai_responses, openai_stream
from services.common.http import HTTPError
from services.common.prom import E2E_BUCKETS_S, TTFT_BUCKETS_S, Histogram, PromText
from services.common.runtime import ThrottledLog
from services.gateway import bus_backend, capabilities, pools, routing, routing_adapter
from services.gateway.breaker import FailureKind
from services.gateway.errors import CREDENTIALS_REJECTED, MemberFailure, MemberUnavailable
from services.gateway.fleet import Fleet
from services.gateway.http_backend import HttpBackend
from services.gateway.pools_file import PoolsFile
from services.gateway.usage_meter import UsageMeter

if TYPE_CHECKING:
    from services.gateway.route_sharing import RouteSharing

log = logging.getLogger(__name__)

# HTTP members whose engines honour stream_options.continuous_usage_stats (vLLM's extension; SGLang has it
# too; ninfer-serve, engine kind "native"): known from their telemetry heartbeats. Others (llama.cpp, stock
# OpenAI servers) are not asked: an unknown stream option may be refused.
CONTINUOUS_USAGE_KINDS = frozenset({"vllm", "sglang", "native"})
# After a cancel, how long the gateway waits for the engine's count of what the request used (normally one
# engine step, milliseconds; a loaded 2-core host has taken over 2 s). The wait runs in the background.
ABORT_REPORT_WAIT_S = 10.0


@dataclass
class Outcome:
    """What one request produced, for its UsageRecord, metrics and access line."""

    member_id: str = ""
    status: Literal["ok", "error", "aborted"] = "ok"  # UsageRecord.status
    http_status: int = 200
    finish_reason: str | None = None
    error_code: str | None = None
    meter: UsageMeter = field(default_factory=UsageMeter)
    ttft_ms: float | None = None
    routing_reason: str = ""
    pool: str = ""
    limit_kind: str | None = None
    # the answer is still being accounted after the handler ended (an abort report, an abandoned read):
    # the usage record is written when this finishes
    settling: asyncio.Future[Any] | None = None
    api_key_id: str | None = None  # the client's key (its id, never the secret); None without auth


@dataclass
class GatewayMetrics:
    """What ``/metrics`` reports, counted since start. The ``requests``/``latency``/``decisions``/``failovers``
    families predate the per-model series; :meth:`observe` fills both from each finished request.

    Labels of the per-model series: ``model`` (the pool the client asked for), ``member`` and ``api_key_id``
    (the key's id, never the secret or any user text): bounded by the pools and keys an operator configures.
    The TTFT histogram leaves the key out (each label set costs a series per bucket)."""

    requests: collections.Counter[tuple[str, str, str]] = field(default_factory=collections.Counter)
    decisions: collections.Counter[str] = field(default_factory=collections.Counter)
    failovers: collections.Counter[str] = field(default_factory=collections.Counter)
    latency: dict[str, Histogram] = field(default_factory=dict)
    affinity_hits: int = 0
    # (model, member, api_key_id, status)
    model_requests: collections.Counter[tuple[str, str, str, str]] = field(default_factory=collections.Counter)
    # (model, member, api_key_id, type) with type prompt | completion | cached
    tokens: collections.Counter[tuple[str, str, str, str]] = field(default_factory=collections.Counter)
    # (model, member, api_key_id, code, http_status): requests answered with an error
    errors: collections.Counter[tuple[str, str, str, str, str]] = field(default_factory=collections.Counter)
    # (model, member, reason): the routing decision that placed each request ("failover:<reason>" after one)
    routed: collections.Counter[tuple[str, str, str]] = field(default_factory=collections.Counter)
    # (model, member): time to the first token the client got, in seconds
    ttft: dict[tuple[str, str], Histogram] = field(default_factory=dict)

    def observe(self, outcome: Outcome, latency_s: float) -> None:
        self.requests[(outcome.pool or "-", outcome.member_id or "-", outcome.status)] += 1
        self.latency.setdefault(outcome.pool or "-", Histogram(E2E_BUCKETS_S)).observe(latency_s)
        model, member, key = outcome.pool or "-", outcome.member_id or "-", outcome.api_key_id or "-"
        self.model_requests[(model, member, key, outcome.status)] += 1
        usage, _ = outcome.meter.result()
        for kind, n in (("prompt", usage.prompt_tokens), ("completion", usage.completion_tokens),
                        ("cached", usage.cached_tokens)):
            if n:
                self.tokens[(model, member, key, kind)] += n
        if outcome.status == "error":
            self.errors[(model, member, key, outcome.error_code or "none", str(outcome.http_status))] += 1
        if outcome.routing_reason:
            self.routed[(model, member, outcome.routing_reason)] += 1
        if outcome.ttft_ms is not None:
            self.ttft.setdefault((model, member), Histogram(TTFT_BUCKETS_S)).observe(outcome.ttft_ms / 1000.0)

    def write(self, m: PromText) -> None:
        """Every family this counts, into ``m``: declared even before its first sample."""
        for name, (kind, help_text) in _FAMILIES.items():
            m.declare(name, kind, help_text)

        def add(name: str, value: float, labels: dict[str, str]) -> None:
            m.counter(name, _FAMILIES[name][1], value, labels)

        for (pool, member, status), n in sorted(self.requests.items()):
            add("llmgw_requests_total", n, {"pool": pool, "member": member, "status": status})
        for pool, hist in sorted(self.latency.items()):
            m.histogram("llmgw_request_latency_seconds", _FAMILIES["llmgw_request_latency_seconds"][1], hist,
                        {"pool": pool})
        for reason, n in sorted(self.decisions.items()):
            add("llmgw_routing_decisions_total", n, {"reason": reason})
        for member, n in sorted(self.failovers.items()):
            add("llmgw_failovers_total", n, {"member": member})
        add("llmgw_affinity_hits_total", self.affinity_hits, {})
        for (model, member, key, status), n in sorted(self.model_requests.items()):
            add("llmgw_model_requests_total", n,
                {"model": model, "member": member, "api_key_id": key, "status": status})
        for (model, member, key, kind), n in sorted(self.tokens.items()):
            add("llmgw_tokens_total", n, {"model": model, "member": member, "api_key_id": key, "type": kind})
        for (model, member, key, code, http_status), n in sorted(self.errors.items()):
            add("llmgw_errors_total", n,
                {"model": model, "member": member, "api_key_id": key, "code": code, "http_status": http_status})
        for (model, member, reason), n in sorted(self.routed.items()):
            add("llmgw_routed_requests_total", n, {"model": model, "member": member, "reason": reason})
        for (model, member), hist in sorted(self.ttft.items()):
            m.histogram("llmgw_time_to_first_token_seconds", _FAMILIES["llmgw_time_to_first_token_seconds"][1], hist,
                        {"model": model, "member": member})


# GatewayMetrics' families in /metrics: name -> (type, help).
_FAMILIES: dict[str, tuple[str, str]] = {
    "llmgw_requests_total": ("counter", "Requests by pool, member and outcome."),
    "llmgw_request_latency_seconds": ("histogram", "Request latency at the gateway."),
    "llmgw_routing_decisions_total": ("counter", "Routing decisions by reason."),
    "llmgw_failovers_total": ("counter", "Members skipped after a failure."),
    "llmgw_affinity_hits_total": ("counter", "Requests routed by cache affinity."),
    "llmgw_model_requests_total": ("counter", "Requests by model (pool), member, API key id and outcome."),
    "llmgw_tokens_total": ("counter", "Tokens by model (pool), member, API key id and type (prompt, completion, "
                           "cached: the part of the prompt served from the member's prefix cache)."),
    "llmgw_errors_total": ("counter", "Requests answered with an error, by model, member, API key id, error code "
                           "and HTTP status."),
    "llmgw_routed_requests_total": ("counter", "Requests placed on a member, by model, member and routing reason "
                                    "(failover:<reason> after a failover)."),
    "llmgw_time_to_first_token_seconds": ("histogram", "Time to the first token the client received, by model "
                                          "and member."),
}


class Forwarder:
    """Forwards one request to its pool's members (:meth:`forward`); the router, the fleet, the HTTP members'
    client and the pools file in force are passed in, as are the metrics it counts into."""

    def __init__(self, nc: Client, gateway_id: str, chunk_timeout_s: float, fleet: Fleet,
                 router: routing_adapter.Router, http: HttpBackend, pools_file: PoolsFile, metrics: GatewayMetrics,
                 rng: random.Random, quiet_log: ThrottledLog) -> None:
        self.nc = nc
        self.gateway_id = gateway_id
        self.chunk_timeout_s = chunk_timeout_s
        self.fleet = fleet
        self.router = router
        self.http = http
        self.pools_file = pools_file
        self.metrics = metrics
        self.rng = rng
        self._quiet_log = quiet_log
        self.sharing: RouteSharing | None = None  # set by the service: routes announced to the other replicas

    async def forward(self, request: web.Request, body: dict[str, Any], parsed: openai_api.ParsedRequest,
                      resolved: pools.ResolvedPool, request_id: str, api_key_id: str | None,
                      outcome: Outcome) -> web.StreamResponse:
        decision = self.decide(request, parsed, resolved, api_key_id)
        self.metrics.decisions[decision.reason] += 1
        if decision.reason == "no_member_fits_context":
            raise HTTPError(400, f"the prompt is longer than any member of '{parsed.model}' accepts",
                            code="context_length_exceeded", param="messages")
        refs = {r.member_id: r for r in resolved.members}
        outcome.meter.prompt_tokens_estimate = decision.request.prompt_tokens
        prompt_chars = routing_adapter.prompt_chars(parsed)
        last_error: HTTPError | None = None
        needed = capabilities.required_features(parsed.generate) if parsed.endpoint != "embeddings" else []
        credentials_error: HTTPError | None = None  # a member refused the gateway's key: say so if none accepts
        # a member passed over because it cannot serve this kind of request (capabilities.py): the answer only
        # when no member was tried at all (one that was tried and is down makes it a 503: retry shortly)
        skipped: HTTPError | None = None
        attempted = False
        for attempt, member_id in enumerate(decision.ranked):
            ref = refs[member_id]
            if parsed.endpoint == "responses" and ref.kind == "http":
                # the gateway translates /v1/responses for bus members only: its HTTP relay meters chat SSE
                skipped = skipped or HTTPError(
                    400, f"/v1/responses is served by the pool's bus engines only; member {member_id} is an HTTP "
                    "member", code="model_not_supported", param="model")
                continue
            if ref.kind != "http" and (missing := capabilities.missing_features(
                    needed, self.fleet.record(member_id).heartbeat)):
                param = capabilities.FEATURE_PARAM.get(missing[0])
                skipped = skipped or HTTPError(400, capabilities.refusal_message(member_id, missing),
                                               code="model_not_supported", param=param)
                continue
            if parsed.unsupported and ref.kind != "http":  # (n > 1, echo and suffix cross the bus: issue #26)
                # Asks for what our engines do not implement (tools, ...): HTTP members get the body as it came.
                refusal = openai_api.unsupported_error(parsed, f"engine {member_id}")
                last_error = last_error or HTTPError.bad_request(refusal)
                continue
            attempted = True
            outcome.member_id = member_id
            outcome.routing_reason = decision.reason if attempt == 0 else f"failover:{decision.reason}"
            pending = max(0, prompt_chars - decision.affinity_chars(member_id))
            routed_s = time.time()
            self.fleet.book(member_id, routed_s)
            if self.sharing is not None:
                self.sharing.routed(member_id, routed_s, pending)
            self.fleet.attempt(member_id, routed_s)
            self.fleet.add_pending_prefill(member_id, pending)
            prefill_done = _Once(functools.partial(self._prefill_done, member_id, pending))
            # Affinity and pins are recorded at the first byte (docs/routing.md §4; issue #29: recorded after the
            # whole answer, a tenant's next requests did not know for seconds where its prefix was)
            recorded = _Once(functools.partial(self._record_route, decision, member_id))

            def first_byte(prefill_done: _Once = prefill_done, recorded: _Once = recorded) -> None:
                prefill_done()
                recorded()
            try:
                if ref.kind == "bus" and parsed.endpoint == "embeddings":
                    response = await self._embed_via_bus(body, parsed, ref, request_id, api_key_id, outcome,
                                                         first_byte)
                elif ref.kind == "bus":
                    response = await self._via_bus(request, parsed, ref, request_id, api_key_id, outcome, first_byte)
                else:
                    response = await self._via_http_member(request, body, parsed, ref, request_id, outcome,
                                                           first_byte)
            except MemberFailure as exc:
                self.fleet.unbook(member_id)
                if outcome.meter.output_tokens_seen == 0 and not outcome.meter.is_final:
                    outcome.meter = UsageMeter(prompt_tokens_estimate=outcome.meter.prompt_tokens_estimate)
                error, bus_down = exc.error, exc.is_bus_down
                if error is not None and error.code == bus_backend.MODEL_NOT_SUPPORTED:
                    # it cannot serve this kind of request (no embeddings): another member may; say so if none does
                    self.fleet.inconclusive(member_id)
                    last_error = last_error or error
                    continue
                if error is not None and error.status < 500:
                    self.fleet.inconclusive(member_id)  # it answered: alive, whatever its breaker thought
                    if error.status in (400, 413):
                        raise error from None  # about the request itself: another member would say the same
                    last_error = error  # e.g. 429 queue full: try the next member, report this if none
                elif bus_down:
                    self.fleet.inconclusive(member_id)  # our bus, not the member
                else:
                    self.fleet.failure(member_id, time.time(), _failure_kind(error))
                    if error is not None and error.code == CREDENTIALS_REJECTED:
                        credentials_error = credentials_error or error
                self._quiet_log.warning(f"unavailable:{member_id}:{bus_down}",
                                        "member %s unavailable for %s: %s", member_id, request_id, exc)
                self.metrics.failovers[member_id] += 1
                continue
            finally:
                prefill_done()
                finished = outcome.status == "ok" and outcome.meter.is_final
                self.fleet.release(member_id, time.time() - routed_s if finished else None)
            if outcome.meter.admitted:  # the member's own count teaches its characters per token
                self.fleet.note_prompt(member_id, prompt_chars, outcome.meter.prompt_tokens)
            if outcome.status == "ok":
                self.fleet.success(member_id)
                recorded()  # an answer whose first byte was not seen as such (e.g. a JSON reply)
                if decision.reason == "affinity":
                    self.metrics.affinity_hits += 1
            elif outcome.status == "error" and outcome.http_status >= 500 and outcome.error_code != "request_timeout":
                # it broke after the first byte (a lost stream, an engine error mid-answer): too late to fail
                # over this request, but the breaker keeps the next ones away (issue #24: 6/6 went back to it)
                self.fleet.failure(member_id, time.time(), "after_first_byte")
            else:
                # the client left, a 4xx in the stream, or our own request timeout cut a member that was still
                # answering (it is slow for this budget, not broken): says nothing about its health
                self.fleet.inconclusive(member_id)
            return response
        if last_error is not None:
            raise last_error
        if credentials_error is not None:
            raise credentials_error
        if skipped is not None and not attempted:
            raise skipped
        outcome.member_id = ""
        raise HTTPError(503, f"no engine of '{parsed.model}' can take the request right now; retry shortly",
                        code="no_backend_available", retry_after_s=5)

    def _prefill_done(self, member_id: str, pending: int) -> None:
        self.fleet.add_pending_prefill(member_id, -pending)
        if self.sharing is not None:
            self.sharing.prefill_done(member_id, pending, time.time())

    def _record_route(self, decision: routing_adapter.Decision, member_id: str) -> None:
        now_s = time.time()
        self.router.record_success(decision, member_id, self.fleet, now_s)
        if self.sharing is not None:
            self.sharing.first_byte(decision, member_id, now_s)

    def _on_final(self, outcome: Outcome) -> Callable[[TokenChunk, float | None], None]:
        def on_final(chunk: TokenChunk, ttft_ms: float | None) -> None:
            outcome.finish_reason, outcome.ttft_ms = chunk.finish_reason, ttft_ms
            if chunk.usage is not None:
                outcome.meter.finished(chunk.usage, "engine" if chunk.finish_reason == "abort" else "member")
            if chunk.error is not None:
                outcome.status, outcome.http_status, outcome.error_code = "error", chunk.error.status, chunk.error.code
            elif chunk.finish_reason == "abort":
                outcome.status = "aborted"
        return on_final

    def _on_error(self, outcome: Outcome) -> Callable[[HTTPError], None]:
        def on_error(err: HTTPError) -> None:
            outcome.status, outcome.http_status, outcome.error_code = "error", err.status, err.code
        return on_error

    async def _via_bus(self, request: web.Request, parsed: openai_api.ParsedRequest, ref: pools.MemberRef,
                       request_id: str, api_key_id: str | None, outcome: Outcome,
                       first_byte: Callable[[], None]) -> web.StreamResponse:
        timeout_s = self.pools_file.file_config.limits.request_timeout_s
        # deadline_s: the wall-clock time this attempt is given up at; the engine drops it if still waiting then
        generate = msgspec.structs.replace(parsed.generate, request_id=request_id, model=ref.model_id,
                                           gateway_id=self.gateway_id, api_key_id=api_key_id,
                                           deadline_s=time.time() + timeout_s)
        deadline_s = time.monotonic() + timeout_s
        hb = self.fleet.record(ref.member_id).heartbeat
        if hb is not None and hb.tool_call_format and hb.tool_call_format != parsed.tool_format:
            parsed = dataclasses.replace(parsed, tool_format=hb.tool_call_format)  # how its model writes calls
        stream = await bus_backend.start(self.nc, ref.member_id, generate, self.pools_file.first_byte_timeout_s,
                                         self.chunk_timeout_s, self._liveness(ref.member_id), deadline_s)
        open_stream: bus_backend.BusStream | None = stream
        meter = outcome.meter
        first = stream.first
        meter.accepted(first.usage.prompt_tokens if first.usage else None,
                       first.usage.cached_tokens if first.usage else 0)
        meter.num_choices = stream.num_choices
        try:
            try:
                await stream.prime(ref.member_id)  # a worker lost before its first token: fail over
            except HTTPError:  # the request timeout ran out before the first token
                await bus_backend.cancel(self.nc, ref.member_id, request_id)
                raise
            except bus_backend.WorkerUnavailable:
                await bus_backend.cancel(self.nc, ref.member_id, request_id)
                raise
            return await openai_stream.respond(request, parsed, request_id, _metered(stream.chunks(), first_byte,
                                               meter), self._on_final(outcome), self._on_error(outcome))
        except (asyncio.CancelledError, ConnectionResetError):
            await bus_backend.cancel(self.nc, ref.member_id, request_id)  # the client went away
            if not meter.is_final:  # the engine answers the cancel with its count: bill that, in the background
                outcome.settling = asyncio.ensure_future(self._abort_report(stream, meter))
                open_stream = None
            raise
        finally:
            if open_stream is not None:
                await open_stream.close()

    @staticmethod
    async def _abort_report(stream: bus_backend.BusStream, meter: UsageMeter) -> None:
        """Read a cancelled request's last chunks: the engine's final ``abort`` chunk says what it used."""
        started = time.monotonic()
        try:
            async for chunk in stream.rest(ABORT_REPORT_WAIT_S):
                meter.saw_tokens(len(chunk.token_ids))
                if chunk.is_final and chunk.usage is not None:  # an abort's count, or an end already on its way
                    meter.choice_finished(chunk.choice, chunk.usage,
                                          "engine" if chunk.finish_reason == "abort" else "member")
            if not meter.is_final:
                log.warning("no abort report from %s within %.1f s: billed the %d tokens the gateway saw",
                            stream.first.worker_id or "the engine", time.monotonic() - started,
                            meter.output_tokens_seen)
        except Exception as exc:  # the report is a bonus: what was counted stands
            log.debug("abort report not read: %s", exc)
        finally:
            await stream.close()

    def _liveness(self, member_id: str) -> Callable[[], bool]:
        """True while the member's heartbeats keep coming from the session that accepted the request."""
        rec = self.fleet.record(member_id)
        session = rec.heartbeat.session_id if rec.heartbeat is not None else None

        def is_alive() -> bool:
            hb = rec.heartbeat
            if hb is None or rec.received_s is None:
                return True  # no telemetry to judge by: the chunk timeout decides
            return hb.session_id == session and time.time() - rec.received_s <= self.pools_file.stale_after_s
        return is_alive

    async def _embed_via_bus(self, body: dict[str, Any], parsed: openai_api.ParsedRequest, ref: pools.MemberRef,
                             request_id: str, api_key_id: str | None, outcome: Outcome,
                             first_byte: Callable[[], None]) -> web.StreamResponse:
        """An embeddings request to one of our engines: one EmbedRequest, one EmbedReply, one JSON body."""
        timeout_s = self.pools_file.file_config.limits.request_timeout_s
        wanted = openai_embeddings.parse_embeddings(body)  # validated in parse(): cannot raise here
        embed = msgspec.structs.replace(wanted.embed, request_id=request_id, model=ref.model_id,
                                        gateway_id=self.gateway_id, api_key_id=api_key_id,
                                        deadline_s=time.time() + timeout_s)
        reply = await bus_backend.embed(self.nc, ref.member_id, embed, timeout_s)
        first_byte()
        if reply.usage is not None:
            outcome.meter.accepted(reply.usage.prompt_tokens)
            outcome.meter.finished(reply.usage)
        outcome.finish_reason = "stop"
        return web.json_response(openai_embeddings.embeddings_body(parsed.model, reply, wanted.encoding_format))

    async def _via_http_member(self, request: web.Request, body: dict[str, Any], parsed: openai_api.ParsedRequest,
                               ref: pools.MemberRef, request_id: str, outcome: Outcome,
                               first_byte: Callable[[], None]) -> web.StreamResponse:
        """:meth:`_via_http`; for embeddings, a member that answers it has no such endpoint or model (404,
        405, 501: llama.cpp without ``--embeddings``, a vLLM generation model) is one that cannot embed."""
        try:
            return await self._via_http(request, body, parsed, ref, request_id, outcome, first_byte)
        except HTTPError as err:
            if parsed.endpoint == "embeddings" and err.status in (404, 405, 501):
                raise MemberUnavailable(ref.member_id, f"no embeddings ({err.status}: {err.message})", err.status,
                                        bus_backend.not_supported(ref.member_id, "embeddings")) from None
            raise

    async def _via_http(self, request: web.Request, body: dict[str, Any], parsed: openai_api.ParsedRequest,
                        ref: pools.MemberRef, request_id: str, outcome: Outcome,
                        first_byte: Callable[[], None]) -> web.StreamResponse:
        assert ref.config is not None
        hb = self.fleet.record(ref.member_id).heartbeat
        running_usage = parsed.stream and hb is not None and hb.engine_kind in CONTINUOUS_USAGE_KINDS
        resp = await self.http.open(ref.config, parsed.endpoint, body, parsed.stream, {"X-Request-Id": request_id},
                                    continuous_usage=running_usage)

        def abandoned(reading: asyncio.Task[Any]) -> None:
            # the member goes on making the answer the client left: bill what it reports when done
            outcome.settling = asyncio.ensure_future(_quietly(reading))
        response, result = await self.http.relay(request, resp, parsed.stream, parsed.include_usage, request_id,
                                                 on_first_byte=first_byte, meter=outcome.meter,
                                                 member_id=ref.member_id, on_abandoned=abandoned,
                                                 strip_running_usage=running_usage and not parsed.continuous_usage)
        outcome.finish_reason, outcome.ttft_ms = result.finish_reason, result.ttft_ms
        if result.error is not None:
            self._on_error(outcome)(result.error)
        return response


    def decide(self, request: web.Request, parsed: openai_api.ParsedRequest, resolved: pools.ResolvedPool,
               api_key_id: str | None) -> routing_adapter.Decision:
        """The router's ranking of the pool's members for this request (also what the explainer shows)."""
        session_key, is_header = self.session_key(request, api_key_id)
        return self.router.decide(resolved, parsed, session_key, is_header, self.fleet, time.time(),
                                  self.weights(), self.rng)

    def weights(self) -> routing.RoutingWeights:
        return routing_adapter.weights_for(self.pools_file.file_config.metrics, self.pools_file.stale_after_s)

    @staticmethod
    def parse(body: dict[str, Any], endpoint: str) -> openai_api.ParsedRequest:
        try:
            if endpoint == "embeddings":
                wanted = openai_embeddings.parse_embeddings(body)
                return openai_api.ParsedRequest("embeddings", wanted.model, False, False,
                                                openai_api.empty_generate(wanted.model),
                                                unsupported=wanted.unsupported)
            if endpoint == "responses":
                return openai_responses.parse_responses(body)
            return openai_api.parse_request(body, endpoint)
        except openai_api.InvalidRequest as exc:
            raise HTTPError.bad_request(exc) from None

    def resolve(self, model: str) -> pools.ResolvedPool:
        resolved = pools.resolve(model, self.pools_file.file_config, self.fleet)
        if resolved is None:
            raise HTTPError(404, f"model '{model}' does not exist", code="model_not_found", param="model")
        return resolved

    @staticmethod
    def session_key(request: web.Request, api_key_id: str | None) -> tuple[str | None, bool]:
        """X-Session-Id, else the API key id (a weaker hint); the flag says which."""
        header = request.headers.get("X-Session-Id")
        return (header, True) if header else (api_key_id, False)


def _failure_kind(error: HTTPError | None) -> FailureKind:
    if error is None:
        return "connect"
    if error.code == CREDENTIALS_REJECTED:
        return "credentials"
    return "timeout" if error.status == 504 or "timeout" in (error.code or "") else "status"


class _Once:
    """Call ``fn`` the first time this is called, never again."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn: Callable[[], None] | None = fn

    def __call__(self) -> None:
        fn, self.fn = self.fn, None
        if fn is not None:
            fn()


async def _metered(chunks: AsyncIterator[TokenChunk], first: Callable[[], None], meter: UsageMeter
                  ) -> AsyncIterator[TokenChunk]:
    """The chunks as they come, counting their tokens (``meter``) and telling ``first`` of the first text."""
    async for chunk in chunks:
        if chunk.text or chunk.is_final:
            first()
        if chunk.index > 0:  # chunk 0, the acceptance, is counted by the caller
            meter.saw_tokens(len(chunk.token_ids))
            if chunk.is_final and chunk.error is None and chunk.usage is not None:
                # each choice's own end (n > 1): a client gone before the last one still bills those
                meter.choice_finished(chunk.choice, chunk.usage,
                                      "engine" if chunk.finish_reason == "abort" else "member")
        yield chunk


async def _quietly(task: asyncio.Future[Any]) -> None:
    """Await ``task`` for its side effects; its failure has been accounted for already."""
    with contextlib.suppress(Exception):
        await task
