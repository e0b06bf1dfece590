"""Capability flags: our engines' heartbeats say what they serve; the gateway sends a tools or
structured-output request only to a bus member that declares it (another member of the pool, else a 400
naming the member and the feature), so an engine from before these fields, which would drop them and
answer as if they were absent, never gets them.

The "old engine" is a heartbeat as such an engine sends it (no ``capabilities``) on the bus, with a probe
on its generate subject that records whatever reaches it.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import msgspec
import openai
import pytest

from proto import GenerateRequest, SlotHeartbeat, decode, encode, subjects
from tests.integration.conftest import Stack, wait_for
from tests.integration.test_ninfer_serve import client
from tests.integration.test_tool_calling import MESSAGES, TOOLS

SCHEMA: Any = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}


@contextlib.asynccontextmanager
async def old_engine(stack: Stack, worker_id: str = "w-old") -> Any:
    """A member of the same pool whose heartbeat declares no capabilities; yields what reached it."""
    nc = stack.worker.nc
    real = stack.worker.heartbeat()
    assert real.capabilities  # ours declare them
    beat = msgspec.structs.replace(real, worker_id=worker_id, capabilities=None, tool_call_format=None)
    received: list[GenerateRequest] = []

    async def on_generate(msg: Any) -> None:
        received.append(decode(msg.data, GenerateRequest))  # never answers: a request sent here would fail over

    sub = await nc.subscribe(subjects.gen(worker_id), cb=on_generate)

    async def heartbeats() -> None:
        while True:
            await nc.publish(subjects.heartbeat(worker_id), encode(beat))
            await asyncio.sleep(0.1)

    task = asyncio.create_task(heartbeats())
    try:
        await wait_for(lambda: stack.gateway.fleet.record(worker_id).heartbeat is not None, timeout_s=120.0)
        yield received
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await sub.unsubscribe()


async def test_our_engines_heartbeat_declares_what_it_serves(stack: Stack) -> None:
    await wait_for(lambda: stack.gateway.fleet.record("w1").heartbeat is not None)
    hb = stack.gateway.fleet.record("w1").heartbeat
    assert hb is not None and hb.capabilities is not None
    assert {"tools", "structured_outputs", "embeddings", "responses"} <= set(hb.capabilities)
    assert hb.tool_call_format == "hermes"
    # an older gateway's decoder (a SlotHeartbeat without the fields) still reads it; an older engine's
    # heartbeat decodes with capabilities None
    assert decode(encode(SlotHeartbeat(worker_id="x", session_id="s", seq=1, ts_s=0.0, model_id="m")),
                  SlotHeartbeat).capabilities is None


async def test_tools_and_schemas_go_only_to_members_that_declare_them(stack: Stack) -> None:
    c = client(stack.base_url, stack.api_key)
    async with old_engine(stack) as received:
        for i in range(6):  # whatever the router ranks first, the old member is passed over
            r = await c.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                                max_tokens=300, seed=i)
            assert r.choices[0].finish_reason == "tool_calls"
            s = await c.chat.completions.create(model="tiny", messages=MESSAGES, response_format=SCHEMA,
                                                max_tokens=100, seed=i)
            assert s.choices[0].finish_reason in ("stop", "length")
            tool: Any = {"type": "function", "name": "f", "parameters": SCHEMA["json_schema"]["schema"]}
            t = await c.responses.create(model="tiny", input="hi", tools=[tool], tool_choice="required",
                                         max_output_tokens=300)
            assert t.output[0].type == "function_call", (t.status, t.output)
        assert received == []
        assert stack.gateway.metrics.failovers["w-old"] == 0
        shown = {row["member_id"]: row["capabilities"] for row in stack.gateway.backends_view()}
        assert shown["w-old"] is None and "tools" in shown["w1"]  # what /backends shows the operator


async def test_a_pool_whose_only_member_lacks_the_feature_answers_400_naming_it(stack: Stack) -> None:
    c = client(stack.base_url, stack.api_key)
    async with old_engine(stack) as received:
        stack.worker._state = "draining"  # w1 takes no new work: the old member is all that is left
        await stack.worker._publish_heartbeat()
        await wait_for(lambda: (hb := stack.gateway.fleet.record("w1").heartbeat) is not None
                       and hb.state == "draining", timeout_s=120.0)
        with pytest.raises(openai.BadRequestError) as tools:
            await c.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=5)
        assert tools.value.code == "model_not_supported" and tools.value.param == "tools"
        assert "w-old" in tools.value.message and "tools" in tools.value.message
        with pytest.raises(openai.BadRequestError) as schema:
            await c.chat.completions.create(model="tiny", messages=MESSAGES, response_format=SCHEMA, max_tokens=5)
        assert schema.value.param == "response_format" and "structured_outputs" in schema.value.message
        # a tool result in the history needs the feature too (an older engine drops tool_call_id / tool_calls)
        with pytest.raises(openai.BadRequestError):
            await c.chat.completions.create(model="tiny", max_tokens=5, messages=[
                *MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "12:00"}])
        assert received == []  # the old engine never got them
