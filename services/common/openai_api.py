"""OpenAI request validation and response shaping. Pure: no I/O, no clock (``created`` is passed in)."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from proto import ChatMessage, Constraint, GenerateRequest, Timings, TokenChunk, TokenLogprob, Tool, ToolCall, Usage
from services.common.tool_calls import ParsedCall, parse_tool_calls

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
MAX_STOP_SEQUENCES = 4
MAX_STOP_TOKEN_IDS = 64
MAX_LOGPROBS = 20  # OpenAI's cap on top_logprobs; the engine's too
MAX_N = 128  # OpenAI's cap on n; an engine bounds it further by its concurrency


class InvalidRequest(ValueError):
    """A 400: the message says what is wrong, ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass(frozen=True)
class ResponsesOptions:
    """What a Response object echoes back of its request."""

    instructions: str | None = None
    tools: list[dict[str, Any]] = field(default_factory=list)  # the flat function tools as sent
    tool_choice: Any = "auto"
    text_format: dict[str, Any] = field(default_factory=lambda: {"type": "text"})
    metadata: dict[str, Any] = field(default_factory=dict)
    max_output_tokens: int | None = None
    user: str | None = None


@dataclass(frozen=True)
class ParsedRequest:
    endpoint: str  # "chat.completions" | "completions"
    model: str
    stream: bool
    include_usage: bool
    generate: GenerateRequest  # request_id/gateway fields are filled in by the service
    # OpenAI parameters present with a value our engine does not implement (tools, response_format, ...):
    # ninfer-serve refuses the request (400 naming the first); the gateway sends it only to HTTP members,
    # which get the client's body as it came.
    unsupported: tuple[str, ...] = ()
    # stream_options.continuous_usage_stats (vLLM's and SGLang's extension): every content chunk of the
    # stream carries the usage so far, so a client (or a gateway) that is cut off knows what it cost
    continuous_usage: bool = False
    # choices to generate (OpenAI's n; also ``generate.n``)
    n: int = 1
    # /v1/responses (services/common/openai_responses.py): what the Response object echoes of its request
    responses: ResponsesOptions | None = None
    # how the serving model writes tool calls (services/common/tool_calls.py TOOL_FORMATS): set by the face
    # that knows the model (the engine from its template, the gateway from the member's heartbeat)
    tool_format: str = "hermes"
    # the request used the legacy ``functions`` / ``function_call`` form (translated to tools at parsing): the
    # reply says ``message.function_call`` / ``delta.function_call`` and ``finish_reason: "function_call"``
    legacy_functions: bool = False

    @property
    def parses_tool_calls(self) -> bool:
        """The reply's ``<tool_call>`` blocks become ``tool_calls`` (tools offered, tool_choice not none)."""
        g = self.generate
        return self.endpoint in ("chat.completions", "responses") and bool(g.tools) and g.tool_choice != "none"


