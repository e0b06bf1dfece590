"""The OpenAI Responses API (``POST /v1/responses``), the subset our engines serve: text, function tools and
structured output, streamed or not. Pure: no I/O, no clock, ids come from the caller.

A Responses request is translated onto the chat-completions path (:func:`parse_responses` builds the chat
body and hands it to :func:`services.common.openai_api.parse_request`), so the engine sees a plain
``GenerateRequest``; the reply's text (and its tool calls, parsed as for chat) is written back as Response
``output`` items by :class:`ResponseBuilder`, which also yields the stream's events. The field names and
event sequence follow the openai SDK's ``openai/types/responses/`` (3.57) and OpenAI's API reference.

What is refused (400 naming the field): state kept between requests (``previous_response_id``,
``conversation``, ``background``, ``prompt``), built-in tools (``web_search``, ``file_search``, ...),
non-text inputs, ``include``, ``top_logprobs``, ``reasoning``, ``max_tool_calls``, ``truncation: auto``, and any
field the API does not define (OpenAI answers those with a 400 too).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

from proto import ErrorInfo, Usage
from services.common.openai_api import InvalidRequest, ParsedRequest, ResponsesOptions, parse_request
from services.common.tool_calls import ArgumentsPiece, CallStart, ParsedCall, Piece

# Fields of the Responses API that change what the answer must be and that we do not implement: a value that
# asks for something is a 400 naming the field (never silently ignored).
_REFUSED: dict[str, Callable[[Any], bool]] = {
    "previous_response_id": lambda v: v is not None,  # no response storage
    "conversation": lambda v: v is not None,
    "background": bool,
    "prompt": lambda v: v is not None,  # stored prompt templates
    "include": lambda v: bool(v),
    "top_logprobs": lambda v: v not in (None, 0),
    # reasoning.effort is taken (the thinking budget, as chat's reasoning_effort); a summary we cannot write
    "reasoning": lambda v: v is not None and (not isinstance(v, dict) or v.get("summary") is not None
                                             or v.get("generate_summary") is not None),
    "max_tool_calls": lambda v: v is not None,
    "truncation": lambda v: v not in (None, "disabled"),
    "context_management": lambda v: v is not None,
}
# Accepted as informational (echoed back or ignored, as OpenAI's results do not depend on them)
_INFORMATIONAL = frozenset({"user", "store", "metadata", "service_tier", "safety_identifier", "prompt_cache_key",
                            "stream_options", "prompt_cache_retention"})
_TRANSLATED = frozenset({"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "text",
                         "max_output_tokens", "temperature", "top_p", "stream"})
# vLLM's Responses endpoint takes its sampling extensions too; these go to the chat path as they are
_SAMPLING_EXTRAS = frozenset({"seed", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                              "frequency_penalty", "stop", "ignore_eos", "min_tokens", "logit_bias"})
_KNOWN = frozenset(_REFUSED) | _INFORMATIONAL | _TRANSLATED | _SAMPLING_EXTRAS
_CHAT_TO_RESPONSES = {"max_completion_tokens": "max_output_tokens", "response_format": "text.format",
                      "messages": "input"}
_ROLES = frozenset({"user", "system", "developer", "assistant"})
_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})


def _text_of(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"'{param}' must be a string or an array of input_text parts", param)
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(kind, str) or kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise InvalidRequest(f"'{param}[{j}]' must be an input_text part (got {kind!r}): only text input is "
                                 "supported", f"{param}[{j}]", code="unsupported_parameter")
        parts.append(part["text"])
    return "".join(parts)


def _parts_text(parts: Any) -> str:
    """The text of a reasoning item's ``content`` (reasoning_text) or ``summary`` (summary_text) parts."""
    if not isinstance(parts, list):
        return ""
    return "".join(p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str))


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """``instructions`` + ``input`` as chat messages: function_call items join the assistant turn before them
    (or make one), function_call_output items become ``role: tool`` turns."""
    out: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise InvalidRequest("'instructions' must be a string", "instructions")
        out.append({"role": "system", "content": instructions})
    raw = body.get("input")
    if isinstance(raw, str):
        out.append({"role": "user", "content": raw})
        return out
    if not isinstance(raw, list) or not raw:
        raise InvalidRequest("'input' is required: a string or a non-empty array of input items", "input")
    reasoning = ""  # a reasoning item's text, for the assistant turn that follows it
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequest(f"'{where}' must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if not isinstance(role, str) or role not in _ROLES:
                raise InvalidRequest(f"'{where}.role' must be one of {sorted(_ROLES)}", f"{where}.role")
            out.append({"role": role, "content": _text_of(item.get("content"), f"{where}.content")})
            if role == "assistant" and reasoning:
                out[-1]["reasoning_content"], reasoning = reasoning, ""
        elif kind == "function_call":
            call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments", "{}")
            if not (isinstance(call_id, str) and call_id and isinstance(name, str) and name
                    and isinstance(arguments, str)):
                raise InvalidRequest(f"'{where}' must have string call_id, name and arguments (JSON text)", where)
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and not reasoning:
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
                if reasoning:
                    out[-1]["reasoning_content"], reasoning = reasoning, ""
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str) or not call_id:
                raise InvalidRequest(f"'{where}.call_id' must be a non-empty string", f"{where}.call_id")
            out.append({"role": "tool", "tool_call_id": call_id, "content": _text_of(output, f"{where}.output")})
        elif kind == "reasoning":
            # a previous answer's reasoning item sent back (an agent's tool loop, replaying output): its text
            # is the reasoning of the assistant turn that follows, which the chat template keeps or drops by
            # its own rule (Qwen3's keeps it after the last user turn); encrypted_content is not ours to read
            # (the full text when the item has it, as ours and vLLM's do, else OpenAI's summary)
            reasoning = _parts_text(item.get("content")) or _parts_text(item.get("summary"))
        else:
            raise InvalidRequest(f"'{where}.type' {kind!r} is not supported (message, function_call, "
                                 "function_call_output)", f"{where}.type", code="unsupported_parameter")
    return out


