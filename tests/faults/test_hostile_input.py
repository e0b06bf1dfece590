"""Issue #12 (5): hostile input against every public endpoint of the gateway's own OpenAPI document.

Property: whatever arrives, the answer is never a 5xx, never a traceback, and every error is an OpenAI
error body ``{"error": {"message", "type", "param", "code"}}``. Hypothesis generates the inputs; the
targeted cases below pin the classic ones (huge and deeply nested bodies, invalid UTF-8, absurd
``max_tokens``, unknown roles, control characters in headers, slow-loris clients).
"""

from __future__ import annotations

import json
import logging
import socket
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.gateway.openapi import document
from tests.faults.conftest import LogCounter
from tests.faults.threaded import ThreadedGateway, threaded_gateway

IDLE_TIMEOUT_S = 1.5
BODY_TIMEOUT_S = 1.5
TRIED: dict[str, int] = {}


@pytest.fixture(scope="module")
def logs() -> Iterator[LogCounter]:
    counter = LogCounter()
    root = logging.getLogger()
    root.addHandler(counter)
    try:
        yield counter
    finally:
        root.removeHandler(counter)


@pytest.fixture(scope="module")
def tg(tmp_path_factory: pytest.TempPathFactory, logs: LogCounter) -> Iterator[ThreadedGateway]:
    with threaded_gateway(Path(tmp_path_factory.mktemp("hostile")), idle_timeout_s=IDLE_TIMEOUT_S,
                          body_timeout_s=BODY_TIMEOUT_S) as gateway:
        yield gateway
    assert logs.lines(logging.ERROR) == []  # no unhandled error in the whole module
    print(f"\nFIGURES hostile-input: inputs_tried={TRIED} server_errors=0")


@pytest.fixture(scope="module")
def client(tg: ThreadedGateway) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=tg.url, timeout=30) as c:
        yield c


def _check(resp: httpx.Response) -> None:
    assert resp.status_code < 500, (resp.status_code, resp.text[:500])
    assert "Traceback" not in resp.text
    if resp.status_code >= 400:
        err = resp.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str)


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=20)
ROLES = st.sampled_from(["system", "developer", "user", "assistant", "tool"]) | st.text(max_size=12) | JSON
MESSAGE = st.fixed_dictionaries({"role": ROLES}, optional={
    "content": st.text() | st.lists(st.fixed_dictionaries({"type": st.just("text") | st.text(max_size=5),
                                                           "text": st.text() | JSON}), max_size=3) | JSON,
    "name": st.text(max_size=10) | JSON})
NUMBER = st.integers(min_value=-2**70, max_value=2**70) | st.floats(allow_nan=True, allow_infinity=True) | JSON
FIELDS = {"max_tokens": NUMBER, "max_completion_tokens": NUMBER, "temperature": NUMBER, "top_p": NUMBER,
          "top_k": NUMBER, "seed": NUMBER, "n": NUMBER, "stop": st.text() | st.lists(st.text(), max_size=6) | JSON,
          "stream": st.booleans() | JSON,
          "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | JSON,
          "ignore_eos": st.booleans() | JSON, "logprobs": JSON, "extra": JSON}
MODEL = st.sampled_from(["m", "nope"]) | st.text(max_size=20) | JSON


def _bodies(kind: str) -> st.SearchStrategy[Any]:
    main = {"chat": {"messages": st.lists(MESSAGE, max_size=4) | JSON},
            "completion": {"prompt": st.text() | JSON},
            "embeddings": {"input": st.text() | st.lists(st.text(), max_size=3) | JSON}}[kind]
    shaped = st.fixed_dictionaries({"model": MODEL, **main}, optional=FIELDS)
    return shaped | JSON


POSTS = {"/v1/chat/completions": "chat", "/v1/completions": "completion", "/v1/embeddings": "embeddings"}
RAW = st.binary(max_size=300) | st.text(max_size=300).map(lambda t: t.encode("utf-8", "surrogatepass"))


def test_the_fuzz_covers_every_public_endpoint() -> None:
    documented = set(document()["paths"])
    covered = set(POSTS) | {"/v1/models", "/v1/models/{model_id}", "/health", "/backends", "/metrics",
                            "/openapi.json"}
    assert documented == covered


@pytest.mark.slow
@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(sorted(POSTS)), data=st.data(), authed=st.booleans(), raw=st.booleans())
def test_posts_never_fail_with_a_5xx_or_a_traceback(client, tg, path, data, authed, raw) -> None:  # type: ignore[no-untyped-def]
    headers = {"Authorization": f"Bearer {tg.gw.api_key}"} if authed else {}
    if raw:
        content = data.draw(RAW)
    else:
        content = json.dumps(data.draw(_bodies(POSTS[path])), allow_nan=True).encode()
    session = data.draw(st.none() | st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7e), min_size=1,
                                            max_size=40))
    if session is not None:
        headers["X-Session-Id"] = session
    TRIED[path] = TRIED.get(path, 0) + 1
    _check(client.post(path, content=content, headers={"Content-Type": "application/json", **headers}))


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(["/v1/models", "/v1/models/{}", "/health", "/backends", "/metrics", "/openapi.json"]),
       segment=st.text(max_size=30), query=st.text(max_size=30), accept=st.sampled_from(["*/*", "application/json",
                                                                                        "text/html"]))
