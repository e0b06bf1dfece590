"""Request parsing (services/common/openai_api.py): parameters our engine cannot honour are named, not
silently dropped; the logprobs and penalty parameters are validated and carried."""

from __future__ import annotations

from typing import Any

import pytest

from proto import TokenChunk
from services.common import openai_api
from services.common.openai_api import InvalidRequest, parse_request

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}


@pytest.mark.parametrize(("extra", "unsupported"), [
    ({}, ()),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, ()),  # implemented (issue #26)
    ({"tools": []}, ()),
    ({"tool_choice": "none"}, ()),
    ({"tool_choice": "auto"}, ()),
    ({"functions": [{"name": "f"}], "function_call": "auto"}, ()),  # the legacy form, translated to tools
    ({"prediction": {"type": "content", "content": "x"}}, ("prediction",)),
    ({"response_format": {"type": "text"}}, ()),
    ({"response_format": {"type": "json_object"}}, ()),  # implemented (issue #26): constrained decoding
    ({"logit_bias": {}}, ()),
    ({"logit_bias": {"42": 5}}, ()),
    ({"min_p": 0.1}, ()),
    ({"modalities": ["text"]}, ()),
    ({"modalities": ["text", "audio"], "audio": {"voice": "x"}}, ("modalities", "audio")),
    ({"user": "u1", "metadata": {"a": "b"}, "store": False}, ()),  # informational: nothing to honour
])
def test_chat_parameters_we_cannot_honour_are_named(extra: dict[str, Any], unsupported: tuple[str, ...]) -> None:
    assert set(parse_request({**CHAT, **extra}, "chat.completions").unsupported) == set(unsupported)


@pytest.mark.parametrize(("extra", "unsupported"), [
    ({"echo": False, "best_of": 1, "suffix": ""}, ()),
    ({"echo": True}, ()),  # implemented (issue #26): carried in the GenerateRequest
    ({"best_of": 3}, ("best_of",)),
    ({"suffix": "end"}, ()),
    ({"n": 3}, ()),
    ({"min_tokens": 4}, ()),
])
def test_completion_parameters_we_cannot_honour_are_named(extra: dict[str, Any],
                                                          unsupported: tuple[str, ...]) -> None:
    parsed = parse_request({**COMPLETION, **extra}, "completions")
    assert parsed.unsupported == unsupported
    if unsupported:
        err = openai_api.unsupported_error(parsed, "ninfer-serve")
        assert err.param == unsupported[0] and err.code == "unsupported_parameter" and "ninfer-serve" in str(err)


def test_logprobs_and_penalties_are_validated_and_carried() -> None:
    chat = parse_request({**CHAT, "logprobs": True, "top_logprobs": 5, "presence_penalty": 0.5,
                          "frequency_penalty": -1, "repetition_penalty": 1.2}, "chat.completions").generate
    assert (chat.logprobs, chat.presence_penalty, chat.frequency_penalty, chat.repetition_penalty) == (5, 0.5, -1, 1.2)
    assert parse_request({**CHAT, "top_logprobs": 5}, "chat.completions").generate.logprobs is None  # not asked
    assert parse_request({**COMPLETION, "logprobs": 0}, "completions").generate.logprobs == 0
    for body, endpoint, param in [
        ({**CHAT, "logprobs": 3}, "chat.completions", "logprobs"),
        ({**CHAT, "logprobs": True, "top_logprobs": 21}, "chat.completions", "top_logprobs"),
        ({**COMPLETION, "logprobs": 21}, "completions", "logprobs"),
        ({**CHAT, "presence_penalty": 2.1}, "chat.completions", "presence_penalty"),
        ({**CHAT, "repetition_penalty": 0}, "chat.completions", "repetition_penalty"),
    ]:
        with pytest.raises(InvalidRequest) as err:
            parse_request(body, endpoint)
        assert err.value.param == param


def test_stop_token_ids_are_carried_and_checked() -> None:
    assert parse_request({**COMPLETION, "stop_token_ids": [7, 9]}, "completions").generate.stop_token_ids == [7, 9]
    for bad in ([-1], ["7"], [True], list(range(65)), 7):
        with pytest.raises(InvalidRequest) as err:
            parse_request({**COMPLETION, "stop_token_ids": bad}, "completions")
        assert err.value.param == "stop_token_ids"


