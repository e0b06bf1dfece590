"""The gateway ↔ engine link: GenerateRequest out, TokenChunk back (usage, timings, logprobs, errors), Cancel.

Conventions (see docs/architecture.md):
- every message that a process emits repeatedly carries its origin id (``worker_id`` or
  ``gateway_id``), a process ``session_id`` (new at every start) and a monotonic ``seq`` so consumers
  can drop duplicates and see gaps;
- timestamps are UTC, float seconds since the Unix epoch (``*_s``); durations are ``*_ms``;
- a value the producer could not measure is ``None`` ("unavailable"), never a made-up 0.
"""

from __future__ import annotations

from typing import Any, Literal

from proto.base import Message

PROTOCOL_VERSION = 1

FinishReason = Literal["stop", "length", "abort", "error"]



class ToolCall(Message, frozen=True):
    """A function call an assistant turn made (OpenAI's ``tool_calls[i]``); ``arguments`` is JSON text."""

    id: str
    name: str
    arguments: str = "{}"


class ChatMessage(Message, frozen=True):
    role: str
    content: str = ""
    name: str | None = None
    # appended for issue #26 (tool calling): an assistant turn's calls, and the call a ``tool`` turn answers
    tool_calls: list[ToolCall] = []
    tool_call_id: str | None = None
    # appended for issue #26 (reasoning): an assistant turn's reasoning as a client sends it back
    # (``reasoning_content`` or ``reasoning``); rendered into the prompt only with --preserve-thinking or
    # after the last user turn
    reasoning: str | None = None


class Tool(Message, frozen=True):
    """A function the model may call (OpenAI's ``tools[i].function``); ``parameters`` is a JSON schema as
    JSON text (``{"type": "object", "properties": {}}`` when the client gave none)."""

    name: str
    description: str | None = None
    parameters: str = '{"type": "object", "properties": {}}'
    strict: bool = False


# "function": the call must be to ``GenerateRequest.tool_choice_name``
ToolChoiceMode = Literal["none", "auto", "required", "function"]


ConstraintKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]


class Constraint(Message, frozen=True):
    """Structured output (constrained decoding): what the reply's text must match.

    ``json_schema``: ``spec`` is the schema as JSON text, ``strict`` OpenAI's flag (no properties beyond
    the schema's); ``json_object``: any JSON object (``spec`` empty); ``regex``: ``spec`` is the pattern;
    ``choice``: ``choices`` lists the allowed replies; ``grammar``: ``spec`` is an EBNF (GBNF) grammar.
    """

    kind: ConstraintKind
    spec: str = ""
    strict: bool = False
    choices: list[str] = []


class GenerateRequest(Message, frozen=True):
    """gateway → engine on ``llm.v1.gen.<worker_id>``; replies stream to the message's reply inbox.

    Exactly one of ``messages`` (chat) and ``prompt`` (completion) is set. ``max_tokens`` None means
    "up to the context limit". ``deadline_s`` is the absolute UTC time after which the gateway has
    given up; the engine may abort work past it.
    """

    request_id: str
    model: str
    messages: list[ChatMessage] | None = None
    prompt: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None
    gateway_id: str = ""
    api_key_id: str | None = None
    deadline_s: float | None = None
    protocol: int = PROTOCOL_VERSION
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    # appended for issue #26 (optional: an older gateway or engine neither sends nor reads them)
    constraint: Constraint | None = None
    min_p: float = 0.0
    logit_bias: dict[int, float] = {}
    # tool calling (issue #26): the functions offered, whether/which one must be called, and whether a
    # reply may hold several calls. tool_choice "none" with tools: they are rendered, never parsed.
    tools: list[Tool] = []
    tool_choice: ToolChoiceMode = "auto"
    tool_choice_name: str | None = None
    parallel_tool_calls: bool = True
    # reasoning (issue #26): OpenAI's ``reasoning_effort`` (none | low | medium | high; None: the engine's
    # default) and vLLM's ``chat_template_kwargs`` (template variables such as ``enable_thinking``, as the
    # client sent them: JSON values the engine passes to the chat template)
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] = {}
    # n > 1, echo and suffix (issue #26): ``n`` choices share the prompt's prefill, choice i sampled with
    # ``seed + i``; ``echo`` (completions): each choice's text starts with the prompt; ``suffix``
    # (completions): the text after the hole, served as fill-in-the-middle (a 400 without FIM tokens). An
    # engine that serves them says ``num_choices == n`` in its acceptance chunk.
    n: int = 1
    echo: bool = False
    suffix: str | None = None


