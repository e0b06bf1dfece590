"""Telemetry on a real nats-server against fixture HTTP servers that answer exactly like vLLM, llama.cpp (both
``/slots`` shapes), SGLang, NInfer and a stock server; faults (500, garbage JSON, hang) injected per member.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import itertools
import json
import socket
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from nats.aio.client import Client
from nats.js.errors import NotFoundError
from prometheus_client.parser import text_string_to_metric_families

from proto import EnergySample, SlotHeartbeat, decode, subjects
from proto import pools as pool_config
from services.common.http import serving
from services.common.runtime import ConfigError
from services.gateway.service import GatewayConfig, GatewayService
from services.telemetry import __main__ as telemetry_main
from services.telemetry.discovery import PortRange, discovered_id
from services.telemetry.probe import Member
from services.telemetry.service import TelemetryConfig, TelemetryService
from tests.integration.conftest import wait_for
from tests.unit.telemetry import samples

INTERVAL_S = 0.1
TIMEOUT_S = 0.3


@dataclass
class Engine:
    """A fixture engine: ``kind`` picks the endpoints it serves; ``fault`` breaks every answer."""

    kind: str
    fault: str | None = None  # "500" | "garbage" | "hang" | "flaky" (every other /metrics answers 503)
    metrics: str | None = None  # a vllm or sglang /metrics body other than the sample one
    slots: dict[str, Any] = field(default_factory=samples.ninfer_slots)
    usage: dict[str, Any] = field(default_factory=lambda: samples.ninfer_usage({"2026-01-01": 10.0}))
    llama_busy: list[bool] = field(default_factory=lambda: [True, False, False])  # llama.cpp /slots is_processing
    models: dict[str, Any] | None = None  # a /v1/models body other than the kind's sample one
    metrics_delay_s: float = 0.0  # a slow /metrics (the rest answers at once)
    chats: int = 0
    hits: collections.Counter[str] = field(default_factory=collections.Counter)

    def app(self) -> web.Application:
        @web.middleware
        async def faults(request: web.Request, handler: Any) -> web.StreamResponse:
            self.hits[request.path] += 1
            if self.fault == "flaky" and request.path == "/metrics" and self.hits[request.path] % 2:
                return web.json_response({"error": {"message": "upstream busy"}}, status=503)
            if self.fault == "500":
                return web.json_response({"error": {"message": "boom"}}, status=500)
            if self.fault == "garbage":
                return web.Response(body=b"{not json <html>", content_type="application/json")
            if self.fault == "hang":
                await asyncio.Event().wait()
            return await handler(request)

        def text(body: str) -> Callable[[web.Request], Any]:
            async def handler(request: web.Request) -> web.Response:
                if request.path == "/metrics" and self.metrics_delay_s:
                    await asyncio.sleep(self.metrics_delay_s)
                return web.Response(text=body, content_type="text/plain")
            return handler

        def js(body: Callable[[], Any]) -> Callable[[web.Request], Any]:
            async def handler(request: web.Request) -> web.Response:
                return web.json_response(body())
            return handler

        app = web.Application(middlewares=[faults])
        add = app.router.add_get
        models = {"vllm": samples.VLLM_MODELS, "llamacpp": samples.LLAMACPP_MODELS,
                  "llamacpp-old": samples.LLAMACPP_MODELS}.get(self.kind, {"object": "list", "data": [{"id": "tiny"}]})
        if self.models is not None:
            models = self.models
        add("/v1/models", js(lambda: models))
        add("/health", js(lambda: {"status": "ok"}))
        if self.kind == "vllm":
            add("/metrics", text(self.metrics or samples.VLLM_METRICS))
            app.router.add_post("/v1/chat/completions", self._chat)
        elif self.kind == "sglang":
            add("/metrics", text(self.metrics or samples.SGLANG_METRICS))
        elif self.kind == "llamacpp":
            add("/slots", js(lambda: samples.llamacpp_slots(self.llama_busy)))
            add("/metrics", text(self.metrics or samples.LLAMACPP_METRICS))
            app.router.add_post("/v1/chat/completions", self._chat)
        elif self.kind == "llamacpp-old":  # an older build, run without --metrics
            add("/slots", js(lambda: samples.llamacpp_slots([True, True], old=True)))
        elif self.kind == "ninfer":
            add("/slots", js(lambda: self.slots))
            add("/usage", js(lambda: self.usage))
            add("/metrics", text(samples.VLLM_METRICS + samples.LLAMACPP_METRICS))  # forks export these too
            app.router.add_post("/v1/chat/completions", self._chat)
        return app

    async def _chat(self, request: web.Request) -> web.Response:
        self.chats += 1
        body = await request.json()
        return web.json_response({
            "id": f"chatcmpl-{self.chats}", "object": "chat.completion", "created": 0, "model": body["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}})


@dataclass
class Fleet:
    engines: dict[str, Engine]
    urls: dict[str, str]
    telemetry: TelemetryService
    heartbeats: dict[str, list[SlotHeartbeat]]
    nc: Client

    def last(self, member_id: str) -> SlotHeartbeat | None:
        beats = self.heartbeats.get(member_id)
        return beats[-1] if beats else None

    async def next_heartbeat(self, member_id: str, timeout_s: float = 5.0) -> SlotHeartbeat:
        seen = len(self.heartbeats[member_id])
        await wait_for(lambda: len(self.heartbeats[member_id]) > seen, timeout_s)
        return self.heartbeats[member_id][seen]


@contextlib.asynccontextmanager
async def fleet_of(nc: Client, kinds: dict[str, str], metrics: dict[str, str] | None = None,
                   **config: Any) -> AsyncIterator[Fleet]:
    """Fixture engines (member id → kind; ``metrics``: member id → its /metrics body), telemetry scraping
    them, and every heartbeat it publishes."""
    async with contextlib.AsyncExitStack() as es:
        engines = {mid: Engine(kind, metrics=(metrics or {}).get(mid)) for mid, kind in kinds.items()}
        urls = {mid: await es.enter_async_context(serving(e.app(), "127.0.0.1", 0)) for mid, e in engines.items()}
        heartbeats: dict[str, list[SlotHeartbeat]] = collections.defaultdict(list)

        async def on_heartbeat(msg: Any) -> None:
            hb = decode(msg.data, SlotHeartbeat)
            heartbeats[hb.worker_id].append(hb)

        sub = await nc.subscribe(subjects.HEARTBEAT_ALL, cb=on_heartbeat)
        es.push_async_callback(sub.unsubscribe)
        telemetry = TelemetryService(nc, TelemetryConfig(
            members=tuple(Member(mid, url) for mid, url in urls.items()),
            **{"interval_s": INTERVAL_S, "timeout_s": TIMEOUT_S, **config}))
        task = asyncio.create_task(telemetry.run())

        async def stop() -> None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

        es.push_async_callback(stop)
        yield Fleet(engines, urls, telemetry, heartbeats, nc)


async def _ready(fleet: Fleet, *member_ids: str) -> None:
    await wait_for(lambda: all((hb := fleet.last(m)) is not None and hb.state == "ready" for m in member_ids))


async def test_each_engine_kind_is_detected_and_its_heartbeat_carries_what_it_said(nc: Client) -> None:
    kinds = {"v": "vllm", "l": "llamacpp", "lo": "llamacpp-old", "n": "ninfer", "s": "sglang", "st": "stock"}
    async with fleet_of(nc, kinds) as fleet:
        await _ready(fleet, *kinds)
        hb = {m: fleet.last(m) for m in kinds}
        assert {m: h.engine_kind for m, h in hb.items() if h} == {
            "v": "vllm", "l": "llamacpp", "lo": "llamacpp", "n": "ninfer", "s": "sglang", "st": "stock"}
        v = hb["v"]
        assert v is not None and (v.model_id, v.running, v.waiting, v.kv_usage, v.kv_blocks_total, v.max_context) == (
            "Qwen/Qwen3-8B", 3, 2, 0.4, 2000, 32768)
        assert v.kv_capacity_tokens == 2000 * 16  # num_gpu_blocks x block_size
        # vLLM does not export max_num_seqs: 3 running while 2 wait says its scheduler is full at 3 (lanes.py)
        assert (v.lanes, v.signal_sources) == (3, {"lanes": "learned", "running": "/metrics", "waiting": "/metrics",
                                                   "kv_usage": "/metrics", "kv_capacity_tokens": "cache_config_info",
                                                   "max_context": "/v1/models"})
        l_, lo = hb["l"], hb["lo"]
        assert l_ is not None and (l_.lanes, l_.running, l_.waiting, l_.kv_usage) == (3, 1, 2, 0.25)
        assert lo is not None and (lo.lanes, lo.running, lo.waiting, lo.kv_usage) == (2, 2, None, None)
        assert l_.signal_sources is not None and l_.signal_sources["lanes"] == l_.signal_sources["running"] == "/slots"
        n = hb["n"]
        assert n is not None and (n.lanes, n.running, n.waiting, n.admitted_total, n.energy_today_wh) == (
            8, 2, 0, 42, 10.0)
        s = hb["s"]
        assert s is not None and (s.running, s.waiting, s.kv_usage) == (5, 4, 0.15)
        assert (s.lanes, (s.signal_sources or {}).get("lanes")) == (5, "learned")  # no server info here: 5 run, 4 queue
        st = hb["st"]
        assert st is not None and st.model_id == "tiny"
        assert (st.lanes, st.running, st.waiting, st.kv_usage) == (None, None, None, None)  # no signal
        assert st.signal_sources is None  # nothing to say where it came from
        for h in hb.values():
            assert h is not None and h.backend == fleet.urls[h.worker_id]
            assert h.heartbeat_interval_s == INTERVAL_S and h.ts_s > 0
        # a new gateway finds the same heartbeats in the KV bucket
        kv = await nc.jetstream().key_value(subjects.KV_WORKERS)
        stored = {m: decode((await kv.get(m)).value or b"", SlotHeartbeat).engine_kind for m in kinds}
        assert stored == {m: h.engine_kind for m, h in hb.items() if h}
        # the detected kind is remembered: a vLLM member is asked for /metrics only, never /slots again
        slots_asked = fleet.engines["v"].hits["/slots"]
        await fleet.next_heartbeat("v")
        await fleet.next_heartbeat("v")
        assert fleet.engines["v"].hits["/slots"] == slots_asked == 1


async def test_messy_prometheus_text_over_http_reads_escaped_labels_nan_as_null_and_openmetrics_counters(
        nc: Client) -> None:
    """The fixture servers answer vLLM and SGLang /metrics with free comments, blank lines, histograms, a
    timestamp, a counter typed without _total whose samples carry it, a served model name holding
    ``\\"`` and ``\\\\`` escapes, and (for one member of each) a NaN KV gauge, which must be null, not 0 or NaN."""
    messy = samples.MESSY_MODEL_NAME
    bodies = {"vnan": samples.vllm_metrics(model_name=messy, kv_usage="NaN"),
              "snan": samples.sglang_metrics(model_name=messy, token_usage="NaN")}
    kinds = {"v": "vllm", "vnan": "vllm", "s": "sglang", "snan": "sglang"}
    async with fleet_of(nc, kinds, metrics=bodies) as fleet:
        await _ready(fleet, *kinds)
        hb = {m: fleet.last(m) for m in kinds}
    v, vnan, s, snan = hb["v"], hb["vnan"], hb["s"], hb["snan"]
    assert v is not None and vnan is not None and s is not None and snan is not None
    assert "\\\\" in bodies["vnan"] and '\\"' in bodies["vnan"]  # escaped on the wire ...
    assert vnan.model_id == snan.model_id == 'acme/"fast", {8B} \\ fp8'  # ... and read back as named
    assert (v.model_id, s.model_id) == ("Qwen/Qwen3-8B", "meta-llama/Llama-3.1-8B-Instruct")
    # vLLM: KV usage NaN → unknown, and so are the blocks derived from it; the rest as the engine said
    assert (v.kv_usage, v.kv_blocks_used, v.kv_blocks_total) == (0.4, round(0.4 * 2000), 2000)
    assert vnan.kv_usage is None and vnan.kv_blocks_used is None and vnan.kv_blocks_total == 2000
    for h in (v, vnan):
        assert (h.engine_kind, h.running, h.waiting, h.max_context) == ("vllm", 3, 2, 32768)
        assert h.preemptions_total == 7  # '# TYPE vllm:num_preemptions counter', sample ..._total 7.0
        assert (h.prompt_tokens_queried_total, h.prompt_tokens_hit_total) == (1000, 250)
    # SGLang: token_usage NaN → unknown; its histogram and counters around it change nothing
    assert s.kv_usage == 0.15 and snan.kv_usage is None
    for h in (s, snan):
        assert (h.engine_kind, h.running, h.waiting, h.kv_blocks_used, h.kv_blocks_total, h.decode_tok_per_s) == (
            "sglang", 5, 4, 6000, 40000, 312.5)
    # not only the newest heartbeat: none ever carried the NaN (msgpack would have sent it as a float)
    for m in ("vnan", "snan"):
        assert all(b.kv_usage is None for b in fleet.heartbeats[m])


