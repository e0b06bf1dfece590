"""The gateway's routing on a real fleet: two bus engines and one HTTP engine in one pool, real nats-server.

Which member served a request is read from the engines themselves (``core.admitted_total`` deltas) for
sequential requests, and from the gateway's ``metrics`` where the request's outcome matters.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from prometheus_client.parser import text_string_to_metric_families

from proto import GenerateRequest, decode, subjects
from proto import pools as pool_config
from services.common.bus import connect, ensure_bus
from services.common.http import serving
from services.common.nats_server import EmbeddedNatsServer
from services.engine.config import EngineConfig
from services.engine.engine_core import EngineCore
from services.engine.outputs import RequestOutput
from services.engine.serve.async_engine import AsyncEngine
from services.engine.serve.energy import UnavailableMeter
from services.engine.serve.http import EngineService, ServeConfig, http_site
from services.engine.serve.worker import BusWorker, WorkerConfig
from services.gateway.service import GatewayConfig, GatewayService
from services.telemetry.probe import Member
from services.telemetry.service import TelemetryConfig, TelemetryService
from tests.integration.conftest import wait_for

# A stream that outlives the test's assertions (cancelled at the end): the engines run the 32k-context
# tiny model, which makes thousands of tokens a second, so a 4k-context stream could end mid-test.
LONG_TOKENS = 12_000


@dataclass
class Engine:
    member_id: str
    core: EngineCore
    engine: AsyncEngine
    finished: list[RequestOutput] = field(default_factory=list)
    worker: BusWorker | None = None
    worker_task: asyncio.Task[None] | None = None
    nc: Client | None = None


@dataclass
class Pool:
    base_url: str
    gateway: GatewayService
    engines: dict[str, Engine]
    http_id: str
    http_url: str
    client: openai.AsyncOpenAI
    session: aiohttp.ClientSession

    @property
    def members(self) -> list[str]:
        return ["w1", "w2", self.http_id]

    def backend(self, member_id: str) -> str:
        return self.http_url if member_id == self.http_id else f"bus:{member_id}"

    def configure(self, members: list[str] | None = None, **pool: Any) -> None:
        """Swap the gateway's pools config (as a reload would): ``members`` of pool "tiny", pool knobs."""
        backends = [self.backend(m) for m in (members or self.members)]
        self.gateway.pools_file.file_config = pool_config.parse({"model_pools": {"tiny": {
            "members": [{"model_id": "tiny", "backend": b} for b in backends], **pool}}})

    @contextlib.contextmanager
    def only(self, member_id: str) -> Iterator[None]:
        """Route to one member for a while (the pool's other knobs as they were)."""
        saved = self.gateway.pools_file.file_config
        pool = saved.pools["tiny"]
        self.configure([member_id], overflow_threshold=pool.overflow_threshold, sticky_bias=pool.sticky_bias)
        try:
            yield
        finally:
            self.gateway.pools_file.file_config = saved

    def admitted(self) -> dict[str, int]:
        return {m: e.core.admitted_total for m, e in self.engines.items()}

    async def chat(self, messages: list[dict[str, str]], session: str | None = None, max_tokens: int = 4) -> str:
        """One sequential request; returns the member that admitted it."""
        before = self.admitted()
        headers = {"X-Session-Id": session} if session else None
        resp = await self.client.chat.completions.create(model="tiny", messages=messages,  # type: ignore[arg-type]
                                                         max_tokens=max_tokens, extra_headers=headers)
        assert resp.choices[0].finish_reason in ("stop", "length")
        after = self.admitted()
        served = [m for m in after if after[m] != before[m]]
        assert len(served) == 1, (before, after)
        await self.fresh_heartbeat(served[0])
        return served[0]

    async def fresh_heartbeat(self, member_id: str) -> None:
        """Wait for a member's heartbeat taken after now (a bus worker's own, or telemetry's scrape of the HTTP
        member): the next decision sees this request finished (heartbeats are rate-limited and scrapes
        periodic, so one taken just before the reply may still count it as running)."""
        task = self.engines[member_id].worker_task
        if member_id != self.http_id and task is None:
            return  # a worker this test stopped: no heartbeat will come
        since = time.time() + 0.01
        await wait_for(lambda: (task is not None and task.done())
                       or ((hb := self.heartbeat(member_id)) is not None and hb.ts_s > since), timeout_s=5)

    async def explain(self, messages: list[dict[str, str]], session: str | None = None) -> dict[str, Any]:
        headers = {"X-Session-Id": session} if session else {}
        async with self.session.post(self.base_url + "/admin/routing/explain", headers=headers,
                                     json={"model": "tiny", "messages": messages}) as resp:
            assert resp.status == 200, await resp.text()
            return await resp.json()

    def heartbeat(self, member_id: str) -> Any:
        return self.gateway.fleet.record(member_id).heartbeat

    @contextlib.asynccontextmanager
    async def hold(self, member_id: str, n: int) -> AsyncIterator[list[aiohttp.ClientResponse]]:
        """``n`` long streams on ``member_id``, admitted and running, until the block ends."""
        opened: list[aiohttp.ClientResponse] = []
        try:
            with self.only(member_id):
                for i in range(n):
                    resp = await self.session.post(self.base_url + "/v1/chat/completions", json={
                        "model": "tiny", "messages": [{"role": "user", "content": f"hold {member_id} {i}"}],
                        "max_tokens": LONG_TOKENS, "ignore_eos": True, "stream": True})
                    opened.append(resp)
                    assert resp.status == 200, await resp.text()
                    await _first_event(resp)
            running = min(n, 2)
            await wait_for(lambda: (self.heartbeat(member_id).running or 0) >= running, timeout_s=5)
            yield opened
        finally:
            for resp in opened:
                resp.close()


