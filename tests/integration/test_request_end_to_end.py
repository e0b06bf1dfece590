"""One request travels gateway → bus → engine → bus → gateway → USAGE stream → DuckDB."""

from __future__ import annotations

import asyncio
import json
import re

import aiohttp
import openai
import pytest

from services.accounting.store import Ledger
from tests.integration.conftest import Stack, wait_for


async def _rows(stack: Stack, sql: str) -> list[tuple[object, ...]]:
    return await stack.accounting.ledger.submit(lambda ledger: ledger.query(sql)).__await__() if False else (
        await _query(stack, sql)
    )


async def _query(stack: Stack, sql: str) -> list[tuple[object, ...]]:
    import asyncio

    _cols, rows = await asyncio.wrap_future(stack.accounting.ledger.submit(lambda led: led.query(sql)))
    return rows


async def test_chat_completion_non_streaming_reaches_the_ledger(stack: Stack) -> None:
    client = openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key=stack.api_key)
    resp = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello there"}], max_tokens=12, temperature=0,
    )
    assert resp.object == "chat.completion"
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].finish_reason in ("stop", "length")
    assert resp.usage is not None and resp.usage.prompt_tokens > 0
    assert 1 <= resp.usage.completion_tokens <= 12
    await wait_for(lambda: stack.accounting.stats.usage_ingested >= 1)
    rows = await _query(stack, "select model, worker_id, status, prompt_tokens, output_tokens from requests")
    assert rows == [("tiny", "w1", "ok", resp.usage.prompt_tokens, resp.usage.completion_tokens)]


async def test_streaming_chat_sends_role_then_content_then_finish_and_usage(stack: Stack) -> None:
    client = openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key=stack.api_key)
    stream = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "count"}], max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason in ("stop", "length")
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    # The streamed text equals the non-streamed text for the same greedy request.
    same = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "count"}], max_tokens=10, temperature=0,
    )
    assert text == same.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == same.usage.completion_tokens  # type: ignore[union-attr]
    await wait_for(lambda: stack.accounting.stats.usage_ingested >= 2)
    rows = await _query(stack, "select stream, count(*) from requests group by stream order by stream")
    assert rows == [(False, 1), (True, 1)]


async def test_logprobs_cross_the_bus(stack: Stack) -> None:
    client = openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key=stack.api_key)
    resp = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "count"}], max_tokens=5, temperature=0,
        logprobs=True, top_logprobs=3,
    )
    content = resp.choices[0].logprobs.content  # type: ignore[union-attr]
    assert len(content) == resp.usage.completion_tokens and all(len(e.top_logprobs) == 3 for e in content)  # type: ignore[union-attr]


async def test_a_parameter_our_engines_lack_is_a_400_naming_it(stack: Stack) -> None:
    client = openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key=stack.api_key, max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}],
            extra_body={"prediction": {"type": "content", "content": "hi"}})
    assert err.value.body["param"] == "prediction"  # type: ignore[index]
    assert err.value.body["code"] == "unsupported_parameter"  # type: ignore[index]


async def test_a_constrained_request_crosses_the_bus_and_its_reply_matches(stack: Stack) -> None:
    client = openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key=stack.api_key, max_retries=0)
    resp = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=200, seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "strict": True, "schema": {
            "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["n"], "additionalProperties": False}}})
    assert resp.choices[0].finish_reason == "stop"
    assert 0 <= json.loads(resp.choices[0].message.content or "")["n"] <= 9
    regex = await client.completions.create(model="tiny", prompt="x", max_tokens=20, extra_body={
        "structured_outputs": {"regex": "[ab]{3}"}})
    assert re.fullmatch("[ab]{3}", regex.choices[0].text)
    with pytest.raises(openai.BadRequestError) as err:  # the engine's compile error comes back over the bus
        await client.completions.create(model="tiny", prompt="x", extra_body={"guided_regex": "(open"})
    assert err.value.body["param"] == "response_format"  # type: ignore[index]


async def test_completions_endpoint_and_models_listing(stack: Stack) -> None:
    client = openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key=stack.api_key)
    models = await client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    resp = await client.completions.create(model="tiny", prompt="def main", max_tokens=5, temperature=0)
    assert resp.choices[0].finish_reason in ("stop", "length")
    assert resp.usage is not None and resp.usage.completion_tokens <= 5


