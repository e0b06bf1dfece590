"""The Responses API (``/v1/responses``) with the official openai client: over ninfer-serve's HTTP face and
through the gateway to a bus member, on the tiny random-weight checkpoint.

A Responses request runs on the chat path, so what is checked is the translation: the greedy answer is the
chat answer of the same messages, the stream's events come in OpenAI's order with consecutive sequence
numbers and add up to the whole answer, a forced function call is a valid call for its schema (and its
streamed argument deltas add up to it), a function_call_output reaches the prompt, ``text.format`` shapes
the text, unsupported features are 400s naming them, and the usage reaches the ledger.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path
from typing import Any, Literal

import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from proto import pools as pool_config
from services.common.bus import connect
from services.common.http import serving
from services.common.nats_server import EmbeddedNatsServer
from services.gateway.service import GatewayConfig, GatewayService
from tests.integration.conftest import Stack
from tests.integration.test_ninfer_serve import client, serve
from tests.integration.test_tool_calling import ARGS

TOOLS: Any = [{"type": "function", "name": name, "description": f"{name} somewhere",
               "parameters": model.model_json_schema()} for name, model in ARGS.items()]
QUESTION = "What is the weather in Paris?"


class Forecast(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: Literal["Paris", "Tokyo", "Lima"]
    days: int = Field(ge=1, le=7)


async def text_answers_are_the_chat_answers(c: openai.AsyncOpenAI) -> str:
    """Greedy: the Response's output_text is the chat completion's content for the same messages."""
    r = await c.responses.create(model="tiny", instructions="Be brief.", input=QUESTION, max_output_tokens=12,
                                 temperature=0.0)
    chat = await c.chat.completions.create(model="tiny", messages=[{"role": "system", "content": "Be brief."},
                                                                   {"role": "user", "content": QUESTION}],
                                           max_tokens=12, temperature=0.0)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "tiny"
    assert r.output_text == (chat.choices[0].message.content or "")
    assert r.usage is not None and chat.usage is not None
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.usage.input_tokens_details.cached_tokens >= 0
    if chat.choices[0].finish_reason == "length":
        assert r.status == "incomplete" and r.incomplete_details is not None
        assert r.incomplete_details.reason == "max_output_tokens"
    else:
        assert r.status == "completed"
    assert r.instructions == "Be brief." and r.max_output_tokens == 12
    # input as message items, content parts included, is the same prompt
    items = await c.responses.create(model="tiny", input=[
        {"role": "system", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]}],
        max_output_tokens=12, temperature=0.0)
    assert items.output_text == r.output_text and items.usage is not None
    assert items.usage.input_tokens == r.usage.input_tokens
    return r.output_text


EXPECTED_TEXT_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
                        "response.content_part.added"]
TEXT_TAIL = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


async def the_stream_has_openais_events(c: openai.AsyncOpenAI, whole_text: str) -> None:
    kwargs: Any = {"model": "tiny", "instructions": "Be brief.", "input": QUESTION, "max_output_tokens": 12,
                   "temperature": 0.0}
    # stream=True: the raw events
    events = [e async for e in await c.responses.create(**kwargs, stream=True)]
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    end = kinds[-1]
    assert end in ("response.completed", "response.incomplete")
    assert whole_text  # the tiny model's greedy reply to QUESTION has text
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert kinds[:4] == EXPECTED_TEXT_EVENTS
    assert kinds[4:4 + len(deltas)] == ["response.output_text.delta"] * len(deltas)
    assert kinds[4 + len(deltas):] == [*TEXT_TAIL, end]
    assert "".join(d.delta for d in deltas) == whole_text
    assert events[-4].text == whole_text  # output_text.done
    final = events[-1].response
    assert final.output_text == whole_text and final.usage is not None and final.usage.output_tokens > 0
    # the SDK's stream helper accumulates the events into the same text
    async with c.responses.stream(**kwargs) as stream:
        text = "".join([e.delta async for e in stream if e.type == "response.output_text.delta"])
    assert text == whole_text
    # and, for a reply that completes (a schema ends it), into the final response, parsed
    async with c.responses.stream(model="tiny", input="A forecast, as JSON.", text_format=Forecast,
                                  max_output_tokens=300, temperature=0.0) as stream:
        got = await stream.get_final_response()
    assert got.status == "completed" and isinstance(got.output_parsed, Forecast)


async def forced_calls_and_a_round_trip(c: openai.AsyncOpenAI) -> None:
    """tool_choice required / named: function_call items valid for their schema; the stream's argument deltas
    add up to the whole answer's call; the call's output sent back reaches the prompt."""
    async def one(seed: int, choice: Any) -> None:
        r = await c.responses.create(model="tiny", input=QUESTION, tools=TOOLS, tool_choice=choice,
                                     parallel_tool_calls=False, temperature=1.0, extra_body={"seed": seed},
                                     max_output_tokens=400)
        assert r.status == "completed" and len(r.output) == 1, r.output
        call = r.output[0]
        assert call.type == "function_call" and call.call_id.startswith("call_") and call.id
        assert call.status == "completed"
        assert call.name in ARGS and (choice == "required" or call.name == choice["name"])
        ARGS[call.name].model_validate_json(call.arguments)
    await asyncio.gather(*(one(i, "required") for i in range(4)),
                         *(one(50 + i, {"type": "function", "name": "get_time"}) for i in range(4)))

    kwargs: Any = {"model": "tiny", "input": QUESTION, "tools": TOOLS, "tool_choice": "required",
                   "parallel_tool_calls": False, "temperature": 0.0, "max_output_tokens": 400}
    whole = await c.responses.create(**kwargs)
    (call,) = whole.output
    assert call.type == "function_call"
    events = [e async for e in await c.responses.create(**kwargs, stream=True)]
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                          "response.completed"]
    # as generated: how many pieces depends on how many tokens the engine coalesced into one chunk (a loaded
    # machine gives one); the parser's incremental output at every split is the unit tests'
    assert len(deltas) >= 1 and "".join(deltas) == call.arguments
    assert events[-3].arguments == call.arguments and events[-3].name == call.name
    assert [e.sequence_number for e in events] == list(range(len(events)))

    answer = await c.responses.create(model="tiny", tools=TOOLS, max_output_tokens=8, temperature=0.0, input=[
        {"role": "user", "content": QUESTION},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"temperature_c": 21})}])
    assert all(item.type == "message" for item in answer.output)
    without = await c.responses.create(model="tiny", input=QUESTION, tools=TOOLS, max_output_tokens=1)
    assert answer.usage is not None and without.usage is not None
    assert answer.usage.input_tokens > without.usage.input_tokens + 20  # the call and its output are in the prompt


async def text_format_shapes_the_text(c: openai.AsyncOpenAI) -> None:
    parsed = await c.responses.parse(model="tiny", input="A forecast, as JSON.", text_format=Forecast,
                                     max_output_tokens=300, temperature=1.0)
    assert isinstance(parsed.output_parsed, Forecast), parsed.output_text
    schema = await c.responses.create(model="tiny", input="JSON please", max_output_tokens=300, text={"format": {
        "type": "json_schema", "name": "forecast", "schema": Forecast.model_json_schema(), "strict": True}})
    Forecast.model_validate_json(schema.output_text)
    assert schema.text is not None and schema.text.format is not None and schema.text.format.type == "json_schema"
    obj = await c.responses.create(model="tiny", input="JSON please", max_output_tokens=300, temperature=1.0,
                                   text={"format": {"type": "json_object"}})
    if obj.status == "completed":
        assert isinstance(json.loads(obj.output_text), dict)


REFUSED: list[tuple[dict[str, Any], str]] = [
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"background": True}, "background"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input[0].content[0]"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"reasoning": {"effort": "low", "summary": "auto"}}, "reasoning"),  # effort alone is the thinking budget
    ({"reasoning": {"effort": "maximal"}}, "reasoning.effort"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"input": []}, "input"),
]


async def unsupported_features_are_400s_naming_them(c: openai.AsyncOpenAI) -> None:
    for extra, param in REFUSED:
        body: Any = {"model": "tiny", "input": "hi", "max_output_tokens": 1, **extra}
        with pytest.raises(openai.BadRequestError) as info:
            await c.post("/responses", body=body, cast_to=object)
        assert info.value.param == param, (extra, info.value.body)


async def test_responses_over_the_engines_http_face(tiny_model: Path, tmp_path: Path) -> None:
    async with serve(tiny_model, tmp_path, max_concurrency=8, max_pending_requests=32) as s:
        c = client(s.url)
        text = await text_answers_are_the_chat_answers(c)
        await the_stream_has_openais_events(c, text)
        await forced_calls_and_a_round_trip(c)
        await text_format_shapes_the_text(c)
        await unsupported_features_are_400s_naming_them(c)


async def test_responses_through_the_gateway_to_a_bus_member_reach_the_ledger(stack: Stack) -> None:
    c = openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key=stack.api_key, max_retries=0)
    text = await text_answers_are_the_chat_answers(c)
    await the_stream_has_openais_events(c, text)
    await forced_calls_and_a_round_trip(c)
    await text_format_shapes_the_text(c)
    await unsupported_features_are_400s_naming_them(c)
    one = await c.responses.create(model="tiny", input="count me", max_output_tokens=5, temperature=0.0)
    assert one.usage is not None
    expected = ("responses", "ok", one.usage.input_tokens, one.usage.output_tokens)

    async def rows() -> list[Any]:
        _cols, found = await asyncio.wrap_future(stack.accounting.ledger.submit(
            lambda led: led.query("select endpoint, status, prompt_tokens, output_tokens from requests "
                                  "where endpoint = 'responses' and status = 'ok'")))
        return list(found)
    async with asyncio.timeout(120.0):  # the ledger ingests the gateway's records as they come
        while expected not in await rows():
            await asyncio.sleep(0.1)


async def test_a_pool_of_http_members_answers_responses_with_a_400_naming_the_member(
        nats_server: EmbeddedNatsServer, tmp_path: Path) -> None:
    """The gateway translates /v1/responses for bus members only; an HTTP member is never sent one."""
    pools_file = tmp_path / "pools.json"
    pools_file.write_text(json.dumps({"model_pools": {"tiny": {"members": [
        {"model_id": "tiny", "backend": "http://127.0.0.1:9"}]}}}))  # never contacted
    async with contextlib.AsyncExitStack() as es:
        nc = await connect(nats_server.url, "gateway")
        es.push_async_callback(nc.drain)
        gateway = GatewayService(nc, GatewayConfig(gateway_id="gw1", port=0, data_dir=tmp_path),
                                 pool_config.load(pools_file))
        await es.enter_async_context(gateway.running())
        url = await es.enter_async_context(serving(gateway.app(), "127.0.0.1", 0))
        assert gateway.bootstrap is not None
        c = openai.AsyncOpenAI(base_url=url + "/v1", api_key=gateway.bootstrap[1], max_retries=0)
        with pytest.raises(openai.BadRequestError) as info:
            await c.responses.create(model="tiny", input="hi")
        assert info.value.code == "model_not_supported"
        assert pool_config.member_id_for("http://127.0.0.1:9") in info.value.message
