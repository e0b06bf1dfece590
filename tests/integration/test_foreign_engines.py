"""Issue #24: every foreign engine kind that has a load signal gets a score out of the box, and /backends says
where each number came from. Fixture servers answer as vLLM (upstream /metrics: no max_num_seqs anywhere),
llama.cpp started with --no-slots (/slots 501, lanes from /props, load from /metrics) and SGLang (/metrics plus
/server_info) do; telemetry and the gateway run for real on a real nats-server, and 10 sequential requests
through the gateway go to the idle member of each pair (docs/telemetry.md, "Lanes"; docs/routing.md §1).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from nats.aio.client import Client

from proto import pools as pool_config
from services.common.heartbeat_load import (
    NINFER_LANE_WEIGHT,
    NINFER_PRESSURE_WEIGHT,
    NINFER_QUEUE_WEIGHT,
    VLLM_KV_WEIGHT,
    VLLM_RUNNING_WEIGHT,
    VLLM_WAITING_WEIGHT,
)
from services.common.http import serving
from services.gateway.service import GatewayConfig, GatewayService
from services.telemetry import __main__ as telemetry_main
from services.telemetry.service import TelemetryService
from tests.unit.telemetry import samples

MODELS = {"object": "list", "data": [{"id": "tiny", "object": "model", "owned_by": "fixture", "max_model_len": 4096}]}


def _llamacpp_metrics(processing: int, deferred: int, kv: float) -> str:
    return (samples.LLAMACPP_METRICS
            .replace("llamacpp:requests_processing 1", f"llamacpp:requests_processing {processing}")
            .replace("llamacpp:requests_deferred 2", f"llamacpp:requests_deferred {deferred}")
            .replace("llamacpp:kv_cache_usage_ratio 0.25", f"llamacpp:kv_cache_usage_ratio {kv}"))


@dataclass
class Foreign:
    """A fixture engine: GET path → (status, body) as the real product answers; anything else 404."""

    routes: dict[str, tuple[int, Any]]
    chats: int = 0
    hits: collections.Counter[str] = field(default_factory=collections.Counter)

    def app(self) -> web.Application:
        async def get(request: web.Request) -> web.Response:
            self.hits[request.path] += 1
            status, body = self.routes.get(request.path, (404, {"detail": "Not Found"}))
            if isinstance(body, str):
                return web.Response(text=body, status=status, content_type="text/plain")
            return web.json_response(body, status=status)

        async def chat(request: web.Request) -> web.Response:
            self.chats += 1
            body = await request.json()
            return web.json_response({
                "id": f"chatcmpl-{self.chats}", "object": "chat.completion", "created": 0, "model": body["model"],
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                             "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}})

        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        app.router.add_get("/{tail:.*}", get)
        return app


def vllm(running: int, waiting: int, kv: str) -> Foreign:
    return Foreign({"/metrics": (200, samples.vllm_metrics(model_name="tiny", running=running, waiting=waiting,
                                                           kv_usage=kv)),
                    "/v1/models": (200, MODELS), "/health": (200, "")})


def llamacpp_no_slots(processing: int, deferred: int, kv: float) -> Foreign:
    return Foreign({"/slots": (501, samples.LLAMACPP_SLOTS_OFF), "/props": (200, samples.llamacpp_props(total_slots=4)),
                    "/metrics": (200, _llamacpp_metrics(processing, deferred, kv)), "/v1/models": (200, MODELS),
                    "/health": (200, {"status": "ok"})})


def sglang(running: int, queued: int, token_usage: str) -> Foreign:
    return Foreign({"/metrics": (200, samples.sglang_metrics(model_name="tiny", running=running, queued=queued,
                                                             token_usage=token_usage)),
                    "/server_info": (200, samples.sglang_server_info(max_running_per_dp=(8,))),
                    "/v1/models": (200, MODELS), "/health": (200, "")})


@dataclass(frozen=True)
class Case:
    busy: Callable[[], Foreign]
    idle: Callable[[], Foreign]
    kind: str
    lanes: tuple[int, int]  # busy, idle
    lanes_source: tuple[str, str]
    busy_load: float
    declared: bool = False  # the pools file declares max_seqs 4 (busy: backend_max_seqs, idle: member max_seqs)


CASES = {
    # upstream vLLM: no max_num_seqs; the loaded one shows 3 running while 2 wait, so its scheduler is full at 3
    # (learned); the idle one is on the default 3. 0.6·3/3 + 0.3·0.4 + 0.1·min(2, 5)/5
    "vllm": Case(lambda: vllm(3, 2, "0.4"), lambda: vllm(0, 0, "0.0"), "vllm", (3, 3), ("learned", "default"),
                 VLLM_RUNNING_WEIGHT * 3 / 3 + VLLM_KV_WEIGHT * 0.4 + VLLM_WAITING_WEIGHT * 2 / 5),
    # the same vLLMs with the operator's max_seqs 4 in the pools file: 0.6·3/4 + 0.3·0.4 + 0.1·2/5
    "vllm-declared": Case(lambda: vllm(3, 2, "0.4"), lambda: vllm(0, 0, "0.0"), "vllm", (4, 4),
                          ("declared", "declared"),
                          VLLM_RUNNING_WEIGHT * 3 / 4 + VLLM_KV_WEIGHT * 0.4 + VLLM_WAITING_WEIGHT * 2 / 5,
                          declared=True),
    # llama.cpp --no-slots: lanes = /props total_slots 4; 4 processing, 3 deferred, KV 0.95:
    # 0.75·1 + 0.15·min(3/2, 1) + 0.10·0.95
    "llamacpp-no-slots": Case(lambda: llamacpp_no_slots(4, 3, 0.95), lambda: llamacpp_no_slots(0, 0, 0.1),
                              "llamacpp", (4, 4), ("/props", "/props"),
                              NINFER_LANE_WEIGHT + NINFER_QUEUE_WEIGHT * 1 + NINFER_PRESSURE_WEIGHT * 0.95),
    # SGLang: lanes = /server_info effective_max_running_requests_per_dp 8; 8 running, 3 queued, token usage 0.5
    # (under the 0.9 high water): 0.75·1 + 0.15·min(3/4, 1) + 0.10·0
    "sglang": Case(lambda: sglang(8, 3, "0.5"), lambda: sglang(0, 0, "0.0"), "sglang", (8, 8),
                   ("/server_info", "/server_info"), NINFER_LANE_WEIGHT + NINFER_QUEUE_WEIGHT * 3 / 4),
}


@pytest.mark.parametrize("case_id", list(CASES))
async def test_the_gateway_sends_every_request_to_the_idle_foreign_member_and_says_where_lanes_came_from(
        nc: Client, tmp_path: Path, case_id: str) -> None:
    case = CASES[case_id]
    async with contextlib.AsyncExitStack() as es:
        busy, idle = case.busy(), case.idle()
        urls = [await es.enter_async_context(serving(e.app(), "127.0.0.1", 0)) for e in (busy, idle)]
        busy_id, idle_id = (pool_config.member_id_for(u) for u in urls)
        members: list[dict[str, Any]] = [{"model_id": "tiny", "backend": urls[0], "capacity_weight": 8},
                                         {"model_id": "tiny", "backend": urls[1], "capacity_weight": 1}]
        raw: dict[str, Any] = {"model_pools": {"tiny": {"cache_affinity": False, "members": members}}}
        if case.declared:
            members[1]["max_seqs"] = 4
            raw["metrics"] = {"backend_max_seqs": {urls[0] + "/": 4}}  # by URL, a trailing / ignored
        pools = tmp_path / "pools.json"
        pools.write_text(json.dumps(raw))  # the busy member is first and weighs 8: without a signal it wins ties
        parser = argparse.ArgumentParser()
        telemetry_main.add_arguments(parser)
        config = telemetry_main.build_config(parser.parse_args(["--config", str(pools), "--interval", "0.1"]))

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
        assert gateway.bootstrap is not None
        http = await es.enter_async_context(aiohttp.ClientSession(
            headers={"Authorization": f"Bearer {gateway.bootstrap[1]}"}))

        rows: dict[str, dict[str, Any]] = {}

        async def settled() -> bool:
            async with http.get(base + "/backends") as resp:
                assert resp.status == 200, await resp.text()
                rows.update({r["member_id"]: r for r in (await resp.json())["members"]})
            return all((rows.get(m) or {}).get("load_score") is not None
                       and (rows[m].get("signal_sources") or {}).get("lanes") == source
                       for m, source in zip((busy_id, idle_id), case.lanes_source, strict=True))

        async with asyncio.timeout(60):  # a loaded 2-core machine
            while not await settled():
                await asyncio.sleep(0.05)
        b, i = rows[busy_id], rows[idle_id]
        assert b["engine_kind"] == i["engine_kind"] == case.kind
        assert (b["lanes"], i["lanes"]) == case.lanes
        assert (b["signal_sources"]["lanes"], i["signal_sources"]["lanes"]) == case.lanes_source
        assert b["signal_sources"]["running"] == i["signal_sources"]["running"] == "/metrics"
        assert b["load_score"] == pytest.approx(case.busy_load)
        assert i["load_score"] == 0.0 and b["no_signal"] is False

        for n in range(10):
            async with http.post(base + "/v1/chat/completions", json={
                    "model": "tiny", "messages": [{"role": "user", "content": f"hello {n}"}]}) as resp:
                assert resp.status == 200, await resp.text()
        assert (busy.chats, idle.chats) == (0, 10)
        if case_id == "llamacpp-no-slots":  # /props at detection only; /slots not asked on every scrape
            # (seen twice once on a loaded machine with /props once: to look into, see the session 11 note)
            assert busy.hits["/props"] == 1 and busy.hits["/slots"] <= 2