async def _first_event(resp: aiohttp.ClientResponse) -> dict[str, Any]:
    async with asyncio.timeout(10):
        while True:
            line = await resp.content.readline()
            if line.startswith(b"data: {"):
                return json.loads(line[6:])
            assert line, "stream ended before its first event"


def _engine(model: Path, member_id: str) -> EngineCore:
    return EngineCore(EngineConfig(model_path=model, model_id="tiny", kv_capacity_tokens=16384, max_concurrency=2,
                                   max_pending_requests=8))


@pytest.fixture
async def pool(nats_server: EmbeddedNatsServer, long_model: Path, tmp_path: Path) -> AsyncIterator[Pool]:
    async with contextlib.AsyncExitStack() as es:
        tasks: list[asyncio.Task[None]] = []

        async def stop_tasks() -> None:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        async def client(name: str) -> Client:
            c = await connect(nats_server.url, name)

            async def close() -> None:
                with contextlib.suppress(Exception):
                    await c.drain()
            es.push_async_callback(close)
            return c

        gw_nc = await client("gateway")
        await ensure_bus(gw_nc)
        engines: dict[str, Engine] = {}
        for wid in ("w1", "w2"):
            core = _engine(long_model, wid)
            engine = await es.enter_async_context(AsyncEngine(core))
            nc = await client(f"engine-{wid}")
            worker = BusWorker(nc, engine, WorkerConfig(worker_id=wid, heartbeat_interval_s=0.1))
            engines[wid] = Engine(wid, core, engine, worker=worker, nc=nc)
        http_core = _engine(long_model, "http")
        http_engine = await es.enter_async_context(AsyncEngine(http_core))
        service = EngineService(http_engine, UnavailableMeter("cpu", "test"), ServeConfig(port=0))
        http_url = await es.enter_async_context(http_site(service))
        http_id = pool_config.member_id_for(http_url)
        engines[http_id] = Engine(http_id, http_core, http_engine)
        for e in engines.values():
            e.engine.on_outputs(lambda outs, e=e: e.finished.extend(o for o in outs if o.finished))
        telemetry = TelemetryService(await client("telemetry"), TelemetryConfig(members=(Member(http_id, http_url),),
                                                                                interval_s=0.1))
        file_config = pool_config.parse({"model_pools": {"tiny": {"members": [
            {"model_id": "tiny", "backend": b} for b in ("bus:w1", "bus:w2", http_url)]}}})
        gateway = GatewayService(gw_nc, GatewayConfig(gateway_id="gw1", port=0, data_dir=tmp_path,
                                                      first_chunk_timeout_s=2.0), file_config)
        await es.enter_async_context(gateway.running())
        es.push_async_callback(stop_tasks)  # engines' workers stop before the gateway and the bus go
        for e in engines.values():
            if e.worker is not None:
                e.worker_task = asyncio.create_task(e.worker.run())
                tasks.append(e.worker_task)
        tasks.append(asyncio.create_task(telemetry.run()))
        base_url = await es.enter_async_context(serving(gateway.app(), "127.0.0.1", 0))
        await wait_for(lambda: all(
            (hb := gateway.fleet.record(m).heartbeat) is not None and hb.state == "ready" and hb.model_id == "tiny"
            for m in engines))
        assert gateway.bootstrap is not None
        key = gateway.bootstrap[1]  # the bootstrap admin's API key: inference and the admin JSON routes
        api = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key=key, max_retries=0)
        es.push_async_callback(api.close)
        session = await es.enter_async_context(aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}))
        yield Pool(base_url, gateway, engines, http_id, http_url, api, session)


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