def _number(body: dict[str, Any], key: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequest(f"'{key}' must be a number", key)
    if value < lo or value > hi or (lo_open and value == lo):
        bounds = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise InvalidRequest(f"'{key}' must be in {bounds}, got {value}", key)
    return float(value)


MAX_INT = 2**63 - 1  # what the bus (msgpack int64) carries; a bigger number was a 500 at encoding


def _int(body: dict[str, Any], key: str, lo: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"'{key}' must be an integer", key)
    if value < lo:
        raise InvalidRequest(f"'{key}' must be >= {lo}, got {value}", key)
    if value > MAX_INT:
        raise InvalidRequest(f"'{key}' must be <= {MAX_INT}", key)
    return value


def _content_text(content: Any, param: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequest(f"only text content parts are supported ({param}[{i}])", f"{param}[{i}]")
            parts.append(part["text"])
        return "".join(parts)
    raise InvalidRequest(f"'{param}' must be a string or a list of text parts", param)


def _messages(body: dict[str, Any]) -> list[ChatMessage]:
    raw = body.get("messages")
    if raw is None:
        raise InvalidRequest("'messages' is required", "messages")
    if not isinstance(raw, list) or not raw:
        raise InvalidRequest("'messages' must be a non-empty array", "messages")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise InvalidRequest(f"messages[{i}] must be an object", f"messages[{i}]")
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:  # a list here was a TypeError (500)
            raise InvalidRequest(f"messages[{i}].role must be one of {sorted(ROLES)}", f"messages[{i}].role")
        name = m.get("name")
        tool_call_id = m.get("tool_call_id")
        reasoning = m.get("reasoning_content", m.get("reasoning")) if role == "assistant" else None
        if reasoning is not None and not isinstance(reasoning, str):
            raise InvalidRequest(f"messages[{i}].reasoning_content must be a string",
                                 f"messages[{i}].reasoning_content")
        if role == "tool" and not (isinstance(tool_call_id, str) and tool_call_id):
            raise InvalidRequest(f"messages[{i}].tool_call_id is required for a tool message (a string)",
                                 f"messages[{i}].tool_call_id")
        out.append(
            ChatMessage(
                role=role,
                content=_content_text(m.get("content"), f"messages[{i}].content"),
                name=name if isinstance(name, str) else None,
                tool_calls=_message_tool_calls(m.get("tool_calls"), f"messages[{i}].tool_calls")
                if role == "assistant" else [],
                tool_call_id=tool_call_id if role == "tool" else None,
                reasoning=reasoning or None,
            )
        )
    return out


def _message_tool_calls(raw: Any, param: str) -> list[ToolCall]:
    """An assistant turn's ``tool_calls`` as a client sends them back (OpenAI's shape)."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise InvalidRequest(f"'{param}' must be an array", param)
    out = []
    for j, call in enumerate(raw):
        where = f"{param}[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if (not isinstance(call, dict) or call.get("type", "function") != "function" or not isinstance(fn, dict)
                or not isinstance(call.get("id"), str) or not isinstance(fn.get("name"), str) or not fn["name"]):
            raise InvalidRequest(f"'{where}' must be {{\"id\": str, \"type\": \"function\", \"function\": "
                                 f"{{\"name\": str, \"arguments\": str}}}}", where)
        arguments = fn.get("arguments", "{}")
        if not isinstance(arguments, str):
            raise InvalidRequest(f"'{where}.function.arguments' must be a string (JSON text)",
                                 f"{where}.function.arguments")
        out.append(ToolCall(id=call["id"], name=fn["name"], arguments=arguments))
    return out


MAX_TOOLS = 128  # OpenAI's limit on tools per request
_TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for a function's name


def _tools(body: dict[str, Any]) -> list[Tool]:
    raw = body.get("tools")
    if raw is None:
        return []
    if not isinstance(raw, list) or len(raw) > MAX_TOOLS:
        raise InvalidRequest(f"'tools' must be an array of at most {MAX_TOOLS} tools", "tools")
    out: list[Tool] = []
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise InvalidRequest(f"'{where}' must be an object with \"type\": \"function\"", f"{where}.type")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise InvalidRequest(f"'{where}.function' must be an object", f"{where}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.match(name):
            raise InvalidRequest(f"'{where}.function.name' must be 1-64 characters of a-z, A-Z, 0-9, _ and -",
                                 f"{where}.function.name")
        if any(t.name == name for t in out):
            raise InvalidRequest(f"'{where}.function.name' repeats the tool name {name!r}", f"{where}.function.name")
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise InvalidRequest(f"'{where}.function.description' must be a string", f"{where}.function.description")
        strict = fn.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise InvalidRequest(f"'{where}.function.strict' must be a boolean", f"{where}.function.strict")
        parameters = fn.get("parameters")
        spec = ('{"type": "object", "properties": {}}' if parameters is None
                else _spec_text(parameters, f"{where}.function.parameters", json_allowed=True))
        out.append(Tool(name=name, description=description, parameters=spec, strict=bool(strict)))
    return out


def _tool_choice(body: dict[str, Any], tools: list[Tool]) -> tuple[str, str | None]:
    """(mode, function name): OpenAI's default is ``auto`` with tools and ``none`` without."""
    raw = body.get("tool_choice")
    if raw is None:
        return ("auto" if tools else "none"), None
    if isinstance(raw, str):
        if raw not in ("none", "auto", "required"):
            raise InvalidRequest("'tool_choice' must be none, auto, required or "
                                 '{"type": "function", "function": {"name": ...}}', "tool_choice")
        if raw == "required" and not tools:  # "auto" without tools is "none" (clients send it by default)
            raise InvalidRequest(f"'tool_choice' {raw!r} is only allowed when 'tools' are given", "tool_choice")
        return (raw if tools else "none"), None
    fn = raw.get("function") if isinstance(raw, dict) else None
    if not isinstance(raw, dict) or raw.get("type") != "function" or not isinstance(fn, dict) \
            or not isinstance(fn.get("name"), str):
        raise InvalidRequest("'tool_choice' must be none, auto, required or "
                             '{"type": "function", "function": {"name": ...}}', "tool_choice")
    if not any(t.name == fn["name"] for t in tools):
        raise InvalidRequest(f"'tool_choice.function.name' {fn['name']!r} is not one of the request's tools",
                             "tool_choice.function.name")
    return "function", fn["name"]


def _stop(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise InvalidRequest("'stop' must be a non-empty string or an array of them", "stop")
    if len(stop) > MAX_STOP_SEQUENCES:
        raise InvalidRequest(f"'stop' allows at most {MAX_STOP_SEQUENCES} sequences", "stop")
    return stop


def _stop_token_ids(body: dict[str, Any]) -> list[int]:
    """vLLM's extension: token ids that end the reply like a stop string (checked by the engine)."""
    ids = body.get("stop_token_ids")
    if ids is None:
        return []
    if (not isinstance(ids, list) or len(ids) > MAX_STOP_TOKEN_IDS
            or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_INT for t in ids)):
        raise InvalidRequest(f"'stop_token_ids' must be an array of at most {MAX_STOP_TOKEN_IDS} token ids (integers "
                             ">= 0)", "stop_token_ids")
    return ids


MAX_CONSTRAINT_CHARS = 64 * 1024  # a schema, regex or grammar's text: bounds the engine's compile work
MAX_CHOICES = 256
MAX_LOGIT_BIAS = 300  # OpenAI's limit on logit_bias entries


def _spec_text(value: Any, param: str, *, json_allowed: bool) -> str:
    if json_allowed and isinstance(value, dict):
        value = json.dumps(value)
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"'{param}' must be a non-empty {'object or ' if json_allowed else ''}string", param)
    if len(value) > MAX_CONSTRAINT_CHARS:
        raise InvalidRequest(f"'{param}' is longer than {MAX_CONSTRAINT_CHARS} characters", param)
    if json_allowed:
        try:
            schema = json.loads(value)
        except ValueError:
            raise InvalidRequest(f"'{param}' is not valid JSON", param) from None
        if not isinstance(schema, dict):
            raise InvalidRequest(f"'{param}' must be a JSON schema object", param)
    return value


def _choices(value: Any, param: str) -> list[str]:
    if (not isinstance(value, list) or not value or len(value) > MAX_CHOICES
            or not all(isinstance(c, str) and c for c in value)):
        raise InvalidRequest(f"'{param}' must be an array of 1..{MAX_CHOICES} non-empty strings", param)
    return value


def _response_format(value: Any) -> Constraint | None:
    if not isinstance(value, dict):
        raise InvalidRequest("'response_format' must be an object", "response_format")
    kind = value.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return Constraint(kind="json_object")
    if kind == "json_schema":
        inner = value.get("json_schema")
        if not isinstance(inner, dict):
            raise InvalidRequest("'response_format.json_schema' must be an object", "response_format.json_schema")
        schema = inner.get("schema", {"type": "object"})
        strict = inner.get("strict", False)
        if strict is not None and not isinstance(strict, bool):
            raise InvalidRequest("'response_format.json_schema.strict' must be a boolean",
                                 "response_format.json_schema.strict")
        return Constraint(kind="json_schema", spec=_spec_text(schema, "response_format.json_schema.schema",
                                                              json_allowed=True), strict=bool(strict))
    raise InvalidRequest("'response_format.type' must be one of text, json_object, json_schema",
                         "response_format.type")


def _constraint(body: dict[str, Any]) -> Constraint | None:
    """Structured output from OpenAI's ``response_format`` or vLLM's ``guided_*`` / ``structured_outputs``
    (at most one of them may ask for a constraint)."""
    found: list[tuple[str, Constraint]] = []
    if body.get("response_format") is not None and (c := _response_format(body["response_format"])) is not None:
        found.append(("response_format", c))
    forms: list[tuple[str, str, Any]] = [(f"guided_{k}", k, body.get(f"guided_{k}"))
                                         for k in ("json", "regex", "choice", "grammar")]
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise InvalidRequest("'structured_outputs' must be an object", "structured_outputs")
        forms += [(f"structured_outputs.{k}", k, so.get(k)) for k in ("json", "regex", "choice", "grammar")]
        if so.get("json_object"):
            found.append(("structured_outputs.json_object", Constraint(kind="json_object")))
    for param, key, value in forms:
        if value is None:
            continue
        if key == "json":
            found.append((param, Constraint(kind="json_schema", spec=_spec_text(value, param, json_allowed=True))))
        elif key == "choice":
            found.append((param, Constraint(kind="choice", choices=_choices(value, param))))
        else:
            found.append((param, Constraint(kind="regex" if key == "regex" else "grammar",
                                            spec=_spec_text(value, param, json_allowed=False))))
    if len(found) > 1:
        names = ", ".join(p for p, _ in found)
        raise InvalidRequest(f"only one structured-output constraint may be given, got {names}", found[1][0])
    return found[0][1] if found else None


def _logit_bias(body: dict[str, Any]) -> dict[int, float]:
    raw = body.get("logit_bias")
    if raw is None:
        return {}
    if not isinstance(raw, dict) or len(raw) > MAX_LOGIT_BIAS:
        raise InvalidRequest(f"'logit_bias' must be an object of at most {MAX_LOGIT_BIAS} token ids", "logit_bias")
    out: dict[int, float] = {}
    for key, bias in raw.items():
        try:
            token_id = int(key)
        except (TypeError, ValueError):
            raise InvalidRequest(f"'logit_bias' keys must be token ids, got {key!r}", "logit_bias") from None
        if not 0 <= token_id <= MAX_INT:
            raise InvalidRequest(f"'logit_bias' keys must be token ids >= 0, got {key!r}", "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not -100 <= bias <= 100:
            raise InvalidRequest(f"'logit_bias' values must be numbers in [-100, 100], got {bias!r}", "logit_bias")
        out[token_id] = float(bias)
    return out


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")


def _reasoning_fields(body: dict[str, Any], endpoint: str) -> dict[str, Any]:
    """OpenAI's ``reasoning_effort`` and vLLM's ``chat_template_kwargs`` (chat only)."""
    if endpoint != "chat.completions":
        return {}
    effort = body.get("reasoning_effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise InvalidRequest(f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}", "reasoning_effort")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise InvalidRequest("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    if len(json.dumps(kwargs)) > MAX_CONSTRAINT_CHARS:
        raise InvalidRequest(f"'chat_template_kwargs' is longer than {MAX_CONSTRAINT_CHARS} characters",
                             "chat_template_kwargs")
    return {"reasoning_effort": effort, "chat_template_kwargs": kwargs}


def _echo_and_suffix(body: dict[str, Any], endpoint: str) -> tuple[bool, str | None]:
    """Legacy completions' ``echo`` (the prompt starts each choice's text) and ``suffix`` (the text after the
    hole: fill-in-the-middle); chat has neither."""
    if endpoint != "completions":
        return False, None
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise InvalidRequest("'echo' must be a boolean", "echo")
    suffix = body.get("suffix")
    if suffix is not None and not isinstance(suffix, str):
        raise InvalidRequest("'suffix' must be a string", "suffix")
    return bool(echo), suffix or None


def _tool_fields(body: dict[str, Any], endpoint: str) -> dict[str, Any]:
    if endpoint != "chat.completions":
        return {}
    tools = _tools(body)
    mode, name = _tool_choice(body, tools)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidRequest("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    return {"tools": tools, "tool_choice": mode, "tool_choice_name": name,
            "parallel_tool_calls": True if parallel is None else parallel}


def _legacy_functions(body: dict[str, Any]) -> dict[str, Any] | None:
    """The legacy ``functions`` / ``function_call`` form (OpenAI's, before tools; still sent by older agent
    frameworks) as the tools form: each function a tool, ``function_call`` the ``tool_choice``, one call per
    reply (the legacy form has no parallel calls); history turns too — an assistant turn's ``function_call``
    becomes its one tool call, a ``role: function`` turn the ``role: tool`` answer to the call before it.
    None when the body does not use the legacy form."""
    functions = body.get("functions")
    function_call = body.get("function_call")
    history = body.get("messages")
    legacy_turns = isinstance(history, list) and any(
        isinstance(m, dict) and (m.get("role") == "function" or m.get("function_call") is not None) for m in history)
    if functions is None and function_call is None and not legacy_turns:
        return None
    if functions is not None and "tools" in body:
        raise InvalidRequest("give either 'functions' (legacy) or 'tools', not both", "functions")
    if function_call is not None and "tool_choice" in body:
        raise InvalidRequest("give either 'function_call' (legacy) or 'tool_choice', not both", "function_call")
    out = dict(body)
    if functions is not None:
        if not isinstance(functions, list) or len(functions) > MAX_TOOLS:
            raise InvalidRequest(f"'functions' must be an array of at most {MAX_TOOLS} functions", "functions")
        for i, fn in enumerate(functions):
            if not isinstance(fn, dict):
                raise InvalidRequest(f"'functions[{i}]' must be an object", f"functions[{i}]")
        out["tools"] = [{"type": "function", "function": fn} for fn in functions]
        out["parallel_tool_calls"] = False
        out.pop("functions")
    if function_call is not None:
        if isinstance(function_call, dict):
            if not isinstance(function_call.get("name"), str):
                raise InvalidRequest("'function_call' must be none, auto or {\"name\": ...}", "function_call")
            out["tool_choice"] = {"type": "function", "function": {"name": function_call["name"]}}
        elif function_call in ("none", "auto"):
            out["tool_choice"] = function_call
        else:
            raise InvalidRequest("'function_call' must be none, auto or {\"name\": ...}", "function_call")
        out.pop("function_call")
    if legacy_turns and isinstance(history, list):
        turns: list[Any] = []
        last_call_id: str | None = None
        for i, m in enumerate(history):
            if not isinstance(m, dict):
                turns.append(m)  # _messages names it
                continue
            m = dict(m)
            call = m.pop("function_call", None)
            if call is not None and m.get("role") == "assistant":
                if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                    raise InvalidRequest(f"messages[{i}].function_call must be {{\"name\": str, \"arguments\": str}}",
                                         f"messages[{i}].function_call")
                last_call_id = f"call_legacy_{i}"
                m["tool_calls"] = [{"id": last_call_id, "type": "function", "function": {
                    "name": call["name"], "arguments": call.get("arguments", "{}")}}]
            elif m.get("role") == "function":
                m["role"] = "tool"
                m["tool_call_id"] = last_call_id or f"call_legacy_{i}"
            turns.append(m)
        out["messages"] = turns
    return out


# a translated field's name in an error -> the legacy field the client sent
_LEGACY_PARAMS = [(re.compile(r"^tools\[(\d+)\]\.function"), r"functions[\1]"), (re.compile(r"^tools\b"), "functions"),
                  (re.compile(r"^tool_choice\.function"), "function_call"),
                  (re.compile(r"^tool_choice\b"), "function_call")]


def parse_request(body: dict[str, Any], endpoint: str) -> ParsedRequest:
    legacy = _legacy_functions(body) if endpoint == "chat.completions" else None
    if legacy is None:
        return _parse_request(body, endpoint)
    try:
        return dataclasses.replace(_parse_request(legacy, endpoint), legacy_functions=True)
    except InvalidRequest as exc:  # name the field the client sent, not the one it was translated into
        param = exc.param
        for pattern, name in _LEGACY_PARAMS:
            if param is not None and pattern.match(param) and name.split("[")[0] in body:
                param = pattern.sub(name, param)
                break
        message = str(exc) if param == exc.param or exc.param is None else str(exc).replace(exc.param, param or "")
        raise InvalidRequest(message, param, exc.code) from None


def _parse_request(body: dict[str, Any], endpoint: str) -> ParsedRequest:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("'model' is required and must be a string", "model")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise InvalidRequest("'stream' must be a boolean", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise InvalidRequest("'stream_options' must be an object", "stream_options")
    include_usage = bool(options.get("include_usage", False))
    continuous_usage = bool(options.get("continuous_usage_stats", False))
    n = body.get("n")
    n = 1 if n is None else n
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise InvalidRequest(f"'n' must be an integer in [1, {MAX_N}]", "n")
    max_tokens = _int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1)
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not -MAX_INT <= seed <= MAX_INT):
        raise InvalidRequest(f"'seed' must be an integer of at most 64 bits (|seed| <= {MAX_INT})", "seed")
    logprobs: int | None = None
    if endpoint == "chat.completions":
        messages: list[ChatMessage] | None = _messages(body)
        prompt = None
        asked = body.get("logprobs", False)
        if not isinstance(asked, bool) and asked is not None:
            raise InvalidRequest("'logprobs' must be a boolean (the number goes in 'top_logprobs')", "logprobs")
        top = _int(body, "top_logprobs", 0)
        if top is not None and top > MAX_LOGPROBS:
            raise InvalidRequest(f"'top_logprobs' must be <= {MAX_LOGPROBS}, got {top}", "top_logprobs")
        if asked:
            logprobs = top or 0
    else:
        messages = None
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise InvalidRequest("'prompt' is required and must be a string", "prompt")
        logprobs = _int(body, "logprobs", 0)
        if logprobs is not None and logprobs > MAX_LOGPROBS:
            raise InvalidRequest(f"'logprobs' must be <= {MAX_LOGPROBS}, got {logprobs}", "logprobs")
    echo, suffix = _echo_and_suffix(body, endpoint)
    generate = GenerateRequest(
        request_id="",
        model=model,
        messages=messages,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=int(_number(body, "top_k", 0, -1, 1_000_000)),
        seed=seed,
        stop=_stop(body),
        stop_token_ids=_stop_token_ids(body),
        ignore_eos=bool(body.get("ignore_eos", False)),
        logprobs=logprobs,
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0, 0.0, 2.0, lo_open=True),
        min_tokens=_int(body, "min_tokens", 0) or 0,
        constraint=_constraint(body),
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
        logit_bias=_logit_bias(body),
        **_tool_fields(body, endpoint),
        **_reasoning_fields(body, endpoint),
        n=n,
        echo=echo,
        suffix=suffix,
    )
    return ParsedRequest(endpoint, model, stream, include_usage, generate, _unsupported(body, endpoint),
                         continuous_usage, n)


# Parameters that change what a reply must be, each with the test for a value that asks for something:
# accepting such a request and ignoring the parameter would hand the client a silently wrong answer.
# (response_format, the guided_* forms, logit_bias, min_p, tools and tool_choice are implemented: issue #26;
# so is the legacy ``functions`` / ``function_call`` form, translated to tools by ``_legacy_functions``.)
# (n > 1, echo and suffix are implemented too and carried in the GenerateRequest: issue #26.)
_CHAT_CHECKS: dict[str, Callable[[Any], bool]] = {
    "modalities": lambda v: v is not None and v != ["text"],
    "audio": lambda v: v is not None,
    "prediction": lambda v: v is not None,
}
_COMPLETIONS_CHECKS: dict[str, Callable[[Any], bool]] = {
    "best_of": lambda v: v not in (None, 1),
}


def _unsupported(body: dict[str, Any], endpoint: str) -> tuple[str, ...]:
    checks = _CHAT_CHECKS if endpoint == "chat.completions" else _COMPLETIONS_CHECKS
    return tuple(name for name, asks in checks.items() if name in body and asks(body[name]))


def unsupported_error(parsed: ParsedRequest, engine: str) -> InvalidRequest:
    """The 400 for a request that asks for something ``engine`` does not implement."""
    name = parsed.unsupported[0]
    return InvalidRequest(f"'{name}' is not supported by {engine}: send the request without it, or route the "
                          "model to an engine that implements it", name, code="unsupported_parameter")


def empty_generate(model: str) -> GenerateRequest:
    """A GenerateRequest placeholder for endpoints that are passed through untouched (embeddings)."""
    return GenerateRequest(request_id="", model=model)


def combined_usage(usages: list[Usage]) -> Usage:
    """One request's usage from its choices' (n > 1, choice 0 first): the prompt (and its cached part) counted
    once, as choice 0 counted it (the choices share it), the output and reasoning tokens summed."""
    first = usages[0]
    if len(usages) == 1:
        return first
    return Usage(prompt_tokens=first.prompt_tokens, cached_tokens=first.cached_tokens,
                 completion_tokens=sum(u.completion_tokens for u in usages),
                 reasoning_tokens=sum(u.reasoning_tokens for u in usages))


def usage_body(usage: Usage | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
    }


def logprobs_body(parsed: ParsedRequest, entries: list[TokenLogprob] | None, text_offset: int = 0
                  ) -> dict[str, Any] | None:
    """``choices[0].logprobs`` for ``entries`` (None when the request did not ask for logprobs).

    Chat: ``{"content": [{token, logprob, bytes, top_logprobs: [...]}], "refusal": None}``. Legacy
    completions: ``{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}``, the offsets
    counted in characters of the completion's text from ``text_offset`` (where this piece starts)."""
    if parsed.generate.logprobs is None or entries is None:
        return None
    if parsed.endpoint == "chat.completions":
        return {"content": [{"token": e.token, "logprob": e.logprob, "bytes": e.bytes,
                             "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": t.bytes}
                                              for t in e.top_logprobs]} for e in entries],
                "refusal": None}
    offsets = []
    for e in entries:
        offsets.append(text_offset)
        text_offset += len(e.token)
    return {"tokens": [e.token for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{t.token: t.logprob for t in e.top_logprobs} for e in entries],
            "text_offset": offsets}


