"""The one request/response translation both faces share: prompts to tokens, wire to sampling params,
engine errors to error fields, engine outputs to TokenChunks.

The HTTP face (``http.py``) parses the OpenAI dialect into a ``GenerateRequest`` and the bus face
(``worker.py``) decodes one; from there both go through :func:`prepare_request`, and every output goes
back as :func:`output_chunk` (errors as :func:`error_info`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from proto import ChatMessage, ErrorInfo, GenerateRequest, Timings, TokenChunk, TokenLogprob, Tool, TopLogprob, Usage
from services.common.tool_calls import HERMES, LLAMA3_JSON
from services.engine.core.sampling_params import SamplingParams, StructuredOutput, ThinkingParams
from services.engine.errors import (
    ContextLengthExceededError,
    CoreLostError,
    DeadlineExceededError,
    EngineError,
    InvalidParameterError,
    QueueFullError,
    UnsupportedParameterError,
)
from services.engine.model.tokenizer import Tokenizer
from services.engine.model.tool_prompt import tool_call_schema
from services.engine.outputs import RequestOutput
from services.engine.serve.reasoning import ReasoningSplitter

if TYPE_CHECKING:
    from services.engine.config import EngineConfig
    from services.engine.model.sampler import TokenLogprobs


class PromptEncoder(Protocol):
    """What the HTTP and bus faces need of an engine to turn a request into prompt tokens.

    The :class:`~services.engine.engine_core.EngineCore` is one; so is the API side of an engine whose core
    runs in another process (:class:`services.engine.serve.process_engine.ProcessEngine`), which loads the
    tokenizer but not the model.
    """

    config: EngineConfig
    tokenizer: Tokenizer
    model_id: str
    max_context: int


def render_chat(core: PromptEncoder, messages: Sequence[dict[str, Any]],
                tools: Sequence[dict[str, Any]] | None = None, template_kwargs: dict[str, Any] | None = None) -> str:
    return core.tokenizer.apply_chat_template(
        list(messages), add_generation_prompt=True, preserve_thinking=core.config.preserve_thinking, tools=tools,
        **(template_kwargs or {}),
    )


# OpenAI's reasoning_effort values; "none" renders without thinking, "minimal" closes the block at once
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")
# what the chat template may not be given through chat_template_kwargs (the engine sets them)
_RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "add_generation_prompt"})


def thinking_tags(tokenizer: Tokenizer) -> tuple[int, int] | None:
    """``(<think> id, </think> id)`` for a thinking model: its chat template writes or switches thinking
    (``<think>`` or ``enable_thinking`` in it) and both tags are single tokens; None otherwise."""
    source = tokenizer.chat_template_source or ""
    if "<think>" not in source and "enable_thinking" not in source:
        return None
    start, end = tokenizer.token_to_id("<think>"), tokenizer.token_to_id("</think>")
    return None if start is None or end is None else (start, end)


def template_kwargs(core: PromptEncoder, req: GenerateRequest) -> dict[str, Any]:
    """The chat template's variables: the client's ``chat_template_kwargs`` and ``enable_thinking`` (the
    client's, else off for ``reasoning_effort: none`` or ``--no-thinking``, else on)."""
    kwargs = dict(req.chat_template_kwargs)
    for name in kwargs:
        if name in _RESERVED_TEMPLATE_KWARGS:
            raise InvalidParameterError(f"chat_template_kwargs.{name}", name,
                                        "is set by the engine from the request, not a template variable")
    effort = req.reasoning_effort or core.config.reasoning_effort
    kwargs.setdefault("enable_thinking", core.config.enable_thinking and effort != "none")
    return kwargs


def thinking_params(core: PromptEncoder, req: GenerateRequest, prompt: str, enable_thinking: bool
                    ) -> ThinkingParams | None:
    """How the core follows the reply's <think> block (None: not a thinking model, or thinking is off and
    the prompt did not open a block anyway). The budget is the effort's (``reasoning_budget_tokens``)."""
    tags = thinking_tags(core.tokenizer)
    if tags is None:
        return None
    starts_inside = prompt.rfind("<think>") > prompt.rfind("</think>")
    if not enable_thinking and not starts_inside:
        return None
    effort = req.reasoning_effort or core.config.reasoning_effort
    budgets = dict(zip(("low", "medium", "high"), core.config.reasoning_budget_tokens, strict=True))
    budget = 0 if effort == "minimal" else budgets.get(effort or "")
    end_ids = tuple(core.tokenizer.encode("</think>\n\n", add_special_tokens=False))
    if not end_ids or end_ids[0] != tags[1]:
        end_ids = (tags[1],)
    return ThinkingParams(start_id=tags[0], end_id=tags[1], starts_inside=starts_inside, budget_tokens=budget,
                          end_ids=end_ids)


def _json_or_text(text: str) -> Any:
    """A call's arguments as templates expect them: an object (vLLM parses them too), the text if not JSON."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def template_message(m: ChatMessage) -> dict[str, Any]:
    """One wire message as a chat template reads it (OpenAI's shape; a call's arguments as an object)."""
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.reasoning:
        out["reasoning_content"] = m.reasoning  # the name chat templates (Qwen3's) read
    if m.name is not None:
        out["name"] = m.name
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.name, "arguments": _json_or_text(c.arguments)}}
                             for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def template_tool(t: Tool) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": t.name}
    if t.description is not None:
        fn["description"] = t.description
    fn["parameters"] = json.loads(t.parameters)
    return {"type": "function", "function": fn}


def tool_structured_output(req: GenerateRequest, tool_format: str = HERMES) -> StructuredOutput | None:
    """The grammar a ``required`` or named ``tool_choice`` imposes (None for auto / none): the reply is
    ``<tool_call>`` blocks whose JSON names one of the tools (the named one) with arguments matching its
    ``parameters`` (one block, or one or more with ``parallel_tool_calls``; a named choice is one call)."""
    if not req.tools or req.tool_choice not in ("required", "function"):
        return None
    tools = [t for t in req.tools if req.tool_choice == "required" or t.name == req.tool_choice_name]
    parallel = req.parallel_tool_calls and req.tool_choice == "required"
    if tool_format == LLAMA3_JSON:  # the reply is the call JSON itself, {"name": ..., "parameters": ...}
        return StructuredOutput(kind="json_tool_calls" if parallel else "json_tool_call", strict=True,
                                spec=tool_call_schema([(t.name, t.parameters) for t in tools], "parameters"))
    return StructuredOutput(kind="tool_calls" if parallel else "tool_call",
                            spec=tool_call_schema([(t.name, t.parameters) for t in tools]), strict=True)


def encode_prompt(core: PromptEncoder, prompt: str) -> list[int]:
    return core.tokenizer.encode(prompt)


def error_info(exc: BaseException) -> ErrorInfo:
    """The OpenAI error fields for an engine exception (the gateway turns them into the HTTP answer)."""
    if isinstance(exc, QueueFullError):
        return ErrorInfo(message=exc.message, type="rate_limit_error", code="queue_full", status=429,
                         retry_after_s=exc.retry_after_s)
    if isinstance(exc, ContextLengthExceededError):
        return ErrorInfo(message=exc.message, type="invalid_request_error", code="context_length_exceeded",
                         param="messages", status=400)
    if isinstance(exc, InvalidParameterError):
        return ErrorInfo(message=exc.message, type="invalid_request_error", code="invalid_parameter",
                         param=exc.field, status=400)
    if isinstance(exc, UnsupportedParameterError):
        return ErrorInfo(message=exc.message, type="invalid_request_error", code="unsupported_parameter",
                         param=exc.field, status=400)
    if isinstance(exc, DeadlineExceededError):
        return ErrorInfo(message=exc.message, type="timeout_error", code="deadline_exceeded", status=504)
    if isinstance(exc, CoreLostError):
        return ErrorInfo(message=f"{exc.message}; the engine is restarting", type="service_unavailable",
                         code="engine_unavailable", status=503, retry_after_s=5)
    if isinstance(exc, EngineError):
        return ErrorInfo(message=exc.message, type="invalid_request_error", status=400)
    return ErrorInfo(message="internal engine error", type="server_error", status=500)


def sampling_params(req: GenerateRequest, max_context: int, num_prompt_tokens: int,
                    thinking: ThinkingParams | None = None, tool_format: str = HERMES) -> SamplingParams:
    max_tokens = req.max_tokens if req.max_tokens is not None else max(1, max_context - num_prompt_tokens)
    return SamplingParams(
        max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, seed=req.seed,
        stop=tuple(req.stop), stop_token_ids=tuple(req.stop_token_ids), ignore_eos=req.ignore_eos,
        logprobs=req.logprobs, presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty, min_tokens=req.min_tokens,
        # a forced tool call's grammar wins over response_format (that shapes a text answer, and there is none)
        structured=tool_structured_output(req, tool_format) or (
            None if (c := req.constraint) is None
            else StructuredOutput(kind=c.kind, spec=c.spec, strict=c.strict, choices=tuple(c.choices))),
        min_p=req.min_p, logit_bias=tuple(sorted(req.logit_bias.items())), thinking=thinking,
    )


def prepare_request(core: PromptEncoder, req: GenerateRequest) -> tuple[list[int], SamplingParams]:
    """Prompt token ids (chat template applied) and sampling params; raises the engine's typed errors."""
    if req.reasoning_effort is not None and req.reasoning_effort not in REASONING_EFFORTS:
        raise InvalidParameterError("reasoning_effort", req.reasoning_effort,
                                    f"must be one of {', '.join(REASONING_EFFORTS)}")
    thinking = None
    if req.messages is not None:
        kwargs = template_kwargs(core, req)
        text = render_chat(core, [template_message(m) for m in req.messages],
                           [template_tool(t) for t in req.tools] or None, kwargs)
        prompt_ids = core.tokenizer.encode(text, add_special_tokens=False)
        thinking = thinking_params(core, req, text, kwargs["enable_thinking"] is not False)
    else:
        prompt_ids = encode_prompt(core, req.prompt or "")
    return prompt_ids, sampling_params(req, core.max_context, len(prompt_ids), thinking,
                                       core.tokenizer.tool_call_format)


def reasoning_splitter(params: SamplingParams) -> ReasoningSplitter | None:
    """The reply's reasoning/content splitter (None: no thinking to split out)."""
    return None if params.thinking is None else ReasoningSplitter(starts_inside=params.thinking.starts_inside)


def render_logprobs(tokenizer: Tokenizer, logprobs: Sequence[TokenLogprobs]) -> list[TokenLogprob]:
    """Token ids to what clients read: each token's text (lossy for part of a UTF-8 character: the bytes
    are exact) and log-probability, and the same for the position's most likely tokens."""
    def top(token_id: int, logprob: float) -> TopLogprob:
        raw = tokenizer.token_bytes(token_id)
        return TopLogprob(token=raw.decode("utf-8", errors="replace"), logprob=logprob, bytes=list(raw))

    out = []
    for lp in logprobs:
        chosen = top(lp.token_id, lp.logprob)
        out.append(TokenLogprob(token=chosen.token, logprob=chosen.logprob, bytes=chosen.bytes,
                                top_logprobs=[top(t, v) for t, v in lp.top]))
    return out


def output_chunk(tokenizer: Tokenizer, request_id: str, index: int, output: RequestOutput, worker_id: str,
                 splitter: ReasoningSplitter | None = None) -> TokenChunk:
    """One engine output as a TokenChunk; the final one carries usage and llama.cpp-style timings. With a
    ``splitter`` (a thinking model's reply) the <think> block's text goes in ``reasoning``."""
    logprobs = None if output.logprobs is None else render_logprobs(tokenizer, output.logprobs)
    text, reasoning = output.text, ""
    if splitter is not None:
        reasoning, text = splitter.push(output.text)
        if output.finished:
            more_reasoning, more_text = splitter.finish()
            reasoning, text = reasoning + more_reasoning, text + more_text
    if not output.finished:
        return TokenChunk(request_id=request_id, index=index, text=text, token_ids=list(output.token_ids),
                          logprobs=logprobs, reasoning=reasoning, reasoning_tokens=output.num_reasoning_tokens)
    t = output.timings
    return TokenChunk(
        request_id=request_id, index=index, text=text, reasoning=reasoning, token_ids=list(output.token_ids),
        logprobs=logprobs,
        finish_reason=output.finish_reason,  # type: ignore[arg-type]  # the core's str is a FinishReason
        usage=Usage(prompt_tokens=output.num_prompt_tokens, completion_tokens=output.num_output_tokens,
                    cached_tokens=output.num_cached_tokens, reasoning_tokens=output.num_reasoning_tokens),
        timings=Timings(
            prompt_n=output.num_prompt_tokens - output.num_cached_tokens, cache_n=output.num_cached_tokens,
            predicted_n=output.num_output_tokens, prompt_ms=t.prompt_ms if t else 0.0,
            predicted_ms=t.predicted_ms if t else 0.0, queue_ms=t.queue_ms if t else 0.0,
            ttft_ms=t.ttft_ms if t else None, draft_n=output.num_draft_tokens,
            draft_n_accepted=output.num_accepted_draft_tokens,
        ),
        worker_id=worker_id, reasoning_tokens=output.num_reasoning_tokens,
    )