# ---- 1. load ---------------------------------------------------------------------------------------------------


async def test_new_requests_avoid_a_member_whose_lanes_are_full(pool: Pool) -> None:
    async with pool.hold("w1", 2):
        rows = {r["member_id"]: r for r in (await (await pool.session.get(pool.base_url + "/backends")).json())
                ["members"]}
        assert rows["w1"]["in_flight"] == 2 and rows["w1"]["running"] == 2
        before = pool.admitted()
        results = await asyncio.gather(*(pool.client.chat.completions.create(
            model="tiny", messages=_user(f"question {i}"), max_tokens=64) for i in range(3)))  # type: ignore[arg-type]
        after = pool.admitted()
        delta = {m: after[m] - before[m] for m in after}
        assert all(r.choices[0].finish_reason in ("stop", "length") for r in results)
        assert delta["w1"] == 0, delta
        assert delta["w2"] >= 1 and delta["w2"] + delta[pool.http_id] == 3, delta
        assert pool.gateway.metrics.decisions["least_loaded"] >= 3


# ---- 2. affinity -----------------------------------------------------------------------------------------------


async def test_a_conversation_sharing_a_long_system_prompt_stays_on_the_engine_that_cached_it(pool: Pool) -> None:
    conversations: dict[str, list[dict[str, str]]] = {}
    for member in pool.members:  # each conversation's first turn lands on a different member
        system = {"role": "system", "content": f"You are assistant {member}. " + "Follow the house rules. " * 60}
        messages = [system, {"role": "user", "content": "first question"}]
        with pool.only(member):
            reply = await pool.client.chat.completions.create(model="tiny", messages=messages,  # type: ignore[arg-type]
                                                              max_tokens=4)
        # the follow-ups' decisions must see this request finished: a heartbeat taken while it ran says the
        # member is busy, and the engine is fast enough now that the first turns end within one interval
        await pool.fresh_heartbeat(member)
        conversations[member] = [*messages, {"role": "assistant", "content": reply.choices[0].message.content or ""}]
    hits = pool.gateway.metrics.affinity_hits
    served: dict[str, list[str]] = collections.defaultdict(list)
    for turn in range(2):  # the pool is idle: without affinity every request would go to the same member
        for member, messages in conversations.items():
            messages.append({"role": "user", "content": f"follow-up {turn}"})
            served[member].append(await pool.chat(messages))
            messages.append({"role": "assistant", "content": "ok"})
        # a new single-turn request that shares only the system prompt goes there too
        for member, messages in conversations.items():
            served[member].append(await pool.chat([messages[0], {"role": "user", "content": f"unrelated {turn}"}]))
    assert served == {m: [m] * 4 for m in pool.members}
    assert pool.gateway.metrics.affinity_hits - hits == 12
    explain = await pool.explain(conversations["w2"])
    assert explain["member"] == "w2" and explain["reason"] == "affinity"


