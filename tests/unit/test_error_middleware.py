"""services.common.http.error_middleware: a client that went away mid-answer is not a server error."""

from __future__ import annotations

import logging

import aiohttp
import pytest
from aiohttp import web

from services.common.http import error_middleware, serving


async def _write_to_a_gone_client(request: web.Request) -> web.StreamResponse:
    raise aiohttp.ClientConnectionResetError("Cannot write to closing transport")  # what StreamResponse.write raises


async def _broken(request: web.Request) -> web.StreamResponse:
    raise RuntimeError("a bug")


async def test_a_gone_client_is_not_logged_as_an_error_but_a_bug_still_is(caplog: pytest.LogCaptureFixture) -> None:
    app = web.Application(middlewares=[error_middleware])
    app.router.add_get("/gone", _write_to_a_gone_client)
    app.router.add_get("/bug", _broken)
    caplog.set_level(logging.ERROR)
    async with serving(app, "127.0.0.1", 0) as url, aiohttp.ClientSession() as http:
        async with http.get(url + "/gone") as resp:  # (here the client is still there to see it)
            assert resp.status == 499
        assert not caplog.records
        async with http.get(url + "/bug") as resp:
            assert resp.status == 500 and (await resp.json())["error"]["type"] == "server_error"
        assert [r.getMessage() for r in caplog.records] == ["unhandled error on GET /bug"]
