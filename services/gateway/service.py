"""The gateway's entry point as a service: the aiohttp app (the OpenAI endpoints, /metrics, /health, the
routing explainer and the admin pages) and the lifecycle (:meth:`GatewayService.running`).

It wires the parts, each with its collaborators passed in:

- :class:`~services.gateway.pools_file.PoolsFile`: the pools file in force, its reload and its broadcast;
- :class:`~services.gateway.fleet.HeartbeatIntake` into :class:`~services.gateway.fleet.Fleet`: heartbeats;
- :class:`~services.gateway.forwarder.Forwarder`: routing and the failover loop over bus and HTTP members;
- :class:`~services.gateway.usage_publisher.UsagePublisher`: one UsageRecord per request to the stream;
- :class:`~services.gateway.peers.Peers`: auth checks, shared limit counters, the ledger's key energy;
- :class:`~services.gateway.identity_sync.IdentitySync`, :class:`~services.gateway.auth.Auth` and
  :class:`~services.gateway.pages.Pages`: users, keys, limits and the admin pages.

Per request (:meth:`GatewayService._serve`): admit the key, validate (400/404/413), resolve the model to a
pool (configured, or discovered bus engines), forward, and write the usage record when the answer is
settled.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web
from nats.aio.client import Client
from nats.aio.msg import Msg

from proto import ProtoDecodeError, Usage, UsageRecord, WorkerMetrics, decode_json, encode_json, subjects
from proto import pools as pool_config
from services.common import openai_api
from services.common.http import HTTPError, body_deadline_middleware, error_middleware, read_json_object, serving
from services.common.prom import CONTENT_TYPE, PromText
from services.common.runtime import HotPathLog, ThrottledLog, new_session_id
from services.gateway import identity_signing, pools, routing_adapter, worker_metrics
from services.gateway.auth import Admission, Auth, LimitExceeded, parse_networks, save_usage_periodically
from services.gateway.fleet import Fleet, HeartbeatIntake
from services.gateway.forwarder import ABORT_REPORT_WAIT_S, Forwarder, GatewayMetrics, Outcome
from services.gateway.http_backend import HttpBackend
from services.gateway.identity import ApiKey, IdentityStore
from services.gateway.identity_sync import IdentitySync
from services.gateway.limits import Cost, PromptEstimator
from services.gateway.openapi import document as openapi_document
from services.gateway.pages import Pages
from services.gateway.peers import Peers, bootstrap_admin
from services.gateway.pools_file import LAST_GOOD_NAME, PoolsFile, first_byte_timeout_s, initial_file_config
from services.gateway.route_sharing import RouteSharing
from services.gateway.shedding import LoadShedder
from services.gateway.usage_publisher import UsagePublisher
from services.gateway.usage_spool import UsageSpool

log = logging.getLogger(__name__)
access_log = HotPathLog("llmgw.access")
RATE_HEADERS = web.RequestKey("llmgw.rate_headers", dict)  # the x-ratelimit-* headers a request's answer carries


@dataclass(frozen=True)
class GatewayConfig:
    gateway_id: str
    host: str = "127.0.0.1"
    port: int = 8080
    config_path: Path | None = None
    data_dir: Path | None = None
    stale_after_s: float | None = None  # None: the pools file's metrics.stale_threshold
    # a member's silence before its first byte → next member; None: the pools file's gateway.first_byte_timeout_s
    first_chunk_timeout_s: float | None = None
    chunk_timeout_s: float = 300.0  # silence between chunks once a member accepted the request
    max_body_bytes: int = 4 * 1024 * 1024  # only until a pools file says otherwise (gateway.max_body_bytes)
    # a connection must deliver a complete request head within this (slow-loris guard; also the idle keep-alive)
    idle_timeout_s: float = 75.0
    body_timeout_s: float = 60.0  # a request body must arrive within this, else 408
    usage_buffer: int = 100_000
    config_poll_s: float = 1.0
    # networks whose callers may run inference without an API key (CIDR); loopback is not trusted by default
    trusted_networks: tuple[str, ...] = ()
    # how often to ask the ledger for the month's energy per key (only while a kWh-per-month limit is set)
    key_energy_poll_s: float = 5.0
    # overload is answered at once (services/gateway/shedding.py): open inference requests in this process,
    # and how late the event loop may wake, before new requests get 503 gateway_overloaded
    max_in_flight: int = 4096
    max_loop_lag_s: float = 0.05
    # one of several worker processes on one port (``llmgw gateway --workers``, services/gateway/workers.py):
    # its label (w0 …; "" for a gateway of one process), how many there are, the group name their /metrics
    # gather runs under, and how this one listens (SO_REUSEPORT, or a listening socket its parent handed down)
    worker: str = ""
    num_workers: int = 1
    worker_group: str | None = None
    reuse_port: bool = False
    listen_fd: int | None = None


class GatewayService:
    def __init__(self, nc: Client, config: GatewayConfig, file_config: pool_config.GatewayFileConfig | None = None,
                 rng: random.Random | None = None) -> None:
        self.nc = nc
        self.config = config
        self.session_id = new_session_id()
        data = config.data_dir or Path("data")
        # the pools file: --config, else DATA/pools.json (what the Config page saves when no file was named)
        config_path = config.config_path or data / "pools.json"
        last_good = data / LAST_GOOD_NAME
        file_config, config_problem = initial_file_config(config_path, file_config, last_good)
        self.identity = IdentityStore(data / "identity")
        self.identity_sync = IdentitySync(nc, self.identity, config.gateway_id, identity_signing.fleet_secret(data))
        self.auth = Auth(self.identity, parse_networks(config.trusted_networks),
                         file_config.limits.max_concurrent_per_key, config.gateway_id, usage_owner=config.worker)
        self.bootstrap: tuple[str, str] | None = None  # (admin password, API key) printed at a first start
        self.fleet = Fleet(config.gateway_id)
        self.router = routing_adapter.Router(config.data_dir, time.time(), worker=config.worker)
        self.metrics = GatewayMetrics()
        self.shedder = LoadShedder(config.max_in_flight, config.max_loop_lag_s)
        self._quiet_log = ThrottledLog(log)  # per-request lines while a member or the bus is down
        self.http = HttpBackend(
            first_byte_timeout_s=first_byte_timeout_s(config.first_chunk_timeout_s, file_config),
            request_timeout_s=file_config.limits.request_timeout_s)
        self.pools_file = PoolsFile(nc, config.gateway_id, config_path, file_config, self.auth, self.http,
                                    config.first_chunk_timeout_s, config.stale_after_s, config.config_poll_s,
                                    last_good, config_problem)
        self.heartbeats = HeartbeatIntake(nc, self.fleet, self.router.load_of)
        self.spool = UsageSpool(data / "usage-spool" / config.gateway_id)
        self.usage = UsagePublisher(nc, config.gateway_id, self.spool, config.usage_buffer, self._quiet_log)
        self.forwarder = Forwarder(nc, config.gateway_id, config.chunk_timeout_s, self.fleet, self.router, self.http,
                                   self.pools_file, self.metrics, rng or random.Random(), self._quiet_log)
        self.route_sharing = RouteSharing(nc, config.gateway_id, self.session_id, self.fleet, self.router)
        self.forwarder.sharing = self.route_sharing
        self.peers = Peers(nc, self.identity, self.auth, config.gateway_id, self.session_id,
                           config.key_energy_poll_s, self._quiet_log)
        self._seq = 0
        self._request_count = 0
        self.prompt_estimator = PromptEstimator()  # prompt tokens per character, learnt per model (limits)

    # ---- lifecycle -------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        await self.identity_sync.start()  # the fleet's users and keys first: only then is "no users" true
        if not self.identity.has_users():
            if await self.identity_sync.claim_bootstrap():
                self.bootstrap = bootstrap_admin(self.identity)
            else:
                log.info("another gateway creates the first admin; its users and keys arrive over the bus "
                         "(if none do, run: llmgw admin create-user)")
        subs = [await self.nc.subscribe(subjects.HEARTBEAT_ALL, cb=self.heartbeats.on_heartbeat),
                await self.nc.subscribe(subjects.AUTH_CHECK, cb=self.peers._on_auth_check),
                await self.nc.subscribe(subjects.CONFIG_CHANGED, cb=self.pools_file._on_config_changed),
                await self.nc.subscribe(subjects.QUOTA_ALL, cb=self.peers._on_limit_counters_elsewhere),
                await self.nc.subscribe(subjects.ENERGY_SUBJECTS, cb=self.heartbeats.on_energy),
                await self.nc.subscribe(subjects.ROUTE_ALL, cb=self.route_sharing.on_notes)]
        if self.config.worker_group is not None:
            subs.append(await self.nc.subscribe(subjects.gateway_metrics(self.config.worker_group),
                                                cb=self._on_metrics_asked))
        await self.heartbeats.load_known_workers()
        await self.usage.start()
        async with self.http, asyncio.TaskGroup() as tasks:
            background = [tasks.create_task(self.usage.publish_usage(), name="usage-publisher"),
                          tasks.create_task(self.usage.resend_spooled(), name="usage-resend"),
                          tasks.create_task(self._save_routing_tables(), name="routing-tables"),
                          tasks.create_task(save_usage_periodically(self.auth), name="key-usage"),
                          tasks.create_task(self.identity_sync.run(), name="identity-sync"),
                          tasks.create_task(self.peers._share_limit_counters(), name="limit-counters-share"),
                          tasks.create_task(self.peers._poll_key_energy(), name="key-energy"),
                          tasks.create_task(self.shedder.probe(), name="loop-lag-probe"),
                          tasks.create_task(self.route_sharing.run(), name="route-sharing")]
            self.pools_file.mark_seen()
            background.append(tasks.create_task(self.pools_file.watch_config(), name="config-watch"))
            try:
                yield
            finally:
                for sub in subs:
                    with contextlib.suppress(Exception):
                        await sub.unsubscribe()
                await self.usage.wait_settling(timeout_s=ABORT_REPORT_WAIT_S + 1.0)
                await self.usage.flush_usage(timeout_s=5.0)
                self.router.save(time.time())
                self.auth.save_usage()
                for task in background:
                    task.cancel()
        await self.usage.stop()
        self.identity.close()

    async def _save_routing_tables(self) -> None:
        while True:
            await asyncio.sleep(30.0)
            try:
                await asyncio.to_thread(self.router.write, self.router.snapshot(time.time()))
            except OSError as exc:
                log.warning("routing tables not saved: %s", exc)

    # ---- usage records ----------------------------------------------------------------------------

    def _admit(self, request: web.Request, key: ApiKey, parsed: openai_api.ParsedRequest) -> Admission:
        """Check and reserve the key's limits (services/gateway/limits.py); the x-ratelimit-* headers go
        on the answer, whether it is the response or a 429."""
        now = time.time()
        max_tokens = parsed.generate.max_tokens
        output = max_tokens if max_tokens is not None else self.pools_file.file_config.limits.reserve_output_tokens
        output *= parsed.n  # each of n choices may make that much (the prompt is shared: counted once)
        prompt = self.prompt_estimator.estimate(parsed.model, routing_adapter.prompt_chars(parsed))
        cost = Cost(tokens=prompt + output, requests=1,
                    usd=self._list_price(parsed.model, Usage(prompt_tokens=prompt, completion_tokens=output)))
        try:
            admission = self.auth.admit_key(key, now, cost)
        except LimitExceeded:
            request[RATE_HEADERS] = self.auth.book.rate_headers(self.identity.principals_of(key), now)
            raise
        request[RATE_HEADERS] = self.auth.rate_headers(admission, now)
        return admission

    def _list_price(self, model: str, usage: Usage) -> float:
        """The usage's value at the price book's list price (0 for a model the book does not price)."""
        book = self.pools_file.file_config.price_book
        prices = book.get(model) or book.get("*")
        if prices is None:
            return 0.0
        cached = min(usage.cached_tokens, usage.prompt_tokens)
        return ((usage.prompt_tokens - cached) * prices.prompt_usd_per_m + cached * prices.cached_usd_per_m
                + usage.completion_tokens * prices.output_usd_per_m) / 1e6

    def _record_usage(self, parsed: openai_api.ParsedRequest, request_id: str, key: ApiKey | None,
                      outcome: Outcome, usage: Usage, source: str, started_s: float, wall_s: float) -> None:
        self._seq += 1
        latency_s = time.monotonic() - started_s
        record = UsageRecord(
            gateway_id=self.config.gateway_id, session_id=self.session_id, seq=self._seq, ts_s=wall_s,
            request_id=request_id, model=parsed.model, pool=outcome.pool or parsed.model, member=outcome.member_id,
            worker_id=outcome.member_id, api_key_id=key.key_id if key else None, endpoint=parsed.endpoint,
            stream=parsed.stream, status=outcome.status,
            http_status=outcome.http_status, finish_reason=outcome.finish_reason,
            error_code=outcome.error_code,
            prompt_tokens=usage.prompt_tokens, cached_tokens=usage.cached_tokens,
            output_tokens=usage.completion_tokens,
            ttft_ms=outcome.ttft_ms, latency_ms=latency_s * 1000.0, routing_reason=outcome.routing_reason,
            usage_source=source, limit_kind=outcome.limit_kind, user_id=key.user_id if key else None,
        )
        self.metrics.observe(outcome, latency_s)
        self.usage.submit(record)
        access_log.info(
            f"request_id={request_id} endpoint={parsed.endpoint} pool={outcome.pool or '-'} "
            f"member={outcome.member_id or '-'} status={outcome.status} http={outcome.http_status} "
            f"prompt={record.prompt_tokens} output={record.output_tokens} ms={record.latency_ms:.1f} "
            f"reason={outcome.routing_reason or '-'}")

    # ---- HTTP -------------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.shedder.middleware, error_middleware, self._body_limit,
                                           body_deadline_middleware(self.config.body_timeout_s)],
                              client_max_size=self.config.max_body_bytes)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/embeddings", self.embeddings)
        app.router.add_post("/v1/responses", self.responses)
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_get("/v1/models/{model_id}", self.get_model)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        app.router.add_get("/openapi.json", self.openapi)
        app.router.add_post("/admin/routing/explain", self.explain)
        Pages(self.auth, self.nc, self.pools_file, self.backends_view, self.config.gateway_id,
              self.config.key_energy_poll_s).routes(app)
        app.on_response_prepare.append(_add_rate_headers)
        return app

    def serving(self) -> contextlib.AbstractAsyncContextManager[str]:
        """Serve :meth:`app` on the configured address with the gateway's connection timeouts."""
        sock = socket.socket(fileno=self.config.listen_fd) if self.config.listen_fd is not None else None
        return serving(self.app(), self.config.host, self.config.port, idle_timeout_s=self.config.idle_timeout_s,
                       reuse_port=self.config.reuse_port, sock=sock)

    @web.middleware
    async def _body_limit(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """The pools file's ``gateway.max_body_bytes`` (applied at every reload) bounds what a body may be."""
        limit = self.pools_file.file_config.limits.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise HTTPError(413, f"request body is {request.content_length} bytes; the limit is {limit}",
                            code="body_too_large")
        if limit != self.config.max_body_bytes:  # what app() set; a reload changed it: read with the new one
            request = request.clone(client_max_size=limit)
        return await handler(request)

    def _model_card(self, name: str) -> dict[str, Any]:
        resolved = pools.resolve(name, self.pools_file.file_config, self.fleet)
        contexts = []
        for ref in resolved.members if resolved else ():
            hb = self.fleet.record(ref.member_id).heartbeat
            contexts.append(ref.max_context or (hb.max_context if hb else None))
        known = [c for c in contexts if c]
        return {"id": name, "object": "model", "created": 0, "owned_by": "llmgw",
                "max_model_len": max(known) if known else None}

    def _models_auth(self, request: web.Request) -> None:
        """GET /v1/models is public (clients probe it before they hold a key), unless the pools file's
        ``gateway.models_require_auth`` says otherwise: then it takes what inference takes."""
        if self.pools_file.file_config.limits.models_require_auth:
            self.auth.admit(request, time.time())

    async def list_models(self, request: web.Request) -> web.Response:
        self._models_auth(request)
        names = pools.model_names(self.pools_file.file_config, self.fleet)
        return web.json_response({"object": "list", "data": [self._model_card(n) for n in names]})

    async def get_model(self, request: web.Request) -> web.Response:
        self._models_auth(request)
        model = request.match_info["model_id"]
        if model not in pools.model_names(self.pools_file.file_config, self.fleet):
            raise HTTPError(404, f"model '{model}' does not exist", code="model_not_found", param="model")
        return web.json_response(self._model_card(model))

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "gateway_id": self.config.gateway_id,
                                  "nats_connected": self.nc.is_connected,
                                  "usage_spooled": self.spool.has_pending(),
                                  # the pools file on disk is broken and an older config is in force (why)
                                  "config_error": str(self.pools_file.problem) if self.pools_file.problem else None})

    async def openapi(self, request: web.Request) -> web.Response:
        return web.json_response(openapi_document())

    def backends_view(self) -> list[dict[str, Any]]:
        return routing_adapter.backends_view(self.pools_file.file_config, self.fleet, self.router, time.time(),
                                             self.pools_file.stale_after_s)

    async def prometheus(self, request: web.Request) -> web.Response:
        """This process's metrics; for one of several workers, every worker's (services/gateway/worker_metrics.py)."""
        text = self._own_metrics()
        if self.config.worker_group is not None:
            texts = {self.config.worker: text, **await self._siblings_metrics()}
            text = worker_metrics.merge(texts, self.config.num_workers)
        return web.Response(body=text.encode(), headers={"Content-Type": CONTENT_TYPE})

    async def _on_metrics_asked(self, msg: Msg) -> None:
        if msg.reply:
            with contextlib.suppress(Exception):  # the asker gave up, or the bus is gone: it counts who answered
                await msg.respond(encode_json(WorkerMetrics(worker=self.config.worker, text=self._own_metrics())))

    async def _siblings_metrics(self, timeout_s: float = 2.0) -> dict[str, str]:
        """The other workers' /metrics texts, by worker label: what arrives within ``timeout_s`` (fewer
        while one restarts or the bus is down; the answer says how many it holds)."""
        assert self.config.worker_group is not None  # only asked for by a worker
        wanted = self.config.num_workers - 1
        texts: dict[str, str] = {}
        done = asyncio.Event()

        async def on_reply(msg: Msg) -> None:
            with contextlib.suppress(ProtoDecodeError):
                reply = decode_json(msg.data, WorkerMetrics)
                if reply.worker != self.config.worker:
                    texts[reply.worker] = reply.text
            if len(texts) >= wanted:
                done.set()

        try:
            sub = await self.nc.subscribe(self.nc.new_inbox(), cb=on_reply)
        except Exception as exc:  # the bus is down: this worker's own samples, said as 1 reporting
            self._quiet_log.warning("metrics-gather", "the other workers' metrics not asked for: %s", exc)
            return texts
        try:
            await self.nc.publish(subjects.gateway_metrics(self.config.worker_group), b"", reply=sub.subject)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await done.wait()
        except Exception as exc:
            self._quiet_log.warning("metrics-gather", "the other workers' metrics not asked for: %s", exc)
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        return dict(texts)

    def _own_metrics(self) -> str:
        m = PromText()
        self.metrics.write(m)
        self.shedder.write(m)
        rows = self.backends_view()
        for row in rows:
            m.counter("llmgw_member_failures_total", "Requests the member failed (connect, 5xx, timeout, broken "
                      "stream), as its circuit breaker counted them.", row["breaker"]["failures_total"],
                      {"pool": row["pool"], "member": row["member_id"]})
        # one family at a time: the exposition format wants each family's samples as one group
        for name, key, help_text in (
            ("llmgw_member_load_score", "load_score", "Load score the router uses (0..1)."),
            ("llmgw_member_heartbeat_age_seconds", "heartbeat_age_s", "Age of the member's newest heartbeat."),
            ("llmgw_member_in_flight", "in_flight", "This gateway's open requests on the member."),
            ("llmgw_member_breaker_state", "breaker_state",
             "The member's circuit breaker: 0 closed, 1 half-open (one probe at a time), 2 open (skipped)."),
            ("llmgw_member_running", "running", "Requests running, as the member's newest heartbeat says."),
            ("llmgw_member_waiting", "waiting", "Requests waiting, as the member's newest heartbeat says."),
            ("llmgw_member_energy_today_wh", "energy_today_wh",
             "The member's own energy figure for today (UTC), Wh; absent where it reports none."),
        ):
            for row in rows:
                m.gauge(name, help_text, row[key], {"pool": row["pool"], "member": row["member_id"]})
        for row in rows:
            m.gauge("llmgw_member_down", "1 while the member is down: its heartbeat says so, or the gateway holds it "
                    "down after a failed request.", 1 if row["down"] or row["state"] == "down" else 0,
                    {"pool": row["pool"], "member": row["member_id"]})
        for row in rows:
            m.gauge("llmgw_member_stale", "1 while the member's newest heartbeat is older than its stale limit (or "
                    "none came).", 1 if row["stale"] else 0, {"pool": row["pool"], "member": row["member_id"]})
        return m.render()

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "chat.completions")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "completions")

    async def embeddings(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "embeddings")

    async def responses(self, request: web.Request) -> web.StreamResponse:
        """The Responses API for bus members (translated onto the chat path: openai_responses.py)."""
        return await self._serve(request, "responses")

    async def explain(self, request: web.Request) -> web.Response:
        """Dry-run the router on a chat/completions body: the candidates, their scores and why."""
        self.auth.api_user(request, time.time(), admin=True)
        body = await read_json_object(request)
        parsed = self.forwarder.parse(body, "chat.completions" if "messages" in body else "completions")
        resolved = self.forwarder.resolve(parsed.model)
        decision = self.forwarder.decide(request, parsed, resolved, None)
        return web.json_response(decision.explain())

    async def _serve(self, request: web.Request, endpoint: str) -> web.StreamResponse:
        key = self.auth.admit(request, time.time())
        body = await read_json_object(request)
        parsed = self.forwarder.parse(body, endpoint)
        resolved = self.forwarder.resolve(parsed.model)
        self._request_count += 1  # unique across gateways and restarts: the session id is random per start
        request_id = f"req-{self.session_id}-{self._request_count:x}"
        api_key_id = key.key_id if key is not None else None
        started, wall = time.monotonic(), time.time()
        outcome = Outcome(pool=resolved.pool.name, api_key_id=api_key_id)
        admission: Admission | None = None
        try:
            if key is not None:
                admission = self._admit(request, key, parsed)
            return await self.forwarder.forward(request, body, parsed, resolved, request_id, api_key_id, outcome)
        except HTTPError as err:
            outcome.status, outcome.http_status, outcome.error_code = "error", err.status, err.code
            outcome.limit_kind = err.kind if isinstance(err, LimitExceeded) else None
            raise
        except (asyncio.CancelledError, ConnectionResetError):
            # The client went away. If the member's final usage was in, the answer was complete (the SDK
            # closed its socket right after [DONE], before our last write landed): that is not an abort.
            if not (outcome.meter.is_final and outcome.status == "ok"):
                outcome.status, outcome.http_status, outcome.finish_reason = "aborted", 499, "abort"
            raise
        finally:
            def settle() -> None:
                usage, source = outcome.meter.result()
                self._record_usage(parsed, request_id, key, outcome, usage, source, started, wall)
                if outcome.meter.prompt_tokens is not None or source in ("member", "engine"):
                    self.prompt_estimator.observe(parsed.model, routing_adapter.prompt_chars(parsed),
                                                  usage.prompt_tokens)
                self.auth.finished(admission, usage.total_tokens, time.time(), self._list_price(parsed.model, usage))
            if outcome.settling is not None and not outcome.settling.done():
                self.usage.settle_later(outcome.settling, settle)
            else:
                settle()


async def _add_rate_headers(request: web.Request, response: web.StreamResponse) -> None:
    """The x-ratelimit-* headers admission computed go on the answer, a 429 included (OpenAI sends them
    on every response; its clients read them to pace themselves)."""
    headers = request.get(RATE_HEADERS)
    if headers:
        response.headers.update(headers)