class Usage(Message, frozen=True):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    # appended for issue #26: output tokens spent inside the reply's <think> block (tags included)
    reasoning_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class Timings(Message, frozen=True):
    """llama.cpp-style timings on the final chunk (milliseconds)."""

    prompt_n: int = 0
    cache_n: int = 0
    predicted_n: int = 0
    prompt_ms: float = 0.0
    predicted_ms: float = 0.0
    queue_ms: float = 0.0
    ttft_ms: float | None = None
    # Speculative decoding (llama.cpp's names): draft tokens proposed for this request, and how many of
    # them the target model accepted. 0 when the engine does not speculate.
    draft_n: int = 0
    draft_n_accepted: int = 0


class ErrorInfo(Message, frozen=True):
    """The OpenAI error fields, carried on the bus so the gateway can answer with the right status."""

    message: str
    type: str = "server_error"
    code: str | None = None
    param: str | None = None
    status: int = 500
    retry_after_s: float | None = None


class TopLogprob(Message, frozen=True):
    """One of a position's most likely tokens: its text, log-probability and UTF-8 bytes (a byte-level
    token may be part of a character, so its text alone can be lossy)."""

    token: str
    logprob: float
    bytes: list[int] = []


class TokenLogprob(Message, frozen=True):
    """The chosen token at one output position, with the position's most likely tokens, best first."""

    token: str
    logprob: float
    bytes: list[int] = []
    top_logprobs: list[TopLogprob] = []


class TokenChunk(Message, frozen=True):
    """engine → gateway on the request's reply inbox, in order (``index`` counts from 0).

    The final chunk has ``finish_reason`` set and carries ``usage`` and ``timings``; an error ends the
    stream with ``error`` set (and ``finish_reason="error"``). With n > 1 each choice (``choice``) ends with
    its own final chunk and the reply is over once the acceptance's ``num_choices`` finals have come.
    """

    request_id: str
    index: int
    text: str = ""
    token_ids: list[int] = []
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    timings: Timings | None = None
    error: ErrorInfo | None = None
    worker_id: str = ""
    # One per entry of ``token_ids`` when the request asked for logprobs (GenerateRequest.logprobs).
    logprobs: list[TokenLogprob] | None = None
    # appended for issue #26 (reasoning): the new text of the reply's <think> block (tags removed); ``text``
    # is then the answer's text only. Empty for a model without thinking.
    reasoning: str = ""
    # appended for issue #26 (n > 1): which of the request's choices this chunk belongs to (``index`` still
    # counts the chunks of the whole reply)
    choice: int = 0
    # appended for issue #26: on the acceptance (chunk 0), how many choices the engine will send (each ends
    # with its own final chunk); None from an engine before n > 1, echo and suffix (it serves one choice and
    # reads past those fields). On other chunks: None.
    num_choices: int | None = None
    # appended for issue #26: this choice's output tokens inside its <think> block so far (tags included),
    # on every chunk of a thinking reply (``continuous_usage_stats`` reports it); the final usage restates it
    reasoning_tokens: int = 0

    @property
    def is_final(self) -> bool:
        return self.finish_reason is not None or self.error is not None


class Cancel(Message, frozen=True):
    """gateway → engine on ``llm.v1.cancel.<worker_id>``: stop generating ``request_id`` (the client left)."""

    request_id: str


class EmbedRequest(Message, frozen=True):
    """gateway → engine on ``llm.v1.embed.<worker_id>`` (request/reply): one :class:`EmbedReply` answers it.

    The inputs are either ``texts`` (tokenized by the engine, no chat template) or ``token_ids`` (one
    list per input), never both; the OpenAI body's four input forms map onto these two. ``dimensions``
    is the client's ask (None: the model's hidden size); an engine that cannot truncate refuses it.
    """

    request_id: str
    model: str
    texts: list[str] = []
    token_ids: list[list[int]] = []
    dimensions: int | None = None
    gateway_id: str = ""
    api_key_id: str | None = None
    deadline_s: float | None = None
    protocol: int = PROTOCOL_VERSION


class EmbedReply(Message, frozen=True):
    """engine → gateway, the answer to one :class:`EmbedRequest`: either ``error`` or one vector per input.

    Each vector is L2-normalised little-endian float32 bytes (``hidden_size * 4`` bytes): compact on the
    bus, and exactly what the OpenAI ``encoding_format: base64`` form encodes. ``usage.prompt_tokens``
    counts every input's tokens; ``completion_tokens`` is 0.
    """

    request_id: str
    embeddings: list[bytes] = []
    usage: Usage | None = None
    error: ErrorInfo | None = None
    worker_id: str = ""
