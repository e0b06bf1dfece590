"""Write a stream of TokenChunks as a Responses API answer: one Response object, or its SSE events
(``event: <type>`` + ``data: <json>``, no ``[DONE]``: OpenAI's Responses stream ends with its terminal
event). The events come from :class:`services.common.openai_responses.ResponseBuilder`, fed the same
pieces as chat's tool-call parser gives, so the streamed and the whole answer hold the same items.

Shared by the gateway (bus members) and the engine's HTTP face, like :mod:`openai_stream`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
from aiohttp import web

from proto import TokenChunk
from services.common import openai_api
from services.common.http import HTTPError
from services.common.openai_responses import ResponseBuilder
from services.common.tool_calls import Piece, new_parser

_json = msgspec.json.Encoder()

OnFinal = Callable[[TokenChunk, float | None], None]
OnError = Callable[[HTTPError], None]


def new_item_id(prefix: str) -> str:
    """``msg_`` / ``fc_`` / ``call_`` + random hex (OpenAI's ids have that shape)."""
    return f"{prefix}_{uuid.uuid4().hex[:24] if prefix == 'call' else uuid.uuid4().hex}"


def _chunk_error(chunk: TokenChunk) -> HTTPError:
    err = chunk.error
    assert err is not None
    return HTTPError(err.status, err.message, code=err.code, param=err.param, type=err.type,
                     retry_after_s=err.retry_after_s)


class _Pieces:
    """A chunk's text as pieces: through the tool-call parser when the request offers tools, else as is.
    Whole answers use the non-incremental parser, as chat's whole answers do."""

    def __init__(self, parsed: openai_api.ParsedRequest, incremental: bool) -> None:
        g = parsed.generate
        self.parser = (new_parser(parsed.tool_format, parallel_tool_calls=g.parallel_tool_calls,
                                  incremental=incremental)
                       if parsed.parses_tool_calls else None)

    def of(self, chunk: TokenChunk) -> list[Piece]:
        if self.parser is None:
            return [chunk.text] if chunk.text else []
        return self.parser.push(chunk.text) + (self.parser.finish() if chunk.is_final else [])


async def respond(request: web.Request, parsed: openai_api.ParsedRequest, request_id: str,
                  chunks: AsyncIterator[TokenChunk], on_final: OnFinal, on_error: OnError) -> web.StreamResponse:
    started = time.monotonic()
    builder = ResponseBuilder(parsed, f"resp_{request_id.removeprefix('req-').replace('-', '')}", int(time.time()),
                              new_item_id)
    pieces = _Pieces(parsed, incremental=parsed.stream)
    ttft_ms: float | None = None
    if not parsed.stream:
        async for chunk in chunks:
            if (chunk.text or chunk.reasoning) and ttft_ms is None:
                ttft_ms = (time.monotonic() - started) * 1000.0
            builder.reasoning(chunk.reasoning)
            for piece in pieces.of(chunk):
                builder.piece(piece)
            if chunk.is_final:
                on_final(chunk, ttft_ms)
                if chunk.error is not None:
                    raise _chunk_error(chunk)
                builder.finish(chunk.finish_reason, chunk.usage)
                return web.Response(body=_json.encode(builder.response()), content_type="application/json",
                                    headers={"X-Request-Id": request_id})
        raise HTTPError(503, "the engine ended the reply without a final chunk", code="upstream_gap")

    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Request-Id": request_id})
    await response.prepare(request)

    def encode(events: list[dict[str, Any]]) -> bytes:
        return b"".join(b"event: " + e["type"].encode() + b"\ndata: " + _json.encode(e) + b"\n\n" for e in events)

    await response.write(encode(builder.start()))
    tail: list[dict[str, Any]] = []
    try:
        async for chunk in chunks:
            events: list[dict[str, Any]] = builder.reasoning(chunk.reasoning)
            for piece in pieces.of(chunk):
                events += builder.piece(piece)
            if events and ttft_ms is None:
                ttft_ms = (time.monotonic() - started) * 1000.0
            if chunk.is_final:
                on_final(chunk, ttft_ms)
                if chunk.error is not None:
                    tail = events + builder.fail(chunk.error)
                else:
                    tail = events + builder.finish(chunk.finish_reason, chunk.usage)
                break
            if events:
                await response.write(encode(events))
        else:
            err = HTTPError(503, "the engine ended the reply without a final chunk", code="upstream_gap")
            on_error(err)
            tail = builder.fail(None, err.message, err.code)
    except HTTPError as err:  # the status line is gone already: end with response.failed
        on_error(err)
        tail = builder.fail(None, err.message, err.code)
    await response.write_eof(encode(tail))
    return response
