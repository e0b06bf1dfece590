"""Write a stream of TokenChunks as an OpenAI response: one JSON body, or SSE.

Shared by the gateway (chunks arrive over the bus) and the engine's own HTTP face (chunks come from the
local engine), so both speak exactly the same OpenAI dialect.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
from aiohttp import web

from proto import TokenChunk, TokenLogprob, Usage
from services.common import openai_api, responses_stream
from services.common.http import HTTPError
from services.common.tool_calls import ArgumentsPiece, CallStart, ParsedCall, new_parser

_json = msgspec.json.Encoder()

# Called once with the final chunk and the time to the first text (ms), before the response ends.
OnFinal = Callable[[TokenChunk, float | None], None]
# Called when the stream fails after its headers were sent (the client gets an SSE error event).
OnError = Callable[[HTTPError], None]


def chunk_error(chunk: TokenChunk) -> HTTPError:
    err = chunk.error
    assert err is not None
    return HTTPError(err.status, err.message, code=err.code, param=err.param, type=err.type,
                     retry_after_s=err.retry_after_s)


def new_call_id() -> str:
    """A tool call's id: ``call_`` and 24 random hex digits (OpenAI's ids have that shape)."""
    return f"call_{uuid.uuid4().hex[:24]}"


def response_id(parsed: openai_api.ParsedRequest, request_id: str) -> str:
    prefix = "chatcmpl" if parsed.endpoint == "chat.completions" else "cmpl"
    return f"{prefix}-{request_id.removeprefix('req-')}"


async def respond(request: web.Request, parsed: openai_api.ParsedRequest, request_id: str,
                  chunks: AsyncIterator[TokenChunk], on_final: OnFinal, on_error: OnError) -> web.StreamResponse:
    if parsed.endpoint == "responses":  # the Responses API's objects and events (responses_stream.py)
        return await responses_stream.respond(request, parsed, request_id, chunks, on_final, on_error)
    if parsed.stream:
        return await _stream(request, parsed, request_id, chunks, on_final, on_error)
    return await _collect(parsed, request_id, chunks, on_final)


def _combined_final(finals: dict[int, TokenChunk]) -> TokenChunk:
    """One final chunk for ``n`` choices: the first choice's, its usage summed over the choices' output
    (the prompt counted once: the choices share it)."""
    first = finals[0]
    if len(finals) == 1 or first.usage is None:
        return first
    usages = [first.usage] + [c.usage for i, c in sorted(finals.items()) if i and c.usage is not None]
    return msgspec.structs.replace(first, usage=openai_api.combined_usage(usages))


async def _collect(parsed: openai_api.ParsedRequest, request_id: str, chunks: AsyncIterator[TokenChunk],
                   on_final: OnFinal) -> web.Response:
    started = time.monotonic()
    parts: dict[int, list[str]] = {i: [] for i in range(parsed.n)}
    reasoning: dict[int, list[str]] = {i: [] for i in range(parsed.n)}
    logprobs: dict[int, list[TokenLogprob] | None] = {
        i: None if parsed.generate.logprobs is None else [] for i in range(parsed.n)}
    finals: dict[int, TokenChunk] = {}
    ttft_ms: float | None = None
    async for chunk in chunks:
        i = chunk.choice
        if (chunk.text or chunk.reasoning) and ttft_ms is None:
            ttft_ms = (time.monotonic() - started) * 1000.0
        parts[i].append(chunk.text)
        reasoning[i].append(chunk.reasoning)
        if (lps := logprobs[i]) is not None and chunk.logprobs:
            lps += chunk.logprobs
        if chunk.error is not None:
            on_final(chunk, ttft_ms)
            raise chunk_error(chunk)
        if chunk.is_final:
            finals[i] = chunk
            if len(finals) < parsed.n:
                continue
            final = _combined_final(finals)
            on_final(final, ttft_ms)
            rid, created = response_id(parsed, request_id), int(time.time())
            body: dict[str, Any] = {}
            for j in range(parsed.n):
                one = openai_api.completion_body(
                    parsed, rid, created, "".join(parts[j]), finals[j], logprobs[j],
                    new_call_id=new_call_id, reasoning="".join(reasoning[j]),
                )
                one["choices"][0]["index"] = j
                if j == 0:
                    body = one
                else:
                    body["choices"] += one["choices"]
            body["usage"] = openai_api.usage_body(final.usage)
            return web.Response(body=_json.encode(body), content_type="application/json",
                                headers={"X-Request-Id": request_id})
    raise HTTPError(503, "the engine ended the reply without a final chunk", code="upstream_gap")


def _error_event(err: HTTPError) -> dict[str, Any]:
    return {"error": {"message": err.message, "type": err.type, "code": err.code, "param": err.param}}


async def _stream(request: web.Request, parsed: openai_api.ParsedRequest, request_id: str,
                  chunks: AsyncIterator[TokenChunk], on_final: OnFinal, on_error: OnError) -> web.StreamResponse:
    started = time.monotonic()
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Request-Id": request_id})
    await response.prepare(request)
    rid, created = response_id(parsed, request_id), int(time.time())

    def event(obj: Any) -> bytes:
        return b"data: " + _json.encode(obj) + b"\n\n"

    ttft_ms: float | None = None
    # per choice (n > 1: chunks carry their choice): legacy completions' logprobs count character offsets
    # across the whole completion; with tools the text goes through the <tool_call> parser
    text_offset = dict.fromkeys(range(parsed.n), 0)
    parsers = {i: new_parser(parsed.tool_format, parallel_tool_calls=parsed.generate.parallel_tool_calls,
                             incremental=True) for i in range(parsed.n)} if parsed.parses_tool_calls else {}
    num_calls = dict.fromkeys(range(parsed.n), 0)
    finals: dict[int, TokenChunk] = {}
    # the usage so far, for stream_options.continuous_usage_stats: the prompt as the acceptance chunk says
    prompt_tokens, cached_tokens, output_tokens = 0, 0, 0
    reasoning_tokens = dict.fromkeys(range(parsed.n), 0)  # each choice's, so far (the chunks restate theirs)

    def running_usage() -> dict[str, Any] | None:
        return openai_api.usage_body(Usage(prompt_tokens=prompt_tokens, completion_tokens=output_tokens,
                                           cached_tokens=cached_tokens,
                                           reasoning_tokens=sum(reasoning_tokens.values())))

    # The last events (the final chunk's text, finish, usage, [DONE]) go out in one write with the end of
    # the chunked body: one system call instead of four or five.
    tail: list[bytes] = []
    roles_sent = parsed.endpoint != "chat.completions"  # chat opens each choice with an assistant role delta
    try:
        async for chunk in chunks:
            i = chunk.choice
            if not roles_sent:  # after the acceptance (chunk 0), whose prompt count a running usage states
                roles_sent = True
                if chunk.usage is not None and not chunk.is_final:
                    prompt_tokens, cached_tokens = chunk.usage.prompt_tokens, chunk.usage.cached_tokens
                for j in range(parsed.n):
                    opening = openai_api.stream_chunk(parsed, rid, created, role=True, text="", index=j)
                    if parsed.continuous_usage:
                        opening["usage"] = running_usage()
                    await response.write(event(opening))
            is_last = chunk.error is not None or (chunk.is_final and len(finals) + 1 >= parsed.n)
            pending: list[bytes] = []  # this chunk's events: they join the tail when it is the reply's last

            if chunk.usage is not None and not chunk.is_final:
                prompt_tokens, cached_tokens = chunk.usage.prompt_tokens, chunk.usage.cached_tokens
            output_tokens += len(chunk.token_ids)
            if chunk.index > 0:  # (the acceptance has none)
                reasoning_tokens[i] = chunk.usage.reasoning_tokens if chunk.is_final and chunk.usage else \
                    chunk.reasoning_tokens
            logprobs = openai_api.logprobs_body(parsed, chunk.logprobs, text_offset[i]) if chunk.logprobs else None
            text = chunk.text
            if chunk.reasoning and parsed.endpoint == "chat.completions":  # the <think> block, before the answer
                if ttft_ms is None:
                    ttft_ms = (time.monotonic() - started) * 1000.0
                body = openai_api.stream_chunk(parsed, rid, created, reasoning=chunk.reasoning, index=i)
                if parsed.continuous_usage:
                    body["usage"] = running_usage()
                await response.write(event(body))
            parser = parsers.get(i)
            if parser is not None:
                text = ""
                for piece in parser.push(chunk.text) + (parser.finish() if chunk.is_final else []):
                    if isinstance(piece, str):
                        text += piece
                        continue
                    if ttft_ms is None:
                        ttft_ms = (time.monotonic() - started) * 1000.0
                    if text:  # content before the call goes out first, in order
                        await response.write(event(openai_api.stream_chunk(parsed, rid, created, text=text,
                                                                           index=i)))
                        text = ""
                    if isinstance(piece, ParsedCall):
                        deltas = openai_api.tool_call_deltas(piece, num_calls[i], new_call_id())
                    elif isinstance(piece, CallStart):
                        deltas = [openai_api.tool_call_start_delta(piece.name, num_calls[i], new_call_id())]
                    else:
                        deltas = [openai_api.tool_call_arguments_delta(piece.text, num_calls[i] - 1)]
                    for delta in deltas:
                        await response.write(event(openai_api.stream_chunk(parsed, rid, created,
                                                                           tool_calls=[delta], index=i)))
                    if not isinstance(piece, ArgumentsPiece):
                        num_calls[i] += 1
            if text or logprobs is not None:  # a token without text yet (part of a character) has logprobs
                if ttft_ms is None and text:
                    ttft_ms = (time.monotonic() - started) * 1000.0
                body = openai_api.stream_chunk(parsed, rid, created, text=text, logprobs=logprobs, index=i)
                if parsed.continuous_usage:
                    body["usage"] = running_usage()
                pending.append(event(body))
                text_offset[i] += sum(len(e.token) for e in chunk.logprobs or ())
            if chunk.error is not None:
                on_final(chunk, ttft_ms)
                pending.append(event(_error_event(chunk_error(chunk))))
            elif chunk.is_final:
                finals[i] = chunk
                final = openai_api.stream_chunk(parsed, rid, created, finish_reason=openai_api.reply_finish_reason(
                    parsed, chunk, num_calls[i]), index=i)
                if chunk.timings is not None:
                    final["timings"] = openai_api.timings_body(chunk.timings)
                if parsed.continuous_usage:
                    final["usage"] = running_usage()
                pending.append(event(final))
                if is_last:
                    combined = _combined_final(finals)
                    on_final(combined, ttft_ms)
                    if parsed.include_usage:
                        pending.append(event(openai_api.usage_chunk(parsed, rid, created, combined.usage)))
            if is_last:
                tail += pending  # (the iterator still runs to its end: its owner's cleanup is in there)
                continue
            for data in pending:
                await response.write(data)
    except HTTPError as err:
        # The status line is gone already: end the stream with an error event instead.
        on_error(err)
        tail.append(event(_error_event(err)))
    await response.write_eof(b"".join(tail) + b"data: [DONE]\n\n")
    return response