@pytest.mark.parametrize("fault", ["500", "garbage", "hang"])
async def test_a_failing_member_is_down_after_two_failures_without_affecting_others_and_recovers(
        nc: Client, fault: str) -> None:
    async with fleet_of(nc, {"bad": "ninfer", "good": "vllm"}) as fleet:
        await _ready(fleet, "bad", "good")
        state = fleet.telemetry.members["bad"]
        failures_before = state.failures_total
        good_before = len(fleet.heartbeats["good"])
        seen = len(fleet.heartbeats["bad"])
        fleet.engines["bad"].fault = fault
        await wait_for(lambda: any(hb.state == "down" for hb in fleet.heartbeats["bad"][seen:]), timeout_s=10)
        after = fleet.heartbeats["bad"][seen:]
        first_down = next(i for i, hb in enumerate(after) if hb.state == "down")
        down = after[first_down]
        assert down.engine_kind == "ninfer" and down.running is None and down.lanes is None
        assert first_down <= 1  # at most one scrape that was already under way when the fault began
        assert state.failures_total - failures_before >= 2  # the first failure published nothing
        good = fleet.heartbeats["good"][good_before:]
        assert good and all(h.state == "ready" for h in good)
        gaps = [b.ts_s - a.ts_s for a, b in itertools.pairwise(good)]
        assert max(gaps, default=0.0) < 3 * INTERVAL_S  # the good member kept its pace

        fleet.engines["bad"].fault = None
        await wait_for(lambda: (hb := fleet.last("bad")) is not None and hb.state == "ready", timeout_s=5)
        back = fleet.last("bad")
        assert back is not None and back.engine_kind == "ninfer" and back.lanes == 8  # re-detected
        assert not state.health.is_down


