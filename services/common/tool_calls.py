"""Tool calls in a model's text: Qwen3 / Hermes ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
blocks parsed out of the reply, whole or as it streams. Pure: no I/O; call ids come from the caller.

The rules (the same for a whole reply and a stream, so both give the same calls and content):

- a block whose JSON is an object with a string ``name`` and an object ``arguments`` (or ``parameters``,
  or a string of JSON holding an object) is a call; its ``arguments`` come back as compact JSON text
  (``json.dumps``), whatever spacing the model used;
- a block that is not such JSON (malformed, wrong shape) or is never closed stays in the content as it
  came, markup included (vLLM's Hermes parser does the same): nothing the model wrote is lost;
- text outside the blocks is the content; whitespace right next to a block is dropped (the newline
  between two calls is not content);
- with ``parallel_tool_calls`` false only the first call is kept (later blocks are dropped), as vLLM does.

A stream holds back a tail that may be the start of ``<tool_call>`` and the whole of an open block until
its ``</tool_call>``: a call's arguments are sent once the block is closed (as the header delta, then the
arguments), never ``<tool_call>`` markup as content.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object


Piece = str | ParsedCall  # content text, or one call


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
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _open_prefix_len(text: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``<tool_call>``."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0


class ToolCallParser:
    """Incremental: :meth:`push` each piece of text, then :meth:`finish`; each returns the pieces that are
    settled (content strings and :class:`ParsedCall` s, in order)."""

    def __init__(self, *, parallel_tool_calls: bool = True) -> None:
        self._parallel = parallel_tool_calls
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

    def _block(self, inner: str, out: list[Piece]) -> None:
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
        rest = (OPEN if self._in_block else "") + self._buffer
        self._buffer, self._in_block = "", False
        if rest:
            self._after_block = False
            self._content(rest, out)
        if self._pending_space:  # the reply ends in whitespace after content: it is the content's
            out.append(self._pending_space)
            self._pending_space = ""
        return out


def parse_tool_calls(text: str, *, parallel_tool_calls: bool = True) -> tuple[str | None, list[ParsedCall]]:
    """A whole reply's content (None when only calls and whitespace) and its calls."""
    parser = ToolCallParser(parallel_tool_calls=parallel_tool_calls)
    pieces = parser.push(text) + parser.finish()
    content = "".join(p for p in pieces if isinstance(p, str))
    return (content if content.strip() else None), [p for p in pieces if isinstance(p, ParsedCall)]