# ---- 3. pinning ------------------------------------------------------------------------------------------------


async def test_a_session_stays_on_its_pinned_engine_until_that_engine_stops(pool: Pool) -> None:
    with pool.only("w1"):
        assert await pool.chat(_user("hello"), session="sess-a") == "w1"
    # an idle pool: without the pin these would go to the lowest-id member (the HTTP one)
    assert [await pool.chat(_user(f"q{i}"), session="sess-a") for i in range(3)] == ["w1"] * 3
    assert await pool.chat(_user("no session")) != "w1"
    explain = await pool.explain(_user("q"), session="sess-a")
    assert explain["reason"] == "pinned" and explain["pinned_member"] == "w1"

    w1 = pool.engines["w1"]
    assert w1.worker_task is not None
    w1.worker_task.cancel()  # a graceful stop: the worker's last heartbeat says "stopped"
    await asyncio.gather(w1.worker_task, return_exceptions=True)
    await wait_for(lambda: pool.heartbeat("w1").state == "stopped", timeout_s=5)
    explain = await pool.explain(_user("q"), session="sess-a")
    assert explain["reason"] == "pin_broken_down" and "w1" not in explain["ranked"]
    moved = await pool.chat(_user("after the stop"), session="sess-a")
    assert moved != "w1"
    assert [await pool.chat(_user(f"r{i}"), session="sess-a") for i in range(2)] == [moved] * 2
    assert (await pool.explain(_user("q"), session="sess-a"))["pinned_member"] == moved


# ---- 4. overflow -----------------------------------------------------------------------------------------------


async def test_a_pinned_member_at_the_overflow_threshold_spills_requests_to_the_others(pool: Pool) -> None:
    pool.configure(sticky_bias=1.0, overflow_threshold=0.85)  # a pin outweighs any load below the threshold
    with pool.only("w1"):
        assert await pool.chat(_user("hello"), session="sess-b") == "w1"
    async with pool.hold("w1", 1):  # w1's load: 1 of 2 lanes = 0.375
        assert await pool.chat(_user("below the threshold"), session="sess-b") == "w1"
        pool.configure(sticky_bias=1.0, overflow_threshold=0.3)  # now w1 is at/above the threshold
        explain = await pool.explain(_user("q"), session="sess-b")
        w1 = next(c for c in explain["candidates"] if c["member_id"] == "w1")
        assert w1["is_busy"] and w1["load"] >= 0.3 and w1["pin"] == 0.0
        assert explain["reason"] == "pin_broken_busy" and explain["ranked"][-1] == "w1"
        assert [await pool.chat(_user(f"above {i}"), session="sess-b") for i in range(2)].count("w1") == 0
        # when every member is busy, the least costly busy one still serves ("overflow")
        pool.configure(sticky_bias=1.0, overflow_threshold=0.0)
        assert (await pool.explain(_user("q")))["reason"] == "overflow"
        assert await pool.chat(_user("all busy")) != "w1"


# ---- 5. failover -----------------------------------------------------------------------------------------------


