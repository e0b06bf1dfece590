"""Issue #12 (5): hostile input against the HTTP endpoints of the other services: the engine (``ninfer-serve``:
``/v1/*``, ``/health``, ``/slots``, ``/usage``, ``/metrics``), telemetry (``/metrics``, ``/members``,
``/health``) and accounting (``POST /sql``, ``GET /costs``, ``/health``).

The engine and telemetry run as their real commands; accounting runs in process next to the gateway that
answers its key checks. Property: no 5xx, no traceback, every error an OpenAI error body; and enough valid,
authenticated cases among the hostile ones that the served path (200) is fuzzed too.
"""

from __future__ import annotations

import json
import socket
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.gateway.identity import hash_password
from tests.faults.conftest import WATCH, engine_proc, procs, telemetry_proc
from tests.faults.fuzz import BODY_MODES, JSON, NUMBER, TEXT, Tally, check, hostile_json
from tests.faults.threaded import ThreadedGateway, threaded_gateway

ENGINE_KEY = "engine-key-for-the-fuzz-0123456789"
# a short context keeps every generation the fuzz can ask for short: max_tokens beyond it is a 400
ENGINE_FLAGS = ("--api-key", ENGINE_KEY, "--max-context", "256", "--max-concurrency", "4")
USER_PASSWORD = "services-fuzz-user-password"
TALLY = Tally()


@dataclass
class Stack:
    tg: ThreadedGateway
    engine_url: str
    telemetry_url: str
    accounting_url: str
    user_key: str


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Stack]:
    tmp = Path(tmp_path_factory.mktemp("services"))
    with threaded_gateway(tmp, with_accounting=True) as tg, procs() as started:
        engine = engine_proc(tiny_model, tg.nats_url, "fz", tmp / "engine", *ENGINE_FLAGS)
        started.append(engine)
        engine.start_sync()
        telemetry = telemetry_proc(tg.nats_url, tmp / "telemetry", "--member", f"fzhttp={engine.url}",
                                   "--interval", "0.5")
        started.append(telemetry)
        telemetry.start_sync()
        identity = tg.gw.gateway.identity

        def user_key() -> str:
            user = identity.create_user("svcfuzz", hash_password(USER_PASSWORD), "user")
            return identity.create_key(user.user_id, "k", None, time.time())[0]  # type: ignore[no-any-return]

        key = tg.call(user_key)
        WATCH.add("services fuzz user key", key)
        WATCH.add("services fuzz user password", USER_PASSWORD)
        assert tg.accounting_url is not None
        yield Stack(tg, engine.url, telemetry.url, tg.accounting_url, key)
        assert "Traceback" not in engine.output and "Traceback" not in telemetry.output
    print(f"\nFIGURES hostile-services: {TALLY} server_errors=0")


def _client(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=30)


# ---- the engine -------------------------------------------------------------------------------------------

ENGINE_VALID = {"/v1/chat/completions": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                         "max_tokens": 4},
                "/v1/completions": {"model": "tiny", "prompt": "hi", "max_tokens": 4}}
ENGINE_FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p",
                 "top_k", "seed", "n", "stop", "stream", "stream_options", "ignore_eos", "logprobs", "top_logprobs",
                 "min_tokens", "repetition_penalty", "presence_penalty", "frequency_penalty", "tools",
                 "tool_choice", "parallel_tool_calls",
                 "response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                 "structured_outputs", "logit_bias", "min_p"]
ENGINE_GETS = ["/v1/models", "/v1/models/{}", "/health", "/slots", "/usage", "/metrics", "/{}"]
KEYS = ["the key"] * 5 + ["none", "a wrong one", "not bearer"]


def _engine_auth(which: str) -> dict[str, str]:
    return {"the key": {"Authorization": f"Bearer {ENGINE_KEY}"}, "none": {},
            "a wrong one": {"Authorization": "Bearer wrong"}, "not bearer": {"Authorization": ENGINE_KEY}}[which]


@pytest.mark.slow
def test_the_engines_endpoints_never_fail_with_a_5xx(stack: Stack) -> None:
    with _client(stack.engine_url) as client:
        @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(path=st.sampled_from(sorted(ENGINE_VALID)), data=st.data(), key=st.sampled_from(KEYS),
               mode=BODY_MODES)
        def posts(path: str, data: st.DataObject, key: str, mode: str) -> None:
            content = hostile_json(data, mode, ENGINE_VALID[path], st.sampled_from(ENGINE_FIELDS), NUMBER | TEXT)
            resp = check(client.post(path, content=content, headers={"Content-Type": "application/json",
                                                                     **_engine_auth(key)}),
                         TALLY, f"engine POST {path}", json_errors=True)
            if key != "the key":
                assert resp.status_code == 401

        @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(path=st.sampled_from(ENGINE_GETS),
               model_id=st.just("tiny") | st.text(max_size=20), key=st.sampled_from(KEYS), query=st.text(max_size=20))
        def gets(path: str, model_id: str, key: str, query: str) -> None:
            url = path.replace("{}", urllib.parse.quote(model_id, safe="") or "x")
            resp = check(client.get(url, params={"q": query}, headers=_engine_auth(key)), TALLY, f"engine GET {path}",
                         json_errors=True)
            is_model = path == "/v1/models" or (path == "/v1/models/{}" and model_id == "tiny")
            if path in ("/health", "/slots", "/usage", "/metrics") or (is_model and key == "the key"):
                assert resp.status_code == 200, (url, resp.status_code)

        posts()
        gets()
    served = sum(TALLY.num(f"engine POST {p}", 200) for p in ENGINE_VALID)
    assert served > 0  # generation itself was fuzzed, not only validation


