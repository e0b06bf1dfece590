"""A lean HTTP/1.1 client for the gateway's HTTP members: keep-alive connections and nothing else.

aiohttp's client took about a quarter of the gateway's CPU per proxied request (request and response
objects with cookie jars, trace hooks, per-request timers, a stream reader per body). The gateway needs
one thing from an upstream: POST a JSON body and pass the answer on as it arrives. This module does
that on an :class:`asyncio.Protocol` per connection:

- requests go out as one ``write`` (head and body); responses are framed by llhttp (``httptools``, the
  parser uvicorn uses) by ``Content-Length``, ``Transfer-Encoding: chunked`` or the end of the connection,
  and handed on chunk by chunk; a connection is reused only after its last answer was complete;
- connections are kept per origin (scheme, host, port) and reused most-recent first; one the server
  closed while idle is noticed when it closes, or (if the close raced our request) the request is sent
  once more on a new connection, but only when not one byte of a response came back;
- a body that is compressed despite ``Accept-Encoding: identity`` is decompressed (gzip, deflate);
- a body the reader does not take fast enough pauses the socket (1 MiB held at most).

Errors: :class:`UpstreamError` for a connection that failed, closed early or spoke something that is
not HTTP/1.x, and its :class:`UpstreamTimeout` for a deadline passed; ``OSError`` (refused, unreachable,
TLS) from connecting. The deadlines are checked every 50 ms by one timer for all requests in progress:
two ``asyncio.timeout`` (or timer handles) per request cost ~5 % of the gateway's CPU at 6,000 req/s.
Cancelling a request closes its connection.
"""

from __future__ import annotations

import asyncio
import base64
import math
import ssl
import time
import zlib
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import lru_cache
from urllib.parse import unquote, urlsplit

import httptools

MAX_HEAD_BYTES = 64 * 1024
MAX_HELD_BODY_BYTES = 1 << 20
IDLE_TIMEOUT_S = 60.0
DEADLINE_TICK_S = 0.05  # how often the deadlines of requests in progress are checked (their precision)
MAX_IDLE_PER_ORIGIN = 256

_HEAD, _BODY, _UNTIL_CLOSE, _DONE = range(4)  # a connection's request: awaiting the head, the body, done


class UpstreamError(Exception):
    """The connection failed, closed early, or the answer is not HTTP/1.x.

    ``nothing_received``: not one byte of a response arrived (the request may be sent again elsewhere).
    """

    def __init__(self, message: str, nothing_received: bool = False) -> None:
        super().__init__(message)
        self.nothing_received = nothing_received


class UpstreamTimeout(UpstreamError):
    """A deadline passed: ``phase`` is ``"first_byte"`` (no status line yet) or ``"total"`` (the whole answer)."""

    def __init__(self, phase: str, nothing_received: bool) -> None:
        super().__init__(f"no {'answer' if phase == 'first_byte' else 'complete answer'} within the deadline",
                         nothing_received)
        self.phase = phase


@dataclass(frozen=True)
class Origin:
    scheme: str
    host: str
    port: int
    path_prefix: str  # the URL's path without its trailing "/", prepended to every request path
    head_prefix: bytes  # the Host (and Authorization, from user:password in the URL) header lines

    @property
    def is_tls(self) -> bool:
        return self.scheme == "https"


@lru_cache(maxsize=1024)
def origin_of(base_url: str) -> Origin:
    """``http(s)://[user:password@]host[:port][/prefix]`` → :class:`Origin` (ValueError if it is not one)."""
    parts = urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {base_url!r}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    default_port = port == (443 if parts.scheme == "https" else 80)
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    head = f"Host: {host}{'' if default_port else f':{port}'}\r\n"
    if parts.username is not None:
        token = base64.b64encode(f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode()).decode()
        head += f"Authorization: Basic {token}\r\n"
    return Origin(parts.scheme, parts.hostname, port, parts.path.rstrip("/"), head.encode("latin-1"))


