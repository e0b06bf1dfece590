"""services.gateway.upstream's framing (llhttp through httptools) against real loopback servers: aiohttp's
own chunked SSE and JSON answers, and raw servers writing the framings engines and proxies produce."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web

from services.gateway.upstream import UpstreamClient, UpstreamError
from tests.unit.gateway.test_upstream_client import OK, answering, post, raw_server, read_request

EVENTS = [b'data: {"choices": [{"delta": {"content": "%d"}}]}\n\n' % i for i in range(8)] + [b"data: [DONE]\n\n"]


async def sse(request: web.Request) -> web.StreamResponse:
    """An SSE stream as aiohttp serves it (vLLM, SGLang and our engine's HTTP face do the same): chunked."""
    await request.read()
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    resp.enable_chunked_encoding()
    await resp.prepare(request)
    for event in EVENTS:
        await resp.write(event)
        await asyncio.sleep(0.001)
    await resp.write_eof()
    return resp


async def completion(request: web.Request) -> web.Response:
    return web.json_response({"echo": await request.json()})


async def test_aiohttp_sse_streams_and_json_answers_share_one_kept_alive_connection() -> None:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", sse)
    app.router.add_post("/v1/completions", completion)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        async with UpstreamClient() as client:
            for _round in range(3):
                status, headers, body = await post(client, port)
                assert (status, headers["transfer-encoding"], body) == (200, "chunked", b"".join(EVENTS))
                status, headers, body = await post(client, port, "/v1/completions", b'{"n": 1}')
                assert (status, json.loads(body)) == (200, {"echo": {"n": 1}})
            assert client.num_connects == 1
    finally:
        await runner.cleanup()


async def test_chunk_extensions_and_trailers_in_one_write_leave_the_connection_usable() -> None:
    wire = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"5;name=\"quoted; value\";other\r\nhello\r\n1;x=y\r\n!\r\n"
            b"0;last\r\nX-Checksum: abc\r\nX-Other: 1\r\n\r\n")
    async with raw_server(answering(wire, OK)) as port, UpstreamClient() as client:
        status, headers, body = await post(client, port)
        assert (status, body) == (200, b"hello!")
        assert "x-checksum" not in headers  # trailers come after the head: they are not passed on as headers
        assert (await post(client, port))[2] == b'{"ok":true}'
        assert client.num_connects == 1