def _tools(body: dict[str, Any]) -> list[dict[str, Any]]:
    raw = body.get("tools")
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise InvalidRequest("'tools' must be an array", "tools")
    for i, tool in enumerate(raw):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise InvalidRequest(f"'tools[{i}].type' {kind!r} is not supported: only function tools are (no built-in "
                                 "tools such as web_search or file_search)", f"tools[{i}].type",
                                 code="unsupported_parameter")
    return raw


def _chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The Responses flat shape ``{type, name, description, parameters, strict}`` in the chat shape."""
    return [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters", "strict")
                                              if t.get(k) is not None}} for t in tools]


def _chat_tool_choice(raw: Any) -> Any:
    if raw is None or isinstance(raw, str):
        return raw
    if isinstance(raw, dict) and raw.get("type") == "function" and isinstance(raw.get("name"), str):
        return {"type": "function", "function": {"name": raw["name"]}}
    kind = raw.get("type") if isinstance(raw, dict) else None
    raise InvalidRequest(f"'tool_choice' {kind!r} is not supported: none, auto, required or "
                         '{"type": "function", "name": ...}', "tool_choice", code="unsupported_parameter")


def _text_format(body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(the ``text.format`` to echo, the chat ``response_format`` or None)."""
    text = body.get("text")
    if text is None:
        return {"type": "text"}, None
    if not isinstance(text, dict):
        raise InvalidRequest("'text' must be an object", "text")
    fmt = text.get("format")
    if fmt is None:
        return {"type": "text"}, None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise InvalidRequest("'text.format.type' must be one of text, json_object, json_schema", "text.format.type")
    if fmt["type"] == "json_schema":
        if not isinstance(fmt.get("name"), str) or not isinstance(fmt.get("schema"), dict):
            raise InvalidRequest("'text.format' json_schema needs a string 'name' and an object 'schema'",
                                 "text.format")
        inner = {k: fmt[k] for k in ("name", "schema", "strict", "description") if fmt.get(k) is not None}
        return fmt, {"type": "json_schema", "json_schema": inner}
    return fmt, {"type": fmt["type"]}


