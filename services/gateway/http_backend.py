"""Proxying to HTTP members (any OpenAI-compatible server): pooled connections, pass-through streaming.

Streams are passed through event by event with no buffering. The gateway always asks the upstream for
``stream_options.include_usage`` so it can account every request, and strips that usage chunk again
when the client did not ask for it. Failure before the first byte (connect error, 5xx, 408, no
response headers within the first-byte deadline) raises :class:`MemberUnavailable` so the caller can
fail over; so does a 401/403: the member refused the *gateway's* key (the member's ``api_key`` /
``api_key_env``), not the client's, which the gateway checked already — the client's ``Authorization``
is never forwarded, the member's own key is sent instead. Any other 4xx is the request's own fault and
is passed to the client as-is. A member that
dies mid-answer fails over too when nothing has reached the client yet (a non-streaming answer), and
ends the stream with an error event otherwise.

The connections are :mod:`services.gateway.upstream`'s (keep-alive HTTP/1.1, made for this one job).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web

from proto import Usage
from proto.pools import MemberConfig
from services.common.http import HTTPError, error_body
from services.common.runtime import raise_if_cancelling
from services.gateway.errors import CREDENTIALS_REJECTED, MemberUnavailable
from services.gateway.upstream import UpstreamClient, UpstreamError, UpstreamResponse, UpstreamTimeout
from services.gateway.usage_meter import UsageMeter

_json = msgspec.json.Encoder()
_MAX_HELD_LINE = 1 << 20  # bytes of an unfinished line held back while waiting for its end
_MAX_TOKENS = 2**31 - 1
_RETRYABLE = frozenset({408, 500, 502, 503, 504})
_CREDENTIALS_REJECTED = frozenset({401, 403})
ENDPOINT_PATHS = {"chat.completions": "/v1/chat/completions", "completions": "/v1/completions",
                  "embeddings": "/v1/embeddings"}


@dataclass
class UpstreamResult:
    """What the gateway needs for its usage record (the tokens are in the caller's :class:`UsageMeter`)."""

    finish_reason: str | None = None
    ttft_ms: float | None = None
    http_status: int = 200
    error: HTTPError | None = None  # the stream ended early with this error event


def _usage(obj: Any) -> Usage | None:
    if not isinstance(obj, dict):
        return None
    details = obj.get("prompt_tokens_details") or {}
    try:
        # bounded: a member's garbage must not make a record the ledger refuses (token counts < 2^31)
        def count(value: Any) -> int:
            return min(max(int(value or 0), 0), _MAX_TOKENS)
        return Usage(prompt_tokens=count(obj.get("prompt_tokens")),
                     completion_tokens=count(obj.get("completion_tokens")),
                     cached_tokens=count((details if isinstance(details, dict) else {}).get("cached_tokens")))
    except (TypeError, ValueError, OverflowError):
        return None


def _event_tokens(choice: dict[str, Any]) -> int:
    """Output tokens one SSE event carries, as the gateway can tell without the member's tokenizer: its
    logprobs entries when it has them (exact), else one for an event with text (exact for llama.cpp and
    for vLLM at its default stream interval; an engine that merges several tokens into one event is
    undercounted, which is why the member's own usage always wins)."""
    logprobs = choice.get("logprobs")
    if isinstance(logprobs, dict):
        content = logprobs.get("content")
        if isinstance(content, list) and content:
            return len(content)
        tokens = logprobs.get("tokens")
        if isinstance(tokens, list) and tokens:
            return len(tokens)
    delta = choice.get("delta")
    text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
    if text:
        return 1
    if isinstance(delta, dict) and (delta.get("reasoning_content") or delta.get("tool_calls")
                                    or delta.get("reasoning")):
        return 1
    return 0


def _retry_after(value: str | None) -> float | None:
    try:
        return max(0.0, float(value)) if value else None
    except ValueError:
        return None  # an HTTP date: rare from engines; the gateway's own default applies


def credentials_rejected(member: MemberConfig, status: int) -> HTTPError:
    """What the client is told when the member refused the gateway's own key (the client's key was fine)."""
    if member.api_key_env:
        fix = f"check the key in ${member.api_key_env} (the member's api_key_env in the pools file)"
    elif member.api_key:
        fix = "check the member's api_key in the pools file"
    else:
        fix = "the member wants a key: set its api_key_env (or api_key) in the pools file"
    return HTTPError(502, f"member {member.member_id!r} rejected the gateway's credentials (HTTP {status}); {fix}",
                     code=CREDENTIALS_REJECTED, type="server_error")


class HttpBackend:
    def __init__(self, first_byte_timeout_s: float, request_timeout_s: float) -> None:
        self.first_byte_timeout_s = first_byte_timeout_s
        self.request_timeout_s = request_timeout_s
        self.client = UpstreamClient()  # one pool of keep-alive connections for all members

    async def __aenter__(self) -> HttpBackend:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.client.close()

    async def open(self, member: MemberConfig, endpoint: str, body: dict[str, Any], stream: bool,
                   headers: dict[str, str], continuous_usage: bool = False) -> UpstreamResponse:
        """Send the request; return the upstream response once its status line arrived (< 400).

        ``continuous_usage``: the member is known to take vLLM's ``stream_options.continuous_usage_stats``
        (vLLM, SGLang, our engine): ask for the usage so far on every chunk, so a stream cut short is billed
        the member's own count rather than the gateway's (:func:`relay` strips it again unless the client
        asked for it)."""
        upstream = dict(body, model=member.model_id)
        if stream:
            options = dict(upstream.get("stream_options") or {})
            options["include_usage"] = True
            if continuous_usage:
                options["continuous_usage_stats"] = True
            upstream["stream_options"] = options
        sent = {"Content-Type": "application/json", **headers}
        if member.api_key:  # the member's key, never the client's (the caller passes no Authorization)
            sent["Authorization"] = f"Bearer {member.api_key}"
        try:
            resp = await self.client.post(member.backend, ENDPOINT_PATHS[endpoint], _json.encode(upstream),
                                          sent, self.first_byte_timeout_s, self.request_timeout_s)
        except UpstreamTimeout:
            raise MemberUnavailable(member.member_id, "no response within the first-byte deadline") from None
        except UpstreamError as exc:
            raise MemberUnavailable(member.member_id, f"no answer: {exc}") from None
        except OSError as exc:  # refused, unreachable, TLS
            raise MemberUnavailable(member.member_id, f"connect failed: {exc}") from None
        if resp.status in _RETRYABLE:
            resp.release()
            raise MemberUnavailable(member.member_id, f"upstream answered {resp.status}", resp.status)
        if resp.status in _CREDENTIALS_REJECTED:
            resp.release()
            raise MemberUnavailable(member.member_id, f"rejected the gateway's credentials ({resp.status})",
                                    resp.status, credentials_rejected(member, resp.status))
        if resp.status >= 400:
            try:
                async with asyncio.timeout(self.first_byte_timeout_s):
                    payload = msgspec.json.decode(await resp.read())
                err = payload.get("error", {}) if isinstance(payload, dict) else {}
                err = err if isinstance(err, dict) else {}
            except (msgspec.DecodeError, UpstreamError, RecursionError, TimeoutError):
                raise_if_cancelling()
                err = {}
            finally:
                resp.release()
            error = HTTPError(resp.status, str(err.get("message") or f"upstream answered {resp.status}"),
                              code=err.get("code"), param=err.get("param"), type=err.get("type"),
                              retry_after_s=_retry_after(resp.headers.get("retry-after")))
            if resp.status == 429:  # busy, not wrong: another member may take it
                raise MemberUnavailable(member.member_id, "upstream busy (429)", 429, error)
            raise error
        return resp

    @staticmethod
    async def _read_whole(resp: UpstreamResponse, meter: UsageMeter, result: UpstreamResult) -> bytes:
        """A non-streamed answer, read whole; its usage goes to ``meter`` as soon as it is in."""
        try:
            raw = await resp.read()
        finally:
            resp.release()
        try:
            body = msgspec.json.decode(raw)
            usage = _usage(body.get("usage"))
            if usage is not None:
                meter.finished(usage)
            choices = body.get("choices") or [{}]
            result.finish_reason = choices[0].get("finish_reason")
        except (msgspec.DecodeError, AttributeError, IndexError, RecursionError, TypeError):
            pass
        return raw

    def _timed_out(self) -> HTTPError:
        return HTTPError(504, f"the request ran past the gateway's request timeout ({self.request_timeout_s:g} s)",
                         code="request_timeout")

    async def relay(self, request: web.Request, resp: UpstreamResponse, stream: bool, client_wants_usage: bool,
                    request_id: str, on_first_byte: Callable[[], None], meter: UsageMeter, member_id: str = "",
                    on_abandoned: Callable[[asyncio.Task[Any]], None] | None = None,
                    strip_running_usage: bool = False) -> tuple[web.StreamResponse, UpstreamResult]:
        """Pass the member's answer on, feeding ``meter`` as it goes (see usage_meter.py for the rules).

        A client that leaves while a non-streamed answer is being made does not stop the member (nothing
        tells it to): the read goes on in a task handed to ``on_abandoned``, which bills the usage the
        member reports when it finishes (or what is known when it fails)."""
        result = UpstreamResult(http_status=resp.status)
        meter.accepted()
        started = time.monotonic()
        if not stream:  # the connection's own deadline bounds the read (no task timer needed)
            reading = asyncio.ensure_future(self._read_whole(resp, meter, result))
            try:
                raw = await asyncio.shield(reading)
            except asyncio.CancelledError:
                if not reading.done() and on_abandoned is not None:
                    on_abandoned(reading)
                else:
                    reading.cancel()
                raise
            except UpstreamTimeout:
                raise self._timed_out() from None
            except UpstreamError as exc:  # nothing reached the client: the next member may answer
                raise MemberUnavailable(member_id, f"the answer broke off: {exc}") from None
            on_first_byte()
            result.ttft_ms = (time.monotonic() - started) * 1000.0
            return web.Response(body=raw, status=resp.status, content_type="application/json",
                                headers={"X-Request-Id": request_id}), result
        out: web.StreamResponse | None = None
        try:
            # a stream's deadline also covers the writes to a slow client, so it is a task timeout
            async with asyncio.timeout(self.request_timeout_s):
                out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                                  "X-Request-Id": request_id})
                await out.prepare(request)
                first = True
                skip_blank = False
                pending = b""  # the start of a line whose end has not arrived yet
                # Whatever one read brought goes out in one write (not one per line): the same bytes, at
                # the same moment, with a fraction of the system calls.
                async for data in resp.iter_any():
                    if first:
                        on_first_byte()
                        first = False
                    *lines, pending = (pending + data).split(b"\n")
                    passed: list[bytes] = []
                    for bare in lines:
                        line = bare + b"\n"
                        if line.startswith(b"data: {"):
                            try:
                                event = msgspec.json.decode(line[6:])
                            except msgspec.DecodeError:
                                event = None
                            if isinstance(event, dict):
                                choices = event.get("choices")
                                usage = _usage(event.get("usage")) if event.get("usage") else None
                                if usage is not None:
                                    # A usage chunk with no choices (OpenAI, vLLM, SGLang) or on the finish
                                    # chunk (older llama.cpp) ends the answer: what the member billed. Usage
                                    # on a chunk with text is a running count (vLLM continuous_usage_stats).
                                    ends = not choices or (isinstance(choices, list) and isinstance(choices[0], dict)
                                                           and choices[0].get("finish_reason"))
                                    meter.finished(usage) if ends else meter.saw_usage(usage)
                                if choices and isinstance(choices, list) and isinstance(choices[0], dict):
                                    if choices[0].get("finish_reason"):
                                        result.finish_reason = choices[0]["finish_reason"]
                                    tokens = _event_tokens(choices[0])
                                    if tokens:
                                        meter.saw_tokens(tokens)
                                        if result.ttft_ms is None:
                                            result.ttft_ms = (time.monotonic() - started) * 1000.0
                                if not choices and event.get("usage") and not client_wants_usage:
                                    skip_blank = True  # the usage chunk we injected: not the client's business
                                    continue
                                if strip_running_usage and choices and "usage" in event:
                                    del event["usage"]  # the running usage we asked for, not the client
                                    line = b"data: " + _json.encode(event) + b"\n"
                        elif skip_blank and line in (b"\n", b"\r\n"):
                            skip_blank = False
                            continue
                        passed.append(line)
                    if len(pending) > _MAX_HELD_LINE:  # not SSE: pass it on rather than hold it
                        passed.append(pending)
                        pending = b""
                    if passed:
                        await out.write(b"".join(passed))
                if pending:
                    await out.write(pending)
                await out.write_eof()
                return out, result
        except (TimeoutError, UpstreamError) as exc:
            raise_if_cancelling()
            if isinstance(exc, UpstreamError) and not isinstance(exc, UpstreamTimeout):
                err = HTTPError(502, f"the member's stream broke off: {exc}", code="upstream_error",
                                type="server_error")
            else:
                err = self._timed_out()
            if out is None or not out.prepared:
                raise err from None
            # the status line is gone already: end the stream with an error event, as for our own engines
            result.http_status, result.error = err.status, err
            await out.write(b"data: " + _json.encode(error_body(err.message, err.type, err.code)) + b"\n\n")
            await out.write(b"data: [DONE]\n\n")
            await out.write_eof()
            return out, result
        finally:
            resp.release()