async def test_a_flaky_metrics_endpoint_is_retried_within_each_scrape_and_the_member_never_goes_down(
        nc: Client) -> None:
    """Every other /metrics answers 503: the retry in the same scrape gets the reading, so no scrape fails."""
    async with fleet_of(nc, {"flaky": "vllm"}) as fleet:
        await _ready(fleet, "flaky")
        state = fleet.telemetry.members["flaky"]
        failures_before = state.failures_total
        seen = len(fleet.heartbeats["flaky"])
        fleet.engines["flaky"].fault = "flaky"
        await wait_for(lambda: len(fleet.heartbeats["flaky"]) >= seen + 5, timeout_s=30)
        assert all(hb.state == "ready" and hb.running == 3 for hb in fleet.heartbeats["flaky"][seen:])
        assert state.failures_total == failures_before
        status = next(s for s in fleet.telemetry.statuses() if s.member_id == "flaky")
        assert status.retries_total >= 4  # about one per scrape since the fault began


async def test_energy_from_ninfer_usage_lands_in_the_energy_stream_only_when_reported(nc: Client) -> None:
    async with fleet_of(nc, {"e": "ninfer", "none": "ninfer"}, energy_interval_s=INTERVAL_S) as fleet:
        # the engine's own rolling-30-day figure, distinct from the daily sum and from today's
        fleet.engines["e"].usage = samples.ninfer_usage({"2026-01-01": 100.0, "2026-01-02": 2.5}, rolling_30d_wh=95.25)
        fleet.engines["none"].usage = samples.ninfer_usage({"2026-01-02": None})
        js = nc.jetstream()
        sub = await js.subscribe(subjects.energy("e"))
        msg = await sub.next_msg(timeout=5)
        sample = decode(msg.data, EnergySample)
        (reading,) = sample.readings
        assert (sample.worker_id, sample.model_id, reading.kind, reading.method) == (
            "e", "qwen3.8-27b", "engine", "engine_reported")
        assert reading.energy_mj == round((100.0 + 2.5) * 3.6e6)
        await _ready(fleet, "none")
        none_hb = await fleet.next_heartbeat("none")
        with pytest.raises(NotFoundError):
            await js.get_last_msg(subjects.STREAM_ENERGY, subjects.energy("none"))
        await sub.unsubscribe()
        e_hb = await fleet.next_heartbeat("e")  # scraped after the usage above was set
    assert (e_hb.energy_today_wh, e_hb.energy_30d_wh) == (2.5, 95.25)
    assert (none_hb.energy_today_wh, none_hb.energy_30d_wh) == (None, None)  # unmeasured: null, not 0


