"""The one function that writes OpenAI-style error bodies, and JSON body reading with clear errors."""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from aiohttp import web

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
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
        self.type = type or _ERROR_TYPES.get(status, "server_error")
        self.retry_after_s = retry_after_s


def error_body(message: str, type: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(err: HTTPError) -> web.Response:
    headers = {}
    if err.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(err.retry_after_s)))
    return web.json_response(
        error_body(err.message, err.type, err.code, err.param), status=err.status, headers=headers
    )


@web.middleware
async def error_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """Every failure leaves as an OpenAI error body: never a traceback, never an HTML page."""
    try:
        return await handler(request)
    except HTTPError as err:
        return error_response(err)
    except web.HTTPRequestEntityTooLarge as exc:
        return error_response(HTTPError(413, f"request body too large: {exc.text}", code="body_too_large"))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(HTTPError(exc.status, exc.reason or "error"))
    except Exception:
        request.app.logger.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(HTTPError(500, "internal server error", type="server_error"))


async def read_json_object(request: web.Request) -> dict[str, Any]:
    """The request body as a JSON object, or a 400 that says what is wrong with it."""
    body = await request.read()
    if not body:
        raise HTTPError(400, "request body is empty: send a JSON object", code="invalid_json")
    try:
        data = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise HTTPError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise HTTPError(400, "request body must be a JSON object", code="invalid_json")
    return data


@contextlib.asynccontextmanager
async def serving(app: web.Application, host: str, port: int) -> AsyncIterator[str]:
    """Serve ``app`` on ``host:port`` (0 picks a free port) and yield its base URL; clean up on exit.

    Handlers are cancelled when their client disconnects, so upstream work can be aborted.
    """
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
        bound_host, bound_port = runner.addresses[0][:2]
        yield f"http://{bound_host}:{bound_port}"
    finally:
        await runner.cleanup()
