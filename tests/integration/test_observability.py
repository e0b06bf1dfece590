"""Issue #24, observability: what real services put on /metrics, read the way Prometheus and Grafana read it.

Real parts: our engine's HTTP face (tiny model, in process, port 0), the gateway with a bus worker and the
accounting on a real nats-server (tests/integration/conftest.py ``stack``), and telemetry watching the engine;
the official ``openai`` client drives them. Every metric the shipped dashboard (its panels' ``expr`` and its
template variables) and the alert rules query must be defined by these expositions (tests/promql_names.py
reads the PromQL); every vLLM name the engine claims (views.VLLM_METRIC_FAMILIES) is there with vLLM's labels
and buckets; every exposition parses with prometheus_client and types each family.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from proto import pools as pool_config
from services.common.bus import connect
from services.common.http import serving
from services.engine.config import EngineConfig
from services.engine.engine_core import EngineCore
from services.engine.serve.async_engine import AsyncEngine
from services.engine.serve.energy import ReplayMeter
from services.engine.serve.http import EngineService, ServeConfig, http_site
from services.engine.serve.views import VLLM_METRIC_FAMILIES
from services.gateway.identity import key_digest
from services.telemetry.probe import Member
from services.telemetry.service import TelemetryConfig, TelemetryService
from tests.integration.conftest import Stack, wait_for
from tests.promql_names import metric_names, missing_names, template_query_names

REPO = Path(__file__).resolve().parents[2]
OBSERVABILITY = REPO / "deploy" / "observability"
DASHBOARDS = sorted((OBSERVABILITY / "grafana" / "dashboards").glob("*.json"))
RULES = OBSERVABILITY / "prometheus" / "alerts.yml"
# Series Prometheus writes itself for every target (not in any /metrics body)
PROMETHEUS_OWN = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}
START_S = 60.0  # a loaded 2-core machine: generous waits

# vLLM v1's buckets (vllm/v1/metrics/loggers.py), written out again here so a changed constant is caught
VLLM_TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
             80.0, 160.0, 640.0, 2560.0]
VLLM_ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
VLLM_REQUEST_LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                        240.0, 480.0, 960.0, 1920.0, 7680.0]
VLLM_ITERATION_TOKENS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
VLLM_N = [1, 2, 5, 10, 20]


# The queries of the official vLLM Grafana dashboard (vllm-project/vllm
# examples/online_serving/prometheus_grafana/grafana.json), one per distinct metric, as it writes them.
VLLM_DASHBOARD = [
    'histogram_quantile(0.99, sum by(le) (rate(vllm:e2e_request_latency_seconds_bucket{model_name="$model_name"}'
    '[$__rate_interval])))',
    'rate(vllm:e2e_request_latency_seconds_sum{model_name="$model_name"}[$__rate_interval])\n/\n'
    'rate(vllm:e2e_request_latency_seconds_count{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:prompt_tokens_total{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:generation_tokens_total{model_name="$model_name"}[$__rate_interval])',
    'histogram_quantile(0.99, sum by(le) (rate(vllm:time_per_output_token_seconds_bucket{model_name="$model_name"}'
    '[$__rate_interval])))',
    'rate(vllm:time_per_output_token_seconds_sum{model_name="$model_name"}[$__rate_interval])\n/\n'
    'rate(vllm:time_per_output_token_seconds_count{model_name="$model_name"}[$__rate_interval])',
    'vllm:num_requests_running{model_name="$model_name"}',
    'vllm:num_requests_waiting{model_name="$model_name"}',
    'histogram_quantile(0.99, sum by(le) (rate(vllm:time_to_first_token_seconds_bucket{model_name="$model_name"}'
    '[$__rate_interval])))',
    'rate(vllm:time_to_first_token_seconds_sum{model_name="$model_name"}[$__rate_interval])\n/\n'
    'rate(vllm:time_to_first_token_seconds_count{model_name="$model_name"}[$__rate_interval])',
    'vllm:gpu_cache_usage_perc{model_name="$model_name"}',
    'sum by(le) (increase(vllm:request_prompt_tokens_bucket{model_name="$model_name"}[$__rate_interval]))',
    'sum by(le) (increase(vllm:request_generation_tokens_bucket{model_name="$model_name"}[$__rate_interval]))',
    'sum by(finished_reason) (increase(vllm:request_success_total{model_name="$model_name"}[$__rate_interval]))',
    'rate(vllm:request_queue_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:request_prefill_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:request_decode_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:request_max_num_generation_tokens_sum{model_name="$model_name"}[$__rate_interval])',
]


def dashboard_queries() -> list[tuple[str, str]]:
    """(where, query) for every panel target and template variable of every shipped dashboard."""
    found = []

    def walk(panels: list[dict[str, Any]], where: str) -> None:
        for panel in panels:
            for target in panel.get("targets", []):
                found.append((f"{where}: {panel['title']} {target['refId']}", target["expr"]))
            walk(panel.get("panels", []), where)

    for path in DASHBOARDS:
        dashboard = json.loads(path.read_text())
        walk(dashboard["panels"], path.name)
        for var in dashboard["templating"]["list"]:
            if var["type"] == "query":
                query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
                found.append((f"{path.name}: ${var['name']}", "label_values-query:" + query))
    return found


def rule_queries() -> list[tuple[str, str]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [(f"{RULES.name}: {r.get('alert') or r.get('record')}", r["expr"]) for g in groups for r in g["rules"]]


def names_of(query: str) -> set[str]:
    if query.startswith("label_values-query:"):
        return template_query_names(query.removeprefix("label_values-query:"))
    return metric_names(query)


class Exposition:
    """One /metrics body as prometheus_client reads it."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.families = {f.name: f for f in text_string_to_metric_families(text)}
        self.types = {name: f.type for name, f in self.families.items()}
        self.sample_names = {s.name for f in self.families.values() for s in f.samples}

    def samples(self, name: str, **labels: str) -> list[Any]:
        return [s for f in self.families.values() for s in f.samples
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]

    def value(self, name: str, **labels: str) -> float:
        return sum(s.value for s in self.samples(name, **labels))

    def buckets(self, family: str) -> list[float]:
        return sorted({float(s.labels["le"]) for s in self.samples(family + "_bucket")} - {float("inf")})