async def test_telemetry_metrics_parse_with_prometheus_client_and_carry_the_router_s_load_score(
        nc: Client) -> None:
    async with fleet_of(nc, {"n": "ninfer", "st": "stock", "bad": "vllm"}) as fleet:
        fleet.engines["bad"].fault = "500"
        await _ready(fleet, "n", "st")
        await wait_for(lambda: (hb := fleet.last("bad")) is not None and hb.state == "down")
        async with serving(fleet.telemetry.app(), "127.0.0.1", 0) as url, aiohttp.ClientSession() as http:
            async with http.get(url + "/metrics") as resp:
                assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
                text = await resp.text()
            async with http.get(url + "/health") as resp:
                assert resp.status == 200 and (await resp.json())["members"] == 3
            async with http.get(url + "/members") as resp:
                members = {m["member_id"]: m for m in (await resp.json())["members"]}
    values = {(s.name, s.labels.get("member")): s.value
              for f in text_string_to_metric_families(text) for s in f.samples}
    # ninfer: lanes 8, running 2, waiting 0, no KV pressure → 0.75·(2/8) + 0.15·0 + 0.10·0
    assert values[("llmgw_telemetry_member_load_score", "n")] == pytest.approx(0.75 * 2 / 8)
    assert ("llmgw_telemetry_member_load_score", "st") not in values  # no signal: absent, not 0
    assert values[("llmgw_telemetry_member_lanes", "n")] == 8
    assert values[("llmgw_telemetry_member_up", "n")] == 1 and values[("llmgw_telemetry_member_up", "bad")] == 0
    assert 0 <= values[("llmgw_telemetry_member_heartbeat_age_seconds", "n")] < 2
    assert values[("llmgw_telemetry_scrapes_total", "bad")] >= 2
    assert values[("llmgw_telemetry_scrape_failures_total", "bad")] >= 2
    assert values[("llmgw_telemetry_scrape_failures_total", "n")] == 0
    assert members["n"]["engine_kind"] == "ninfer" and members["st"]["load_score"] is None


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_discovery_watches_what_answers_v1_models_under_a_deterministic_id(nc: Client) -> None:
    async with contextlib.AsyncExitStack() as es:
        found = await es.enter_async_context(serving(Engine("vllm").app(), "127.0.0.1", 0))
        port = int(found.rsplit(":", 1)[1])
        closed = _closed_port()
        ranges = (PortRange("127.0.0.1", port, port), PortRange("127.0.0.1", closed, closed))
        fleet = await es.enter_async_context(fleet_of(nc, {}, discover=ranges, discover_interval_s=60.0))
        mid = discovered_id("127.0.0.1", port)
        assert mid == f"disc-127-0-0-1-{port}"
        await _ready(fleet, mid)
        hb = fleet.last(mid)
        assert hb is not None and hb.engine_kind == "vllm" and hb.backend == found
        assert set(fleet.telemetry.members) == {mid}
        assert fleet.telemetry.members[mid].is_discovered