def tool_call_body(call: ParsedCall, call_id: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def tool_call_start_delta(name: str, index: int, call_id: str) -> dict[str, Any]:
    """A call's first delta as OpenAI streams it: index, id, type, name and ``arguments: ""``."""
    return {"index": index, "id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}


def tool_call_arguments_delta(text: str, index: int) -> dict[str, Any]:
    return {"index": index, "function": {"arguments": text}}


def tool_call_deltas(call: ParsedCall, index: int, call_id: str) -> list[dict[str, Any]]:
    """A whole call as OpenAI streams one: the first delta, then the arguments."""
    return [tool_call_start_delta(call.name, index, call_id), tool_call_arguments_delta(call.arguments, index)]


def reply_finish_reason(parsed: ParsedRequest, final: TokenChunk, num_tool_calls: int) -> str | None:
    """``tool_calls`` for a reply that stopped by itself after making calls (OpenAI's), else the engine's."""
    if num_tool_calls and final.finish_reason == "stop":
        return "function_call" if parsed.legacy_functions else "tool_calls"
    return final.finish_reason


def completion_body(
    parsed: ParsedRequest, response_id: str, created: int, text: str, final: TokenChunk,
    logprobs: list[TokenLogprob] | None = None, new_call_id: Callable[[], str] | None = None,
    reasoning: str = "",
) -> dict[str, Any]:
    """The JSON answer. With tools (:attr:`ParsedRequest.parses_tool_calls`) the text's ``<tool_call>``
    blocks become ``message.tool_calls`` (ids from ``new_call_id``) and the rest the content."""
    body: dict[str, Any]
    if parsed.endpoint == "chat.completions" and parsed.parses_tool_calls and new_call_id is not None:
        content, calls = parse_tool_calls(text, parallel_tool_calls=parsed.generate.parallel_tool_calls,
                                          tool_format=parsed.tool_format)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls and parsed.legacy_functions:  # one call (parallel_tool_calls is off for the legacy form)
            message["function_call"] = {"name": calls[0].name, "arguments": calls[0].arguments}
        elif calls:
            message["tool_calls"] = [tool_call_body(c, new_call_id()) for c in calls]
        body = {
            "id": response_id, "object": "chat.completion", "created": created, "model": parsed.model,
            "choices": [{"index": 0, "message": message, "logprobs": logprobs_body(parsed, logprobs),
                         "finish_reason": reply_finish_reason(parsed, final, len(calls))}],
        }
    elif parsed.endpoint == "chat.completions":
        body = {
            "id": response_id,
            "object": "chat.completion",
            "created": created,
            "model": parsed.model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": logprobs_body(parsed, logprobs),
                    "finish_reason": final.finish_reason,
                }
            ],
        }
    else:
        body = {
            "id": response_id,
            "object": "text_completion",
            "created": created,
            "model": parsed.model,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs_body(parsed, logprobs),
                         "finish_reason": final.finish_reason}],
        }
    if reasoning and parsed.endpoint == "chat.completions":
        # vLLM's two names: reasoning_content (DeepSeek's, what most clients read) and reasoning (vLLM >= 0.11)
        body["choices"][0]["message"].update(reasoning_content=reasoning, reasoning=reasoning)
    body["usage"] = usage_body(final.usage)
    if final.timings is not None:
        body["timings"] = timings_body(final.timings)
    return body


