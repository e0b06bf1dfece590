"""The Qwen3/Hermes ``<tool_call>`` parser on hand-written replies, whole and streamed in every split."""

from __future__ import annotations

import json

import msgspec
import pytest

from proto import ChatMessage, GenerateRequest, Tool, ToolCall, decode, encode
from proto.base import Message
from services.common.tool_calls import CallStart, ParsedCall, ToolCallParser, parse_tool_calls

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
        None, [ParsedCall("f", '{"a":1}')])


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


def _streamed(text: str, size: int, **kw: bool) -> tuple[str, list[ParsedCall], int]:
    """Push ``text`` in pieces of ``size`` into an incremental parser; the content, the calls reassembled
    from their starts and argument pieces (as a client does), and how many argument pieces came."""
    parser = ToolCallParser(incremental=True, **kw)
    pieces = []
    for i in range(0, len(text), size):
        pieces += parser.push(text[i:i + size])
    pieces += parser.finish()
    content, calls, num_args = "", [], 0
    for p in pieces:
        if isinstance(p, str):
            content += p
        elif isinstance(p, ParsedCall):
            calls.append(p)
        elif isinstance(p, CallStart):
            calls.append(ParsedCall(p.name, ""))
        else:
            num_args += 1
            calls[-1] = ParsedCall(calls[-1].name, calls[-1].arguments + p.text)
    return content, calls, num_args


STREAMED = [TWO_CALLS, 'x <tool_call>{"name":"f","arguments":{}}</tool_call> y', "plain <tool text",
            '<tool_call>\n{"arguments": {"k": [1, {"z": "}"}]}, "name": "g"}\n</tool_call>',  # other key order
            '<tool_call>{"name": "n", "arguments": {"v": 1.50, "w": {"in": "}"} } }\n</tool_call>']


@pytest.mark.parametrize("size", [1, 2, 3, 5, 11, 64])
def test_streamed_in_any_split_gives_the_same_calls_and_never_markup_as_content(size: int) -> None:
    for text in STREAMED:
        content, calls, _ = _streamed(text, size)
        whole_content, whole_calls = parse_tool_calls(text)
        assert content == (whole_content or "") and calls == whole_calls, text
        if whole_calls:
            assert "<tool_call>" not in content and "</tool_call>" not in content


def test_arguments_stream_as_they_grow_and_keep_the_models_spelling() -> None:
    _content, calls, num_args = _streamed(TWO_CALLS, 2)
    assert num_args > 5 and len(calls) == 2  # piece by piece, not one piece per call
    text = STREAMED[-1]
    assert parse_tool_calls(text)[1] == [ParsedCall("n", '{"v": 1.50, "w": {"in": "}"} }')]
    assert _streamed(TWO_CALLS, 3, parallel_tool_calls=False)[1] == parse_tool_calls(
        TWO_CALLS, parallel_tool_calls=False)[1]


# ---- the request side: parse_request's fields and the forced call's grammar --------------------------------

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "d",
                                         "parameters": {"type": "object", "properties": {"city": {"enum": ["A", "B"]}},
                                                        "required": ["city"]}}}
OTHER = {"type": "function", "function": {"name": "noop"}}


def _chat(**extra: object) -> dict[str, object]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}


def test_parse_request_carries_tools_choice_and_turns() -> None:
    from services.common.openai_api import parse_request

    g = parse_request(_chat(tools=[TOOL, OTHER], tool_choice={"type": "function", "function": {"name": "noop"}},
                            parallel_tool_calls=False), "chat.completions").generate
    assert [t.name for t in g.tools] == ["get_weather", "noop"] and g.tools[1].parameters == (
        '{"type": "object", "properties": {}}')
    assert (g.tool_choice, g.tool_choice_name, g.parallel_tool_calls) == ("function", "noop", False)
    assert parse_request(_chat(), "chat.completions").generate.tool_choice == "none"
    assert parse_request(_chat(tools=[TOOL]), "chat.completions").generate.tool_choice == "auto"
    turns = [{"role": "user", "content": "hi"},
             {"role": "assistant", "content": None, "tool_calls": [
                 {"id": "call_1", "type": "function", "function": {"name": "noop", "arguments": "{}"}}]},
             {"role": "tool", "tool_call_id": "call_1", "content": "ok"}]
    msgs = parse_request(_chat(messages=turns, tools=[OTHER]), "chat.completions").generate.messages
    assert msgs is not None and msgs[1].tool_calls[0].name == "noop" and msgs[1].content == ""
    assert msgs[2].tool_call_id == "call_1"


