"""The Responses API translation (pure): a /v1/responses body onto the chat request the engine runs, and the
reply's pieces into Response output items and OpenAI's stream events."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest

from proto import ErrorInfo, Usage
from services.common.openai_api import InvalidRequest
from services.common.openai_responses import ResponseBuilder, parse_responses
from services.common.tool_calls import ArgumentsPiece, CallStart, ParsedCall


def test_input_items_become_chat_turns_with_calls_joined_to_the_assistant_turn() -> None:
    parsed = parse_responses({"model": "m", "instructions": "Be brief.", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "weather "}, {"type": "input_text", "text": "?"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"a": 1}'},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call_output", "call_id": "c1", "output": "42"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "43"}]},
    ], "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}], "max_output_tokens": 7,
        "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}, "strict": True}}})
    g = parsed.generate
    assert parsed.endpoint == "responses" and parsed.parses_tool_calls and g.max_tokens == 7
    assert [(m.role, m.content) for m in g.messages or []] == [
        ("system", "Be brief."), ("user", "weather ?"), ("assistant", "Checking."), ("tool", "42"), ("tool", "43")]
    assistant = (g.messages or [])[2]
    assert [(c.id, c.name, c.arguments) for c in assistant.tool_calls] == [("c1", "f", '{"a": 1}'), ("c2", "g", "{}")]
    assert [m.tool_call_id for m in (g.messages or [])[3:]] == ["c1", "c2"]
    assert [t.name for t in g.tools] == ["f"] and g.tool_choice == "auto"
    assert g.constraint is not None and g.constraint.kind == "json_schema" and g.constraint.strict
    assert parsed.responses is not None and parsed.responses.text_format["name"] == "x"


@pytest.mark.parametrize(("body", "param"), [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"tools": [{"type": "file_search"}]}, "tools[0].type"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"input": [{"role": ["user"], "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": ["input_text"], "text": "x"}]}]}, "input[0].content[0]"),
    ({"max_output_tokens": 0}, "max_output_tokens"),  # the chat parser's error, named as the Responses field
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format"),
    ({"truncation": "auto"}, "truncation"),
    ({"modalities": ["text"]}, "modalities"),  # a chat parameter, unknown to the Responses API
])
def test_what_is_not_served_is_a_400_naming_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_responses({"model": "m", "input": "hi", **body})
    assert info.value.param == param


def _builder(**body: Any) -> ResponseBuilder:
    ids = itertools.count()
    return ResponseBuilder(parse_responses({"model": "m", "input": "hi", **body}), "resp_1", 1700000000,
                           lambda prefix: f"{prefix}_{next(ids)}")


def test_text_then_a_streamed_call_then_text_make_three_items_and_the_events_in_order() -> None:
    b = _builder(tools=[{"type": "function", "name": "f"}])
    events = b.start()
    for piece in ["Let me ", "check.", CallStart("f"), ArgumentsPiece('{"a": '), ArgumentsPiece("1}"), "Done.",
                  ParsedCall("g", "{}")]:
        events += b.piece(piece)
    events += b.finish("stop", Usage(prompt_tokens=10, completion_tokens=4, cached_tokens=3))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"].removeprefix("response.") for e in events] == [
        "created", "in_progress",
        "output_item.added", "content_part.added", "output_text.delta", "output_text.delta",
        "output_text.done", "content_part.done", "output_item.done",
        "output_item.added", "function_call_arguments.delta", "function_call_arguments.delta",
        "function_call_arguments.done", "output_item.done",
        "output_item.added", "content_part.added", "output_text.delta", "output_text.done", "content_part.done",
        "output_item.done",
        "output_item.added", "function_call_arguments.delta", "function_call_arguments.done", "output_item.done",
        "completed"]
    final = events[-1]["response"]
    assert final["status"] == "completed" and final["usage"] == {
        "input_tokens": 10, "input_tokens_details": {"cached_tokens": 3}, "output_tokens": 4,
        "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 14}
    assert [(i["type"], i["id"], i.get("call_id")) for i in final["output"]] == [
        ("message", "msg_0", None), ("function_call", "fc_1", "call_2"), ("message", "msg_3", None),
        ("function_call", "fc_4", "call_5")]
    assert final["output"][0]["content"][0]["text"] == "Let me check."
    assert final["output"][1]["arguments"] == '{"a": 1}' and final["output"][1]["status"] == "completed"
    # each added event is a snapshot of the item when it was added (the SDK accumulates from there)
    assert events[2]["item"]["content"][0]["text"] == "" and events[9]["item"]["arguments"] == ""
    assert events[0]["response"]["output"] == [] and events[0]["response"]["status"] == "in_progress"
    json.dumps(events)  # plain JSON all through


def test_a_reply_cut_by_max_output_tokens_is_incomplete_and_a_failure_is_failed() -> None:
    b = _builder(max_output_tokens=3)
    b.start()
    b.piece("abc")
    end = b.finish("length", Usage(prompt_tokens=1, completion_tokens=3))
    assert end[-1]["type"] == "response.incomplete"
    assert end[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert end[-1]["response"]["output"][0]["status"] == "incomplete"
    f = _builder()
    f.start()
    failed = f.fail(ErrorInfo(message="engine stopped", code="engine_error", status=503))
    assert failed[-1]["type"] == "response.failed"
    assert failed[-1]["response"]["error"] == {"code": "engine_error", "message": "engine stopped"}


def test_a_reasoning_item_sent_back_is_the_reasoning_of_the_assistant_turn_after_it() -> None:
    """An agent replaying a thinking model's output (reasoning, function_call, function_call_output, then the
    next turn): the reasoning reaches the chat template with its turn, which keeps it within the tool loop."""
    parsed = parse_responses({"model": "m", "input": [
        {"role": "user", "content": "weather?"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "I should call f."}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "Answer now."}],
         "encrypted_content": "opaque"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]},
        {"role": "user", "content": "thanks"},
    ]})
    turns = parsed.generate.messages or []
    assert [(m.role, m.reasoning) for m in turns] == [("user", None), ("assistant", "I should call f."),
                                                      ("tool", None), ("assistant", "Answer now."), ("user", None)]
    assert [c.name for c in turns[1].tool_calls] == ["f"] and turns[3].content == "Sunny."