async def get_metrics(http: aiohttp.ClientSession, url: str) -> Exposition:
    async with http.get(url + "/metrics") as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return Exposition(await resp.text())


@contextlib.asynccontextmanager
async def metered_engine(model: Path) -> AsyncIterator[tuple[str, EngineService]]:
    """ninfer-serve's HTTP face whose meter reads a GPU counter that rises by 100 J between its first two reads
    (read them 0.1 s or more apart: a faster rise is more than a device can draw, and is refused)."""
    core = EngineCore(EngineConfig(model_path=model, model_id="tiny", kv_capacity_tokens=4096, max_concurrency=2,
                                   max_pending_requests=4))
    meter = ReplayMeter([{"GPU-0": 10_000_000}, {"GPU-0": 10_100_000}])
    async with AsyncEngine(core) as engine:
        service = EngineService(engine, meter, ServeConfig(port=0, energy_interval_s=0.5), worker_id="http-e")
        async with http_site(service) as url:
            yield url, service


# ---- the engine's vLLM metric set -------------------------------------------------------------------------


async def test_the_engine_exports_vllm_s_metric_set_with_its_labels_buckets_and_measured_values(
        tiny_model: Path) -> None:
    async with metered_engine(tiny_model) as (url, _), aiohttp.ClientSession() as http:
        c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        max_tokens = [5, 3, 7]
        for n in max_tokens:  # ignore_eos: each request makes exactly max_tokens tokens
            await c.completions.create(model="tiny", prompt=f"count to {n}", max_tokens=n,
                                       extra_body={"ignore_eos": True})
        m = await get_metrics(http, url)
    model = {"model_name": "tiny", "engine": "0"}
    assert {f for f in VLLM_METRIC_FAMILIES} <= set(m.families), set(VLLM_METRIC_FAMILIES) - set(m.families)
    for name in VLLM_METRIC_FAMILIES:
        assert m.families[name].samples, name
        for s in m.families[name].samples:  # vLLM v1's labels on every per-engine series
            # (cache_config_info, as vLLM's, carries the cache config and the engine, not the model)
            assert s.labels.get("engine") == "0", s
            assert s.labels.get("model_name") == ("tiny" if name != "vllm:cache_config_info" else None), s
    assert m.buckets("vllm:time_to_first_token_seconds") == VLLM_TTFT
    for name in ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds",
                 "vllm:request_time_per_output_token_seconds"):
        assert m.buckets(name) == VLLM_ITL, name
    for name in ("vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
                 "vllm:request_inference_time_seconds", "vllm:request_prefill_time_seconds",
                 "vllm:request_decode_time_seconds"):
        assert m.buckets(name) == VLLM_REQUEST_LATENCY, name
    assert m.buckets("vllm:iteration_tokens_total") == VLLM_ITERATION_TOKENS
    assert m.buckets("vllm:request_params_n") == VLLM_N
    # token-count buckets: 1-2-5 up to the engine's max context (vLLM: max_model_len), here 4096
    assert m.buckets("vllm:request_prompt_tokens") == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]
    # the values are the requests': counts, lengths and parameters
    num = len(max_tokens)
    for name in ("vllm:request_generation_tokens", "vllm:request_prompt_tokens", "vllm:request_params_n",
                 "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
                 "vllm:request_decode_time_seconds", "vllm:request_time_per_output_token_seconds"):
        assert m.value(name + "_count", **model) == num, name
    assert m.value("vllm:request_generation_tokens_sum", **model) == 5 + 3 + 7
    assert m.value("vllm:request_max_num_generation_tokens_sum", **model) == 5 + 3 + 7  # n = 1
    assert m.value("vllm:request_params_max_tokens_sum", **model) == 5 + 3 + 7
    assert m.value("vllm:request_params_n_sum", **model) == 1 + 1 + 1
    prompt_total = m.value("vllm:prompt_tokens_total", **model)
    assert m.value("vllm:request_prompt_tokens_sum", **model) == prompt_total
    # one inter-token gap per token after each request's first: (5 - 1) + (3 - 1) + (7 - 1)
    assert m.value("vllm:inter_token_latency_seconds_count", **model) == 4 + 2 + 6
    assert m.value("vllm:time_per_output_token_seconds_count", **model) == 4 + 2 + 6
    # tokens per step: every prompt token computed (none cached: the prompts differ) plus one per decode step
    cached = m.value("vllm:prefix_cache_hits_total", **model)
    assert m.value("vllm:iteration_tokens_total_sum", **model) == prompt_total - cached + (4 + 2 + 6)
    # the phases add up: inference = prefill + decode, e2e = queue + inference
    e2e, queue = m.value("vllm:e2e_request_latency_seconds_sum"), m.value("vllm:request_queue_time_seconds_sum")
    prefill, decode = m.value("vllm:request_prefill_time_seconds_sum"), m.value("vllm:request_decode_time_seconds_sum")
    inference = m.value("vllm:request_inference_time_seconds_sum")
    assert inference == pytest.approx(prefill + decode) and e2e == pytest.approx(queue + inference)
    assert decode > 0 and prefill > 0
    # the decode phase spans the gaps between tokens: their sum is that phase, to float rounding
    assert m.value("vllm:inter_token_latency_seconds_sum") == pytest.approx(decode, rel=1e-6)
    # the official vLLM dashboard finds every series it reads, under our model name
    for query in VLLM_DASHBOARD:
        names = metric_names(query)
        assert names and not missing_names(names, m.types, m.sample_names), query
        for name in names:
            assert m.samples(name, model_name="tiny"), (query, name)
    info = m.samples("vllm:cache_config_info")
    assert len(info) == 1 and {"block_size", "num_gpu_blocks", "max_num_seqs", "engine"} <= set(info[0].labels)


