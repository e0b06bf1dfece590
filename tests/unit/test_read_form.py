"""services.common.http.read_form: the admin pages' one form reader (a 400/415, never a 500)."""

from __future__ import annotations

import logging

import aiohttp
import pytest
from aiohttp import web

from services.common.http import error_middleware, read_form, serving


async def _echo(request: web.Request) -> web.Response:
    return web.json_response(await read_form(request))


@pytest.fixture
async def base() -> object:
    app = web.Application(middlewares=[error_middleware])
    app.router.add_post("/f", _echo)
    async with serving(app, "127.0.0.1", 0) as url:
        yield url


@pytest.mark.parametrize(("body", "content_type", "status", "expected"), [
    (b"a=1&b=%C3%A9&a=2&empty=", "application/x-www-form-urlencoded", 200, {"a": "1", "b": "é", "empty": ""}),
    (b"a=\x80", "application/x-www-form-urlencoded", 400, "invalid_form"),
    (b"a=%80", "application/x-www-form-urlencoded", 400, "invalid_form"),
    (b"&".join(b"f%d=1" % i for i in range(1001)), "application/x-www-form-urlencoded", 400, "invalid_form"),
    (b"--x\r\nContent-Disposition: form-data; name=\"a\"\r\n\r\n1\r\n--x--\r\n", "multipart/form-data; boundary=x",
     415, "unsupported_media_type"),
    (b"", "application/x-www-form-urlencoded", 200, {}),
])
async def test_a_form_is_read_or_refused_with_a_clear_error(base: str, body: bytes, content_type: str, status: int,
                                                           expected: object, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR)
    async with aiohttp.ClientSession() as http, \
            http.post(base + "/f", data=body, headers={"Content-Type": content_type}) as resp:
        payload = await resp.json()
    assert resp.status == status
    assert payload == expected if status == 200 else payload["error"]["code"] == expected
    assert not caplog.records  # the client's mistake is not the server's error


async def test_aiohttp_log_lines_about_a_bad_request_quote_nothing_the_client_sent(
        base: str, caplog: pytest.LogCaptureFixture) -> None:
    import asyncio
    from urllib.parse import urlsplit
    caplog.set_level(logging.WARNING)
    parts = urlsplit(base)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    writer.write(b"POST /f HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-secret-in-a-bad-header\x01\r\n"
                 b"Content-Length: 0\r\n\r\n")
    await writer.drain()
    head = await reader.read(4096)
    writer.close()
    assert head.split(b" ")[1] == b"400"
    assert caplog.records and "sk-secret" not in caplog.text