def parse_responses(body: dict[str, Any]) -> ParsedRequest:
    """A ``/v1/responses`` body as a :class:`ParsedRequest` (endpoint ``responses``) whose ``generate`` is the
    chat request the engine runs. Raises :class:`InvalidRequest` (a 400) naming the field."""
    unknown = sorted(k for k in body if k not in _KNOWN)
    if unknown:
        raise InvalidRequest(f"unknown parameter '{unknown[0]}'", unknown[0], code="unknown_parameter")
    for name, asks in _REFUSED.items():
        if name in body and asks(body[name]):
            raise InvalidRequest(f"'{name}' is not supported by this server's Responses API (it keeps no responses "
                                 "and serves text, function tools and structured output only)", name,
                                 code="unsupported_parameter")
    tools = _tools(body)
    text_format, response_format = _text_format(body)
    metadata = body.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise InvalidRequest("'metadata' must be an object", "metadata")
    chat: dict[str, Any] = {k: body[k] for k in _SAMPLING_EXTRAS | {"model", "temperature", "top_p", "stream",
                                                                   "parallel_tool_calls"} if k in body}
    chat["messages"] = _messages(body)
    if tools:
        chat["tools"] = _chat_tools(tools)
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _chat_tool_choice(body["tool_choice"])
    if response_format is not None:
        chat["response_format"] = response_format
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    if isinstance(body.get("reasoning"), dict) and body["reasoning"].get("effort") is not None:
        chat["reasoning_effort"] = body["reasoning"]["effort"]
    try:
        parsed = parse_request(chat, "chat.completions")
    except InvalidRequest as exc:  # the chat parser names chat fields: say them in the Responses spelling
        param = exc.param
        head = (param or "").split(".")[0].split("[")[0]
        if param is not None and head in _CHAT_TO_RESPONSES:
            param = _CHAT_TO_RESPONSES[head]
        if param == "reasoning_effort":
            param = "reasoning.effort"
        raise InvalidRequest(str(exc).replace("max_completion_tokens", "max_output_tokens")
                             .replace("reasoning_effort", "reasoning.effort"), param, exc.code) from None
    user = body.get("user")
    options = ResponsesOptions(
        instructions=body.get("instructions"), tools=tools,
        tool_choice=body.get("tool_choice") if body.get("tool_choice") is not None else ("auto" if tools else "none"),
        text_format=text_format, metadata=metadata, max_output_tokens=parsed.generate.max_tokens,
        user=user if isinstance(user, str) else None)
    return dataclasses.replace(parsed, endpoint="responses", include_usage=False, continuous_usage=False,
                               responses=options)