# ---- telemetry --------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_telemetrys_endpoints_never_fail_with_a_5xx(stack: Stack) -> None:
    with _client(stack.telemetry_url) as client:
        @settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(path=st.sampled_from(["/metrics", "/members", "/health", "/{}"]), segment=st.text(max_size=20),
               query=st.text(max_size=30), accept=st.sampled_from(["*/*", "application/json", "text/plain"]),
               method=st.sampled_from(["GET", "GET", "GET", "POST", "DELETE"]))
        def fuzz(path: str, segment: str, query: str, accept: str, method: str) -> None:
            url = path.replace("{}", urllib.parse.quote(segment, safe="") or "x")
            resp = check(client.request(method, url, params={"q": query}, headers={"Accept": accept}), TALLY,
                         f"telemetry {method} {path}", json_errors=True)
            if method == "GET" and path != "/{}":
                assert resp.status_code == 200

        fuzz()
        members = client.get("/members").json()
    assert "fzhttp" in json.dumps(members)  # it watches the engine it was given


# ---- accounting -------------------------------------------------------------------------------------------

SELECTS = ["SELECT 1", "SELECT count(*) FROM requests", "SELECT * FROM requests LIMIT 3",
           "SELECT * FROM sample_log LIMIT 2", "SELECT 'a' || 'b'"]
SQL = st.sampled_from(SELECTS) | TEXT | st.text(st.sampled_from(list("SELECT *FROM;()'\"-/\\0123456789,")), max_size=40)
CALLERS = ["admin key", "admin key", "admin key", "user key", "nobody", "garbage"]


@pytest.mark.slow
def test_accountings_endpoints_never_fail_with_a_5xx(stack: Stack) -> None:
    keys = {"admin key": {"Authorization": f"Bearer {stack.tg.gw.api_key}"},
            "user key": {"Authorization": f"Bearer {stack.user_key}"}, "nobody": {},
            "garbage": {"Authorization": "Bearer sk-garbage"}}
    with _client(stack.accounting_url) as client:
        @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(caller=st.sampled_from(CALLERS), data=st.data(),
               mode=st.sampled_from(["sql", "sql", "sql", "any JSON", "raw bytes", "costs", "costs", "health"]))
        def fuzz(caller: str, data: st.DataObject, mode: str) -> None:
            headers = keys[caller]
            if mode == "costs":
                days = data.draw(st.sampled_from(["1", "30", "366"]) | TEXT | st.integers().map(str))
                resp = client.get("/costs", params={"days": days}, headers=headers)
            elif mode == "health":
                resp = client.get("/health", params={"q": data.draw(TEXT)}, headers=headers)
            else:
                body: Any = {"sql": data.draw(SQL)} if mode == "sql" else data.draw(JSON)
                content = json.dumps(body, allow_nan=True).encode() if mode != "raw bytes" else data.draw(st.binary())
                resp = client.post("/sql", content=content, headers={"Content-Type": "application/json", **headers})
            check(resp, TALLY, f"accounting {mode} {caller}", json_errors=True)
            if mode != "health":
                expected = {"nobody": 401, "garbage": 401, "user key": 403}.get(caller)
                assert expected is None or resp.status_code == expected, (caller, resp.status_code)

        fuzz()
    served = TALLY.num("accounting sql admin key", 200) + TALLY.num("accounting costs admin key", 200)
    assert served > 0


def _raw_status(url: str, request: bytes) -> tuple[int, bytes]:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(request)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    reply = b"".join(chunks)
    return int(reply.split(b" ", 2)[1]), reply


def test_header_bytes_that_are_not_utf8_are_refused_on_every_service(stack: Stack) -> None:
    """Issue #25: `Authorization: Bearer \\xff` and `Cookie: llmgw_session=a.\\xe9` gave a 500 with a
    traceback, unauthenticated, on the gateway, accounting and engine."""
    targets = {"gateway": (stack.tg.url, b"/v1/chat/completions"), "accounting": (stack.accounting_url, b"/sql"),
               "engine": (stack.engine_url, b"/v1/chat/completions"), "telemetry": (stack.telemetry_url, b"/fleet")}
    body = b'{"model":"m","messages":[{"role":"user","content":"a"}]}'
    for name, (url, path) in targets.items():
        for header, expected in ((b"Authorization: Bearer \xff", 401), (b"Cookie: llmgw_session=a.\xe9", 400),
                                 (b"X-Session-Id: \xc3\x28", 400)):
            status, reply = _raw_status(url, b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Type: "
                                        b"application/json\r\n" + header + b"\r\nContent-Length: "
                                        + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
            assert (name, header, status) == (name, header, expected), reply[-300:]
            assert b"Traceback" not in reply and b'"error"' in reply
        status, reply = _raw_status(url, b"GET / HTTP/1.1\r\nHost: x\r\nCookie: llmgw_session=a.\xe9\r\n"
                                         b"Connection: close\r\n\r\n")
        assert status == 400, (name, reply[-300:])