async def test_a_worker_killed_before_the_first_byte_is_failed_over_to_another_member(pool: Pool) -> None:
    with pool.only("w1"):
        assert await pool.chat(_user("hello"), session="sess-c") == "w1"
    w1 = pool.engines["w1"]
    assert w1.nc is not None and w1.worker_task is not None
    await w1.nc.close()  # a crash: no goodbye heartbeat, the subject has no responder
    w1.worker_task.cancel()
    await asyncio.gather(w1.worker_task, return_exceptions=True)
    # Wait until the broker has dropped the dead connection's subscription (it learns of the crash a
    # moment after the socket closes); from then on a request to w1 gets NATS' no-responders status.
    async with asyncio.timeout(2):
        while True:
            try:
                await pool.gateway.nc.request(subjects.gen("w1"), b"", timeout=0.2)
            except NoRespondersError:
                break
            except NatsTimeout:
                continue
    hb_age = time.time() - (pool.gateway.fleet.record("w1").received_s or 0)
    assert hb_age < pool.gateway.pools_file.stale_after_s and pool.heartbeat("w1").state == "ready"
    assert (await pool.explain(_user("q"), session="sess-c"))["member"] == "w1"  # the router still picks it

    started = time.monotonic()
    served = await pool.chat(_user("are you there?"), session="sess-c")
    assert served != "w1"
    assert time.monotonic() - started < pool.gateway.config.first_chunk_timeout_s  # no-responder, not a timeout
    assert pool.gateway.metrics.failovers["w1"] == 1
    assert pool.gateway.metrics.requests[("tiny", served, "ok")] >= 1
    assert pool.gateway.fleet.is_down("w1", time.time())
    assert await pool.chat(_user("again"), session="sess-c") == served  # the pin moved with the failover


# ---- 6. client disconnect --------------------------------------------------------------------------------------


@pytest.mark.parametrize("transport", ["bus", "http"])
async def test_a_client_that_disconnects_mid_stream_aborts_the_request_in_the_engine(pool: Pool,
                                                                                      transport: str) -> None:
    member = "w2" if transport == "bus" else pool.http_id
    engine = pool.engines[member]
    with pool.only(member):
        resp = await pool.session.post(pool.base_url + "/v1/chat/completions", json={
            "model": "tiny", "messages": _user("tell me a long story"), "max_tokens": LONG_TOKENS,
            "ignore_eos": True, "stream": True})
        assert resp.status == 200
        await _first_event(resp)
        await _first_event(resp)
        resp.close()
    await wait_for(lambda: len(engine.finished) == 1, timeout_s=10)
    out = engine.finished[0]
    assert out.finish_reason == "abort" and 0 < out.num_output_tokens < LONG_TOKENS
    await wait_for(lambda: engine.engine.snapshot().stats.num_kv_blocks_used == 0, timeout_s=5)
    assert engine.engine.snapshot().stats.num_running == 0
    await wait_for(lambda: pool.gateway.metrics.requests[("tiny", member, "aborted")] == 1, timeout_s=5)


# ---- 7. operator endpoints -------------------------------------------------------------------------------------


