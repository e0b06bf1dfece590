"""The one function that writes OpenAI-style error bodies, and JSON body reading with clear errors."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
import urllib.parse
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from services.common.runtime import raise_if_cancelling

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    409: "invalid_request_error",
    411: "invalid_request_error",
    413: "invalid_request_error",
    414: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class HTTPError(Exception):
    """Raised by handlers; turned into an OpenAI error body by :func:`error_middleware`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        type: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        # any other 4xx is the client's (an unknown one must not read as our fault); 5xx are ours
        self.type = type or _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        self.retry_after_s = retry_after_s

    @classmethod
    def bad_request(cls, exc: ValueError) -> HTTPError:
        """The 400 for a validation error that names its ``param`` and ``code`` (openai_api.InvalidRequest)."""
        return cls(400, str(exc), param=getattr(exc, "param", None), code=getattr(exc, "code", None))


def error_body(message: str, type: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(err: HTTPError) -> web.Response:
    headers = {}
    if err.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(err.retry_after_s)))
    return web.json_response(
        error_body(err.message, err.type, err.code, err.param), status=err.status, headers=headers
    )


def _check_header_text(request: web.Request) -> None:
    """Header bytes that are not UTF-8 reach handlers as lone surrogates (aiohttp decodes with
    ``surrogateescape``), which fail the first time a handler encodes them (a key hash, a cookie signature):
    refuse them here, once, as the client's error (401 for the credentials, 400 for any other header)."""
    for name, value in request.headers.items():
        if value.isascii():
            continue
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            if name.lower() == "authorization":
                raise HTTPError(401, "the Authorization header is not valid UTF-8; send 'Authorization: Bearer "
                                     "sk-…'", code="invalid_api_key") from None
            raise HTTPError(400, f"the {name} header is not valid UTF-8", code="invalid_header",
                            param=name) from None


@web.middleware
async def error_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """Every failure leaves as an OpenAI error body: never a traceback, never an HTML page."""
    try:
        _check_header_text(request)
        return await handler(request)
    except HTTPError as err:
        return error_response(err)
    except ConnectionResetError:
        # The client went away while we wrote to it (aiohttp cancels the handler too, but a write can get there
        # first). Nobody is left to answer and nothing went wrong here: no traceback. aiohttp drops this
        # response quietly when it finds the connection closed.
        return web.Response(status=499, reason="Client Closed Request")
    except web.HTTPRequestEntityTooLarge as exc:
        return error_response(HTTPError(413, f"request body too large: {exc.text}", code="body_too_large"))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(HTTPError(exc.status, exc.reason or "error"))
    except Exception:
        request.app.logger.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(HTTPError(500, "internal server error", type="server_error"))


