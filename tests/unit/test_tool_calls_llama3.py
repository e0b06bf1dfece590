"""The Llama 3.x JSON tool-call format (``{"name": ..., "parameters": {...}}``, optionally after
``<|python_tag|>``, several calls separated by ``;``) on hand-written replies, whole and streamed in every
split: the streamed pieces add up to the whole parse."""

from __future__ import annotations

import pytest

from services.common.tool_calls import (
    LLAMA3_JSON,
    ArgumentsPiece,
    CallStart,
    ParsedCall,
    Piece,
    new_parser,
    parse_tool_calls,
)


def whole(text: str, parallel: bool = True) -> tuple[str | None, list[tuple[str, str]]]:
    content, calls = parse_tool_calls(text, tool_format=LLAMA3_JSON, parallel_tool_calls=parallel)
    return content, [(c.name, c.arguments) for c in calls]


def streamed(text: str, step: int, parallel: bool = True) -> tuple[str | None, list[tuple[str, str]], int]:
    """(content, calls, number of argument pieces) from pushing ``text`` ``step`` characters at a time."""
    parser = new_parser(LLAMA3_JSON, parallel_tool_calls=parallel, incremental=True)
    pieces: list[Piece] = []
    for i in range(0, len(text), step):
        pieces += parser.push(text[i:i + step])
    pieces += parser.finish()
    content, calls, num_pieces = "", [], 0
    for p in pieces:
        if isinstance(p, str):
            content += p
        elif isinstance(p, ParsedCall):
            calls.append([p.name, p.arguments])
        elif isinstance(p, CallStart):
            calls.append([p.name, ""])
        else:
            assert isinstance(p, ArgumentsPiece) and calls
            calls[-1][1] += p.text
            num_pieces += 1
    return (content if content.strip() else None), [(n, a) for n, a in calls], num_pieces


REPLIES = [
    # (reply, content, calls)
    ('{"name": "get_weather", "parameters": {"city": "Paris", "note": "a } brace"}}', None,
     [("get_weather", '{"city": "Paris", "note": "a } brace"}')]),
    ('<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}', None,
     [("f", '{"a": 1}'), ("g", "{}")]),
    ('  {"parameters": {"a": 1}, "name": "f"}', None, [("f", '{"a": 1}')]),  # other key order: json.dumps
    ('{"name": "f", "arguments": "{\\"a\\": 2}"}', None, [("f", '{"a": 2}')]),  # arguments as a JSON string
    ("The weather is fine.", "The weather is fine.", []),
    ('hello {"name": "f", "parameters": {}}', 'hello {"name": "f", "parameters": {}}', []),  # not at the start
    ('{not json', "{not json", []),
    ('{"name": "f", "parameters": [1]}', '{"name": "f", "parameters": [1]}', []),  # parameters not an object
    ("<|pyth", "<|pyth", []),
]


@pytest.mark.parametrize(("reply", "content", "calls"), REPLIES)
def test_whole_replies(reply: str, content: str | None, calls: list[tuple[str, str]]) -> None:
    assert whole(reply) == (content, calls)


@pytest.mark.parametrize(("reply", "content", "calls"), REPLIES)
@pytest.mark.parametrize("step", [1, 2, 3, 5, 8, 1000])
def test_streamed_replies_add_up_to_the_whole_parse(reply: str, content: str | None, calls: list[tuple[str, str]],
                                                    step: int) -> None:
    got_content, got_calls, _ = streamed(reply, step)
    assert (got_content, got_calls) == (content, calls)


def test_a_call_streams_its_arguments_piece_by_piece_and_content_flows_at_once() -> None:
    reply = '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3, "metric": true}}'
    _content, calls, num_pieces = streamed(reply, 2)
    assert calls == [("get_weather", '{"city": "Paris", "days": 3, "metric": true}')]
    assert num_pieces > 5  # not held to the end
    parser = new_parser(LLAMA3_JSON, incremental=True)
    assert parser.push("Sure") == ["Sure"]  # the first character says it is not a call: no hold-back
    assert parser.push(", ") == [", "]


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    reply = '{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}'
    assert whole(reply, parallel=False) == (None, [("f", '{"a": 1}')])
    for step in (1, 4, 100):
        assert streamed(reply, step, parallel=False)[:2] == (None, [("f", '{"a": 1}')])


def test_a_streamed_call_cut_by_max_tokens_ends_with_what_the_model_wrote() -> None:
    # announced already (as vLLM's streaming parser does); the whole parse keeps it as content
    assert whole('{"name": "f", "parameters": {"a": 1') == ('{"name": "f", "parameters": {"a": 1', [])
    assert streamed('{"name": "f", "parameters": {"a": 1', 3)[:2] == (None, [("f", '{"a": 1')])