def test_gets_never_fail_with_a_5xx_or_a_traceback(client, path, segment, query, accept) -> None:  # type: ignore[no-untyped-def]
    url = path.replace("{}", urllib.parse.quote(segment, safe="") or "x")
    TRIED[path] = TRIED.get(path, 0) + 1
    _check(client.get(url, params={"q": query}, headers={"Accept": accept}))


def _auth(tg: ThreadedGateway) -> dict[str, str]:
    return {"Authorization": f"Bearer {tg.gw.api_key}", "Content-Type": "application/json"}


def test_classic_hostile_bodies_get_openai_errors_not_500s(client, tg) -> None:  # type: ignore[no-untyped-def]
    url = "/v1/chat/completions"
    cases: dict[str, tuple[bytes, int]] = {
        "huge body": (b'{"model":"m","messages":[{"role":"user","content":"' + b"x" * (5 * 1024 * 1024) + b'"}]}', 413),
        "deeply nested": (b'{"model":"m","messages":' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400),
        "deep objects": (b'{"model":"m","x":' + b'{"a":' * 50_000 + b"1" + b"}" * 50_000 + b"}", 400),
        "invalid utf-8": (b'{"model":"m","messages":[{"role":"user","content":"\xff\xfe\xc3"}]}', 400),
        "lone surrogate": (b'{"model":"m","messages":[{"role":"user","content":"\\ud800"}]}', 400),
        "nul bytes": (b'{"model":"m","messages":[{"role":"user","content":"a\\u0000b"}]}', 200),
        "negative max_tokens": (b'{"model":"m","messages":[{"role":"user","content":"a"}],"max_tokens":-5}', 400),
        "huge max_tokens": (b'{"model":"m","messages":[{"role":"user","content":"a"}],"max_tokens":'
                            + b"9" * 400 + b"}", 400),
        "huge seed": (b'{"model":"m","messages":[{"role":"user","content":"a"}],"seed":' + b"9" * 30 + b"}", 400),
        "float max_tokens": (b'{"model":"m","messages":[{"role":"user","content":"a"}],"max_tokens":1e308}', 400),
        "unknown role": (b'{"model":"m","messages":[{"role":"wizard","content":"a"}]}', 400),
        "role not a string": (b'{"model":"m","messages":[{"role":["user"],"content":"a"}]}', 400),
        "not an object": (b"[1,2,3]", 400),
        "empty": (b"", 400),
        "truncated": (b'{"model":"m","messages":[', 400),
    }
    statuses = {}
    for name, (body, expected) in cases.items():
        resp = client.post(url, content=body, headers=_auth(tg))
        _check(resp)
        statuses[name] = resp.status_code
    TRIED["classic"] = len(cases)
    assert statuses == {name: expected for name, (_, expected) in cases.items()}


def _raw(tg: ThreadedGateway, data: bytes, timeout_s: float = 10.0) -> bytes:
    host, port = tg.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout_s) as s:
        s.sendall(data)
        chunks = []
        while True:
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                break
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)


def test_control_characters_in_headers_are_refused_with_400(tg) -> None:  # type: ignore[no-untyped-def]
    body = b'{"model":"m","messages":[{"role":"user","content":"a"}]}'
    for header in (b"X-Session-Id: a\x00b", b"X-Session-Id: a\x01\x7fb", b"Authorization: Bearer sk-\x00",
                   b"X-Bad\x07Name: 1", b"X-Session-Id: a\rb"):
        reply = _raw(tg, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + header + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n"
                     + body)
        status = int(reply.split(b" ", 2)[1])
        assert status in (400, 401), reply[:200]
        assert b"Traceback" not in reply
    TRIED["header control characters"] = 5


def test_a_slow_loris_client_is_cut_off(tg) -> None:  # type: ignore[no-untyped-def]
    host, port = tg.url.removeprefix("http://").split(":")
    # headers trickled a byte at a time: the connection is closed once the idle timeout has run
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 200
    started = time.monotonic()
    closed_after = None
    with socket.create_connection((host, int(port)), timeout=5) as s:
        try:
            for byte in head:
                s.sendall(bytes([byte]))
                s.settimeout(0.1)
                try:
                    if s.recv(1024) == b"":
                        closed_after = time.monotonic() - started
                        break
                except TimeoutError:
                    pass
        except (BrokenPipeError, ConnectionResetError):
            closed_after = time.monotonic() - started
    assert closed_after is not None and closed_after < IDLE_TIMEOUT_S + 1.5, closed_after
    # a complete head, then the body trickled: 408 once the body timeout has run
    started = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + tg.gw.api_key.encode() + b"\r\nContent-Length: 1000\r\n\r\n{")
        s.settimeout(0.2)
        reply = b""
        for _ in range(50):
            try:
                s.sendall(b" ")
                reply += s.recv(4096)
                if reply:
                    break
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                break
    body_cut_s = time.monotonic() - started
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert b'"code":"body_timeout"' in reply.replace(b" ", b"")
    assert body_cut_s < BODY_TIMEOUT_S + 1.0
    TRIED["slow loris"] = 2
    print(f"\nFIGURES slow-loris: head_cut_after_s={closed_after:.2f} body_cut_after_s={body_cut_s:.2f}")
