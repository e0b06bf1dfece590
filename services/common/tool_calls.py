"""Tool calls in a model's text: Qwen3 / Hermes ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
blocks parsed out of the reply, whole or as it streams. Pure: no I/O; call ids come from the caller.

The rules (the same for a whole reply and a stream, so both give the same calls and content):

- a block whose JSON is an object with a string ``name`` and an object ``arguments`` (or ``parameters``,
  or a string of JSON holding an object) is a call; its ``arguments`` are the object's text as the model
  wrote it when the block is ``{"name": ..., "arguments": {...}}`` in that order (what a stream sends
  piece by piece), else ``json.dumps`` of the parsed object;
- a block that is not such JSON (malformed, wrong shape) or is never closed stays in the content as it
  came, markup included (vLLM's Hermes parser does the same): nothing the model wrote is lost;
- text outside the blocks is the content; whitespace right next to a block is dropped (the newline
  between two calls is not content);
- with ``parallel_tool_calls`` false only the first call is kept (later blocks are dropped), as vLLM does.

A stream (``incremental=True``) holds back a tail that may be the start of ``<tool_call>``; inside a block
it sends a :class:`CallStart` once ``{"name": "...", "arguments": {`` is there, then
:class:`ArgumentsPiece` s as the arguments grow (holding back the text from the last ``}``, which may close
the call, and trailing whitespace); a block in another form is held to its ``</tool_call>`` and comes out
as a :class:`ParsedCall`. Never ``<tool_call>`` markup as content. A streamed call whose block turns out
malformed or is never closed has been announced already: it ends with what the model wrote (vLLM's
streaming parser does the same), where the whole reply's parse leaves it in the content.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object


@dataclass(frozen=True)
class CallStart:
    """A stream's call whose name is known and whose arguments follow as :class:`ArgumentsPiece` s."""

    name: str


@dataclass(frozen=True)
class ArgumentsPiece:
    text: str


# content text, a whole call, or (incremental parsers only) a call's start and its arguments' pieces
Piece = str | ParsedCall | CallStart | ArgumentsPiece


def parse_block(inner: str) -> ParsedCall | None:
    """The call in one block's text (between the tags), or None when it is not a call."""
    try:
        obj = json.loads(inner)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args: Any = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    raw = _raw_arguments(inner) if set(obj) == {"name", "arguments"} else None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False) if raw is None else raw)


# The start of a block in the form Qwen3 / Hermes write: {"name": "...", "arguments": <here the arguments>
_CALL_PREFIX = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\S)')
_OUTER_END = re.compile(r"\s*\}\s*")


def _raw_arguments(inner: str) -> str | None:
    """The arguments object's text as the model wrote it, when the block is ``{"name": ..., "arguments":
    {...}}`` in that order (what a stream sends piece by piece); None otherwise."""
    m = _CALL_PREFIX.match(inner)
    if m is None or inner[m.end()] != "{":
        return None
    try:
        _value, end = json.JSONDecoder().raw_decode(inner, m.end())
    except ValueError:
        return None
    return inner[m.end():end] if _OUTER_END.fullmatch(inner, end) else None