@pytest.mark.parametrize(
    ("body", "status", "code_or_param"),
    [
        (b"{not json", 400, "invalid_json"),
        (b'{"model": "tiny"}', 400, "messages"),
        (b'{"model": "nope", "messages": [{"role": "user", "content": "x"}]}', 404, "model_not_found"),
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": 9}', 400,
         "temperature"),
        (b'[1, 2]', 400, "invalid_json"),
    ],
)
async def test_bad_requests_get_openai_error_bodies(stack: Stack, body: bytes, status: int,
                                                   code_or_param: str) -> None:
    async with aiohttp.ClientSession() as http, http.post(
        stack.base_url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json", **stack.auth}
    ) as resp:
        assert resp.status == status
        payload = await resp.json()
    error = payload["error"]
    assert set(error) >= {"message", "type", "code"}
    assert code_or_param in (error["code"], error["param"])
    assert "Traceback" not in error["message"]


async def test_context_overflow_is_a_400_with_the_openai_code(stack: Stack) -> None:
    client = openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key=stack.api_key, max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=100_000,
        )
    assert info.value.code == "context_length_exceeded"
    await wait_for(lambda: stack.accounting.stats.usage_ingested >= 1)
    rows = await _query(stack, "select status, http_status, error_code from requests")
    assert rows == [("error", 400, "context_length_exceeded")]


async def test_a_pool_with_no_live_member_answers_503_with_retry_after(stack: Stack) -> None:
    from proto import pools as pool_config

    stack.gateway.pools_file.file_config = pool_config.parse({"model_pools": {"ghost": {"members": [
        {"model_id": "ghost", "backend": "bus:nobody-home"}]}}})
    async with aiohttp.ClientSession() as http, http.post(
        stack.base_url + "/v1/chat/completions", headers=stack.auth,
        json={"model": "ghost", "messages": [{"role": "user", "content": "x"}]},
    ) as resp:
        assert resp.status == 503
        assert resp.headers["Retry-After"] == "5"
        assert (await resp.json())["error"]["code"] == "no_backend_available"


def test_ledger_insert_is_idempotent_by_request_id(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from proto import UsageRecord

    ledger = Ledger(tmp_path / "l.duckdb")
    rec = UsageRecord(gateway_id="g", session_id="s", seq=1, ts_s=1.7e9, request_id="r1", model="m", pool="m",
                      prompt_tokens=3, output_tokens=4)
    assert ledger.insert_usage([rec, rec]) == 1
    assert ledger.insert_usage([rec]) == 0
    assert ledger.query("select count(*), sum(output_tokens) from requests")[1] == [(1, 4)]
    ledger.close()


async def test_a_stopping_worker_says_so_in_a_final_heartbeat(stack: Stack) -> None:
    from proto import SlotHeartbeat, decode, subjects

    seen: list[SlotHeartbeat] = []

    async def collect(msg) -> None:  # type: ignore[no-untyped-def]
        seen.append(decode(msg.data, SlotHeartbeat))

    watcher = await stack.gateway.nc.subscribe(subjects.heartbeat("w1"), cb=collect)
    run = asyncio.create_task(stack.worker.run())  # a second run loop we can stop on its own
    await wait_for(lambda: len(seen) >= 2)
    assert all(hb.lanes == 4 and hb.state == "ready" for hb in seen)
    # the cache size a gateway bounds its affinity credit by (docs/routing.md §4)
    assert all(hb.kv_capacity_tokens and hb.kv_blocks_total and hb.kv_capacity_tokens >= hb.kv_blocks_total
               for hb in seen)
    run.cancel()
    await asyncio.gather(run, return_exceptions=True)
    await wait_for(lambda: seen[-1].state == "stopped")
    await watcher.unsubscribe()