def test_flags_build_the_config_from_members_a_pools_file_and_lanes(tmp_path: Path) -> None:
    pools = tmp_path / "pools.json"
    pools.write_text(json.dumps({"model_pools": {"m": {"members": [
        {"model_id": "m", "backend": "http://10.0.0.1:8000/"}, {"model_id": "m", "backend": "bus:w1"},
        {"id": "own", "model_id": "m", "backend": "http://10.0.0.2:8000", "max_seqs": 16},
        {"id": "flagged", "model_id": "m", "backend": "http://10.0.0.3:8000", "max_seqs": 16}]}},
        "metrics": {"default_max_seqs": 5, "backend_max_seqs": {"http://10.0.0.1:8000": 32}}}))
    parser = argparse.ArgumentParser()
    telemetry_main.add_arguments(parser)
    args = parser.parse_args(["--member", "a=http://h:1", "--config", str(pools), "--lanes", "a=64",
                              "--lanes", "flagged=8", "--discover", "h:8000-8002", "--interval", "0.5"])
    config = telemetry_main.build_config(args)
    # declared lanes: --lanes, else the member's max_seqs, else metrics.backend_max_seqs by URL
    assert config.members == (Member("a", "http://h:1", 64), Member("http-10-0-0-1-8000", "http://10.0.0.1:8000", 32),
                              Member("own", "http://10.0.0.2:8000", 16), Member("flagged", "http://10.0.0.3:8000", 8))
    assert config.default_lanes == 5  # metrics.default_max_seqs, for members nobody declared
    assert config.interval_s == 0.5 and config.discover == (PortRange("h", 8000, 8002),)
    assert telemetry_main.build_config(parser.parse_args(["--data-dir", str(tmp_path / "none")])).default_lanes == 3


def _build(*flags: str) -> TelemetryConfig:
    parser = argparse.ArgumentParser()
    telemetry_main.add_arguments(parser)
    return telemetry_main.build_config(parser.parse_args(list(flags)))