@pytest.mark.parametrize(("extra", "kind", "spec", "choices", "strict"), [
    ({"response_format": {"type": "json_object"}}, "json_object", "", [], False),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": True,
                                                                 "schema": {"type": "integer"}}}},
     "json_schema", '{"type": "integer"}', [], True),
    ({"guided_json": {"type": "integer"}}, "json_schema", '{"type": "integer"}', [], False),
    ({"guided_json": '{"type": "integer"}'}, "json_schema", '{"type": "integer"}', [], False),
    ({"guided_regex": "[a-z]+"}, "regex", "[a-z]+", [], False),
    ({"guided_choice": ["a", "b"]}, "choice", "", ["a", "b"], False),
    ({"guided_grammar": 'root ::= "x"'}, "grammar", 'root ::= "x"', [], False),
    ({"structured_outputs": {"regex": "[0-9]"}}, "regex", "[0-9]", [], False),
    ({"structured_outputs": {"choice": ["y"]}}, "choice", "", ["y"], False),
    ({"structured_outputs": {"json_object": True}}, "json_object", "", [], False),
])
def test_every_structured_output_spelling_becomes_one_constraint(extra: dict[str, Any], kind: str, spec: str,
                                                                choices: list[str], strict: bool) -> None:
    for body, endpoint in ((CHAT, "chat.completions"), (COMPLETION, "completions")):
        c = parse_request({**body, **extra}, endpoint).generate.constraint
        assert c is not None and (c.kind, c.spec, c.choices, c.strict) == (kind, spec, choices, strict)


@pytest.mark.parametrize(("extra", "param"), [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": "{not json"}}},
     "response_format.json_schema.schema"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"min_p": 1.5}, "min_p"),
])
def test_bad_structured_output_logit_bias_and_min_p_are_400s_naming_the_field(extra: dict[str, Any],
                                                                              param: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        parse_request({**CHAT, **extra}, "chat.completions")
    assert err.value.param == param


def test_logit_bias_and_min_p_are_carried() -> None:
    g = parse_request({**CHAT, "logit_bias": {"42": 5, "7": -100}, "min_p": 0.25}, "chat.completions").generate
    assert (g.logit_bias, g.min_p) == ({42: 5.0, 7: -100.0}, 0.25)


def test_the_legacy_functions_form_is_the_tools_form_with_one_call_and_legacy_replies() -> None:
    fn = {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": '{"a": 1}'}},
               {"role": "function", "name": "f", "content": "42"}]
    parsed = parse_request({**CHAT, "messages": history, "functions": [fn], "function_call": {"name": "f"}},
                           "chat.completions")
    tools = parse_request({**CHAT, "messages": [history[0]], "tools": [{"type": "function", "function": fn}]},
                          "chat.completions").generate.tools
    g = parsed.generate
    assert parsed.legacy_functions and parsed.unsupported == ()
    assert (g.tools, g.tool_choice, g.tool_choice_name, g.parallel_tool_calls) == (tools, "function", "f", False)
    call_id = g.messages[1].tool_calls[0].id  # type: ignore[index]
    assert [(m.role, m.tool_call_id) for m in g.messages or []] == [("user", None), ("assistant", None),
                                                                    ("tool", call_id)]
    assert (g.messages[1].tool_calls[0].name, g.messages[1].tool_calls[0].arguments) == ("f", '{"a": 1}')  # type: ignore[index]
    assert parse_request({**CHAT, "functions": [fn], "function_call": "none"}, "chat.completions").generate \
        .tool_choice == "none"
    assert not parse_request({**CHAT, "tools": [{"type": "function", "function": fn}]},
                             "chat.completions").legacy_functions
    # the reply: message.function_call, finish_reason function_call; streamed as delta.function_call
    final = TokenChunk(request_id="r", index=0, finish_reason="stop")
    text = '<tool_call>\n{"name": "f", "arguments": {"a": 2}}\n</tool_call>'
    body = openai_api.completion_body(parsed, "id", 0, text, final, new_call_id=lambda: "call_x")
    message = body["choices"][0]["message"]
    assert message == {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": '{"a": 2}'}}
    assert body["choices"][0]["finish_reason"] == "function_call"
    start = openai_api.stream_chunk(parsed, "id", 0, tool_calls=[openai_api.tool_call_start_delta("f", 0, "call_x")])
    more = openai_api.stream_chunk(parsed, "id", 0, tool_calls=[openai_api.tool_call_arguments_delta('{"a"', 0)])
    assert start["choices"][0]["delta"] == {"function_call": {"name": "f", "arguments": ""}}
    assert more["choices"][0]["delta"] == {"function_call": {"arguments": '{"a"'}}


@pytest.mark.parametrize(("extra", "param"), [
    ({"functions": [{"name": "f"}], "tools": [{"type": "function", "function": {"name": "f"}}]}, "functions"),
    ({"function_call": {"name": "f"}, "tool_choice": "auto"}, "function_call"),
    ({"functions": {"name": "f"}}, "functions"),
    ({"functions": ["f"]}, "functions[0]"),
    ({"functions": [{"name": "f"}], "function_call": "required"}, "function_call"),
    ({"functions": [{"name": "f"}], "function_call": {"name": "g"}}, "function_call.name"),
    ({"functions": [{"name": "has space"}]}, "functions[0].name"),
    ({"functions": [{"name": "f", "parameters": "{bad"}]}, "functions[0].parameters"),
    ({"messages": [{"role": "assistant", "function_call": "f"}]}, "messages[0].function_call"),
])
def test_a_bad_legacy_functions_request_is_a_400_naming_the_field(extra: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        parse_request({**CHAT, **extra}, "chat.completions")
    assert err.value.param == param