class _StrayBytes(Exception):
    """Raised from a parser callback to stop at bytes that came after the answer was complete."""


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 connection: one request at a time, its response framed by llhttp as the bytes arrive.

    The parser (:class:`httptools.HttpResponseParser`, one per connection) calls back ``on_message_begin``,
    ``on_header``, ``on_headers_complete``, ``on_body`` and ``on_message_complete``; it frames by
    ``Content-Length``, chunks (extensions skipped, trailers reported through ``on_header`` after the body
    and ignored here) or the close, and gives 1xx, 204 and 304 answers no body. The status number comes
    from ``get_status_code()``: the reason phrase is not used, so there is no ``on_status`` callback.
    """

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.is_closed = False
        self.idle_since = 0.0
        self._parser = httptools.HttpResponseParser(self)
        self._state = _DONE
        self._head_bytes = 0  # bytes taken while no final status line and headers were complete
        self._first_bytes = b""  # the start of the answer, for the error when it is not HTTP
        self._received_any = False
        self._head: asyncio.Future[tuple[int, dict[str, str]]] | None = None
        self._headers: dict[str, str] = {}
        self._body: deque[bytes] = deque()
        self._held = 0
        self._body_done = False
        self._waiter: asyncio.Future[None] | None = None
        self._error: UpstreamError | None = None
        self._is_paused = False
        self.keep_alive = False
        self.first_byte_at = self.total_at = math.inf

    # ---- asyncio.Protocol ---------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # asyncio.Protocol's signature; a TCP connection gives a Transport

    def data_received(self, data: bytes) -> None:
        if self._state == _DONE:  # bytes nobody asked for: this connection cannot be trusted again
            self.keep_alive = False
            self.close()
            return
        if not self._received_any:
            self._received_any, self._first_bytes = True, data[:80]
        if self._state == _HEAD:
            self._head_bytes += len(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__context__
            if isinstance(cause, _StrayBytes):
                return  # the answer is complete; on_message_begin marked the connection not reusable
            self._fail(cause if isinstance(cause, UpstreamError) else UpstreamError(f"parsing the answer: {cause!r}"))
            self.close()
            return
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            if self._state == _DONE:  # e.g. bytes after a complete "Connection: close" answer
                self.keep_alive = False
                return
            self._fail(self._parse_error(str(exc)))
            self.close()
            return
        if self._state == _HEAD and self._head_bytes > MAX_HEAD_BYTES:
            self._fail(UpstreamError(f"response headers longer than {MAX_HEAD_BYTES} bytes"))
            self.close()

    def eof_received(self) -> bool:
        if self._state == _UNTIL_CLOSE:
            self._finish_body()
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.is_closed = True
        if self._state != _DONE:
            self._fail(UpstreamError(f"the member closed the connection before the response was complete"
                                     f"{f' ({exc})' if exc else ''}", nothing_received=not self._received_any))
        self._wake()

    # ---- httptools.HttpResponseParser callbacks -----------------------------------------------------

    def on_message_begin(self) -> None:
        if self._state == _DONE:  # the member sent more than it announced: never reuse this connection
            self.keep_alive = False
            raise _StrayBytes
        self._headers = {}

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._state == _HEAD:  # after the head, these are a chunked body's trailers: not passed on
            self._headers[name.decode("latin-1").lower()] = value.decode("latin-1").strip()

    def on_headers_complete(self) -> None:
        parser = self._parser
        if not parser.get_http_version().startswith("1."):
            raise UpstreamError(f"not an HTTP/1.x response: {self._first_line!r}")
        status = parser.get_status_code()
        if status == 101:
            raise UpstreamError("the member switched protocols (101) though no upgrade was asked for")
        if status < 200:
            return  # an interim response (100 Continue, 103 Early Hints): the real one follows
        headers = self._headers
        self.keep_alive = parser.should_keep_alive()
        is_close_delimited = ("content-length" not in headers and status not in (204, 304)
                              and "chunked" not in headers.get("transfer-encoding", "").lower())
        self._state = _UNTIL_CLOSE if is_close_delimited else _BODY
        if self._head is not None and not self._head.done():
            self._head.set_result((status, headers))

    def on_body(self, body: bytes) -> None:
        self._push(body)

    def on_message_complete(self) -> None:
        if self._state == _HEAD:
            return  # an interim response ended; the parser waits for the next status line
        self._finish_body()

    # ---- requests -----------------------------------------------------------------------------------

    def send(self, data: bytes, first_byte_at: float, total_at: float) -> asyncio.Future[tuple[int, dict[str, str]]]:
        """Send one request; the status line is due by ``first_byte_at``, the whole answer by ``total_at``
        (loop times; :meth:`check_deadline` enforces them). Only on a connection whose last answer was
        complete (:attr:`is_reusable`): the parser then stands at the start of the next message."""
        assert self.transport is not None and self._state == _DONE
        self._state, self._received_any, self._error, self._head_bytes = _HEAD, False, None, 0
        self._body.clear()
        self._held, self._body_done, self.keep_alive = 0, False, False
        self._head = asyncio.get_running_loop().create_future()
        self.first_byte_at, self.total_at = first_byte_at, total_at
        self.transport.write(data)
        return self._head

    def check_deadline(self, now: float) -> None:
        """Fail the request in progress (and close) if a deadline passed."""
        if self._state == _DONE:
            return
        phase = "first_byte" if self._state == _HEAD and now >= self.first_byte_at else \
            "total" if now >= self.total_at else None
        if phase is not None:
            self._fail(UpstreamTimeout(phase, nothing_received=not self._received_any))
            self.close()

    async def next_chunk(self) -> bytes | None:
        """The body bytes that arrived since the last call (joined), or None once the body is complete."""
        while not self._body:
            if self._error is not None:
                raise self._error
            if self._body_done:
                return None
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        data = self._body.popleft() if len(self._body) == 1 else b"".join(self._body)
        self._body.clear()
        self._held = 0
        if self._is_paused and self.transport is not None:
            self._is_paused = False
            self.transport.resume_reading()
        return data

    @property
    def is_reusable(self) -> bool:
        return self.keep_alive and self._state == _DONE and not self.is_closed

    def close(self) -> None:
        if self.transport is not None and not self.is_closed:
            self.transport.close()
        self.is_closed = True

    # ---- parsing ------------------------------------------------------------------------------------

    @property
    def _first_line(self) -> bytes:
        return self._first_bytes.split(b"\r\n", 1)[0]

    def _parse_error(self, reason: str) -> UpstreamError:
        """llhttp's reason for refusing the bytes → the error naming what was wrong."""
        if "Content-Length" in reason:
            return UpstreamError(f"bad Content-Length ({reason})")
        if "chunk" in reason.lower():
            return UpstreamError(f"bad chunk size or framing ({reason})")
        if "header" in reason.lower():
            return UpstreamError(f"malformed header line ({reason})")
        if self._state == _HEAD:
            return UpstreamError(f"not an HTTP/1.x response: {self._first_line!r} ({reason})")
        return UpstreamError(f"malformed response ({reason})")

    def _push(self, data: bytes) -> None:
        if not data:
            return
        self._body.append(data)
        self._held += len(data)
        if self._held > MAX_HELD_BODY_BYTES and not self._is_paused and self.transport is not None:
            self._is_paused = True
            self.transport.pause_reading()
        self._wake()

    def _finish_body(self) -> None:
        self._state, self._body_done = _DONE, True
        self._wake()

    def _fail(self, exc: UpstreamError) -> None:
        self._error = exc
        self._state = _DONE
        self.keep_alive = False
        if self._head is not None and not self._head.done():
            self._head.set_exception(exc)
            self._head.exception()  # retrieved here: the caller may be gone (cancelled) by now
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class UpstreamResponse:
    """A member's answer: the status and headers at once, the body as it arrives. Release it when done."""

    def __init__(self, client: UpstreamClient, key: Origin, conn: _Connection, status: int,
                 headers: dict[str, str]) -> None:
        self.status = status
        self.headers = headers  # lower-case names
        self._client, self._key, self._conn = client, key, conn
        encoding = headers.get("content-encoding", "identity").lower()
        self._inflate = zlib.decompressobj(wbits=47) if encoding in ("gzip", "x-gzip", "deflate") else None

    async def iter_any(self) -> AsyncIterator[bytes]:
        """The body, in the pieces it arrived in (what came between two reads is joined)."""
        while (data := await self._conn.next_chunk()) is not None:
            if self._inflate is not None:
                try:
                    data = self._inflate.decompress(data)
                except zlib.error as exc:
                    raise UpstreamError(f"the member's {self.headers['content-encoding']} body is corrupt: "
                                        f"{exc}") from None
            if data:
                yield data

    async def read(self) -> bytes:
        return b"".join([data async for data in self.iter_any()])

    def release(self) -> None:
        """Give the connection back for reuse if its response was read to the end, else close it."""
        conn, self._conn = self._conn, None  # type: ignore[assignment]  # released: nothing reads the body after this
        if conn is not None:
            self._client._put_back(self._key, conn)