async def test_a_content_length_body_split_over_writes_and_an_http_1_0_keep_alive_reuse_the_connection() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        for piece in (b"HTTP/1.1 200 OK\r\nContent-Le", b"ngth: 10\r\n\r\n01234", b"56789"):
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0.01)
        await read_request(reader)
        writer.write(b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 3\r\n\r\nabc")
        await writer.drain()
        await read_request(reader)
        writer.write(OK)
        await writer.drain()
        await reader.read()

    async with raw_server(handler) as port, UpstreamClient() as client:
        assert (await post(client, port))[2] == b"0123456789"
        assert (await post(client, port))[2] == b"abc"
        assert (await post(client, port))[2] == b'{"ok":true}'
        assert client.num_connects == 1


async def test_an_http_1_1_answer_without_length_is_read_until_the_close() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\ndata: 1\n\n")
        await writer.drain()
        await asyncio.sleep(0.01)
        writer.write(b"data: [DONE]\n\n")
        writer.close()

    async with raw_server(handler) as port, UpstreamClient() as client:
        assert (await post(client, port))[2] == b"data: 1\n\ndata: [DONE]\n\n"
        assert (await post(client, port))[2] == b"data: 1\n\ndata: [DONE]\n\n"
        assert client.num_connects == 2


async def test_interim_answers_before_a_chunked_answer_are_skipped_with_their_headers() -> None:
    wire = (b"HTTP/1.1 100 Continue\r\n\r\n"
            b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n"
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n")

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        for _round in range(2):
            await read_request(reader)
            writer.write(wire[:30])  # the 100 Continue alone first, as a server that reads the body after it
            await writer.drain()
            await asyncio.sleep(0.01)
            writer.write(wire[30:])
            await writer.drain()
        await reader.read()

    async with raw_server(handler) as port, UpstreamClient() as client:
        for _round in range(2):
            status, headers, body = await post(client, port)
            assert (status, body, "link" in headers) == (200, b"ok", False)
        assert client.num_connects == 1


@pytest.mark.parametrize("status", [204, 304])
async def test_answers_that_have_no_body_end_at_their_head(status: int) -> None:
    no_body = b"HTTP/1.1 %d Nothing\r\nContent-Length: 7\r\n\r\n" % status  # the length is the would-be body's
    async with raw_server(answering(no_body, OK)) as port, UpstreamClient() as client:
        assert await post(client, port) == (status, {"content-length": "7"}, b"")
        assert (await post(client, port))[2] == b'{"ok":true}'  # the next answer on the same connection
        assert client.num_connects == 1


async def test_bytes_after_a_complete_answer_make_the_connection_unusable_not_the_answer_wrong() -> None:
    unasked = OK + b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nextra"  # a second answer nobody asked for
    async with raw_server(answering(unasked, unasked)) as port, UpstreamClient() as client:
        assert (await post(client, port))[2] == b'{"ok":true}'
        assert (await post(client, port))[2] == b'{"ok":true}'  # on a new connection, not the leftover "extra"
        assert client.num_connects == 2


async def test_bytes_after_a_connection_close_answer_are_ignored() -> None:
    closing = b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nhiGARBAGE"
    async with raw_server(answering(closing)) as port, UpstreamClient() as client:
        assert (await post(client, port))[2] == b"hi"
        assert (await post(client, port))[2] == b"hi"
        assert client.num_connects == 2


async def test_a_chunked_body_cut_off_mid_chunk_is_an_error_after_the_bytes_that_came() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n10\r\nonly")
        await writer.drain()

    async with raw_server(handler) as port, UpstreamClient() as client:
        resp = await client.post(f"http://127.0.0.1:{port}", "/x", b"{}", {})
        pieces: list[bytes] = []
        with pytest.raises(UpstreamError, match="before the response was complete") as info:
            async for piece in resp.iter_any():
                pieces.append(piece)
        resp.release()
        assert b"".join(pieces) == b"helloonly" and not info.value.nothing_received


async def test_headers_longer_than_the_limit_over_many_writes_are_an_error() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\n")
        for i in range(100):  # 100 headers of 1 KiB: 100 KiB of head, no end
            writer.write(b"X-H%d: %s\r\n" % (i, b"v" * 1024))
            await writer.drain()
        await reader.read()

    async with raw_server(handler) as port, UpstreamClient() as client:
        with pytest.raises(UpstreamError, match="response headers longer than 65536 bytes"):
            await post(client, port)


@pytest.mark.parametrize("wire, match", [
    (b"HTTP/1.1 abc OK\r\n\r\n", "not an HTTP/1.x response: b'HTTP/1.1 abc OK'"),
    (b"HTTP/2.0 200 OK\r\nContent-Length: 0\r\n\r\n", "not an HTTP/1.x response: b'HTTP/2.0 200 OK'"),
    (b"<html>hello</html>\r\n\r\n", "not an HTTP/1.x response"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", "bad Content-Length"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n", "bad Content-Length"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n", "bad Content-Length"),
    (b"HTTP/1.1 200 OK\r\nX-Bad: a\x01b\r\n\r\n", "malformed header line"),
    (b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\n\r\n", "switched protocols"),
])
async def test_malformed_answers_are_upstream_errors(wire: bytes, match: str) -> None:
    async with raw_server(answering(wire)) as port, UpstreamClient() as client:
        with pytest.raises(UpstreamError, match=match):
            await post(client, port)


async def test_a_chunk_without_its_crlf_is_an_error_once_the_body_started() -> None:
    wire = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nokXX0\r\n\r\n"
    async with raw_server(answering(wire)) as port, UpstreamClient() as client:
        resp = await client.post(f"http://127.0.0.1:{port}", "/x", b"{}", {})
        with pytest.raises(UpstreamError, match="chunk"):
            await resp.read()
        resp.release()
