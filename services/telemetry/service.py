"""Telemetry's I/O shell: one scrape loop per HTTP member, heartbeats and energy on the bus, /metrics.

Each member has its own loop (a slow or hung member delays only itself), phase-shifted across the
interval so 200 members do not all fire in the same millisecond. All loops share one aiohttp session.
Per scrape::

    ok   → lanes resolved (lanes.py: the engine's, declared, learned, default), then
           SlotHeartbeat(state="ready", ts_s=scrape start) on llm.v1.hb.<id> and the llm_workers KV bucket;
           an EnergySample on ENERGY when the engine reported energy (at most every energy_interval_s)
    1st failure → nothing: gateways keep the last reading, which ages (their stale threshold applies)
    2nd+ failure → SlotHeartbeat(state="down"), logged once; the member's kind is re-detected next time
    success after down → "recovered", logged once
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.kv import KeyValue

from proto import SlotHeartbeat, encode, subjects
from proto import pools as pool_config
from services.common.http import error_middleware
from services.common.prom import CONTENT_TYPE
from services.common.runtime import ConfigError, new_session_id, raise_if_cancelling
from services.telemetry import discovery, lanes, schedule, views
from services.telemetry.normalize import MalformedBody, Reading, models_info
from services.telemetry.probe import Health, Member, down_heartbeat, energy_sample, heartbeat
from services.telemetry.scraper import Knowledge, ScrapeError, Scraper

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 256  # the shared pool: enough for every member's keep-alive connection at 200 members
DISCOVERY_CONCURRENCY = 32
PUBLISH_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class TelemetryConfig:
    members: tuple[Member, ...]
    interval_s: float = schedule.DEFAULT_INTERVAL_S  # the interval at start (see is_interval_from_pools)
    # True when interval_s is the pools file's metrics.poll_interval (no --interval was given): a saved
    # pools file's new poll_interval then applies at once. False: the operator's flag wins over any file.
    is_interval_from_pools: bool = False
    timeout_s: float = schedule.DEFAULT_TIMEOUT_S  # one request's deadline (schedule.request_timeout_s bounds it)
    energy_interval_s: float = 5.0
    discover: tuple[discovery.PortRange, ...] = ()
    discover_interval_s: float = 30.0
    from_pools: frozenset[str] = frozenset()  # members that came from the pools file (follow its changes)
    # lanes for members whose engine does not say and nobody declared: the pools file's metrics.default_max_seqs
    default_lanes: int = field(default_factory=lambda: pool_config.MetricsConfig().default_lanes)
    flag_lanes: Mapping[str, int] = field(default_factory=dict)  # --lanes ID=N: wins over the pools file's


@dataclass
class MemberState:
    """The shell's bookkeeping for one member (the loop that owns it is the only writer)."""

    member: Member
    is_discovered: bool = False
    from_pools: bool = False
    knowledge: Knowledge = field(default_factory=Knowledge)
    health: Health = field(default_factory=Health)
    last: Reading | None = None
    heartbeat: SlotHeartbeat | None = None
    previous: SlotHeartbeat | None = None
    last_ok_s: float | None = None
    seq: int = 0
    scrapes_total: int = 0
    failures_total: int = 0
    energy_seq: int = 0
    energy_sent_s: float = float("-inf")
    lane_memory: lanes.LaneMemory = field(default_factory=lanes.LaneMemory)

    def status(self, retries_total: int = 0) -> views.MemberStatus:
        return views.MemberStatus(
            member_id=self.member.member_id, url=self.member.url, engine_kind=self.knowledge.kind or (
                self.last.engine_kind if self.last else None),
            is_up=self.scrapes_total > 0 and not self.health.is_down,
            heartbeat=self.heartbeat, previous=self.previous, last_ok_s=self.last_ok_s,
            scrapes_total=self.scrapes_total, failures_total=self.failures_total, is_discovered=self.is_discovered,
            retries_total=retries_total,
        )