class UpstreamClient:
    """Keep-alive connections to the HTTP members (an async context manager: closes them all on exit)."""

    def __init__(self, max_idle_per_origin: int = MAX_IDLE_PER_ORIGIN, idle_timeout_s: float = IDLE_TIMEOUT_S,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self.max_idle_per_origin = max_idle_per_origin
        self.idle_timeout_s = idle_timeout_s
        self._ssl_context = ssl_context
        self._idle: dict[Origin, list[_Connection]] = {}
        self._busy: set[_Connection] = set()
        self._ticker: asyncio.TimerHandle | None = None
        self.num_connects = 0

    async def __aenter__(self) -> UpstreamClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            self._ticker = None
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()
        for conn in self._busy:
            conn.close()
        self._busy.clear()

    async def post(self, base_url: str, path: str, body: bytes, headers: dict[str, str],
                   first_byte_timeout_s: float | None = None, total_timeout_s: float | None = None
                   ) -> UpstreamResponse:
        """POST ``body`` to ``base_url + path``; return once the status line and headers are in.

        ``first_byte_timeout_s`` bounds connecting plus the wait for the status line, ``total_timeout_s``
        the whole answer (its body is read through the response): past either, :class:`UpstreamTimeout`.
        """
        key = origin_of(base_url)
        extra = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
        if extra.count("\n") != len(headers) or extra.count("\r") != len(headers):
            raise ValueError("a header name or value holds a line break")
        data = (f"POST {key.path_prefix}{path} HTTP/1.1\r\n".encode("latin-1") + key.head_prefix
                + f"Content-Length: {len(body)}\r\nAccept-Encoding: identity\r\n{extra}\r\n".encode("latin-1")
                + body)
        for attempt in range(2):
            conn, is_reused = self._take_idle(key), True
            if conn is None:
                started = asyncio.get_running_loop().time()
                try:
                    async with asyncio.timeout(first_byte_timeout_s):
                        conn, is_reused = await self._connect(key), False
                except TimeoutError:
                    raise UpstreamTimeout("first_byte", nothing_received=True) from None
                spent_s = asyncio.get_running_loop().time() - started
                first_byte_timeout_s = None if first_byte_timeout_s is None else first_byte_timeout_s - spent_s
                total_timeout_s = None if total_timeout_s is None else total_timeout_s - spent_s
            self._busy.add(conn)
            now = asyncio.get_running_loop().time()
            if self._ticker is None:
                self._ticker = asyncio.get_running_loop().call_at(now + DEADLINE_TICK_S, self._check_deadlines)
            try:
                status, response_headers = await conn.send(
                    data, now + (math.inf if first_byte_timeout_s is None else first_byte_timeout_s),
                    now + (math.inf if total_timeout_s is None else total_timeout_s))
            except UpstreamError as exc:
                self._busy.discard(conn)
                conn.close()
                if is_reused and exc.nothing_received and attempt == 0 and not isinstance(exc, UpstreamTimeout):
                    continue  # the member had closed this idle connection as we sent: once more, on a new one
                raise
            except BaseException:  # cancelled (the caller's timeout, the client went away): mid-request
                self._busy.discard(conn)
                conn.close()
                raise
            return UpstreamResponse(self, key, conn, status, response_headers)
        raise AssertionError("unreachable")

    def _check_deadlines(self) -> None:
        """Every :data:`DEADLINE_TICK_S` while requests are out: one timer for all of them, not two per request."""
        now = asyncio.get_running_loop().time()
        for conn in list(self._busy):
            conn.check_deadline(now)
        self._ticker = asyncio.get_running_loop().call_at(now + DEADLINE_TICK_S, self._check_deadlines) \
            if self._busy else None

    async def _connect(self, key: Origin) -> _Connection:
        loop = asyncio.get_running_loop()
        context = None
        if key.is_tls:
            context = self._ssl_context or ssl.create_default_context()
        _, conn = await loop.create_connection(_Connection, key.host, key.port, ssl=context,
                                               server_hostname=key.host if context else None)
        self.num_connects += 1
        return conn

    def _take_idle(self, key: Origin) -> _Connection | None:
        conns = self._idle.get(key)
        now = time.monotonic()
        while conns:
            conn = conns.pop()  # most recently used first: the one least likely to have been closed
            if not conn.is_closed and now - conn.idle_since < self.idle_timeout_s:
                return conn
            conn.close()
        return None

    def _put_back(self, key: Origin, conn: _Connection) -> None:
        self._busy.discard(conn)
        if not conn.is_reusable:
            conn.close()
            return
        conns = self._idle.setdefault(key, [])
        if len(conns) >= self.max_idle_per_origin:
            conns.pop(0).close()
        conn.idle_since = time.monotonic()
        conns.append(conn)