def test_without_interval_the_pools_file_s_poll_interval_is_the_scrape_interval_and_the_flag_wins(
        tmp_path: Path) -> None:
    pools = tmp_path / "pools.json"
    pools.write_text(json.dumps({"model_pools": {}, "metrics": {"poll_interval": 2.5}}))
    from_file = _build("--config", str(pools))
    assert (from_file.interval_s, from_file.is_interval_from_pools) == (2.5, True)
    # --energy-interval (default 5 s) is checked against the flag only: a file's slower poll is not an error
    pools.write_text(json.dumps({"metrics": {"poll_interval": 10.0}}))
    assert _build("--config", str(pools)).interval_s == 10.0
    flag = _build("--config", str(pools), "--interval", "0.5")
    assert (flag.interval_s, flag.is_interval_from_pools) == (0.5, False)
    # the data dir's pools.json (what the gateway's Config page saves) counts as the pools file too
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "pools.json").write_text(json.dumps({"metrics": {"poll_interval": 0.25}}))
    assert _build("--data-dir", str(tmp_path / "data")).interval_s == 0.25
    # no pools file at all: the file's default, still following a file a gateway may save later
    empty = _build("--data-dir", str(tmp_path / "nothing-here"))
    assert (empty.interval_s, empty.is_interval_from_pools) == (1.0, True)


@pytest.mark.parametrize(("flags", "key"), [
    (["--interval", "0.05"], "interval"),  # the 100 ms floor
    (["--interval", "6", "--energy-interval", "5"], "energy-interval"),
])
def test_bad_interval_flags_stop_start_up_and_name_the_key(tmp_path: Path, flags: list[str], key: str) -> None:
    with pytest.raises(ConfigError) as err:
        _build("--data-dir", str(tmp_path), *flags)
    assert err.value.key == key


def test_a_pools_file_poll_interval_under_100_ms_stops_start_up_naming_the_key(tmp_path: Path) -> None:
    pools = tmp_path / "pools.json"
    pools.write_text(json.dumps({"metrics": {"poll_interval": 0.05}}))
    with pytest.raises(ConfigError) as err:
        _build("--config", str(pools))
    assert err.value.key == "metrics.poll_interval"


async def test_a_saved_pools_file_s_poll_interval_retimes_scrapes_at_once_unless_the_flag_pinned_it(
        nc: Client) -> None:
    """A gateway's Config page broadcasts the new file on llm.v1.config.changed; telemetry does not restart."""
    from proto import ConfigChanged, encode_json

    def change(poll_interval_s: float) -> bytes:
        return encode_json(ConfigChanged(gateway_id="gw", config={"metrics": {"poll_interval": poll_interval_s}}))

    async with contextlib.AsyncExitStack() as es:
        # ids chosen for a small phase (crc32 % 1000: follower 38, pinned 223), so the first scrape comes soon
        follower = await es.enter_async_context(fleet_of(nc, {"follower": "vllm"}, interval_s=5.0,
                                                         is_interval_from_pools=True, energy_interval_s=5.0))
        pinned = await es.enter_async_context(fleet_of(nc, {"pinned": "vllm"}, interval_s=0.2,
                                                       energy_interval_s=0.2))
        await follower.telemetry.following_pools.wait()
        await pinned.telemetry.following_pools.wait()
        first = await follower.next_heartbeat("follower")
        assert first.heartbeat_interval_s == 5.0
        await pinned.next_heartbeat("pinned")

        seen = len(follower.heartbeats["follower"])
        sent_s = time.monotonic()
        await nc.publish(subjects.CONFIG_CHANGED, change(0.1))
        # the loop was 5 s from its next tick: re-timed, the next scrape comes one new interval after the last
        await follower.next_heartbeat("follower", timeout_s=5.0)
        assert time.monotonic() - sent_s < 2.5  # without re-timing: about 5 s
        await wait_for(lambda: len(follower.heartbeats["follower"]) >= seen + 4, timeout_s=5.0)
        fast = follower.heartbeats["follower"][seen:]
        assert all(hb.heartbeat_interval_s == 0.1 for hb in fast)
        assert follower.telemetry.interval_s == 0.1
        gaps = [b.ts_s - a.ts_s for a, b in itertools.pairwise(fast)]
        assert max(gaps) < 1.0  # 0.1 s apart, with room for a loaded machine; never the old 5 s
        # --interval given: the flag wins over the file, before and after the change
        assert pinned.telemetry.interval_s == 0.2
        assert (await pinned.next_heartbeat("pinned")).heartbeat_interval_s == 0.2

        await nc.publish(subjects.CONFIG_CHANGED, change(0.6))
        await wait_for(lambda: (hb := follower.last("follower")) is not None and hb.heartbeat_interval_s == 0.6)
        slow_from = len(follower.heartbeats["follower"])
        await wait_for(lambda: len(follower.heartbeats["follower"]) >= slow_from + 2, timeout_s=5.0)
        slow = follower.heartbeats["follower"][slow_from - 1:]
        gaps = [b.ts_s - a.ts_s for a, b in itertools.pairwise(slow)]
        # on the new 0.6 s grid, not the 0.1 s one (a late tick then a punctual one may sit closer than 0.6 s)
        assert min(gaps) > 0.6 / 2 and sum(gaps) / len(gaps) > 0.6 * 0.8
        assert pinned.telemetry.interval_s == 0.2