def _open_prefix_len(text: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``<tool_call>``."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0


class ToolCallParser:
    """Incremental: :meth:`push` each piece of text, then :meth:`finish`; each returns the pieces that are
    settled (content strings and :class:`ParsedCall` s, in order)."""

    def __init__(self, *, parallel_tool_calls: bool = True, incremental: bool = False) -> None:
        self._parallel = parallel_tool_calls
        # incremental: a block in the Qwen3 / Hermes order ({"name": ..., "arguments": {...}}) comes out as a
        # CallStart once its name is known, then ArgumentsPieces as the arguments grow
        self._incremental = incremental
        self._args_start = -1  # where the streamed call's arguments start in the block (-1: none streaming)
        self._args_sent = 0  # characters of them sent
        self._buffer = ""  # outside a block: text not yet settled; inside: the block so far (after OPEN)
        self._in_block = False
        self._pending_space = ""  # whitespace after content: dropped if a block follows
        self._after_block = False  # skip whitespace right after a block
        self.num_calls = 0

    def _content(self, text: str, out: list[Piece]) -> None:
        if self._after_block:
            text = text.lstrip()
            if not text:
                return
            self._after_block = False
        stripped = text.rstrip()
        if stripped:
            out.append(self._pending_space + stripped)
            self._pending_space = ""
        self._pending_space += text[len(stripped):]

    def _stream_arguments(self, out: list[Piece]) -> None:
        """Inside an open block: send the call's start, then the arguments so far, holding back the text
        from the last ``}`` (it may be the end of the whole call) and trailing whitespace."""
        if self._args_start < 0:
            if not (self._parallel or self.num_calls == 0):
                return  # a call that will be dropped
            m = _CALL_PREFIX.match(self._buffer)
            if m is None or self._buffer[m.end()] != "{":
                return
            try:
                name = json.loads('"' + m.group(1) + '"')
            except ValueError:
                return
            if not name:
                return
            self._args_start, self._args_sent = m.end(), 0
            self.num_calls += 1
            out.append(CallStart(name))
        region = self._buffer[self._args_start:]
        last = region.rfind("}")
        safe = (region[:last] if last >= 0 else region).rstrip()
        if len(safe) > self._args_sent:
            out.append(ArgumentsPiece(safe[self._args_sent:]))
            self._args_sent = len(safe)

    def _end_streamed_call(self, inner: str, out: list[Piece]) -> None:
        """The rest of a streamed call's arguments: up to their end when the block is a call; what the model
        wrote when it is not (its start was sent already: the client gets the broken call, as from vLLM)."""
        start, sent = self._args_start, self._args_sent
        self._args_start = -1
        raw = _raw_arguments(inner) if parse_block(inner) is not None else None
        rest = (raw if raw is not None else inner[start:].rstrip())[sent:]
        if rest:
            out.append(ArgumentsPiece(rest))
        self._pending_space = ""
        self._after_block = True

    def _block(self, inner: str, out: list[Piece]) -> None:
        if self._args_start >= 0:
            self._end_streamed_call(inner, out)
            return
        call = parse_block(inner)
        if call is None:
            self._after_block = False
            self._content(OPEN + inner + CLOSE, out)
            return
        self._pending_space = ""
        self._after_block = True
        if self._parallel or self.num_calls == 0:
            self.num_calls += 1
            out.append(call)

    def push(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        self._buffer += text
        while True:
            if self._in_block:
                end = self._buffer.find(CLOSE)
                if end < 0:
                    if self._incremental:
                        self._stream_arguments(out)
                    return out
                inner, self._buffer = self._buffer[:end], self._buffer[end + len(CLOSE):]
                self._in_block = False
                self._block(inner, out)
            else:
                start = self._buffer.find(OPEN)
                if start < 0:
                    keep = _open_prefix_len(self._buffer)
                    settled = self._buffer[:len(self._buffer) - keep]
                    self._buffer = self._buffer[len(settled):]
                    if settled:
                        self._content(settled, out)
                    return out
                before, self._buffer = self._buffer[:start], self._buffer[start + len(OPEN):]
                if before:
                    self._content(before, out)
                self._in_block = True

    def finish(self) -> list[Piece]:
        out: list[Piece] = []
        if self._in_block and self._args_start >= 0:  # a streamed call never closed (cut by max_tokens)
            self._end_streamed_call(self._buffer, out)
            self._buffer, self._in_block = "", False
            return out
        rest = (OPEN if self._in_block else "") + self._buffer
        self._buffer, self._in_block = "", False
        if rest:
            self._after_block = False
            self._content(rest, out)
        if self._pending_space:  # the reply ends in whitespace after content: it is the content's
            out.append(self._pending_space)
            self._pending_space = ""
        return out


HERMES = "hermes"  # Qwen3 / Hermes: <tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks
# Llama 3.1 / 3.2 / 3.3 ("JSON based tool calling"): the whole reply is the call, {"name": ..., "parameters":
# {...}}, optionally after <|python_tag|>; several calls separated by ";" (vLLM's llama3_json parser)
LLAMA3_JSON = "llama3_json"
TOOL_FORMATS = (HERMES, LLAMA3_JSON)
PYTHON_TAG = "<|python_tag|>"


def new_parser(tool_format: str = HERMES, *, parallel_tool_calls: bool = True,
               incremental: bool = False) -> ToolCallParser | Llama3JsonParser:
    """The parser for a model family's tool-call format (one of :data:`TOOL_FORMATS`)."""
    if tool_format == LLAMA3_JSON:
        return Llama3JsonParser(parallel_tool_calls=parallel_tool_calls, incremental=incremental)
    return ToolCallParser(parallel_tool_calls=parallel_tool_calls, incremental=incremental)


def parse_llama3_calls(text: str) -> list[ParsedCall] | None:
    """The calls a whole Llama 3 reply makes (``<|python_tag|>``? then JSON objects separated by ``;``),
    or None when the reply is not calls (then all of it is content)."""
    rest = text.strip()
    rest = rest.removeprefix(PYTHON_TAG).lstrip()
    if not rest.startswith("{"):
        return None
    decoder = json.JSONDecoder()
    calls, at = [], 0
    while True:
        try:
            obj, end = decoder.raw_decode(rest, at)
        except ValueError:
            return None
        call = _llama3_call(obj, rest[at:end])
        if call is None:
            return None
        calls.append(call)
        at = end
        while at < len(rest) and rest[at].isspace():
            at += 1
        if at == len(rest):
            return calls
        if rest[at] != ";":
            return None
        at += 1
        while at < len(rest) and rest[at].isspace():
            at += 1
        if at == len(rest):
            return calls  # a trailing separator


def _llama3_call(obj: Any, written: str) -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args: Any = obj.get("parameters", obj.get("arguments", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict) or not set(obj) <= {"name", "parameters", "arguments"}:
        return None
    raw = None
    if set(obj) in ({"name", "parameters"}, {"name", "arguments"}):
        m = _LLAMA3_PREFIX.match(written)
        if m is not None and written[m.end()] == "{":
            try:
                _value, end = json.JSONDecoder().raw_decode(written, m.end())
            except ValueError:
                end = -1
            if end > 0 and _OUTER_END.fullmatch(written, end):
                raw = written[m.end():end]
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False) if raw is None else raw)


_LLAMA3_PREFIX = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:parameters|arguments)"\s*:\s*(?=\S)')