def test_the_answer_body_has_tool_calls_and_finish_reason_tool_calls() -> None:
    from proto import TokenChunk
    from services.common.openai_api import completion_body, parse_request

    parsed = parse_request(_chat(tools=[TOOL]), "chat.completions")
    final = TokenChunk(request_id="r", index=1, finish_reason="stop")
    body = completion_body(parsed, "id", 0, 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "A"}}'
                           '\n</tool_call>', final, new_call_id=lambda: "call_x")
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"] == {
        "role": "assistant", "content": "Sure.",
        "tool_calls": [{"id": "call_x", "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "A"}'}}]}
    # tool_choice none: the text is plain content, blocks and all
    none = parse_request(_chat(tools=[TOOL], tool_choice="none"), "chat.completions")
    text = '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
    assert completion_body(none, "id", 0, text, final, new_call_id=lambda: "c")["choices"][0]["message"] == {
        "role": "assistant", "content": text}


def test_the_forced_call_grammar_admits_valid_calls_only(tmp_path_factory: pytest.TempPathFactory) -> None:
    from services.common.openai_api import parse_request
    from services.engine.model.grammar import GrammarCache
    from services.engine.model.tokenizer import Tokenizer
    from services.engine.serve.frontend import tool_structured_output
    from services.engine.tiny_checkpoint import write_tiny_checkpoint

    tok = Tokenizer.from_dir(write_tiny_checkpoint(tmp_path_factory.mktemp("m") / "tiny", arch="qwen3"))
    cache = GrammarCache(tok, tok.vocab_size, tok.stop_token_ids)
    good = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "B"}}\n</tool_call>'

    def accepts(choice: object, parallel: bool, text: str) -> bool:
        req = parse_request(_chat(tools=[TOOL, OTHER], tool_choice=choice, parallel_tool_calls=parallel),
                            "chat.completions").generate
        structured = tool_structured_output(req)
        assert structured is not None
        matcher = cache.matcher(structured)
        return all(matcher.accept_token(t) for t in tok.encode(text, add_special_tokens=False)) and \
            matcher.is_terminated() is False and matcher.accept_token(tok.stop_token_ids[0])

    assert accepts("required", False, good)
    assert not accepts("required", False, good.replace('"B"', '"C"'))  # not in the enum
    assert not accepts("required", False, good + "\n" + good)  # one call only
    assert accepts("required", True, good + "\n" + good)
    assert not accepts({"type": "function", "function": {"name": "noop"}}, True, good)  # the named one only
    assert accepts({"type": "function", "function": {"name": "noop"}}, True,
                   '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>')
    assert tool_structured_output(parse_request(_chat(tools=[TOOL]), "chat.completions").generate) is None  # auto


class OldChatMessage(Message, frozen=True):
    """ChatMessage before the tool fields."""

    role: str
    content: str = ""
    name: str | None = None


class OldRequest(Message, frozen=True):
    """The start of GenerateRequest, as a reader from before the tool fields sees it."""

    request_id: str
    model: str
    messages: list[OldChatMessage] | None = None


def test_the_tool_fields_are_appended_so_old_and_new_messages_both_decode() -> None:
    new = GenerateRequest(request_id="r", model="m", tools=[Tool(name="f")], tool_choice="function",
                          tool_choice_name="f", parallel_tool_calls=False,
                          messages=[ChatMessage(role="assistant", tool_calls=[ToolCall(id="c", name="f")]),
                                    ChatMessage(role="tool", content="1", tool_call_id="c")])
    old_view = msgspec.msgpack.decode(encode(new), type=OldRequest)  # an old reader ignores them
    assert old_view.messages is not None and [m.role for m in old_view.messages] == ["assistant", "tool"]
    assert decode(encode(new), GenerateRequest) == new
    from_old = decode(msgspec.msgpack.encode(OldRequest(request_id="r", model="m",
                                                        messages=[OldChatMessage(role="user")])), GenerateRequest)
    assert (from_old.tools, from_old.tool_choice, from_old.parallel_tool_calls) == ([], "auto", True)
    assert from_old.messages is not None and from_old.messages[0].tool_calls == []