# ---- end to end: the gateway routes by what telemetry published -----------------------------------------------


def _llamacpp_metrics(processing: int, deferred: int, kv: float) -> str:
    return (samples.LLAMACPP_METRICS
            .replace("llamacpp:requests_processing 1", f"llamacpp:requests_processing {processing}")
            .replace("llamacpp:requests_deferred 2", f"llamacpp:requests_deferred {deferred}")
            .replace("llamacpp:kv_cache_usage_ratio 0.25", f"llamacpp:kv_cache_usage_ratio {kv}"))


@pytest.mark.parametrize("kind", ["ninfer", "llamacpp"])
async def test_the_gateway_routes_to_the_member_telemetry_says_is_idle(nc: Client, tmp_path: Path, kind: str) -> None:
    async with contextlib.AsyncExitStack() as es:
        busy, idle = Engine(kind), Engine(kind)
        if kind == "ninfer":
            busy.slots = samples.ninfer_slots(running=8, waiting=3, lanes=8, model="tiny")
            idle.slots = samples.ninfer_slots(running=0, waiting=0, lanes=8, model="tiny")
            expected_busy = (8, 3, 0.75 + 0.15 * 3 / 4)  # lanes full and a queue: 0.75·1 + 0.15·min(3/4, 1) + 0.10·0
        else:  # issue #24: every slot processing, 3 deferred, KV 0.95 — the signal was shown, then ignored
            busy.llama_busy, busy.metrics = [True] * 4, _llamacpp_metrics(4, 3, 0.95)
            idle.llama_busy, idle.metrics = [False] * 4, _llamacpp_metrics(0, 0, 0.1)
            busy.models = idle.models = {"object": "list", "data": [{"id": "tiny", "object": "model"}]}
            expected_busy = (4, 3, 0.75 + 0.15 * min(3 / 2, 1) + 0.10 * 0.95)  # 4 slots = lanes
        urls = [await es.enter_async_context(serving(e.app(), "127.0.0.1", 0)) for e in (busy, idle)]
        busy_id, idle_id = (pool_config.member_id_for(u) for u in urls)
        pools = tmp_path / "pools.json"
        # the busy member is listed first and weighs more: without telemetry it would win every tie
        pools.write_text(json.dumps({"model_pools": {"tiny": {"cache_affinity": False, "members": [
            {"model_id": "tiny", "backend": urls[0], "capacity_weight": 8},
            {"model_id": "tiny", "backend": urls[1], "capacity_weight": 1}]}}}))
        parser = argparse.ArgumentParser()
        telemetry_main.add_arguments(parser)
        config = telemetry_main.build_config(parser.parse_args(["--config", str(pools), "--interval", "0.1"]))
        assert {m.member_id for m in config.members} == {busy_id, idle_id}

        gateway = GatewayService(nc, GatewayConfig(gateway_id="gw1", port=0, data_dir=tmp_path),
                                 pool_config.load(pools))
        await es.enter_async_context(gateway.running())
        base = await es.enter_async_context(serving(gateway.app(), "127.0.0.1", 0))
        telemetry = TelemetryService(nc, config)
        task = asyncio.create_task(telemetry.run())

        async def stop() -> None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

        es.push_async_callback(stop)
        # the gateway's bootstrap admin key (created at its first start) passes its API-key auth
        assert gateway.bootstrap is not None
        http = await es.enter_async_context(aiohttp.ClientSession(
            headers={"Authorization": f"Bearer {gateway.bootstrap[1]}"}))

        async def backends() -> dict[str, dict[str, Any]]:
            async with http.get(base + "/backends") as resp:
                assert resp.status == 200, await resp.text()
                return {r["member_id"]: r for r in (await resp.json())["members"]}

        rows: dict[str, dict[str, Any]] = {}

        async def both_scored() -> bool:
            rows.update(await backends())
            return all(rows.get(m, {}).get("load_score") is not None for m in (busy_id, idle_id))

        async with asyncio.timeout(10):
            while not await both_scored():
                await asyncio.sleep(0.05)
        assert rows[busy_id]["engine_kind"] == rows[idle_id]["engine_kind"] == kind
        assert (rows[busy_id]["running"], rows[busy_id]["waiting"]) == expected_busy[:2]
        assert rows[busy_id]["load_score"] == pytest.approx(expected_busy[2])
        assert rows[idle_id]["load_score"] == 0.0
        assert rows[busy_id]["stale"] is False and rows[busy_id]["heartbeat_age_s"] < 1.0

        for i in range(10):
            async with http.post(base + "/v1/chat/completions", json={
                    "model": "tiny", "messages": [{"role": "user", "content": f"hello {i}"}]}) as resp:
                assert resp.status == 200, await resp.text()
                assert (await resp.json())["choices"][0]["message"]["content"] == "hi"
        assert (busy.chats, idle.chats) == (0, 10)