def body_deadline_middleware(timeout_s: float) -> Any:
    """Read each request body within ``timeout_s`` (408 otherwise), before the handler runs.

    aiohttp has no body-read timeout: a client that trickles its body would hold a handler (and, for the
    gateway, a per-key request slot) for as long as it likes. The body is cached by aiohttp, so the
    handler's own ``read()``/``post()`` find it at once. The header phase is bounded by the server's
    keep-alive timeout, which aiohttp starts when the connection opens (see :func:`serving`).
    """

    @web.middleware
    async def body_deadline(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.body_exists and not request.content.is_eof():  # most bodies came with the headers
            try:
                async with asyncio.timeout(timeout_s):
                    await request.read()
            except TimeoutError:
                raise_if_cancelling()
                raise HTTPError(408, f"the request body did not arrive within {timeout_s:g} s",
                                code="body_timeout") from None
        return await handler(request)

    return body_deadline


async def read_json_object(request: web.Request) -> dict[str, Any]:
    """The request body as a JSON object, or a 400 that says what is wrong with it."""
    body = await request.read()
    if not body:
        raise HTTPError(400, "request body is empty: send a JSON object", code="invalid_json")
    try:
        data = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise HTTPError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:  # msgspec's nesting limit: e.g. 100 000 '[' (found by tests/faults, a 500 before)
        raise HTTPError(400, "request body is nested too deeply", code="invalid_json") from None
    if not isinstance(data, dict):
        raise HTTPError(400, "request body must be a JSON object", code="invalid_json")
    return data


FORM_TYPE = "application/x-www-form-urlencoded"
MAX_FORM_FIELDS = 1000


async def read_form(request: web.Request) -> dict[str, str]:
    """A browser form (``application/x-www-form-urlencoded``: what our pages send) as a dict, first value per
    name; a 415 or 400 that says what is wrong otherwise.

    Not aiohttp's ``request.post()``: it raises ``UnicodeDecodeError`` on a body that is not UTF-8 (a 500),
    and cannot read a multipart body once :func:`body_deadline_middleware` has read the stream.
    """
    if not request.body_exists:
        return {}
    if request.content_type != FORM_TYPE:
        raise HTTPError(415, f"send the form as {FORM_TYPE}", code="unsupported_media_type")
    body = await request.read()
    try:
        pairs = urllib.parse.parse_qsl(body.decode("utf-8"), keep_blank_values=True, errors="strict",
                                       max_num_fields=MAX_FORM_FIELDS)
    except UnicodeDecodeError:
        raise HTTPError(400, "the form is not valid UTF-8", code="invalid_form") from None
    except ValueError:
        raise HTTPError(400, f"the form has more than {MAX_FORM_FIELDS} fields", code="invalid_form") from None
    form: dict[str, str] = {}
    for name, value in pairs:
        form.setdefault(name, value)
    return form


class _ServerLog(logging.LoggerAdapter[logging.Logger]):
    """aiohttp's protocol logger, minus one storm: it logs every malformed request (control characters in
    a header, a broken request line…) as an ERROR with a traceback, so any client could flood the log
    (tests/faults/test_hostile_input.py). Those are the client's fault: one WARNING line each, no traceback,
    and nothing of what the client sent."""

    def exception(self, msg: object, *args: object, exc_info: Any = True, **kw: Any) -> None:
        if isinstance(exc_info, HttpProcessingError):
            # The kind and status only: aiohttp's message quotes the offending bytes, which may be a header
            # carrying an API key or a cookie (tests/faults: no secret in any log line).
            self.logger.warning("%s: %s (HTTP %s)", str(msg) % args if args else msg, type(exc_info).__name__,
                                exc_info.code)
        else:
            self.logger.exception(msg, *args, exc_info=exc_info, **kw)


@contextlib.asynccontextmanager
async def serving(app: web.Application, host: str, port: int, idle_timeout_s: float = 75.0,
                  reuse_port: bool = False, sock: socket.socket | None = None) -> AsyncIterator[str]:
    """Serve ``app`` on ``host:port`` (0 picks a free port) and yield its base URL; clean up on exit.

    ``reuse_port`` binds with ``SO_REUSEPORT``, so several processes listen on one port and the kernel
    spreads connections over them (``llmgw gateway --workers``); ``sock`` serves an already listening
    socket instead (one a parent process handed down where ``SO_REUSEPORT`` is missing).

    Handlers are cancelled when their client disconnects, so upstream work can be aborted.
    ``idle_timeout_s`` is aiohttp's keep-alive timeout: it runs from the moment a connection opens until
    a complete request head has arrived, so it also cuts off a client that sends its headers slowly
    (slow loris; aiohttp's own default is 3630 s).
    """
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, keepalive_timeout=idle_timeout_s,
                           logger=_ServerLog(logging.getLogger("aiohttp.server"), {}))
    await runner.setup()
    try:
        site: web.BaseSite = (web.SockSite(runner, sock) if sock is not None
                              else web.TCPSite(runner, host, port, reuse_port=reuse_port or None))
        await site.start()
        bound_host, bound_port = runner.addresses[0][:2]
        yield f"http://{bound_host}:{bound_port}"
    finally:
        await runner.cleanup()