async def test_explain_backends_openapi_and_metrics_describe_the_pool(pool: Pool) -> None:
    assert await pool.chat(_user("warm up")) in pool.members
    explain = await pool.explain(_user("which engine?"))
    assert explain["reason"] in ("least_loaded", "affinity", "pinned")
    assert explain["member"] == explain["ranked"][0] and sorted(explain["ranked"]) == sorted(pool.members)
    assert {c["member_id"] for c in explain["candidates"]} == set(pool.members)
    assert all(isinstance(c["cost"], float) and c["basis"] in ("heartbeat", "no_signal") for c in explain["candidates"])

    async with pool.session.get(pool.base_url + "/backends") as resp:
        rows = {r["member_id"]: r for r in (await resp.json())["members"]}
    assert set(rows) == set(pool.members)
    for wid in ("w1", "w2"):
        assert rows[wid]["engine_kind"] == "native" and rows[wid]["transport"] == "bus"
        assert isinstance(rows[wid]["load_score"], float) and rows[wid]["no_signal"] is False
    http = rows[pool.http_id]
    assert http["engine_kind"] == "ninfer" and http["transport"] == "http" and http["backend"] == pool.http_url
    assert isinstance(http["load_score"], float) and http["no_signal"] is False  # telemetry read its /slots
    for row in rows.values():
        assert 0 <= row["heartbeat_age_s"] < 1.0 and row["stale"] is False and row["down"] is False

    async with pool.session.get(pool.base_url + "/openapi.json") as resp:
        documented = (await resp.json())["paths"]
    served: dict[str, set[str]] = collections.defaultdict(set)
    for route in pool.gateway.app().router.routes():
        path = route.resource.canonical if route.resource is not None else ""
        is_page = path in ("/", "/login", "/logout") or path.startswith(("/admin/", "/account", "/static/"))
        if route.method != "HEAD" and not is_page:  # the browser pages are not the API
            served[path].add(route.method.lower())
    assert {p: set(ops) for p, ops in documented.items()} == served

    async with pool.session.get(pool.base_url + "/metrics") as resp:
        assert resp.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
        text = await resp.text()
    parsed = list(text_string_to_metric_families(text))
    families = {f.name: f for f in parsed}
    assert len(families) == len(parsed), "a metric family is split into several groups"
    requests = [s for s in families["llmgw_requests"].samples if s.name == "llmgw_requests_total"]
    assert sum(s.value for s in requests) == 1
    assert families["llmgw_member_load_score"].type == "gauge"
    # every member has a load signal here (the HTTP one through telemetry); one without would be absent
    assert {s.labels["member"] for s in families["llmgw_member_load_score"].samples} == set(pool.members)
    assert {s.labels["member"] for s in families["llmgw_member_in_flight"].samples} == set(pool.members)
    assert "llmgw_routing_decisions" in families and "llmgw_request_latency_seconds" in families


# ---- 8. HTTP member streaming ----------------------------------------------------------------------------------


async def test_an_http_member_streams_with_usage_injected_upstream_and_stripped_unless_asked(
        pool: Pool, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="llmgw.access")
    with pool.only(pool.http_id):
        stream = await pool.client.chat.completions.create(
            model="tiny", messages=_user("hi"), max_tokens=5, stream=True,  # type: ignore[arg-type]
            extra_body={"ignore_eos": True})
        plain = [c async for c in stream]
        stream = await pool.client.chat.completions.create(
            model="tiny", messages=_user("hi"), max_tokens=5, stream=True,  # type: ignore[arg-type]
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        asked = [c async for c in stream]
    assert all(c.usage is None and c.choices for c in plain)
    assert plain[-1].choices[0].finish_reason == "length"
    assert asked[-1].choices == [] and asked[-1].usage is not None
    assert asked[-1].usage.completion_tokens == 5 and asked[-1].usage.prompt_tokens > 0
    assert sum(1 for c in asked if c.usage is not None) == 1
    lines = [r.getMessage() for r in caplog.records if r.name == "llmgw.access"]
    assert len(lines) == 2 and all(f"member={pool.http_id}" in ln and " output=5 " in ln for ln in lines), lines
    assert pool.engines[pool.http_id].core.admitted_total == 2


async def test_the_gateway_tells_the_engine_when_it_gives_up_on_a_request(pool: Pool,
                                                                           nats_server: EmbeddedNatsServer) -> None:
    """GenerateRequest.deadline_s is the wall-clock time the gateway's request timeout ends: the engine drops a
    request still waiting then (tests/integration/test_engine_deadline.py)."""
    seen: list[GenerateRequest] = []

    async def capture(msg: Msg) -> None:
        seen.append(decode(msg.data, GenerateRequest))

    watcher = await connect(nats_server.url, "watcher")  # a connection does not hear its own messages
    sub = await watcher.subscribe(subjects.gen("*"), cb=capture)
    await watcher.flush()
    timeout_s = pool.gateway.pools_file.file_config.limits.request_timeout_s
    before = time.time()
    with pool.only("w1"):  # a bus member
        await pool.chat(_user("hello"))
    after = time.time()
    await wait_for(lambda: bool(seen))
    await sub.unsubscribe()
    await watcher.close()
    deadline_s = seen[0].deadline_s
    assert deadline_s is not None and before + timeout_s <= deadline_s <= after + timeout_s
