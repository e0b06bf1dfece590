"""Llama 3.x tool calling with the official openai client, on a tiny random-weight Llama checkpoint whose
chat template is written the way Llama 3.1's is (tools as JSON in the first user turn with the
``{"name": ..., "parameters": ...}`` instruction, an assistant call as that JSON, tool results as
``ipython`` turns). The engine picks the Llama 3 JSON format from the template: a forced call is that JSON
(the grammar), parsed into ``message.tool_calls``, streamed as deltas that add up to the whole answer; the
gateway learns the format from the member's heartbeat and parses its bus replies the same way.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest

from services.common.bus import connect
from services.common.http import serving
from services.common.nats_server import EmbeddedNatsServer
from services.common.tool_calls import LLAMA3_JSON
from services.engine.model.tokenizer import Tokenizer
from services.gateway import pools
from services.gateway.service import GatewayConfig, GatewayService
from tests.integration.conftest import start_engine_and_ledger, wait_for
from tests.integration.test_ninfer_serve import client, serve
from tests.integration.test_tool_calling import ARGS, MESSAGES, NAMED, TOOLS, check_call

# Our own template in Llama 3.1's tool conventions, on the tiny tokenizer's ChatML turn markers.
LLAMA3_STYLE_TEMPLATE = (
    '{%- set ns = namespace(system="") -%}'
    '{%- if messages[0].role == "system" %}{% set ns.system = messages[0].content %}'
    '{% set messages = messages[1:] %}{% endif -%}'
    "<|im_start|>system\n{% if tools %}Environment: ipython\n{% endif %}{{ ns.system }}<|im_end|>\n"
    "{%- for m in messages %}"
    "{%- if loop.first and tools %}<|im_start|>user\nGiven the following functions, please respond with a JSON "
    "for a function call with its proper arguments that best answers the given prompt.\n\n"
    'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}. '
    "Do not use variables.\n\n{% for t in tools %}{{ t | tojson }}\n\n{% endfor %}{{ m.content }}<|im_end|>\n"
    "{%- elif m.tool_calls %}<|im_start|>assistant\n{% for c in m.tool_calls %}"
    '{"name": "{{ c.function.name }}", "parameters": {{ c.function.arguments | tojson }}}'
    '{% if not loop.last %}; {% endif %}{% endfor %}<|im_end|>\n'
    "{%- elif m.role == 'tool' %}<|im_start|>ipython\n{{ m.content }}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def llama_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from services.engine.tiny_checkpoint import write_tiny_checkpoint

    path = write_tiny_checkpoint(tmp_path_factory.mktemp("models") / "tiny-llama3", arch="llama")
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = LLAMA3_STYLE_TEMPLATE
    config_path.write_text(json.dumps(config))
    return path


def test_the_template_selects_the_llama3_format_and_renders_calls_and_ipython_turns(llama_model: Path,
                                                                                     tiny_model: Path) -> None:
    tok = Tokenizer.from_dir(llama_model)
    assert tok.tool_call_format == LLAMA3_JSON
    assert Tokenizer.from_dir(tiny_model).tool_call_format == "hermes"  # ChatML, tools ignored: Hermes blocks
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    text = tok.apply_chat_template([
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"}], tools=tools)
    assert '{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}' in text
    assert '<|im_start|>assistant\n{"name": "f", "parameters": {"a": 1}}<|im_end|>' in text
    assert "<|im_start|>ipython\n42<|im_end|><|im_start|>assistant\n" in text
    assert "<tool_call>" not in text  # the template renders tools itself: no Hermes fallback


async def forced_calls_in_the_llama3_form(c: openai.AsyncOpenAI) -> None:
    for seed in range(6):
        choice: Any = "required" if seed % 2 else NAMED
        r = await c.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                            parallel_tool_calls=seed != 1, temperature=1.0, seed=seed,
                                            max_tokens=400)
        c0 = r.choices[0]
        assert c0.finish_reason == "tool_calls" and c0.message.content is None, c0
        assert c0.message.tool_calls
        for call in c0.message.tool_calls:
            check_call(call, "get_time" if choice == NAMED else None)
    # the streamed deltas add up to the whole answer (greedy)
    kwargs: Any = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required",
                   "temperature": 0.0, "max_tokens": 400, "parallel_tool_calls": False}
    whole = await c.chat.completions.create(**kwargs)
    assert whole.choices[0].message.tool_calls is not None
    expected = [check_call(t) for t in whole.choices[0].message.tool_calls]
    calls: dict[int, list[str]] = {}
    content, finish, num_deltas = "", None, 0
    async for chunk in await c.chat.completions.create(**kwargs, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
        for d in delta.tool_calls or []:
            if d.index not in calls:
                assert d.id and d.function and d.function.name and d.function.arguments == ""
                calls[d.index] = [d.function.name, ""]
            else:
                num_deltas += 1
                calls[d.index][1] += (d.function.arguments or "") if d.function else ""
    assert finish == "tool_calls" and content == ""  # the call's JSON never reaches the content
    # the arguments come after the name, in as many deltas as the engine's steps were read in: usually
    # several, one when a loaded machine let them pile up (a fresh-clone run saw that once)
    assert num_deltas >= 1 and [tuple(calls[i]) for i in sorted(calls)] == expected
    # a round trip: the call and its result (an ipython turn) reach the prompt
    message = whole.choices[0].message
    history: Any = [*MESSAGES, message.model_dump(exclude_none=True),
                    *({"role": "tool", "tool_call_id": t.id, "content": '{"temperature_c": 21}'}
                      for t in message.tool_calls or [])]
    answer = await c.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=4,
                                             tool_choice="none")
    without = await c.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=1,
                                              tool_choice="none")
    assert answer.usage is not None and without.usage is not None
    assert answer.usage.prompt_tokens > without.usage.prompt_tokens + 20


async def test_llama3_tool_calls_over_the_engines_http_face(llama_model: Path, tmp_path: Path) -> None:
    async with serve(llama_model, tmp_path, max_concurrency=8, max_pending_requests=32) as s:
        c = client(s.url)
        await forced_calls_in_the_llama3_form(c)
        r = await c.responses.create(model="tiny", input="Weather?", tools=[
            {"type": "function", "name": n, "parameters": m.model_json_schema()} for n, m in ARGS.items()],
            tool_choice="required", parallel_tool_calls=False, max_output_tokens=400)
        (call,) = r.output
        assert call.type == "function_call" and call.name in ARGS
        ARGS[call.name].model_validate_json(call.arguments)


@contextlib.asynccontextmanager
async def llama_stack(nats_server: EmbeddedNatsServer, model: Path, tmp_path: Path) -> AsyncIterator[tuple[str, str]]:
    async with contextlib.AsyncExitStack() as es:
        await start_engine_and_ledger(es, nats_server.url, model, tmp_path)
        nc = await connect(nats_server.url, "gateway")
        es.push_async_callback(nc.drain)
        gateway = GatewayService(nc, GatewayConfig(gateway_id="gw1", port=0, data_dir=tmp_path))
        await es.enter_async_context(gateway.running())
        url = await es.enter_async_context(serving(gateway.app(), "127.0.0.1", 0))
        await wait_for(lambda: "tiny" in pools.model_names(gateway.pools_file.file_config, gateway.fleet),
                       timeout_s=120.0)
        hb = gateway.fleet.record("w1").heartbeat
        assert hb is not None and hb.tool_call_format == LLAMA3_JSON  # the member says how its model writes calls
        assert gateway.bootstrap is not None
        yield url, gateway.bootstrap[1]


async def test_llama3_tool_calls_through_the_gateway_to_a_bus_member(nats_server: EmbeddedNatsServer,
                                                                      llama_model: Path, tmp_path: Path) -> None:
    async with llama_stack(nats_server, llama_model, tmp_path) as (url, key):
        await forced_calls_in_the_llama3_form(openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0))