class Llama3JsonParser:
    """Llama 3's tool calls, with :class:`ToolCallParser`'s interface and rules: a reply that starts (after
    whitespace and an optional ``<|python_tag|>``) with ``{`` and is one or more call objects separated by
    ``;`` is calls (no content); anything else is all content, as it came. Streamed (``incremental``): content
    flows as soon as the reply's first character shows it is not a call; a call in the ``{"name": ...,
    "parameters": {...}}`` order comes out as a :class:`CallStart` and :class:`ArgumentsPiece` s (holding back
    the text from the last ``}``); a reply in any other form is held to the end and settled as a whole."""

    def __init__(self, *, parallel_tool_calls: bool = True, incremental: bool = False) -> None:
        self._parallel = parallel_tool_calls
        self._incremental = incremental
        self._buffer = ""
        self._mode = "undecided"  # "content" | "calls" | "held" (a call in another form: settled at finish)
        self._obj_start = 0  # where the current call object starts in the buffer
        self._args_start = -1  # where the streamed call's arguments start (-1: none streaming)
        self._args_sent = 0
        self._skip = False  # the current call is dropped (parallel_tool_calls false, a later call)
        self._done_end = -1  # the end of the last whole call object (-1: inside one)
        self._announced = False  # a CallStart went out
        self.num_calls = 0

    def _decide(self) -> None:
        head = self._buffer.lstrip()
        if not head:
            return
        if head.startswith(PYTHON_TAG):
            head = head[len(PYTHON_TAG):].lstrip()
            if not head:
                return
        elif PYTHON_TAG.startswith(head):
            return  # may still become the tag
        if head.startswith("{"):
            self._mode = "calls" if self._incremental else "held"
            self._obj_start = len(self._buffer) - len(head)
        else:
            self._mode = "content"

    def push(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        self._buffer += text
        if self._mode == "undecided":
            self._decide()
        if self._mode == "content":
            if self._buffer:
                out.append(self._buffer)
            self._buffer = ""
        elif self._mode == "calls":
            self._stream(out, len(self._buffer) - len(text))
        return out

    def _stream(self, out: list[Piece], new_from: int) -> None:
        """``new_from``: where this push's text starts in the buffer. An object can only have closed if a
        ``}`` arrived since: only then is the object decoded (a call's arguments otherwise cost a decode of
        the whole object per push)."""
        decoder = json.JSONDecoder()
        while True:
            if self._done_end >= 0:  # after a whole call object: a ";" and the next object, or the end
                rest = self._buffer[self._done_end:]
                stripped = rest.lstrip()
                if not stripped.startswith(";") or not stripped[1:].strip():
                    return
                after = stripped[1:].lstrip()
                if not after.startswith("{"):
                    return  # not another call: the stream ends its calls here
                self._obj_start = len(self._buffer) - len(after)
                self._done_end = -1
                new_from = self._obj_start
            region = self._buffer[self._obj_start:]
            may_close = "}" in self._buffer[max(new_from, self._obj_start):]
            if self._args_start < 0:
                m = _LLAMA3_PREFIX.match(region)
                if m is None or region[m.end()] != "{":
                    if not may_close:
                        return  # may still become a call's start
                    try:
                        decoder.raw_decode(region)
                    except ValueError:
                        return  # may still become a call's start
                    self._mode = "held"  # a whole object in another form: the reply is settled at the end
                    return
                try:
                    name = json.loads('"' + m.group(1) + '"')
                except ValueError:
                    self._mode = "held"
                    return
                self._skip = not (self._parallel or self.num_calls == 0)
                self._args_start, self._args_sent = self._obj_start + m.end(), 0
                if not self._skip:
                    self.num_calls += 1
                    self._announced = True
                    out.append(CallStart(name))
            try:
                if not may_close:
                    raise ValueError("open")
                obj, end = decoder.raw_decode(self._buffer, self._obj_start)
            except ValueError:  # the object is still open: the arguments so far
                args = self._buffer[self._args_start:]
                last = args.rfind("}")
                safe = (args[:last] if last >= 0 else args).rstrip()
                if len(safe) > self._args_sent and not self._skip:
                    out.append(ArgumentsPiece(safe[self._args_sent:]))
                    self._args_sent = len(safe)
                return
            call = _llama3_call(obj, self._buffer[self._obj_start:end])
            args_text = call.arguments if call is not None else self._buffer[self._args_start:end - 1].rstrip()
            if not self._skip and len(args_text) > self._args_sent:
                out.append(ArgumentsPiece(args_text[self._args_sent:]))
            self._args_start, self._done_end = -1, end

    def finish(self) -> list[Piece]:
        out: list[Piece] = []
        text, self._buffer = self._buffer, ""
        if self._mode in ("undecided", "content"):
            if text:
                out.append(text)
            return out
        if self._mode == "held" or (self._mode == "calls" and self._args_start < 0 and self._done_end < 0
                                    and not self._announced):
            calls = parse_llama3_calls(text)
            if calls is None:
                out.append(text)
                return out
            kept = calls if self._parallel else calls[:1]
            self.num_calls = len(kept)
            out.extend(kept)
            return out
        # streamed calls: a call still open (cut by max_tokens) ends with what the model wrote; text after the
        # calls that is not another call is content (nothing is lost, though the calls were announced)
        if self._args_start >= 0 and not self._skip:
            rest = text[self._args_start:].rstrip()[self._args_sent:]
            if rest:
                out.append(ArgumentsPiece(rest))
        elif self._done_end >= 0:
            tail = text[self._done_end:].strip()
            if tail.startswith(";"):
                tail = tail[1:].strip()
            if tail:
                out.append(tail)
        return out


def parse_tool_calls(text: str, *, parallel_tool_calls: bool = True,
                     tool_format: str = HERMES) -> tuple[str | None, list[ParsedCall]]:
    """A whole reply's content (None when only calls and whitespace) and its calls, in ``tool_format``."""
    parser = new_parser(tool_format, parallel_tool_calls=parallel_tool_calls)
    pieces = parser.push(text) + parser.finish()
    content = "".join(p for p in pieces if isinstance(p, str))
    return (content if content.strip() else None), [p for p in pieces if isinstance(p, ParsedCall)]