class TelemetryService:
    def __init__(self, nc: Client, config: TelemetryConfig) -> None:
        self.nc = nc
        self.config = config
        self.session_id = new_session_id()
        self.members: dict[str, MemberState] = {
            m.member_id: MemberState(m, from_pools=m.member_id in config.from_pools) for m in config.members}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._group: asyncio.TaskGroup | None = None
        self._kv: KeyValue | None = None
        self._scraper: Scraper | None = None
        self.interval_s = config.interval_s  # seconds between a member's scrapes now; set_interval changes it
        self.default_lanes = config.default_lanes  # follows the pools file's metrics.default_max_seqs
        self._retimed = asyncio.Event()  # set (and replaced) when interval_s changes: wakes every waiting loop
        self.following_pools = asyncio.Event()  # set once config changes are listened to (tests await it)

    # ---- lifecycle -------------------------------------------------------------------------------

    async def run(self) -> None:
        """Scrape until cancelled."""
        connector = aiohttp.TCPConnector(limit=MAX_CONNECTIONS, limit_per_host=0, ttl_dns_cache=300)
        # each request has its own deadline (Scraper.request_timeout_s); none for the session as a whole
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as http, \
                asyncio.TaskGroup() as group:
            self._scraper = Scraper(http, self.request_timeout_s)
            self._group = group
            for state in list(self.members.values()):
                self._start(state)
            if self.config.discover:
                group.create_task(self._discover_forever(http), name="telemetry-discovery")
            sub = await self.nc.subscribe(subjects.CONFIG_CHANGED, cb=self._on_config_changed)
            self.following_pools.set()
            try:
                await asyncio.Event().wait()  # with no member yet (none configured) keep serving until cancelled
            finally:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()

    async def _on_config_changed(self, msg: Msg) -> None:
        """A gateway saved new pools (its Config page): watch the HTTP members it added, drop removed ones,
        and scrape at its ``metrics.poll_interval`` unless ``--interval`` pinned the interval."""
        try:
            config = pool_config.read_change_message(msg.data).config
        except ConfigError as exc:
            log.warning("ignored a config-changed message: %s", exc)
            return
        self.default_lanes = config.metrics.default_lanes
        self.follow_pools([Member(m.member_id, m.backend.rstrip("/"),
                                  self.config.flag_lanes.get(m.member_id) or config.metrics.max_seqs_for(m),
                                  api_key=m.api_key)
                           for m in config.http_members()])
        if self.config.is_interval_from_pools:
            self.set_interval(config.metrics.poll_interval)

    def set_interval(self, interval_s: float) -> None:
        """Scrape every ``interval_s`` from now on; every member's loop re-times the wait it is in at once
        (schedule.py). ``interval_s`` comes checked: the pools file's parser bounds poll_interval to 0.1..60 s."""
        if interval_s == self.interval_s:
            return
        log.info("scraping every %gs (was %gs): the pools file's metrics.poll_interval", interval_s, self.interval_s)
        self.interval_s = interval_s
        if self._scraper is not None:
            self._scraper.request_timeout_s = self.request_timeout_s
        retimed, self._retimed = self._retimed, asyncio.Event()
        retimed.set()

    @property
    def request_timeout_s(self) -> float:
        return schedule.request_timeout_s(self.config.timeout_s, self.interval_s)

    def follow_pools(self, members: list[Member]) -> None:
        wanted = {m.member_id: m for m in members}
        for mid, state in list(self.members.items()):
            if state.from_pools and mid not in wanted:
                task = self._tasks.pop(mid, None)
                if task is not None:
                    task.cancel()
                del self.members[mid]
                log.info("stopped watching %s: no pool names it any more", mid)
        for mid, member in wanted.items():
            known = self.members.get(mid)
            if known is not None and known.from_pools and (known.member.api_key, known.member.lanes) != (
                    member.api_key, member.lanes):  # a new key or declared lanes: from the next scrape
                known.member = dataclasses.replace(known.member, api_key=member.api_key, lanes=member.lanes)
            if known is None:
                state = self.members[mid] = MemberState(member, from_pools=True)
                self._start(state)
                log.info("watching %s (%s): a pool names it now", mid, member.url)

    def _start(self, state: MemberState) -> None:
        assert self._group is not None
        mid = state.member.member_id
        self._tasks[mid] = self._group.create_task(self._watch(state), name=f"telemetry-{mid}")

    # ---- scraping ----------------------------------------------------------------------------------

    async def _pause(self, delay_s: float) -> bool:
        """Sleep ``delay_s``; True when the scrape interval changed meanwhile (the sleep ended early)."""
        retimed = self._retimed
        try:
            async with asyncio.timeout(max(0.0, delay_s)):
                await retimed.wait()
        except TimeoutError:
            raise_if_cancelling()
            return False
        return True

    async def _watch(self, state: MemberState) -> None:
        await self._pause(schedule.phase_s(state.member.member_id, self.interval_s))
        tick_s = time.monotonic()
        while True:
            raise_if_cancelling()
            await self.scrape_once(state)
            while True:  # wait for the next tick; a new interval re-times the wait from the same last tick
                next_s = schedule.next_tick_s(tick_s, self.interval_s, time.monotonic())
                if not await self._pause(next_s - time.monotonic()):
                    break
            tick_s = next_s

    async def scrape_once(self, state: MemberState) -> None:
        """Scrape one member, publish what it says (or that it is down). Never raises but for cancellation."""
        assert self._scraper is not None
        member = state.member
        started_s = time.time()
        state.scrapes_total += 1
        reading: Reading | None = None
        try:  # every request has its deadline and one retry (scraper.py), so the scrape as a whole is bounded
            reading, state.knowledge = await self._scraper.scrape(member, state.knowledge)
        except ScrapeError as exc:
            reason = str(exc)
        except Exception:  # a body no normaliser foresaw: a failed scrape, never a dead telemetry service
            log.exception("scrape of %s failed unexpectedly", member.member_id)
            reason = f"{member.member_id}: unexpected error (logged)"
        transition = state.health.observe(reading is not None)
        if reading is None:
            state.failures_total += 1
            state.knowledge = Knowledge()  # detect afresh: the engine may have been replaced
            if transition == "down":
                log.warning("member %s down after %d failed scrapes: %s", member.member_id,
                            state.health.consecutive_failures, reason)
            else:
                log.debug("scrape failed: %s", reason)
            if state.health.is_down:
                state.seq += 1
                await self._publish(state, down_heartbeat(member, state.last, session_id=self.session_id,
                                                          seq=state.seq, ts_s=started_s,
                                                          interval_s=self.interval_s))
            return
        reading, state.lane_memory = lanes.resolve(reading, state.lane_memory, declared=member.lanes,
                                                   default=self.default_lanes)
        if transition == "recovered":
            log.info("member %s recovered (%s)", member.member_id, reading.engine_kind)
        elif state.last is None or state.last.engine_kind != reading.engine_kind:
            log.info("member %s speaks %s", member.member_id, reading.engine_kind)
        state.last = reading
        state.last_ok_s = started_s
        state.seq += 1
        await self._publish(state, heartbeat(member, reading, session_id=self.session_id, seq=state.seq,
                                             ts_s=started_s, interval_s=self.interval_s))
        if started_s - state.energy_sent_s >= self.config.energy_interval_s:
            await self._publish_energy(state, reading, started_s)

    # ---- bus ---------------------------------------------------------------------------------------

    async def _publish(self, state: MemberState, hb: SlotHeartbeat) -> None:
        """Core publish for live gateways, KV put for gateways that start later; a bus outage costs
        heartbeats (the next one carries the news), never the loop."""
        state.previous, state.heartbeat = state.heartbeat, hb
        data = encode(hb)
        try:
            await self.nc.publish(subjects.heartbeat(hb.worker_id), data)
            if self._kv is None:
                self._kv = await self.nc.jetstream().key_value(subjects.KV_WORKERS)
            await self._kv.put(hb.worker_id, data)
        except Exception as exc:
            log.debug("heartbeat of %s not stored: %s", hb.worker_id, exc)

    async def _publish_energy(self, state: MemberState, reading: Reading, ts_s: float) -> None:
        sample = energy_sample(state.member, reading, session_id=self.session_id, seq=state.energy_seq + 1,
                               ts_s=ts_s)
        if sample is None:
            return
        state.energy_seq += 1
        state.energy_sent_s = ts_s
        msg_id = f"energy-{sample.worker_id}-{sample.session_id}-{sample.seq}"
        try:
            await self.nc.jetstream().publish(subjects.energy(sample.worker_id), encode(sample),
                                              headers={"Nats-Msg-Id": msg_id}, timeout=PUBLISH_TIMEOUT_S)
        except Exception as exc:  # cumulative: the next sample carries this interval's energy too
            log.warning("energy sample %d of %s not published: %s", sample.seq, sample.worker_id, exc)

    # ---- discovery ---------------------------------------------------------------------------------

    async def _discover_forever(self, http: aiohttp.ClientSession) -> None:
        while True:
            raise_if_cancelling()
            await self.discover_once(http)
            await asyncio.sleep(self.config.discover_interval_s)

    async def discover_once(self, http: aiohttp.ClientSession) -> list[str]:
        """Probe every configured port not yet watched; start watching those that answer. Returns new ids."""
        watched = {m.member.url for m in self.members.values()}
        gate = asyncio.Semaphore(DISCOVERY_CONCURRENCY)

        async def probe(url: str) -> bool:
            async with gate:
                try:
                    async with asyncio.timeout(self.config.timeout_s), http.get(url + "/v1/models") as resp:
                        if resp.status != 200:
                            return False
                        models_info(await resp.json(content_type=None))
                        return True
                except (aiohttp.ClientError, ValueError, MalformedBody):
                    return False
                except TimeoutError:
                    raise_if_cancelling()
                    return False

        candidates = [(r.host, port, r.url(port)) for r in self.config.discover for port in r.ports()
                      if r.url(port) not in watched]
        answers = await asyncio.gather(*(probe(url) for _, _, url in candidates))
        found = []
        for (host, port, url), ok in zip(candidates, answers, strict=True):
            mid = discovery.discovered_id(host, port)
            if ok and mid not in self.members:
                state = self.members[mid] = MemberState(Member(mid, url), is_discovered=True)
                log.info("discovered %s at %s", mid, url)
                self._start(state)
                found.append(mid)
        return found

    # ---- HTTP --------------------------------------------------------------------------------------

    def statuses(self) -> list[views.MemberStatus]:
        retries = self._scraper.retries_total if self._scraper is not None else {}
        return [s.status(retries.get(mid, 0)) for mid, s in self.members.items()]

    def app(self) -> web.Application:
        app = web.Application(middlewares=[error_middleware])
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/members", self._members)
        app.router.add_get("/health", self._health)
        return app

    async def _metrics(self, request: web.Request) -> web.Response:
        text = views.metrics_text(self.statuses(), time.time())
        return web.Response(body=text.encode(), headers={"Content-Type": CONTENT_TYPE})

    async def _members(self, request: web.Request) -> web.Response:
        return web.json_response(views.members_body(self.statuses(), time.time()))

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "members": len(self.members),
                                  "bus": "connected" if self.nc.is_connected else "disconnected"})