async def test_a_slow_metrics_endpoint_leaves_a_one_member_pool_serving(nc: Client, tmp_path: Path) -> None:
    """Issue #24: a vLLM whose /metrics takes 2.5 s (telemetry's scrape limit is 2 s) still answers chat: telemetry
    reports it down, the gateway routes it by its own in-flight count instead of answering 503."""
    async with contextlib.AsyncExitStack() as es:
        slow = Engine("vllm", metrics_delay_s=2.5, models={"object": "list", "data": [{"id": "tiny"}]})
        url = await es.enter_async_context(serving(slow.app(), "127.0.0.1", 0))
        member_id = pool_config.member_id_for(url)
        pools = pool_config.parse({"model_pools": {"tiny": {"members": [{"model_id": "tiny", "backend": url}]}}})
        gateway = GatewayService(nc, GatewayConfig(gateway_id="gw1", port=0, data_dir=tmp_path), pools)
        await es.enter_async_context(gateway.running())
        base = await es.enter_async_context(serving(gateway.app(), "127.0.0.1", 0))
        telemetry = TelemetryService(nc, TelemetryConfig(members=(Member(member_id, url),), interval_s=0.2))
        task = asyncio.create_task(telemetry.run())

        async def stop() -> None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

        es.push_async_callback(stop)
        await wait_for(lambda: (hb := gateway.fleet.record(member_id).heartbeat) is not None and hb.state == "down",
                       30)
        assert gateway.bootstrap is not None
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {gateway.bootstrap[1]}"}) as http:
            for i in range(3):
                async with http.post(base + "/v1/chat/completions", json={
                        "model": "tiny", "messages": [{"role": "user", "content": f"hello {i}"}]}) as resp:
                    assert resp.status == 200, await resp.text()
            async with http.get(base + "/backends") as resp:
                row = next(r for r in (await resp.json())["members"] if r["member_id"] == member_id)
        assert slow.chats == 3
        assert row["state"] == "down"  # /backends still says what telemetry saw


async def test_members_follow_the_pools_a_gateway_saves(nc: Client) -> None:
    """The Config page broadcasts new pools: telemetry starts watching an added HTTP member, stops a removed one."""
    from proto import ConfigChanged, encode_json

    async with contextlib.AsyncExitStack() as es:
        url = await es.enter_async_context(serving(Engine("ninfer").app(), "127.0.0.1", 0))
        fleet = await es.enter_async_context(fleet_of(nc, {}))
        await fleet.telemetry.following_pools.wait()
        raw: dict[str, Any] = {"model_pools": {"m": {"members": [{"model_id": "m", "backend": url, "max_seqs": 6}]}},
                               "metrics": {"default_max_seqs": 7}}
        await nc.publish(subjects.CONFIG_CHANGED, encode_json(ConfigChanged(gateway_id="gw", config=raw)))
        mid = pool_config.member_id_for(url)
        await _ready(fleet, mid)
        assert fleet.telemetry.members[mid].from_pools
        # the saved file's declared lanes and default lanes apply too
        assert (fleet.telemetry.members[mid].member.lanes, fleet.telemetry.default_lanes) == (6, 7)
        raw["model_pools"]["m"]["members"][0]["max_seqs"] = 12
        await nc.publish(subjects.CONFIG_CHANGED, encode_json(ConfigChanged(gateway_id="gw", config=raw)))
        await wait_for(lambda: fleet.telemetry.members[mid].member.lanes == 12)
        await nc.publish(subjects.CONFIG_CHANGED, encode_json(ConfigChanged(gateway_id="gw", config={})))
        await wait_for(lambda: mid not in fleet.telemetry.members)
        await nc.publish(subjects.CONFIG_CHANGED, b"garbage")  # ignored with a warning, nothing breaks
        await nc.flush()
