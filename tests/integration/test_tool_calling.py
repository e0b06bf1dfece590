"""Tool calling with the official openai client: over ninfer-serve's HTTP face and through the gateway to
a bus member, on the tiny random-weight checkpoint (its template ignores tools: the Hermes fallback).

The model writes garbage, so what is checked is what the grammar and the parser guarantee: a forced call
is always a valid call for its schema, the streamed deltas add up to the non-streamed call, a round trip's
tool result reaches the prompt, bad tools are 400s naming the param.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, Literal

import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from services.engine.model.tokenizer import Tokenizer
from tests.integration.conftest import Stack
from tests.integration.test_ninfer_serve import client, serve


class WeatherArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: Literal["Paris", "Tokyo", "Lima"]
    days: int = Field(ge=1, le=7)
    metric: bool


class TimeArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    zone: str = Field(pattern=r"^[A-Z]{3}$")


ARGS = {"get_weather": WeatherArgs, "get_time": TimeArgs}
TOOLS: Any = [{"type": "function", "function": {"name": name, "description": f"{name} somewhere",
                                                 "parameters": model.model_json_schema()}}
              for name, model in ARGS.items()]
MESSAGES: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED: Any = {"type": "function", "function": {"name": "get_time"}}


def check_call(call: Any, name: str | None = None) -> tuple[str, str]:
    """The call is a function call to one of TOOLS (``name`` if given) with arguments valid for its schema."""
    assert call.type == "function" and call.id.startswith("call_") and len(call.id) > 10
    assert call.function.name in ARGS and (name is None or call.function.name == name)
    ARGS[call.function.name].model_validate_json(call.function.arguments)
    return call.function.name, call.function.arguments


async def forced_calls_are_valid(c: openai.AsyncOpenAI) -> None:
    """tool_choice required and named: 10 samples each at temperature 1, every one a valid call."""
    async def one(seed: int, choice: Any, parallel: bool) -> None:
        r = await c.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                            parallel_tool_calls=parallel, temperature=1.0, seed=seed,
                                            max_tokens=400)
        choice0 = r.choices[0]
        assert choice0.finish_reason == "tool_calls", choice0
        calls = choice0.message.tool_calls or []
        assert len(calls) >= 1 and (parallel or len(calls) == 1)
        for call in calls:
            check_call(call, "get_time" if choice == NAMED else None)
        assert choice0.message.content is None  # nothing but the call(s)

    await asyncio.gather(*(one(i, "required", parallel=False) for i in range(10)))
    await asyncio.gather(*(one(100 + i, NAMED, parallel=False) for i in range(10)))
    await asyncio.gather(*(one(200 + i, "required", parallel=True) for i in range(4)))


async def streamed_equals_whole(c: openai.AsyncOpenAI) -> None:
    """The streamed delta.tool_calls reassemble into the call the non-streamed answer gives (greedy)."""
    for choice in ("required", NAMED):
        kwargs: Any = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS, "tool_choice": choice,
                       "temperature": 0.0, "max_tokens": 400, "parallel_tool_calls": False}
        whole = await c.chat.completions.create(**kwargs)
        assert whole.choices[0].message.tool_calls is not None
        expected = [check_call(t) for t in whole.choices[0].message.tool_calls]
        calls: dict[int, dict[str, Any]] = {}
        content, finish, num_argument_deltas = "", None, 0
        stream = await c.chat.completions.create(**kwargs, stream=True)
        async for chunk in stream:
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            content += delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
            for d in delta.tool_calls or []:
                if d.index not in calls:  # the first delta of a call: id, type, name, arguments ""
                    assert d.id and d.type == "function" and d.function and d.function.name
                    assert d.function.arguments == ""
                    calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
                else:
                    assert d.id is None
                    num_argument_deltas += 1
                calls[d.index]["arguments"] += (d.function.arguments or "") if d.function else ""
        assert finish == "tool_calls" and content == ""  # no <tool_call> markup leaks into the content
        # each call's arguments came after its start, in deltas of their own (piece by piece as generated: how
        # many pieces depends on how many tokens the engine coalesced into one chunk on a busy machine; the
        # parser's incremental output at every split is tests/unit/test_tool_calls.py's)
        assert num_argument_deltas >= len(calls)
        assert [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)] == expected


async def round_trip(c: openai.AsyncOpenAI) -> None:
    """assistant tool_calls → role tool → an answer (auto: the tiny model writes text, no blocks)."""
    first = await c.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                            seed=1, max_tokens=400)
    message = first.choices[0].message
    assert message.tool_calls
    history: Any = [*MESSAGES, message.model_dump(exclude_none=True)]
    history += [{"role": "tool", "tool_call_id": t.id, "content": json.dumps({"temperature_c": 21})}
                for t in message.tool_calls]
    answer = await c.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=8,
                                             temperature=0.0)
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert answer.choices[0].message.tool_calls is None
    # the same history streamed: the same greedy answer, as content deltas
    stream = await c.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=8,
                                             temperature=0.0, stream=True)
    chunks = [ch async for ch in stream if ch.choices]
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == (answer.choices[0].message.content or "")
    assert all(ch.choices[0].delta.tool_calls is None for ch in chunks)
    without = await c.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=1)
    # the call and its result reached the prompt
    assert answer.usage is not None and without.usage is not None
    assert answer.usage.prompt_tokens > without.usage.prompt_tokens + 20


FUNCTIONS: Any = [t["function"] for t in TOOLS]  # the legacy form: the function objects themselves


async def legacy_functions(c: openai.AsyncOpenAI) -> None:
    """The legacy ``functions`` / ``function_call`` form (older agent frameworks): a forced call comes back as
    ``message.function_call`` with ``finish_reason: function_call``, streamed as ``delta.function_call`` that
    reassembles into it; a ``role: function`` result turn reaches the prompt."""
    kwargs: Any = {"model": "tiny", "messages": MESSAGES, "functions": FUNCTIONS,
                   "function_call": {"name": "get_time"}, "temperature": 0.0, "max_tokens": 400}
    whole = await c.chat.completions.create(**kwargs)
    choice = whole.choices[0]
    assert choice.finish_reason == "function_call" and choice.message.tool_calls is None, choice
    call = choice.message.function_call
    assert call is not None and call.name == "get_time"
    TimeArgs.model_validate_json(call.arguments)
    name, arguments, finish = None, "", None
    async for chunk in await c.chat.completions.create(**kwargs, stream=True):
        if chunk.choices:
            delta = chunk.choices[0].delta
            assert delta.tool_calls is None
            if delta.function_call is not None:
                name = name or delta.function_call.name
                arguments += delta.function_call.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
    assert (name, arguments, finish) == ("get_time", call.arguments, "function_call")
    history: Any = [*MESSAGES, {"role": "assistant", "content": None,
                                "function_call": {"name": call.name, "arguments": call.arguments}},
                    {"role": "function", "name": "get_time", "content": json.dumps({"time": "12:00"})}]
    answer = await c.chat.completions.create(model="tiny", messages=history, functions=FUNCTIONS, max_tokens=4,
                                             temperature=0.0)
    without = await c.chat.completions.create(model="tiny", messages=MESSAGES, functions=FUNCTIONS, max_tokens=1)
    assert answer.choices[0].finish_reason in ("stop", "length", "function_call")
    assert answer.usage is not None and without.usage is not None
    assert answer.usage.prompt_tokens > without.usage.prompt_tokens + 10  # the call and its result were rendered


BAD: list[tuple[dict[str, Any], str]] = [
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{not json"}}]},
     "tools[0].function.parameters"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    # a schema xgrammar cannot compile, found when the forced call's grammar is built
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
      "tool_choice": "required"}, "tools"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function"}]}]},
     "messages[0].tool_calls[0]"),
    ({"functions": FUNCTIONS, "tools": TOOLS}, "functions"),
    ({"functions": FUNCTIONS, "function_call": "always"}, "function_call"),
    ({"functions": [{"name": "has space"}]}, "functions[0].name"),
]


async def bad_requests_are_400s(c: openai.AsyncOpenAI) -> None:
    for extra, param in BAD:
        body: Any = {"model": "tiny", "messages": MESSAGES, "max_tokens": 1, **extra}
        with pytest.raises(openai.BadRequestError) as info:
            await c.chat.completions.create(**body)
        assert info.value.param == param, (extra, info.value.body)


async def test_tool_calling_over_the_engines_http_face(tiny_model: Path, tmp_path: Path) -> None:
    async with serve(tiny_model, tmp_path, max_concurrency=8, max_pending_requests=32) as s:
        c = client(s.url)
        await forced_calls_are_valid(c)
        await streamed_equals_whole(c)
        await round_trip(c)
        await legacy_functions(c)
        await bad_requests_are_400s(c)


async def test_tool_calling_through_the_gateway_to_a_bus_member(stack: Stack) -> None:
    c = openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key=stack.api_key, max_retries=0)
    await forced_calls_are_valid(c)
    await streamed_equals_whole(c)
    await round_trip(c)
    await legacy_functions(c)
    await bad_requests_are_400s(c)


def test_a_template_that_ignores_tools_gets_the_hermes_block_and_the_turns(tiny_model: Path) -> None:
    tok = Tokenizer.from_dir(tiny_model)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
        {"role": "tool", "tool_call_id": "call_2", "content": "43"},
    ]
    text = tok.apply_chat_template(messages, tools=tools)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert '<tools>\n{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}\n</tools>' \
        in text
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call><|im_end|>' in text
    assert ("<|im_start|>user\n<tool_response>\n42\n</tool_response>\n<tool_response>\n43\n</tool_response>"
            "<|im_end|>\n<|im_start|>assistant\n") in text
    # a template that renders tools itself gets them as transformers passes them, messages untouched
    own = Tokenizer(tok._tok, {}, chat_template=(
        "{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}{{ m.role }}:{{ m.tool_calls | tojson if m.tool_calls else m.content }};"
        "{% endfor %}"))
    assert own.apply_chat_template(messages[1:3], tools=tools, add_generation_prompt=False) == (
        '[f]user:hi;assistant:[{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '
        '{"a": 1}}}];')
