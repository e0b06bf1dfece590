"""services.gateway.upstream: the gateway's HTTP/1.1 client for HTTP members, against raw socket servers
that answer exactly the bytes each test writes (framings, splits, closes, garbage)."""

from __future__ import annotations

import asyncio
import gzip
import os
import shutil
import ssl
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from services.gateway.upstream import UpstreamClient, UpstreamError, UpstreamTimeout, origin_of

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """(head, body) of one request, or (b"", b"") when the client closed."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return b"", b""
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    return head, await reader.readexactly(length)


@asynccontextmanager
async def raw_server(handler: Handler, ssl_context: ssl.SSLContext | None = None) -> AsyncIterator[int]:
    """A server calling ``handler(reader, writer, connection_number)``; yields its port."""
    count = 0

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal count
        count += 1
        try:
            await handler(reader, writer, count)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0, ssl=ssl_context)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await server.wait_closed()


def answering(*responses: bytes, heads: list[bytes] | None = None) -> Handler:
    """Answer each request on a connection with the next of ``responses`` (then keep the connection open)."""
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        for response in responses:
            head, _body = await read_request(reader)
            if not head:
                return
            if heads is not None:
                heads.append(head)
            writer.write(response)
            await writer.drain()
        await reader.read()
    return handler


OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{\"ok\":true}"


async def post(client: UpstreamClient, port: int, path: str = "/v1/chat/completions", body: bytes = b"{}",
               base: str | None = None) -> tuple[int, dict[str, str], bytes]:
    resp = await client.post(base or f"http://127.0.0.1:{port}", path, body, {"Content-Type": "application/json"})
    try:
        return resp.status, resp.headers, await resp.read()
    finally:
        resp.release()


async def test_content_length_answers_reuse_one_connection() -> None:
    heads: list[bytes] = []
    async with raw_server(answering(OK, OK, OK, heads=heads)) as port, UpstreamClient() as client:
        for _ in range(3):
            status, headers, body = await post(client, port)
            assert (status, headers["content-type"], body) == (200, "application/json", b'{"ok":true}')
        assert client.num_connects == 1
    assert heads[0].startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
    assert f"Host: 127.0.0.1:{port}".encode() in heads[0] and b"Content-Length: 2" in heads[0]


async def test_a_chunked_stream_split_at_every_byte_arrives_whole_and_in_order() -> None:
    events = [b"data: {\"n\": %d}\n\n" % i for i in range(5)]
    wire = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Type: text/event-stream\r\n\r\n"
    wire += b"".join(b"%x;ext=1\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\nX-Trailer: t\r\n\r\n"

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        for _round in range(2):
            await read_request(reader)
            for i in range(len(wire)):  # one byte per write: every parser state sees a split
                writer.write(wire[i:i + 1])
                await writer.drain()
                await asyncio.sleep(0)
        await reader.read()

    async with raw_server(handler) as port, UpstreamClient() as client:
        for _round in range(2):
            resp = await client.post(f"http://127.0.0.1:{port}", "/v1/completions", b"{}", {})
            pieces = [p async for p in resp.iter_any()]
            resp.release()
            assert b"".join(pieces) == b"".join(events)
        assert client.num_connects == 1  # the trailers were consumed: the connection stayed usable


async def test_a_body_framed_by_the_close_is_read_to_the_end_and_the_connection_not_reused() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n{\"a\":")
        await writer.drain()
        writer.write(b"1}")
        writer.close()

    async with raw_server(handler) as port, UpstreamClient() as client:
        assert (await post(client, port))[2] == b'{"a":1}'
        assert (await post(client, port))[2] == b'{"a":1}'
        assert client.num_connects == 2


async def test_connection_close_is_honoured() -> None:
    closing = b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nhi"
    async with raw_server(answering(closing)) as port, UpstreamClient() as client:
        assert (await post(client, port))[2] == b"hi"
        assert (await post(client, port))[2] == b"hi"
        assert client.num_connects == 2


async def test_an_idle_connection_the_member_dropped_is_retried_once_on_a_new_one() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, number: int) -> None:
        await read_request(reader)
        writer.write(OK)
        await writer.drain()
        if number == 1:  # takes the next request, then hangs up without a byte (its keep-alive ran out)
            await read_request(reader)
            return
        await reader.read()

    async with raw_server(handler) as port, UpstreamClient() as client:
        assert (await post(client, port))[0] == 200
        assert (await post(client, port))[0] == 200  # sent on the dropped one, then once more on a new one
        assert client.num_connects == 2


async def test_a_member_that_hangs_up_on_a_new_connection_is_an_error_not_a_retry_loop() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)

    async with raw_server(handler) as port, UpstreamClient() as client:
        with pytest.raises(UpstreamError) as info:
            await post(client, port)
        assert info.value.nothing_received
        assert client.num_connects == 1


async def test_an_answer_cut_off_mid_body_is_an_error() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly this much")
        await writer.drain()

    async with raw_server(handler) as port, UpstreamClient() as client:
        resp = await client.post(f"http://127.0.0.1:{port}", "/x", b"{}", {})
        with pytest.raises(UpstreamError, match="before the response was complete"):
            await resp.read()
        resp.release()


@pytest.mark.parametrize("wire, match", [
    (b"SSH-2.0-OpenSSH_9.2\r\n\r\n", "not an HTTP/1.x response"),
    (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "malformed header line"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: ten\r\n\r\n", "bad Content-Length"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "bad chunk size"),
    (b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * 70_000, "response headers longer than"),
])
async def test_what_is_not_http_is_a_clear_error(wire: bytes, match: str) -> None:
    async with raw_server(answering(wire)) as port, UpstreamClient() as client:
        with pytest.raises(UpstreamError, match=match):
            await post(client, port)


async def test_interim_answers_are_skipped_and_gzip_is_undone() -> None:
    payload = b'{"choices": []}' * 100
    wire = (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\n"
            b"Content-Length: %d\r\n\r\n" % len(gzip.compress(payload))) + gzip.compress(payload)
    async with raw_server(answering(wire)) as port, UpstreamClient() as client:
        assert (await post(client, port))[2] == payload


async def test_a_large_body_is_read_whole_through_the_paused_socket() -> None:
    big = os.urandom(3 << 20)
    wire = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(big) + big
    async with raw_server(answering(wire, wire)) as port, UpstreamClient() as client:
        resp = await client.post(f"http://127.0.0.1:{port}", "/x", b"{}", {})
        await asyncio.sleep(0.2)  # let the member write ahead of the reader: the socket pauses at 1 MiB held
        assert await resp.read() == big
        resp.release()
        assert (await post(client, port))[2] == big
        assert client.num_connects == 1


async def test_a_cancelled_request_closes_its_connection() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, number: int) -> None:
        await read_request(reader)
        if number == 1:
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
            await writer.drain()
            await reader.read()  # never finishes the body
            return
        writer.write(OK)
        await writer.drain()
        await reader.read()

    async with raw_server(handler) as port, UpstreamClient() as client:
        resp = await client.post(f"http://127.0.0.1:{port}", "/x", b"{}", {})
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                await resp.read()
        resp.release()  # the body was not read to its end: the connection cannot be reused
        assert (await post(client, port))[0] == 200
        assert client.num_connects == 2


async def test_the_base_url_prefix_and_credentials_go_into_the_request() -> None:
    heads: list[bytes] = []
    async with raw_server(answering(OK, heads=heads)) as port, UpstreamClient() as client:
        await post(client, port, base=f"http://bob:s%40cret@127.0.0.1:{port}/proxy/")
    assert heads[0].startswith(b"POST /proxy/v1/chat/completions HTTP/1.1\r\n")
    assert b"Authorization: Basic Ym9iOnNAY3JldA==\r\n" in heads[0]  # bob:s@cret


async def test_a_line_break_in_a_header_is_refused_before_anything_is_sent() -> None:
    async with UpstreamClient() as client:
        with pytest.raises(ValueError, match="line break"):
            await client.post("http://127.0.0.1:9", "/x", b"{}", {"X-Request-Id": "a\r\nX-Evil: 1"})
    with pytest.raises(ValueError):
        origin_of("ftp://example.com")


async def test_a_refused_connection_is_an_os_error() -> None:
    async with raw_server(answering()) as port:
        pass  # closed: nothing listens there now
    async with UpstreamClient() as client:
        with pytest.raises(OSError):
            await post(client, port)


async def test_https_members_are_verified_and_served(tmp_path: Path) -> None:
    if shutil.which("openssl") is None:
        if os.environ.get("LLMGW_CI"):
            pytest.fail("openssl is needed to make the test certificate (install it: apt-get install openssl)")
        pytest.skip("openssl not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(cert, key)
    trusting = ssl.create_default_context(cafile=str(cert))
    async with raw_server(answering(OK, OK), server_ctx) as port:
        async with UpstreamClient(ssl_context=trusting) as client:
            assert (await post(client, port, base=f"https://localhost:{port}"))[2] == b'{"ok":true}'
        async with UpstreamClient() as client:  # the system's trust store does not know this certificate
            with pytest.raises(ssl.SSLError):
                await post(client, port, base=f"https://localhost:{port}")


async def test_deadlines_are_kept_by_the_connection_and_end_it() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, number: int) -> None:
        await read_request(reader)
        if number == 2:  # the status line at once, then a body that never finishes
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
            await writer.drain()
        elif number == 3:
            writer.write(OK)
            await writer.drain()
        await reader.read()

    async with raw_server(handler) as port, UpstreamClient() as client:
        base = f"http://127.0.0.1:{port}"
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(UpstreamTimeout) as info:  # no status line at all
            await client.post(base, "/x", b"{}", {}, first_byte_timeout_s=0.2, total_timeout_s=30)
        assert (info.value.phase, info.value.nothing_received) == ("first_byte", True)
        assert 0.15 < loop.time() - started < 2.0

        resp = await client.post(base, "/x", b"{}", {}, first_byte_timeout_s=5, total_timeout_s=0.3)
        with pytest.raises(UpstreamTimeout) as info:  # the body stalls past the whole-answer deadline
            await resp.read()
        resp.release()
        assert info.value.phase == "total"

        assert (await post(client, port))[0] == 200  # both timed-out connections were closed, not reused
        assert client.num_connects == 3