def usage_body(usage: Usage | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    reasoning_tokens = usage.reasoning_tokens
    return {"input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


class ResponseBuilder:
    """The Response object a reply makes, and the stream's events on the way (each with its
    ``sequence_number``). Feed it the reply as :mod:`services.common.tool_calls` pieces (plain text is a
    ``str`` piece), then :meth:`finish` with the final chunk's outcome. ``new_id(prefix)`` makes item ids
    (``msg``, ``fc``, ``call``)."""

    def __init__(self, parsed: ParsedRequest, response_id: str, created_at: int,
                 new_id: Callable[[str], str]) -> None:
        assert parsed.responses is not None
        self.parsed = parsed
        self.options = parsed.responses
        self.response_id = response_id
        self.created_at = created_at
        self._new_id = new_id
        self._seq = -1
        self.output: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the item still being written
        self.status = "in_progress"
        self.usage: dict[str, Any] | None = None
        self.error: dict[str, Any] | None = None
        self.incomplete_details: dict[str, Any] | None = None

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self._seq += 1
        return {"type": kind, "sequence_number": self._seq, **fields}

    def response(self) -> dict[str, Any]:
        g, o = self.parsed.generate, self.options
        return {
            "id": self.response_id, "object": "response", "created_at": self.created_at, "status": self.status,
            "background": False, "error": self.error, "incomplete_details": self.incomplete_details,
            "instructions": o.instructions, "max_output_tokens": o.max_output_tokens, "model": self.parsed.model,
            "output": [dict(item) for item in self.output], "parallel_tool_calls": g.parallel_tool_calls,
            "previous_response_id": None, "store": False,
            "reasoning": None if g.reasoning_effort is None else {"effort": g.reasoning_effort, "summary": None},
            "temperature": g.temperature,
            "text": {"format": o.text_format}, "tool_choice": o.tool_choice, "tools": o.tools, "top_p": g.top_p,
            "truncation": "disabled", "usage": self.usage, "user": o.user, "metadata": o.metadata,
        }

    def start(self) -> list[dict[str, Any]]:
        return [self._event("response.created", response=self.response()),
                self._event("response.in_progress", response=self.response())]

    def _close(self, status: str = "completed") -> list[dict[str, Any]]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = len(self.output) - 1
        item["status"] = status
        if item["type"] == "reasoning":
            ids = {"item_id": item["id"], "output_index": index, "content_index": 0}
            return [self._event("response.reasoning_text.done", **ids, text=item["content"][0]["text"]),
                    self._event("response.output_item.done", output_index=index, item=_copy(item))]
        if item["type"] == "message":
            part = item["content"][0]
            ids = {"item_id": item["id"], "output_index": index, "content_index": 0}
            return [self._event("response.output_text.done", **ids, text=part["text"], logprobs=[]),
                    self._event("response.content_part.done", **ids, part=dict(part)),
                    self._event("response.output_item.done", output_index=index, item=_copy(item))]
        return [self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                            name=item["name"], arguments=item["arguments"]),
                self._event("response.output_item.done", output_index=index, item=_copy(item))]

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.output.append(item)
        self._open = item
        return [self._event("response.output_item.added", output_index=len(self.output) - 1, item=_copy(item))]

    def text(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        events: list[dict[str, Any]] = []
        if self._open is None or self._open["type"] != "message":
            events += self._close()
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events += self._add({"type": "message", "id": self._new_id("msg"), "status": "in_progress",
                                 "role": "assistant", "content": [part]})
            events.append(self._event("response.content_part.added", item_id=self._open_id(),
                                      output_index=len(self.output) - 1, content_index=0, part=dict(part)))
        assert self._open is not None
        self._open["content"][0]["text"] += text
        events.append(self._event("response.output_text.delta", item_id=self._open_id(),
                                  output_index=len(self.output) - 1, content_index=0, delta=text, logprobs=[]))
        return events

    def reasoning(self, text: str) -> list[dict[str, Any]]:
        """A thinking model's ``<think>`` block (TokenChunk.reasoning): one ``reasoning`` item before the answer,
        its text as ``reasoning_text`` content (as vLLM's Responses endpoint writes it; no summary)."""
        if not text:
            return []
        events: list[dict[str, Any]] = []
        if self._open is None or self._open["type"] != "reasoning":
            events += self._close()
            events += self._add({"type": "reasoning", "id": self._new_id("rs"), "summary": [],
                                 "content": [{"type": "reasoning_text", "text": ""}], "status": "in_progress"})
        assert self._open is not None
        self._open["content"][0]["text"] += text
        events.append(self._event("response.reasoning_text.delta", item_id=self._open_id(),
                                  output_index=len(self.output) - 1, content_index=0, delta=text))
        return events

    def _open_id(self) -> str:
        assert self._open is not None
        return str(self._open["id"])

    def call_start(self, name: str) -> list[dict[str, Any]]:
        events = self._close()
        return events + self._add({"type": "function_call", "id": self._new_id("fc"), "call_id": self._new_id("call"),
                                   "name": name, "arguments": "", "status": "in_progress"})

    def call_arguments(self, text: str) -> list[dict[str, Any]]:
        if not text or self._open is None or self._open["type"] != "function_call":
            return []
        self._open["arguments"] += text
        return [self._event("response.function_call_arguments.delta", item_id=self._open_id(),
                            output_index=len(self.output) - 1, delta=text)]

    def piece(self, piece: Piece) -> list[dict[str, Any]]:
        if isinstance(piece, str):
            return self.text(piece)
        if isinstance(piece, ParsedCall):
            return self.call_start(piece.name) + self.call_arguments(piece.arguments) + self._close()
        if isinstance(piece, CallStart):
            return self.call_start(piece.name)
        assert isinstance(piece, ArgumentsPiece)
        return self.call_arguments(piece.text)

    def finish(self, finish_reason: str | None, usage: Usage | None) -> list[dict[str, Any]]:
        """Close the open item and end the response: ``completed``, or ``incomplete`` when the reply was cut by
        ``max_output_tokens`` (finish reason ``length``)."""
        self.usage = usage_body(usage)
        if finish_reason == "length":
            events = self._close("incomplete")
            self.status, self.incomplete_details = "incomplete", {"reason": "max_output_tokens"}
            return [*events, self._event("response.incomplete", response=self.response())]
        events = self._close()
        self.status = "completed"
        return [*events, self._event("response.completed", response=self.response())]

    def fail(self, error: ErrorInfo | None, message: str = "", code: str | None = None) -> list[dict[str, Any]]:
        """End with ``response.failed`` (the stream's status line was sent already)."""
        events = self._close("incomplete")
        self.status = "failed"
        self.error = {"code": (error.code if error else code) or "server_error",
                      "message": error.message if error else message}
        return [*events, self._event("response.failed", response=self.response())]


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(item))  # events carry a snapshot, not the item that goes on growing