async def test_timings_carry_llama_cpp_s_fields_and_ttft_s_on_a_body_and_on_the_last_stream_chunk(
        tiny_model: Path) -> None:
    llama_cpp = {"cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_n",
                 "predicted_ms", "predicted_per_token_ms", "predicted_per_second"}
    async with metered_engine(tiny_model) as (url, _):
        c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        body = await c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=4, extra_body={"ignore_eos": True})
        stream = await c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "ho"}],
                                                 max_tokens=4, stream=True, extra_body={"ignore_eos": True})
        chunks = [ch async for ch in stream]
    final = next(ch for ch in chunks if ch.choices and ch.choices[0].finish_reason)
    assert [ch for ch in chunks if (ch.model_extra or {}).get("timings")] == [final]  # only the last one
    for timings in (body.model_extra["timings"], final.model_extra["timings"]):
        assert llama_cpp <= set(timings)
        assert timings["predicted_n"] == 4 and timings["ttft_s"] > 0
        assert timings["ttft_s"] == pytest.approx(timings["ttft"] / 1000.0)
        assert timings["predicted_per_token_ms"] == pytest.approx(timings["predicted_ms"] / 4)
        assert timings["prompt_per_token_ms"] == pytest.approx(timings["prompt_ms"] / timings["prompt_n"])


# ---- the gateway's per-model series, and the shipped dashboard and rules against all of it -----------------


