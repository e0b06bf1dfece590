"""ninfer-serve's HTTP face, in process on port 0: interop shapes, SSE, errors, disconnects, energy."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proto import EnergySample, decode, subjects
from services.engine.config import EngineConfig
from services.engine.engine_core import EngineCore
from services.engine.serve.async_engine import AsyncEngine
from services.engine.serve.energy import ReplayMeter, UnavailableMeter
from services.engine.serve.http import EngineService, ServeConfig, http_site
from services.engine.serve.usage_ledger import utc_day
from services.telemetry.normalize import ModelsInfo, vllm_reading
from services.telemetry.promparse import parse as parse_exposition
from tests.conftest import LONG_GENERATION_TOKENS
from tests.integration.conftest import wait_for

API_KEY = "sk-test-secret"


@dataclass
class Served:
    url: str
    service: EngineService


@contextlib.asynccontextmanager
async def serve(model: Path, tmp_path: Path, meter=None, **engine_kwargs) -> AsyncIterator[Served]:  # type: ignore[no-untyped-def]
    settings = {"kv_capacity_tokens": 4096, "max_concurrency": 2, "max_pending_requests": 2, **engine_kwargs}
    core = EngineCore(EngineConfig(model_path=model, model_id="tiny", **settings))
    config = ServeConfig(port=0, api_key=API_KEY, metrics_state=tmp_path / "metrics-state.json",
                         energy_interval_s=0.5, max_body_bytes=64 * 1024)
    async with AsyncEngine(core) as engine:
        service = EngineService(engine, meter or UnavailableMeter("cpu", "test"), config, worker_id="w1")
        async with http_site(service) as url:
            yield Served(url, service)
        service.save_metrics_state()


def client(url: str, key: str = API_KEY) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


async def test_openai_client_reads_streams_and_bodies_with_timings_and_usage(tiny_model: Path, tmp_path: Path) -> None:
    async with serve(tiny_model, tmp_path) as s:
        c = client(s.url)
        models = await c.models.list()
        assert models.data[0].id == "tiny" and models.data[0].model_extra["max_model_len"] == 4096
        # ignore_eos: a random-weight model may sample its EOS early (once in a few hundred runs it did).
        stream = await c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=6, stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        chunks = [ch async for ch in stream]
        assert chunks[0].choices[0].delta.role == "assistant"
        final = next(ch for ch in chunks if ch.choices and ch.choices[0].finish_reason)
        assert set(final.model_extra["timings"]) >= {"prompt_n", "cache_n", "predicted_n", "prompt_ms",
                                                     "predicted_ms", "ttft"}
        assert chunks[-1].usage.completion_tokens == 6  # type: ignore[union-attr]
        # Same prompt again: its full prompt blocks now come from the prefix cache, and usage says so.
        again = await c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=6)
        cached = again.usage.prompt_tokens_details.cached_tokens  # type: ignore[union-attr]
        block = s.service.core.config.block_size
        assert cached == (again.usage.prompt_tokens - 1) // block * block  # type: ignore[union-attr]
        assert again.model_extra["timings"]["cache_n"] == cached


async def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk_as_vllm_does(tiny_model: Path,
                                                                                      tmp_path: Path) -> None:
    async with serve(tiny_model, tmp_path) as s:
        stream = await client(s.url).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8, stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True})
        chunks = [ch async for ch in stream]
        final = chunks[-1].usage
        assert final is not None and final.completion_tokens == 8
        running = [ch.usage for ch in chunks if ch.choices and ch.choices[0].delta.content]
        assert running and all(u is not None and u.prompt_tokens == final.prompt_tokens for u in running)
        counts = [u.completion_tokens for u in running]  # type: ignore[union-attr]
        assert counts == sorted(counts) and 1 <= counts[0] and counts[-1] <= 8
        # not asked: no usage on the content chunks (OpenAI's shape)
        plain = await client(s.url).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True)
        assert all(ch.usage is None for ch in [c async for c in plain])


async def test_logprobs_in_chat_and_completions_streamed_and_not(tiny_model: Path, tmp_path: Path) -> None:
    async with serve(tiny_model, tmp_path) as s:
        c = client(s.url)
        ask = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0,
               "logprobs": True, "top_logprobs": 2}
        whole = await c.chat.completions.create(**ask)  # type: ignore[call-overload]
        content = whole.choices[0].logprobs.content  # type: ignore[union-attr]
        assert len(content) == whole.usage.completion_tokens  # type: ignore[union-attr]
        assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in content)
        assert all(e.top_logprobs[0].logprob == pytest.approx(e.logprob) for e in content)  # greedy: the best
        stream = await c.chat.completions.create(**ask, stream=True)  # type: ignore[call-overload]
        streamed = [e for ch in [ch async for ch in stream] if ch.choices and ch.choices[0].logprobs
                    for e in ch.choices[0].logprobs.content or ()]
        assert [(e.token, e.bytes) for e in streamed] == [(e.token, e.bytes) for e in content]
        assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-5)
        plain = await c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=4)
        assert plain.choices[0].logprobs is None  # not asked, not sent

        legacy = await c.completions.create(model="tiny", prompt="once upon", max_tokens=6, temperature=0,
                                            logprobs=1)
        lp = legacy.choices[0].logprobs
        assert lp is not None and len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
        stream = await c.completions.create(model="tiny", prompt="once upon", max_tokens=6, temperature=0,
                                            logprobs=1, stream=True)
        pieces = [ch.choices[0].logprobs for ch in [ch async for ch in stream] if ch.choices and ch.choices[0].logprobs]
        assert [t for p in pieces for t in p.tokens] == lp.tokens
        assert [o for p in pieces for o in p.text_offset] == lp.text_offset


async def test_penalties_reach_the_sampler_and_bad_ones_are_400(tiny_model: Path, tmp_path: Path) -> None:
    async with serve(tiny_model, tmp_path) as s:
        c = client(s.url)
        ask = {"model": "tiny", "prompt": "a b a b a b", "max_tokens": 16, "temperature": 0}
        plain = await c.completions.create(**ask)  # type: ignore[call-overload]
        # vLLM's stop_token_ids: the reply ends at the first occurrence of the given id (counted as output,
        # as an EOS would be). The ids of the greedy reply come from the chat logprobs' bytes.
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "a b"}], "max_tokens": 8, "temperature": 0}
        reply = await c.chat.completions.create(**chat, logprobs=True)  # type: ignore[call-overload]
        tokenizer = s.service.core.tokenizer
        by_bytes = {tokenizer.token_bytes(i): i for i in reversed(range(tokenizer.vocab_size))}
        ids = [by_bytes[bytes(e.bytes)] for e in reply.choices[0].logprobs.content]  # type: ignore[union-attr]
        stopped = await c.chat.completions.create(**chat, extra_body={"stop_token_ids": [ids[2]]})  # type: ignore[call-overload]
        assert stopped.choices[0].finish_reason == "stop"
        assert stopped.usage.completion_tokens == ids.index(ids[2]) + 1  # type: ignore[union-attr]
        penalised = await c.completions.create(**ask, frequency_penalty=2.0, presence_penalty=2.0)  # type: ignore[call-overload]
        assert plain.choices[0].text != penalised.choices[0].text
        with pytest.raises(openai.BadRequestError) as err:
            await c.completions.create(**ask, presence_penalty=3.0)  # type: ignore[call-overload]
        assert err.value.body["param"] == "presence_penalty"  # type: ignore[index]
        # Asked for what the engine does not do: refused by name, not answered as if it had not been asked.
        with pytest.raises(openai.BadRequestError) as err:
            await c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                            extra_body={"prediction": {"type": "content", "content": "x"}})
        assert err.value.body["param"] == "prediction" and err.value.body["code"] == "unsupported_parameter"  # type: ignore[index]


async def test_slots_and_usage_have_the_interop_shapes(tiny_model: Path, tmp_path: Path) -> None:
    async with serve(tiny_model, tmp_path) as s, aiohttp.ClientSession() as http:
        await client(s.url).completions.create(model="tiny", prompt="hello", max_tokens=3)
        async with http.get(s.url + "/slots") as r:
            slots = await r.json()
        assert slots["max_concurrency"] == 2 and len(slots["slots"]) == 2
        assert set(slots) >= {"model", "requests_processing", "requests_waiting", "prefilling", "decode_ready",
                              "materializing", "device_state_slots", "host_state_slots", "kv_pages"}
        async with http.get(s.url + "/usage") as r:
            usage = await r.json()
        assert set(usage) == {"model", "uptime", "tokens", "throughput", "requests", "lanes", "health", "energy"}
        assert usage["tokens"]["output"]["total"] == 3
        assert usage["lanes"]["capacity"] == 2
        today = usage["energy"]["today"]
        # No meter on this host: energy is unavailable (null), never 0, and the note says so.
        assert today["wh"] is None and today["kwh"] is None and today["cost_usd"] is None
        assert "unavailable" in usage["energy"]["note"]


async def test_metrics_parse_with_prometheus_client_and_carry_all_three_dialects(tiny_model: Path,
                                                                                  tmp_path: Path) -> None:
    async with serve(tiny_model, tmp_path) as s, aiohttp.ClientSession() as http:
        await client(s.url).completions.create(model="tiny", prompt="hello", max_tokens=4)
        async with http.get(s.url + "/metrics") as r:
            assert r.headers["Content-Type"].startswith("text/plain")
            assert "version=0.0.4" in r.headers["Content-Type"]  # scrapers pick the text parser by it
            text = await r.text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions",
                 "vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:generation_tokens", "llamacpp:requests_processing", "llamacpp:tokens_predicted",
                 "ninfer:requests", "ninfer:process_uptime_seconds"):
        assert name in families, name
    generated = [smp.value for smp in families["vllm:generation_tokens"].samples if smp.name.endswith("_total")]
    assert generated == [4.0]
    ttft_count = [smp.value for smp in families["vllm:time_to_first_token_seconds"].samples
                  if smp.name.endswith("_count")]
    assert ttft_count == [1.0]
    assert "ninfer:energy_joules" not in families  # unavailable energy is absent, not 0
    # what vLLM-shaped readers need (issue #24): the pre-0.10 KV name, and lanes in cache_config_info, which
    # telemetry's vLLM reader turns into lanes for the router's vLLM formula
    assert "vllm:gpu_cache_usage_perc" in families
    exposition = parse_exposition(text)
    reading = vllm_reading(exposition, ModelsInfo(model_ids=("tiny",)))
    assert reading.lanes == 2 and reading.kv_capacity_tokens is not None


async def test_error_paths_have_the_right_status(tiny_model: Path, tmp_path: Path) -> None:
    async with serve(tiny_model, tmp_path) as s, aiohttp.ClientSession() as http:
        with pytest.raises(openai.AuthenticationError):
            await client(s.url, key="wrong").models.list()
        with pytest.raises(openai.BadRequestError) as info:
            await client(s.url).completions.create(model="tiny", prompt="x", max_tokens=10_000)
        assert info.value.code == "context_length_exceeded"
        headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
        async with http.post(s.url + "/v1/completions", data=b"{oops", headers=headers) as r:
            assert r.status == 400 and (await r.json())["error"]["code"] == "invalid_json"
        big = json.dumps({"model": "tiny", "prompt": "x" * 100_000}).encode()
        async with http.post(s.url + "/v1/completions", data=big, headers=headers) as r:
            assert r.status == 413 and "error" in await r.json()


async def test_a_full_queue_answers_429_with_retry_after(long_model: Path, tmp_path: Path) -> None:
    async with serve(long_model, tmp_path, max_concurrency=1, max_pending_requests=1,
                     kv_capacity_tokens=2 * LONG_GENERATION_TOKENS) as s:
        c = client(s.url)
        long = dict(model="tiny", prompt="a", max_tokens=LONG_GENERATION_TOKENS, extra_body={"ignore_eos": True})
        first = asyncio.create_task(c.completions.create(**long))  # type: ignore[arg-type]
        await wait_for(lambda: s.service.engine.snapshot().stats.num_running == 1)
        second = asyncio.create_task(c.completions.create(**long))  # type: ignore[arg-type]
        await wait_for(lambda: s.service.engine.snapshot().stats.num_waiting == 1)
        with pytest.raises(openai.RateLimitError) as info:
            await c.completions.create(model="tiny", prompt="b", max_tokens=2)
        assert int(info.value.response.headers["Retry-After"]) >= 1
        assert info.value.code == "queue_full"
        for t in (first, second):
            t.cancel()
        await asyncio.gather(first, second, return_exceptions=True)


async def test_a_client_disconnect_aborts_the_request_and_frees_its_blocks(long_model: Path,
                                                                         tmp_path: Path) -> None:
    async with serve(long_model, tmp_path, kv_capacity_tokens=2 * LONG_GENERATION_TOKENS) as s, \
            aiohttp.ClientSession() as http:
        body = {"model": "tiny", "prompt": "a b c d e f g h", "max_tokens": LONG_GENERATION_TOKENS, "stream": True,
                "ignore_eos": True}
        resp = await http.post(s.url + "/v1/completions", json=body,
                               headers={"Authorization": f"Bearer {API_KEY}"})
        await resp.content.readline()  # the stream has started
        assert s.service.engine.snapshot().stats.num_kv_blocks_used > 0
        resp.close()  # the client goes away mid-stream
        await wait_for(lambda: s.service.requests.finished["abort"] == 1, timeout_s=5)
        await wait_for(lambda: s.service.engine.snapshot().stats.num_kv_blocks_used == 0, timeout_s=5)
        assert s.service.requests.num_output_tokens < LONG_GENERATION_TOKENS


async def test_metrics_state_survives_a_restart_and_a_corrupt_file(tiny_model: Path, tmp_path: Path) -> None:
    async with serve(tiny_model, tmp_path) as s:
        await client(s.url).completions.create(model="tiny", prompt="hello", max_tokens=5)
    state = json.loads((tmp_path / "metrics-state.json").read_text())
    assert state["schema"] == 2 and state["persisted_output_tokens"] == 5
    async with serve(tiny_model, tmp_path) as s:
        await client(s.url).completions.create(model="tiny", prompt="hello", max_tokens=2)
        assert s.service.ledger.output_tokens_total == 5 + 2
    (tmp_path / "metrics-state.json").write_text("{ not json")
    async with serve(tiny_model, tmp_path) as s:
        assert s.service.ledger.output_tokens_total == 0
    assert len(list(tmp_path.glob("metrics-state.json.corrupt-*"))) == 1


async def test_energy_samples_book_measured_joules_and_carry_request_tokens(tiny_model: Path, tmp_path: Path,
                                                                          nc) -> None:  # type: ignore[no-untyped-def]
    # A GPU counter at 0, then +0.3 J, then a driver reload (reset) and +0.01 J after it. Small amounts: the
    # samples are taken back to back (a millisecond or less apart), and the counter rules refuse more than
    # 3000 W (services/common/energy_counter.py), as the ledger does.
    meter = ReplayMeter([{"GPU-a": 0}, {"GPU-a": 300}, {"GPU-a": 50}, {"GPU-a": 60}])
    async with serve(tiny_model, tmp_path, meter=meter) as s:
        s.service.nc = nc
        js = nc.jetstream()
        sub = await js.subscribe(subjects.ENERGY_SUBJECTS, stream=subjects.STREAM_ENERGY)
        await s.service.sample_energy()  # baseline
        await client(s.url).completions.create(model="tiny", prompt="hello", max_tokens=4)
        sample = await s.service.sample_energy()
        assert [(t.output_tokens, t.prompt_tokens > 0) for t in sample.request_tokens] == [(4, True)]
        assert sample.readings[0].energy_mj == 300 and sample.readings[0].method == "counter"
        await s.service.sample_energy()  # the reset interval: flagged, no energy booked, never negative
        await s.service.sample_energy()
        assert s.service.energy_j_total == pytest.approx((300 + (60 - 50)) / 1000)
        task = asyncio.create_task(s.service.energy_loop())
        msg = await sub.next_msg(timeout=5)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        published = decode(msg.data, EnergySample)
        assert published.worker_id == "w1" and published.readings[0].device_id == "GPU-a"
        usage = s.service.ledger.energy_view(utc_day(published.ts_s))
        assert usage["today"]["wh"] == pytest.approx((300 + (60 - 50)) / 1000 / 3600.0)
