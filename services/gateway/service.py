"""The gateway's I/O shell: aiohttp handlers, heartbeat intake, bus and HTTP hops, usage records.

Per request: validate (400/404/413), resolve the model to a pool (configured, or discovered bus
engines), rank its members with the pure router, then try them in order — each once — until one
accepts (bus: chunk 0; HTTP: a status line that is not 5xx/408). All down → 503 + Retry-After.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import json
import logging
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import msgspec.json
from aiohttp import web
from nats.aio.client import Client
from nats.aio.msg import Msg

from proto import (
    AuthCheck,
    AuthReply,
    KeyEnergyQuery,
    KeyEnergyReply,
    LimitCounters,
    ProtoDecodeError,
    SlotHeartbeat,
    TokenChunk,
    Usage,
    UsageRecord,
    decode,
    decode_json,
    encode,
    encode_json,
    subjects,
)
from proto import pools as pool_config
from services.common import openai_api, openai_stream
from services.common.http import HTTPError, body_deadline_middleware, error_middleware, read_json_object, serving
from services.common.prom import E2E_BUCKETS_S, Histogram, PromText
from services.common.runtime import (
    ConfigError,
    HotPathLog,
    ThrottledLog,
    atomic_write_text,
    new_session_id,
    raise_if_cancelling,
)
from services.gateway import bus_backend, pools, routing, routing_adapter
from services.gateway.acked_publisher import AckedPublisher
from services.gateway.auth import Admission, Auth, LimitExceeded, parse_networks, save_usage_periodically
from services.gateway.fleet import Fleet
from services.gateway.http_backend import HttpBackend, MemberUnavailable
from services.gateway.identity import ApiKey, IdentityStore
from services.gateway.identity_sync import IdentitySync
from services.gateway.limits import Cost, PromptEstimator
from services.gateway.limits import month_of as limits_month
from services.gateway.openapi import document as openapi_document
from services.gateway.pages import Pages
from services.gateway.usage_meter import UsageMeter
from services.gateway.usage_spool import UsageSpool

log = logging.getLogger(__name__)
access_log = HotPathLog("llmgw.access")
USAGE_BATCH = 256  # usage records sent before waiting for their acks

# A gateway that does not know a key answers an auth check this much later than one that does.
NEGATIVE_AUTH_DELAY_S = 0.25
# How often each gateway tells the others its per-key token counts (a quota may overrun by this much traffic).
QUOTA_SHARE_S = 1.0
# HTTP members whose engines honour stream_options.continuous_usage_stats (vLLM's extension; SGLang has it
# too; ninfer-serve, engine kind "native"): known from their telemetry heartbeats. Others (llama.cpp, stock
# OpenAI servers) are not asked: an unknown stream option may be refused.
CONTINUOUS_USAGE_KINDS = frozenset({"vllm", "sglang", "native"})
# After a cancel, how long the gateway waits for the engine's count of what the request used (normally one
# engine step, milliseconds; a loaded 2-core host has taken over 2 s). The wait runs in the background.
ABORT_REPORT_WAIT_S = 10.0
_json = msgspec.json.Encoder()
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


@dataclass
class _Outcome:
    """What one request produced, for its UsageRecord, metrics and access line."""

    member_id: str = ""
    status: str = "ok"
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


@dataclass
class GatewayMetrics:
    requests: collections.Counter[tuple[str, str, str]] = field(default_factory=collections.Counter)
    decisions: collections.Counter[str] = field(default_factory=collections.Counter)
    failovers: collections.Counter[str] = field(default_factory=collections.Counter)
    latency: dict[str, Histogram] = field(default_factory=dict)
    affinity_hits: int = 0

    def observe(self, outcome: _Outcome, latency_s: float) -> None:
        self.requests[(outcome.pool or "-", outcome.member_id or "-", outcome.status)] += 1
        self.latency.setdefault(outcome.pool or "-", Histogram(E2E_BUCKETS_S)).observe(latency_s)


class GatewayService:
    def __init__(self, nc: Client, config: GatewayConfig, file_config: pool_config.GatewayFileConfig | None = None,
                 rng: random.Random | None = None) -> None:
        self.nc = nc
        self.config = config
        self.session_id = new_session_id()
        data = config.data_dir or Path("data")
        # the pools file: --config, else DATA/pools.json (what the Config page saves when no file was named)
        self.config_path = config.config_path or data / "pools.json"
        if file_config is None and config.config_path is None and self.config_path.exists():
            file_config = pool_config.load(self.config_path)
        self.file_config = file_config or pool_config.GatewayFileConfig()
        self.identity = IdentityStore(data / "identity")
        self.identity_sync = IdentitySync(nc, self.identity, config.gateway_id)
        self.auth = Auth(self.identity, parse_networks(config.trusted_networks),
                         self.file_config.limits.max_concurrent_per_key, config.gateway_id)
        self.bootstrap: tuple[str, str] | None = None  # (admin password, API key) printed at a first start
        self.fleet = Fleet(config.gateway_id)
        self.router = routing_adapter.Router(config.data_dir, time.time())
        self.metrics = GatewayMetrics()
        self._quiet_log = ThrottledLog(log)  # per-request lines while a member or the bus is down
        self.http = HttpBackend(first_byte_timeout_s=self.first_byte_timeout_s,
                                request_timeout_s=self.file_config.limits.request_timeout_s)
        self.spool = UsageSpool(data / "usage-spool" / config.gateway_id)
        self.rng = rng or random.Random()
        self._usage_queue: asyncio.Queue[UsageRecord] = asyncio.Queue(maxsize=config.usage_buffer)
        self._acked = AckedPublisher(nc)
        self._seq = 0
        self._request_count = 0
        self.usage_published = 0
        self._config_mtime: float | None = None
        self.prompt_estimator = PromptEstimator()  # prompt tokens per character, learnt per model (limits)
        self._settling: set[asyncio.Future[Any]] = set()  # answers still being accounted (see _Outcome)

    # ---- lifecycle -------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        await self.identity_sync.start()  # the fleet's users and keys first: only then is "no users" true
        if not self.identity.has_users():
            if await self.identity_sync.claim_bootstrap():
                self._bootstrap_admin()
            else:
                log.info("another gateway creates the first admin; its users and keys arrive over the bus "
                         "(if none do, run: llmgw admin create-user)")
        subs = [await self.nc.subscribe(subjects.HEARTBEAT_ALL, cb=self._on_heartbeat),
                await self.nc.subscribe(subjects.AUTH_CHECK, cb=self._on_auth_check),
                await self.nc.subscribe(subjects.CONFIG_CHANGED, cb=self._on_config_changed),
                await self.nc.subscribe(subjects.QUOTA_ALL, cb=self._on_limit_counters_elsewhere)]
        await self._load_known_workers()
        await self._acked.start()
        async with self.http, asyncio.TaskGroup() as tasks:
            background = [tasks.create_task(self._publish_usage(), name="usage-publisher"),
                          tasks.create_task(self._resend_spooled(), name="usage-resend"),
                          tasks.create_task(self._save_routing_tables(), name="routing-tables"),
                          tasks.create_task(save_usage_periodically(self.auth), name="key-usage"),
                          tasks.create_task(self.identity_sync.run(), name="identity-sync"),
                          tasks.create_task(self._share_limit_counters(), name="limit-counters-share"),
                          tasks.create_task(self._poll_key_energy(), name="key-energy")]
            self._config_mtime = _mtime(self.config_path)
            background.append(tasks.create_task(self._watch_config(), name="config-watch"))
            try:
                yield
            finally:
                for sub in subs:
                    with contextlib.suppress(Exception):
                        await sub.unsubscribe()
                await self._wait_settling(timeout_s=ABORT_REPORT_WAIT_S + 1.0)
                await self._flush_usage(timeout_s=5.0)
                self.router.save(time.time())
                self.auth.save_usage()
                for task in background:
                    task.cancel()
        await self._acked.stop()
        self.identity.close()

    def _bootstrap_admin(self) -> None:
        """First start: an admin user with a generated password and one API key, printed once (never logged)."""
        password, key = self.identity.bootstrap_admin(time.time())
        self.bootstrap = (password, key)
        print(f"llmgw gateway: first start: created user 'admin' (password {password}) and API key {key}; "
              "both are shown only this once: sign in at the gateway's / to manage keys and users", flush=True)

    async def _on_auth_check(self, msg: Msg) -> None:
        """Other services (accounting's /sql, /costs) ask whether an API key's digest is valid, and whose."""
        try:
            digest: str | None = decode_json(msg.data, AuthCheck).key_sha256
        except ProtoDecodeError:
            digest = None
        key = self.identity.lookup_key(digest, time.time()) if digest is not None else None
        user = self.identity.user(key.user_id) if key is not None else None
        reply = AuthReply(ok=False)
        if key is not None and user is not None:
            reply = AuthReply(ok=True, role=user.role, key_id=key.key_id, user=user.name)
        else:  # every gateway answers and the asker takes the first reply: let one that knows the key win
            await asyncio.sleep(NEGATIVE_AUTH_DELAY_S)
        with contextlib.suppress(Exception):
            await msg.respond(encode_json(reply))

    async def _share_limit_counters(self) -> None:
        """Tell the other gateways what this one counted against every limit, so limits hold fleet-wide."""
        told: dict[str, float] | None = None
        seq = 0
        while True:
            raise_if_cancelling()
            await asyncio.sleep(QUOTA_SHARE_S)
            now = time.time()
            counters = self.auth.limit_counters(now)
            if counters == told:
                continue
            seq += 1
            message = LimitCounters(gateway_id=self.config.gateway_id, session_id=self.session_id, seq=seq,
                                    ts_s=now, counters=counters)
            with contextlib.suppress(Exception):  # the bus is down: the next round tells them
                await self.nc.publish(subjects.quota(self.config.gateway_id), encode(message))
                told = counters

    async def _poll_key_energy(self) -> None:
        """The ledger's month-to-date energy per key, summed per principal, for the kWh-per-month limits.

        Asked only while some principal has such a limit. The ledger's figure lags the engines (samples
        every few seconds, attribution when both the sample and the usage record are in); a limit can be
        overshot by what ran in that lag (docs/admin.md, "Limits")."""
        while True:
            raise_if_cancelling()
            await asyncio.sleep(self.config.key_energy_poll_s)
            if not any(lim.kwh_per_month is not None for lim in self.identity.all_limits().values()):
                continue
            now = time.time()
            month = limits_month(now)
            try:
                msg = await self.nc.request(subjects.ACCOUNTING_KEY_ENERGY, encode(KeyEnergyQuery(month=month)),
                                            timeout=5.0)
                reply = decode(msg.data, KeyEnergyReply)
            except Exception as exc:  # accounting down or slow: keep the last figure (the page says its age)
                raise_if_cancelling()
                self._quiet_log.warning("key-energy", "month-to-date key energy not read from accounting: %s", exc)
                continue
            if reply.month != month:
                continue
            kwh: collections.Counter[str] = collections.Counter()
            keys = {k.key_id: k for k in self.identity.keys_of(None)}
            for key_id, joules in reply.joules_by_key.items():
                key = keys.get(key_id)
                if key is None:
                    continue
                for principal in self.identity.principals_of(key):
                    kwh[principal.principal_id] += joules / 3.6e6
            self.auth.book.set_energy(month, dict(kwh), reply.as_of_s)

    async def _on_limit_counters_elsewhere(self, msg: Msg) -> None:
        try:
            message = decode(msg.data, LimitCounters)
        except ProtoDecodeError:
            return  # e.g. an older gateway's JSON summary: it cannot be merged with these counters
        self.auth.counted_elsewhere(message.gateway_id, message.counters)

    # ---- the pools file ---------------------------------------------------------------------------

    @property
    def first_byte_timeout_s(self) -> float:
        if self.config.first_chunk_timeout_s is not None:
            return self.config.first_chunk_timeout_s
        return self.file_config.limits.first_byte_timeout_s

    @property
    def stale_after_s(self) -> float:
        """``--stale-after`` when given, else the pools file's ``metrics.stale_threshold`` (reloads apply)."""
        if self.config.stale_after_s is not None:
            return self.config.stale_after_s
        return self.file_config.metrics.stale_threshold

    def _use_file_config(self, parsed: pool_config.GatewayFileConfig) -> None:
        """The one place a new pools file takes effect (reload, Config page, another gateway's save)."""
        self.file_config = parsed
        self.auth.max_concurrent_per_key = parsed.limits.max_concurrent_per_key
        self.http.first_byte_timeout_s = self.first_byte_timeout_s
        self.http.request_timeout_s = parsed.limits.request_timeout_s

    def config_dict(self) -> dict[str, Any]:
        return pool_config.to_dict(self.file_config)

    async def apply_config(self, raw: dict[str, Any], broadcast: bool = True) -> ConfigError | None:
        """Validate, save atomically, apply now, and tell the other gateways; a bad config changes nothing."""
        try:
            parsed = pool_config.parse(raw)
        except ConfigError as exc:
            return exc
        text = json.dumps(raw, indent=2) + "\n"
        await asyncio.to_thread(atomic_write_text, self.config_path, text)
        self._use_file_config(parsed)
        self._config_mtime = _mtime(self.config_path)
        log.info("config saved to %s and applied: %d pool(s)", self.config_path, len(parsed.pools))
        if broadcast:
            await self._announce_config(raw)
        return None

    async def _announce_config(self, raw: dict[str, Any]) -> None:
        """Tell telemetry and the other gateways (``llm.v1.config.changed``) that the pools changed."""
        try:
            await self.nc.publish(subjects.CONFIG_CHANGED, pool_config.change_message(self.config.gateway_id, raw))
        except Exception as exc:
            log.warning("other gateways not told about the new config (bus: %s); they keep their own", exc)

    async def _on_config_changed(self, msg: Msg) -> None:
        try:
            change = pool_config.read_change_message(msg.data)
        except ConfigError as exc:
            log.error("kept the previous config: a config-changed message was refused: %s", exc)
            return
        if change.gateway_id == self.config.gateway_id:
            return
        try:
            await self.apply_config(change.raw, broadcast=False)  # already valid: read_change_message parsed it
        except OSError as exc:
            log.error("config from gateway %s not saved: %s", change.gateway_id, exc)

    async def _load_known_workers(self) -> None:
        """A new gateway knows the fleet at once from the KV bucket's last heartbeat per worker."""
        try:
            kv = await self.nc.jetstream().key_value(subjects.KV_WORKERS)
            keys = await kv.keys()
        except Exception as exc:  # empty bucket raises NoKeysError; a missing one NotFound
            log.debug("no known workers in KV: %s", exc)
            return
        now = time.time()
        for key in keys:
            with contextlib.suppress(Exception):
                entry = await kv.get(key)
                if entry.value:
                    hb = decode(entry.value, SlotHeartbeat)
                    self.fleet.observe(hb, min(now, hb.ts_s))  # as old as the engine says it is

    async def _on_heartbeat(self, msg: Msg) -> None:
        try:
            hb = decode(msg.data, SlotHeartbeat)
        except ProtoDecodeError as exc:
            log.warning("dropped heartbeat on %s: %s", msg.subject, exc.reason)
            return
        now = time.time()
        if self.fleet.observe(hb, now):
            rec = self.fleet.members[hb.worker_id]
            load = self.router.load_of(hb.engine_kind, hb, rec.previous)
            if load is not None:
                rec.load_history.append(round(load, 3))

    async def _save_routing_tables(self) -> None:
        while True:
            await asyncio.sleep(30.0)
            try:
                await asyncio.to_thread(self.router.write, self.router.snapshot(time.time()))
            except OSError as exc:
                log.warning("routing tables not saved: %s", exc)

    async def _watch_config(self) -> None:
        """Reload the pools file when it changes (and tell the bus); a broken file keeps the old config and says why."""
        while True:
            await asyncio.sleep(self.config.config_poll_s)
            mtime = _mtime(self.config_path)
            if mtime == self._config_mtime or mtime is None:
                continue
            self._config_mtime = mtime
            try:
                parsed = await asyncio.to_thread(pool_config.load, self.config_path)
            except ConfigError as exc:
                log.error("kept the previous config: %s", exc)
                continue
            if parsed == self.file_config:
                continue  # rewritten with what we have (another gateway saved it into a shared file)
            self._use_file_config(parsed)
            log.info("reloaded %s: %d pool(s)", self.config_path, len(self.file_config.pools))
            await self._announce_config(pool_config.to_dict(parsed))  # as for a Config page save

    # ---- usage records ----------------------------------------------------------------------------

    def _admit(self, request: web.Request, key: ApiKey, parsed: openai_api.ParsedRequest) -> Admission:
        """Check and reserve the key's limits (services/gateway/limits.py); the x-ratelimit-* headers go
        on the answer, whether it is the response or a 429."""
        now = time.time()
        max_tokens = parsed.generate.max_tokens
        output = max_tokens if max_tokens is not None else self.file_config.limits.reserve_output_tokens
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
        book = self.file_config.price_book
        prices = book.get(model) or book.get("*")
        if prices is None:
            return 0.0
        cached = min(usage.cached_tokens, usage.prompt_tokens)
        return ((usage.prompt_tokens - cached) * prices.prompt_usd_per_m + cached * prices.cached_usd_per_m
                + usage.completion_tokens * prices.output_usd_per_m) / 1e6

    def _record_usage(self, parsed: openai_api.ParsedRequest, request_id: str, key: ApiKey | None,
                      outcome: _Outcome, usage: Usage, source: str, started_s: float, wall_s: float) -> None:
        self._seq += 1
        latency_s = time.monotonic() - started_s
        record = UsageRecord(
            gateway_id=self.config.gateway_id, session_id=self.session_id, seq=self._seq, ts_s=wall_s,
            request_id=request_id, model=parsed.model, pool=outcome.pool or parsed.model, member=outcome.member_id,
            worker_id=outcome.member_id, api_key_id=key.key_id if key else None, endpoint=parsed.endpoint,
            stream=parsed.stream, status=outcome.status,  # type: ignore[arg-type]
            http_status=outcome.http_status, finish_reason=outcome.finish_reason,
            error_code=outcome.error_code,
            prompt_tokens=usage.prompt_tokens, cached_tokens=usage.cached_tokens,
            output_tokens=usage.completion_tokens,
            ttft_ms=outcome.ttft_ms, latency_ms=latency_s * 1000.0, routing_reason=outcome.routing_reason,
            usage_source=source, limit_kind=outcome.limit_kind, user_id=key.user_id if key else None,
        )
        self.metrics.observe(outcome, latency_s)
        try:
            self._usage_queue.put_nowait(record)
        except asyncio.QueueFull:
            if not self.spool.append(encode(record)):
                log.error("usage of %s could not be kept (memory queue and spool full)", request_id)
        access_log.info(
            f"request_id={request_id} endpoint={parsed.endpoint} pool={outcome.pool or '-'} "
            f"member={outcome.member_id or '-'} status={outcome.status} http={outcome.http_status} "
            f"prompt={record.prompt_tokens} output={record.output_tokens} ms={record.latency_ms:.1f} "
            f"reason={outcome.routing_reason or '-'}")

    def _usage_message(self, data: bytes, request_id: str) -> tuple[str, bytes, dict[str, str]]:
        # Nats-Msg-Id lets the stream drop a duplicate when we resend after a lost ack.
        return subjects.usage(self.config.gateway_id), data, {"Nats-Msg-Id": f"usage-{request_id}"}

    async def _publish_usage(self) -> None:
        """Send records as they come, a batch of what is queued at a time (each acked on its own); what
        the stream did not take within 2 s goes to the disk spool and is resent from there."""
        while True:
            raise_if_cancelling()
            batch = [await self._usage_queue.get()]
            while len(batch) < USAGE_BATCH and not self._usage_queue.empty():
                batch.append(self._usage_queue.get_nowait())
            data = [encode(record) for record in batch]
            stored: list[bool] = []
            try:
                stored = await self._acked.publish(
                    [self._usage_message(d, r.request_id) for d, r in zip(data, batch, strict=True)], timeout_s=2.0)
            finally:  # also when cancelled: what was not acked is kept on disk
                for d, record, ok in itertools.zip_longest(data, batch, stored, fillvalue=False):
                    if ok:
                        self.usage_published += 1
                    else:
                        self._quiet_log.warning("spooled", "usage of %s spooled to disk (the bus did not take it)",
                                                record.request_id)
                        self.spool.append(d)
                    self._usage_queue.task_done()

    async def _resend_spooled(self) -> None:
        while True:
            raise_if_cancelling()
            await asyncio.sleep(1.0)
            if not self.spool.has_pending() or not self.nc.is_connected:
                continue
            try:
                pending = self.spool.take()
                for start in range(0, len(pending), USAGE_BATCH):
                    chunk = pending[start:start + USAGE_BATCH]
                    stored = await self._acked.publish(
                        [self._usage_message(d, decode(d, UsageRecord).request_id) for d in chunk], timeout_s=5.0)
                    self.usage_published += sum(stored)
                    if not all(stored):
                        raise RuntimeError(f"the bus took {sum(stored)} of {len(chunk)} records")
                self.spool.done()
                log.info("spooled usage records delivered")
            except Exception as exc:
                raise_if_cancelling()
                log.warning("spooled usage not delivered yet: %s", exc)

    async def _wait_settling(self, timeout_s: float) -> None:
        """Let answers still being accounted write their records before the usage queue is flushed."""
        if self._settling:
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait(list(self._settling), timeout=timeout_s)

    async def _flush_usage(self, timeout_s: float) -> None:
        try:
            async with asyncio.timeout(timeout_s):
                await self._usage_queue.join()
        except TimeoutError:
            raise_if_cancelling()

    # ---- HTTP -------------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(middlewares=[error_middleware, self._body_limit,
                                           body_deadline_middleware(self.config.body_timeout_s)],
                              client_max_size=self.config.max_body_bytes)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/embeddings", self.embeddings)
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_get("/v1/models/{model_id}", self.get_model)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        app.router.add_get("/openapi.json", self.openapi)
        app.router.add_post("/admin/routing/explain", self.explain)
        Pages(self).routes(app)
        app.on_response_prepare.append(_add_rate_headers)
        return app

    def serving(self) -> contextlib.AbstractAsyncContextManager[str]:
        """Serve :meth:`app` on the configured address with the gateway's connection timeouts."""
        return serving(self.app(), self.config.host, self.config.port, idle_timeout_s=self.config.idle_timeout_s)

    @web.middleware
    async def _body_limit(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """The pools file's ``gateway.max_body_bytes`` (applied at every reload) bounds what a body may be."""
        limit = self.file_config.limits.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise HTTPError(413, f"request body is {request.content_length} bytes; the limit is {limit}",
                            code="body_too_large")
        if limit != self.config.max_body_bytes:  # what app() set; a reload changed it: read with the new one
            request = request.clone(client_max_size=limit)
        return await handler(request)

    def _model_card(self, name: str) -> dict[str, Any]:
        resolved = pools.resolve(name, self.file_config, self.fleet)
        contexts = []
        for ref in resolved.members if resolved else ():
            hb = self.fleet.record(ref.member_id).heartbeat
            contexts.append(ref.max_context or (hb.max_context if hb else None))
        known = [c for c in contexts if c]
        return {"id": name, "object": "model", "created": 0, "owned_by": "llmgw",
                "max_model_len": max(known) if known else None}

    async def list_models(self, request: web.Request) -> web.Response:
        names = pools.model_names(self.file_config, self.fleet)
        return web.json_response({"object": "list", "data": [self._model_card(n) for n in names]})

    async def get_model(self, request: web.Request) -> web.Response:
        model = request.match_info["model_id"]
        if model not in pools.model_names(self.file_config, self.fleet):
            raise HTTPError(404, f"model '{model}' does not exist", code="model_not_found", param="model")
        return web.json_response(self._model_card(model))

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "gateway_id": self.config.gateway_id,
                                  "nats_connected": self.nc.is_connected,
                                  "usage_spooled": self.spool.has_pending()})

    async def openapi(self, request: web.Request) -> web.Response:
        return web.json_response(openapi_document())

    def backends_view(self) -> list[dict[str, Any]]:
        now = time.time()
        rows = []
        names = list(self.file_config.pools) + [n for n in pools.model_names(self.file_config, self.fleet)
                                                 if n not in self.file_config.pools]
        for name in names:
            resolved = pools.resolve(name, self.file_config, self.fleet)
            if resolved is None or resolved.pool.name != name:
                continue
            for ref in resolved.members:
                rows.append(self.router.describe_member(resolved, ref, self.fleet, now, self.stale_after_s))
        return rows

    async def prometheus(self, request: web.Request) -> web.Response:
        m = PromText()
        for (pool, member, status), n in sorted(self.metrics.requests.items()):
            m.counter("llmgw_requests_total", "Requests by pool, member and outcome.", n,
                      {"pool": pool, "member": member, "status": status})
        for pool, hist in sorted(self.metrics.latency.items()):
            m.histogram("llmgw_request_latency_seconds", "Request latency at the gateway.", hist, {"pool": pool})
        for reason, n in sorted(self.metrics.decisions.items()):
            m.counter("llmgw_routing_decisions_total", "Routing decisions by reason.", n, {"reason": reason})
        for member, n in sorted(self.metrics.failovers.items()):
            m.counter("llmgw_failovers_total", "Members skipped after a failure.", n, {"member": member})
        m.counter("llmgw_affinity_hits_total", "Requests routed by cache affinity.", self.metrics.affinity_hits)
        rows = self.backends_view()
        # one family at a time: the exposition format wants each family's samples as one group
        for name, key, help_text in (
            ("llmgw_member_load_score", "load_score", "Load score the router uses (0..1)."),
            ("llmgw_member_heartbeat_age_seconds", "heartbeat_age_s", "Age of the member's newest heartbeat."),
            ("llmgw_member_in_flight", "in_flight", "This gateway's open requests on the member."),
        ):
            for row in rows:
                m.gauge(name, help_text, row[key], {"pool": row["pool"], "member": row["member_id"]})
        return web.Response(text=m.render(), content_type="text/plain", charset="utf-8")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "chat.completions")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "completions")

    async def embeddings(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "embeddings")

    async def explain(self, request: web.Request) -> web.Response:
        """Dry-run the router on a chat/completions body: the candidates, their scores and why."""
        self.auth.api_user(request, time.time(), admin=True)
        body = await read_json_object(request)
        parsed = self._parse(body, "chat.completions" if "messages" in body else "completions")
        resolved = self._resolve(parsed.model)
        session_key, is_header = self._session_key(request, None)
        decision = self.router.decide(resolved, parsed, session_key, is_header, self.fleet, time.time(),
                                      self._weights(), self.rng)
        return web.json_response(decision.explain())

    def _weights(self) -> routing.RoutingWeights:
        return routing_adapter.weights_for(self.file_config.metrics, self.stale_after_s)

    @staticmethod
    def _parse(body: dict[str, Any], endpoint: str) -> openai_api.ParsedRequest:
        try:
            if endpoint == "embeddings":
                model = body.get("model")
                if not isinstance(model, str) or not model:
                    raise openai_api.InvalidRequest("'model' is required and must be a string", "model")
                if "input" not in body:
                    raise openai_api.InvalidRequest("'input' is required", "input")
                return openai_api.ParsedRequest("embeddings", model, False, False, openai_api.empty_generate(model))
            return openai_api.parse_request(body, endpoint)
        except openai_api.InvalidRequest as exc:
            raise HTTPError.bad_request(exc) from None

    def _resolve(self, model: str) -> pools.ResolvedPool:
        resolved = pools.resolve(model, self.file_config, self.fleet)
        if resolved is None:
            raise HTTPError(404, f"model '{model}' does not exist", code="model_not_found", param="model")
        return resolved

    @staticmethod
    def _session_key(request: web.Request, api_key_id: str | None) -> tuple[str | None, bool]:
        """X-Session-Id, else the API key id (a weaker hint); the flag says which."""
        header = request.headers.get("X-Session-Id")
        return (header, True) if header else (api_key_id, False)

    async def _serve(self, request: web.Request, endpoint: str) -> web.StreamResponse:
        key = self.auth.admit(request, time.time())
        body = await read_json_object(request)
        parsed = self._parse(body, endpoint)
        resolved = self._resolve(parsed.model)
        self._request_count += 1  # unique across gateways and restarts: the session id is random per start
        request_id = f"req-{self.session_id}-{self._request_count:x}"
        api_key_id = key.key_id if key is not None else None
        started, wall = time.monotonic(), time.time()
        outcome = _Outcome(pool=resolved.pool.name)
        admission: Admission | None = None
        try:
            if key is not None:
                admission = self._admit(request, key, parsed)
            return await self._forward(request, body, parsed, resolved, request_id, api_key_id, outcome)
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
                self._settling.add(outcome.settling)
                outcome.settling.add_done_callback(lambda f: (self._settling.discard(f), settle()))
            else:
                settle()

    async def _forward(self, request: web.Request, body: dict[str, Any], parsed: openai_api.ParsedRequest,
                       resolved: pools.ResolvedPool, request_id: str, api_key_id: str | None,
                       outcome: _Outcome) -> web.StreamResponse:
        session_key, is_header = self._session_key(request, api_key_id)
        decision = self.router.decide(resolved, parsed, session_key, is_header, self.fleet, time.time(),
                                      self._weights(), self.rng)
        self.metrics.decisions[decision.reason] += 1
        if decision.reason == "no_member_fits_context":
            raise HTTPError(400, f"the prompt is longer than any member of '{parsed.model}' accepts",
                            code="context_length_exceeded", param="messages")
        refs = {r.member_id: r for r in resolved.members}
        outcome.meter.prompt_tokens_estimate = decision.request.prompt_tokens
        prompt_chars = decision.request.prompt_tokens * routing.CHARS_PER_TOKEN
        last_error: HTTPError | None = None
        for attempt, member_id in enumerate(decision.ranked):
            ref = refs[member_id]
            if parsed.endpoint == "embeddings" and ref.kind != "http":
                continue  # our engines do not serve embeddings
            if parsed.unsupported and ref.kind != "http":
                # Asks for what our engines do not implement (tools, ...): HTTP members get the body as it came.
                refusal = openai_api.unsupported_error(parsed, f"engine {member_id}")
                last_error = last_error or HTTPError.bad_request(refusal)
                continue
            outcome.member_id = member_id
            outcome.routing_reason = decision.reason if attempt == 0 else f"failover:{decision.reason}"
            pending = max(0, prompt_chars - decision.affinity_chars(member_id))
            self.fleet.book(member_id)
            self.fleet.add_pending_prefill(member_id, pending)
            first_byte = _Once(lambda m=member_id, p=pending: self.fleet.add_pending_prefill(m, -p))
            try:
                if ref.kind == "bus":
                    response = await self._via_bus(request, parsed, ref, request_id, api_key_id, outcome, first_byte)
                else:
                    response = await self._via_http(request, body, parsed, ref, request_id, outcome, first_byte)
            except (bus_backend.WorkerUnavailable, MemberUnavailable) as exc:
                self.fleet.unbook(member_id)
                if outcome.meter.output_tokens_seen == 0 and not outcome.meter.is_final:
                    outcome.meter = UsageMeter(prompt_tokens_estimate=outcome.meter.prompt_tokens_estimate)
                error = getattr(exc, "error", None)
                bus_down = getattr(exc, "is_bus_down", False)
                if error is not None and error.status < 500:
                    if error.status in (400, 413):
                        raise error from None  # about the request itself: another member would say the same
                    last_error = error  # e.g. 429 queue full: try the next member, report this if none
                elif not bus_down:
                    self.fleet.mark_down(member_id, time.time())
                self._quiet_log.warning(f"unavailable:{member_id}:{bus_down}",
                                        "member %s unavailable for %s: %s", member_id, request_id, exc)
                self.metrics.failovers[member_id] += 1
                continue
            finally:
                first_byte()
                self.fleet.release(member_id)
            if outcome.status == "ok":
                self.router.record_success(decision, member_id, self.fleet, time.time())
                if decision.reason == "affinity":
                    self.metrics.affinity_hits += 1
            return response
        if last_error is not None:
            raise last_error
        outcome.member_id = ""
        raise HTTPError(503, f"no engine of '{parsed.model}' can take the request right now; retry shortly",
                        code="no_backend_available", retry_after_s=5)

    def _on_final(self, outcome: _Outcome) -> Callable[[TokenChunk, float | None], None]:
        def on_final(chunk: TokenChunk, ttft_ms: float | None) -> None:
            outcome.finish_reason, outcome.ttft_ms = chunk.finish_reason, ttft_ms
            if chunk.usage is not None:
                outcome.meter.finished(chunk.usage, "engine" if chunk.finish_reason == "abort" else "member")
            if chunk.error is not None:
                outcome.status, outcome.http_status, outcome.error_code = "error", chunk.error.status, chunk.error.code
            elif chunk.finish_reason == "abort":
                outcome.status = "aborted"
        return on_final

    def _on_error(self, outcome: _Outcome) -> Callable[[HTTPError], None]:
        def on_error(err: HTTPError) -> None:
            outcome.status, outcome.http_status, outcome.error_code = "error", err.status, err.code
        return on_error

    async def _via_bus(self, request: web.Request, parsed: openai_api.ParsedRequest, ref: pools.MemberRef,
                       request_id: str, api_key_id: str | None, outcome: _Outcome,
                       first_byte: Callable[[], None]) -> web.StreamResponse:
        generate = msgspec.structs.replace(parsed.generate, request_id=request_id, model=ref.model_id,
                                           gateway_id=self.config.gateway_id, api_key_id=api_key_id)
        deadline_s = time.monotonic() + self.file_config.limits.request_timeout_s
        stream = await bus_backend.start(self.nc, ref.member_id, generate, self.first_byte_timeout_s,
                                         self.config.chunk_timeout_s, self._liveness(ref.member_id), deadline_s)
        open_stream: bus_backend.BusStream | None = stream
        meter = outcome.meter
        first = stream.first
        meter.accepted(first.usage.prompt_tokens if first.usage else None,
                       first.usage.cached_tokens if first.usage else 0)
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
                    meter.finished(chunk.usage, "engine" if chunk.finish_reason == "abort" else "member")
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
            return hb.session_id == session and time.time() - rec.received_s <= self.stale_after_s
        return is_alive

    async def _via_http(self, request: web.Request, body: dict[str, Any], parsed: openai_api.ParsedRequest,
                        ref: pools.MemberRef, request_id: str, outcome: _Outcome,
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
        yield chunk


async def _quietly(task: asyncio.Future[Any]) -> None:
    """Await ``task`` for its side effects; its failure has been accounted for already."""
    with contextlib.suppress(Exception):
        await task


async def _add_rate_headers(request: web.Request, response: web.StreamResponse) -> None:
    """The x-ratelimit-* headers admission computed go on the answer, a 429 included (OpenAI sends them
    on every response; its clients read them to pace themselves)."""
    headers = request.get(RATE_HEADERS)
    if headers:
        response.headers.update(headers)


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None