def timings_body(t: Timings) -> dict[str, Any]:
    """llama.cpp-style timings (milliseconds) as clients of llama.cpp and NInfer read them: llama.cpp's fields
    (server's ``result_timings``), ``ttft`` (ms) and ``ttft_s`` (seconds: what the Go gateway reads)."""
    return {
        "prompt_n": t.prompt_n, "cache_n": t.cache_n, "predicted_n": t.predicted_n,
        "prompt_ms": t.prompt_ms, "predicted_ms": t.predicted_ms, "ttft": t.ttft_ms,
        "ttft_s": t.ttft_ms / 1000.0 if t.ttft_ms is not None else None,
        "prompt_per_token_ms": t.prompt_ms / t.prompt_n if t.prompt_n > 0 else None,
        "prompt_per_second": t.prompt_n / t.prompt_ms * 1000.0 if t.prompt_ms > 0 else None,
        "predicted_per_token_ms": t.predicted_ms / t.predicted_n if t.predicted_n > 0 else None,
        "predicted_per_second": t.predicted_n / t.predicted_ms * 1000.0 if t.predicted_ms > 0 else None,
        "draft_n": t.draft_n, "draft_n_accepted": t.draft_n_accepted,  # speculative decoding (0: none)
    }


def stream_chunk(
    parsed: ParsedRequest,
    response_id: str,
    created: int,
    *,
    text: str | None = None,
    role: bool = False,
    finish_reason: str | None = None,
    logprobs: dict[str, Any] | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
    reasoning: str | None = None,
    index: int = 0,
) -> dict[str, Any]:
    """One SSE chunk of choice ``index``; ``logprobs`` is a :func:`logprobs_body` for the tokens of this chunk's
    text; ``tool_calls`` are :func:`tool_call_deltas`; ``reasoning`` a piece of the <think> block."""
    if parsed.endpoint == "chat.completions":
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if reasoning is not None:
            delta["reasoning_content"] = delta["reasoning"] = reasoning
        if text is not None:
            delta["content"] = text
        if tool_calls is not None and parsed.legacy_functions:  # {"name", "arguments": ""}, then {"arguments"}
            delta["function_call"] = tool_calls[0]["function"]
        elif tool_calls is not None:
            delta["tool_calls"] = tool_calls
        choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "text_completion"
    return {"id": response_id, "object": obj, "created": created, "model": parsed.model, "choices": [choice]}


def usage_chunk(parsed: ParsedRequest, response_id: str, created: int, usage: Usage | None) -> dict[str, Any]:
    obj = "chat.completion.chunk" if parsed.endpoint == "chat.completions" else "text_completion"
    return {
        "id": response_id, "object": obj, "created": created, "model": parsed.model,
        "choices": [], "usage": usage_body(usage),
    }