async def test_every_metric_the_dashboard_and_the_alert_rules_query_is_defined_by_our_services(
        stack: Stack, tiny_model: Path, tmp_path: Path) -> None:
    key_id = stack.gateway.identity.lookup_key(key_digest(stack.api_key), time.time())
    assert key_id is not None
    async with contextlib.AsyncExitStack() as es:
        http = await es.enter_async_context(aiohttp.ClientSession())
        engine_url, engine = await es.enter_async_context(metered_engine(tiny_model))
        c = openai.AsyncOpenAI(base_url=engine_url + "/v1", api_key="unused", max_retries=0)
        await c.completions.create(model="tiny", prompt="hello", max_tokens=3)
        await engine.sample_energy()
        await asyncio.sleep(0.2)
        await engine.sample_energy()  # the counter rose by 100 J between the two reads
        engine_metrics = await get_metrics(http, engine_url)

        # the gateway: answers, a stream, and an error, all with the bootstrap key
        gw = openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key=stack.api_key, max_retries=0)
        completion_tokens = 0
        for _ in range(2):
            reply = await gw.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=4, extra_body={"ignore_eos": True})
            assert reply.usage is not None
            completion_tokens += reply.usage.completion_tokens
        stream = await gw.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "yo"}],
                                                  max_tokens=3, stream=True, stream_options={"include_usage": True},
                                                  extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.usage is not None:
                completion_tokens += chunk.usage.completion_tokens
        with pytest.raises(openai.BadRequestError):
            await gw.completions.create(model="tiny", prompt="x", max_tokens=100_000)

        # then the metered engine joins the pool as an HTTP member (the gateway reloads its pools file), and
        # telemetry watching it brings its heartbeat, with today's energy, to the gateway
        member = pool_config.member_id_for(engine_url)
        (tmp_path / "pools.json").write_text(json.dumps({"model_pools": {"tiny": {"members": [
            {"model_id": "tiny", "backend": "bus:w1"}, {"model_id": "tiny", "backend": engine_url}]}}}))
        tel_nc = await connect(stack.nats_url, "telemetry")
        es.push_async_callback(tel_nc.drain)
        telemetry = TelemetryService(tel_nc, TelemetryConfig(members=(Member(member, engine_url),),
                                                             interval_s=0.2, timeout_s=5.0))
        task = asyncio.create_task(telemetry.run())

        async def stop() -> None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

        es.push_async_callback(stop)
        await wait_for(lambda: any(row["member_id"] == member and row["energy_today_wh"] is not None
                                   for row in stack.gateway.backends_view()), timeout_s=START_S)
        gateway_metrics = await get_metrics(http, stack.base_url)
        telemetry_url = await es.enter_async_context(serving(telemetry.app(), "127.0.0.1", 0))
        telemetry_metrics = await get_metrics(http, telemetry_url)

    # every family of every exposition is typed
    for where, m in (("engine", engine_metrics), ("gateway", gateway_metrics), ("telemetry", telemetry_metrics)):
        untyped = {name for name, kind in m.types.items() if kind in ("unknown", "untyped")}
        assert not untyped, (where, untyped)

    # what the dashboard and the rules read
    families = {**telemetry_metrics.types, **gateway_metrics.types, **engine_metrics.types}
    samples = engine_metrics.sample_names | gateway_metrics.sample_names | telemetry_metrics.sample_names
    queries = dashboard_queries() + rule_queries()
    assert len(queries) > 40 and any("EnergyCoverageFalling" in where for where, _ in queries)
    for where, query in queries:
        read = names_of(query)
        assert read, where  # every panel, variable and rule reads some metric (else the reader missed it)
        names = read - PROMETHEUS_OWN
        assert not missing_names(names, families, samples), (where, missing_names(names, families, samples))

    # the gateway's series hold what happened, by model (pool), member and key id; no secret anywhere
    g = gateway_metrics
    assert g.value("llmgw_tokens_total", model="tiny", member="w1", api_key_id=key_id.key_id,
                   type="completion") == completion_tokens == 4 + 4 + 3
    assert g.value("llmgw_model_requests_total", model="tiny", api_key_id=key_id.key_id, status="ok") == 3
    assert g.value("llmgw_errors_total", model="tiny", api_key_id=key_id.key_id, code="context_length_exceeded",
                   http_status="400") == 1
    assert g.value("llmgw_time_to_first_token_seconds_count", model="tiny", member="w1") == 3
    # four placed on w1: three answered, and the one its engine refused (the prompt and max_tokens overflow)
    assert g.value("llmgw_routed_requests_total", model="tiny", member="w1") == 3 + 1
    assert g.value("llmgw_member_energy_today_wh", member=member) == pytest.approx(100 / 3600, rel=1e-3)
    assert g.value("llmgw_member_down", member="w1") == 0 and g.value("llmgw_member_stale", member="w1") == 0
    assert stack.api_key not in g.text
    # the engine's measured energy, which the energy panels and EnergyCoverageFalling read
    assert engine_metrics.value("ninfer:energy_joules_total") == pytest.approx(100.0)
    assert telemetry_metrics.value("llmgw_telemetry_member_up", member=member) == 1
