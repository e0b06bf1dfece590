"""The Qwen3/Hermes ``<tool_call>`` parser on hand-written replies, whole and streamed in every split."""

from __future__ import annotations

import json

import pytest

from services.common.tool_calls import ParsedCall, ToolCallParser, parse_tool_calls

TWO_CALLS = (
    "Let me check both cities.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tōkyō"}}\n</tool_call>'
)


def test_two_calls_with_text_before_them() -> None:
    content, calls = parse_tool_calls(TWO_CALLS)
    assert content == "Let me check both cities."
    assert calls == [ParsedCall("get_weather", '{"city": "Paris", "unit": "celsius"}'),
                     ParsedCall("get_weather", '{"city": "Tōkyō"}')]
    assert json.loads(calls[1].arguments) == {"city": "Tōkyō"}


def test_text_after_a_call_is_content_and_only_calls_is_none() -> None:
    content, calls = parse_tool_calls('<tool_call>{"name":"f","arguments":{}}</tool_call>\nDone.')
    assert content == "Done." and calls == [ParsedCall("f", "{}")]
    assert parse_tool_calls('<tool_call>{"name":"f","arguments":{"a":1}}</tool_call>\n') == (
        None, [ParsedCall("f", '{"a": 1}')])


def test_no_blocks_is_plain_content() -> None:
    assert parse_tool_calls("a < b, <tool is not a tag") == ("a < b, <tool is not a tag", [])


@pytest.mark.parametrize("block", [
    '<tool_call>\n{"name": "f", "arguments": {"x": 1}\n</tool_call>',  # missing brace
    '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
    '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>',  # arguments not an object
    '<tool_call>\n{"name": "f", "arguments": {"x": ',  # never closed (cut by max_tokens)
])
def test_a_malformed_or_unclosed_block_is_left_as_content(block: str) -> None:
    content, calls = parse_tool_calls("Hi " + block)
    assert calls == [] and content == "Hi " + block


def test_a_malformed_block_next_to_a_good_one() -> None:
    text = '<tool_call>{"name": "f"</tool_call><tool_call>{"name": "g", "arguments": "{\\"y\\": 2}"}</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == '<tool_call>{"name": "f"</tool_call>' and calls == [ParsedCall("g", '{"y": 2}')]


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    assert parse_tool_calls(TWO_CALLS, parallel_tool_calls=False)[1] == [
        ParsedCall("get_weather", '{"city": "Paris", "unit": "celsius"}')]


@pytest.mark.parametrize("size", [1, 2, 3, 5, 11, 64])
def test_streamed_in_any_split_gives_the_same_pieces_and_never_markup_as_content(size: int) -> None:
    for text in (TWO_CALLS, 'x <tool_call>{"name":"f","arguments":{}}</tool_call> y', "plain <tool text"):
        parser = ToolCallParser()
        pieces = []
        for i in range(0, len(text), size):
            pieces += parser.push(text[i:i + size])
        pieces += parser.finish()
        content = "".join(p for p in pieces if isinstance(p, str))
        whole_content, whole_calls = parse_tool_calls(text)
        assert content == (whole_content or "")
        assert [p for p in pieces if isinstance(p, ParsedCall)] == whole_calls
        if whole_calls:
            assert "<tool_call>" not in content and "</tool_call>" not in content
