"""The bus is a trust boundary (issue #25): the real `llmgw up`, attacked from loopback.

One stack serves every test of this module: its embedded nats-server refuses anonymous and wrong-password
clients, an engine's user cannot write the identity bucket, a forged (unsigned) key row is ignored while a
row signed with the fleet secret is taken (so the check can fail), the engine's own HTTP port wants the
internal key, and a chat still works through the official openai client.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import nats
import nats.js.errors
import openai
import pytest
from nats.errors import Error as NatsError

from proto import ApiKeyRow, encode_json, subjects
from services.common.nats_auth import url_with_credentials
from services.gateway import identity_signing
from services.gateway.identity import key_digest
from tests.e2e.procs import Followed, stop_stack

MODEL_ID = "tiny"


@dataclass
class UpStack:
    followed: Followed
    data: Path
    gateway_url: str
    nats_url: str  # without credentials
    key: str

    @property
    def creds(self) -> dict[str, str]:
        creds: dict[str, str] = json.loads((self.data / "nats" / "credentials.json").read_text())
        return creds

    def url_as(self, role: str, password: str | None = None) -> str:
        return url_with_credentials(self.nats_url, role, password if password is not None else self.creds[role])


@pytest.fixture(scope="module")
def up(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpStack]:
    data = tmp_path_factory.mktemp("bus-auth") / "data"
    env = {k: v for k, v in os.environ.items() if k not in ("NATS_URL", "LLMGW_FLEET_SECRET", "NINFER_API_KEY")}
    followed = Followed([sys.executable, "-m", "services.cli", "up", "--model", str(tiny_model), "--model-id",
                         MODEL_ID, "--port", "0", "--data-dir", str(data)], marker="llmgw is up.", env=env,
                        own_group=True)
    try:
        line = followed.wait_ready(180)
        gateway_url = line.split("Gateway: ", 1)[1].split()[0]
        nats_url = line.split("(NATS ", 1)[1].split(",", 1)[0]
        key = followed.line_with("API key: ").split("API key: ", 1)[1].split()[0]
        yield UpStack(followed, data, gateway_url, nats_url, key)
    finally:
        stop_stack(followed)


def chat(up: UpStack, key: str) -> str:
    client = openai.OpenAI(base_url=up.gateway_url + "/v1", api_key=key, max_retries=0)
    reply = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=4)
    return reply.choices[0].finish_reason or ""


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


@pytest.mark.slow
def test_the_stack_serves_a_chat_over_the_authenticated_bus(up: UpStack) -> None:
    assert chat(up, up.key) in ("stop", "length")
    assert "nats://" in up.nats_url and "@" not in up.nats_url  # the banner shows no password
    for name in ("nats/credentials.json", "nats/nats-server.conf", "engine.key", "fleet.secret", "stack.json"):
        assert (up.data / name).stat().st_mode & 0o077 == 0, name  # 0600: nobody else on the host reads them
    conf = (up.data / "nats" / "nats-server.conf").read_text()
    assert "$2a$" in conf and not any(p in conf for p in up.creds.values())  # hashes only
    # no service was refused anything it needs on the way
    assert "ermissions violation" not in up.followed.output.lower(), up.followed.output[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("who", ["anonymous", "wrong password", "unknown user"])
def test_a_client_without_the_right_credentials_is_refused(up: UpStack, who: str) -> None:
    url = {"anonymous": up.nats_url, "wrong password": up.url_as("engine", "not-the-password"),
           "unknown user": url_with_credentials(up.nats_url, "mallory", "x")}[who]

    async def attempt() -> None:
        await nats.connect(url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=5)

    with pytest.raises(NatsError, match="Authorization Violation"):
        run(attempt())


@pytest.mark.slow
@pytest.mark.parametrize("role", ["engine", "telemetry", "accounting"])
def test_only_the_gateway_may_write_or_read_the_identity_bucket(up: UpStack, role: str) -> None:
    errors: list[str] = []

    async def attempt() -> tuple[list[str], bool]:
        async def on_error(exc: Exception) -> None:
            errors.append(str(exc))

        nc = await nats.connect(up.url_as(role), error_cb=on_error, allow_reconnect=False)
        try:
            await nc.publish(f"$KV.{subjects.KV_IDENTITY}.users.evil", b'{"role":"admin"}')
            await nc.flush()
            can_read = True
            try:
                await nc.jetstream().key_value(subjects.KV_IDENTITY)
            except Exception:
                can_read = False
            await asyncio.sleep(0.3)
        finally:
            await nc.close()
        async with await_admin(up) as admin:
            # asked by key, not by listing: nats-py's keys() can time out empty-handed on a loaded machine
            kv = await admin.jetstream().key_value(subjects.KV_IDENTITY)
            try:
                await kv.get("users.evil")
                planted = True
            except nats.js.errors.KeyNotFoundError:
                planted = False
        return planted, can_read

    planted, can_read = run(attempt())
    assert any("permissions violation for publish" in e for e in errors), errors
    assert not planted
    assert not can_read
    # the same user may do its own job: an engine or telemetry user publishes a heartbeat subject
    if role in ("engine", "telemetry"):
        errors.clear()

        async def heartbeat() -> None:
            async def on_error(exc: Exception) -> None:
                errors.append(str(exc))

            nc = await nats.connect(up.url_as(role), error_cb=on_error, allow_reconnect=False)
            await nc.publish(subjects.heartbeat(engine_id(up) if role == "engine" else "probe"), b"")
            await nc.flush()
            await asyncio.sleep(0.2)
            await nc.close()

        run(heartbeat())
        assert errors == []


def engine_id(up: UpStack) -> str:
    """The stack's engine's bus worker id, from its start line."""
    return up.followed.line_with("bus worker ").split("bus worker ", 1)[1].split()[0].rstrip(";,")


@pytest.mark.slow
def test_an_engine_user_speaks_only_for_its_own_engine_and_cannot_empty_the_ledger(up: UpStack) -> None:
    """The stack's engine user may heartbeat for its own engine id only, take only its own requests, and no
    role but admin may purge or delete a stream or loosen its limits (what the old wildcard engine user could)."""
    own = engine_id(up)
    errors: list[str] = []

    async def attempt() -> dict[str, bool]:
        async def on_error(exc: Exception) -> None:
            errors.append(str(exc))

        nc = await nats.connect(up.url_as("engine"), error_cb=on_error, allow_reconnect=False)
        js = nc.jetstream(timeout=3)
        refused: dict[str, bool] = {}
        try:
            await nc.publish(subjects.heartbeat("someone-else"), b"")
            await nc.publish(subjects.energy("someone-else"), b"")
            await nc.publish(f"$KV.{subjects.KV_WORKERS}.someone-else", b"")
            await nc.subscribe(subjects.gen("someone-else"))
            await nc.flush()
            await asyncio.sleep(0.3)
            for name, call in (("purge", lambda: js.purge_stream(subjects.STREAM_USAGE)),
                               ("delete", lambda: js.delete_stream(subjects.STREAM_ENERGY)),
                               ("loosen", lambda: js.update_stream(name=subjects.STREAM_USAGE,
                                                                     subjects=[subjects.USAGE_SUBJECTS], max_age=1.0))):
                try:
                    await call()
                    refused[name] = False
                except Exception:
                    refused[name] = True
        finally:
            await nc.close()
        async with await_admin(up) as admin:  # the ledger's stream is as it was
            info = await admin.jetstream().stream_info(subjects.STREAM_USAGE)
            refused["limits kept"] = info.config.max_age == 30 * 24 * 3600.0
            await admin.jetstream().stream_info(subjects.STREAM_ENERGY)  # still there
        return refused

    refused = run(attempt())
    assert all(refused.values()), refused
    text = " ".join(errors).lower()  # nats-py lowercases the server's -ERR text
    for subject in (subjects.heartbeat("someone-else"), subjects.energy("someone-else"),
                    f"$KV.{subjects.KV_WORKERS}.someone-else"):
        assert f'publish to "{subject.lower()}"' in text, errors
    assert f'subscription to "{subjects.gen("someone-else")}"' in text, errors
    assert own != "someone-else" and chat(up, up.key) in ("stop", "length")  # its own engine still serves

    errors.clear()

    async def telemetry_as_the_engine() -> None:  # telemetry speaks for scraped members, not for our engine
        async def on_error(exc: Exception) -> None:
            errors.append(str(exc))

        nc = await nats.connect(up.url_as("telemetry"), error_cb=on_error, allow_reconnect=False)
        await nc.publish(subjects.heartbeat(own), b"")
        await nc.flush()
        await asyncio.sleep(0.3)
        await nc.close()

    run(telemetry_as_the_engine())
    assert any(f'publish to "{subjects.heartbeat(own).lower()}"' in e.lower() for e in errors), errors


@contextlib.asynccontextmanager
async def await_admin(up: UpStack) -> AsyncIterator[nats.NATS]:
    """A bus connection as the stack's admin user (the operator's full permissions)."""
    nc = await nats.connect(up.url_as("admin"), allow_reconnect=False)
    try:
        yield nc
    finally:
        await nc.close()


def _admin_user_id(up: UpStack) -> str:
    async def read() -> str:
        async with await_admin(up) as nc:
            kv = await nc.jetstream().key_value(subjects.KV_IDENTITY)
            for key in await kv.keys():
                if key.startswith("users."):
                    entry = await kv.get(key)
                    assert entry.value is not None
                    row = json.loads(entry.value)
                    if row["name"] == "admin":
                        return str(row["user_id"])
        raise AssertionError("no admin row in the bucket")

    result: str = run(read())
    return result


def _key_row(user_id: str, key: str, key_id: str) -> bytes:
    now = time.time()
    return encode_json(ApiKeyRow(key_id=key_id, user_id=user_id, name="planted", key_sha256=key_digest(key),
                                 hint=key[-4:], daily_quota=None, created_s=now, expires_s=None,
                                 revoked_s=None, replaced_by=None, updated_s=now))


def _put(up: UpStack, key: str, value: bytes) -> None:
    async def put() -> None:
        async with await_admin(up) as nc:
            await (await nc.jetstream().key_value(subjects.KV_IDENTITY)).put(key, value)

    run(put())


def _accepted(up: UpStack, key: str, timeout_s: float = 20.0) -> bool:
    """Whether the gateway takes ``key`` within ``timeout_s`` (rows arrive by subscription at once, or by the
    15 s resync)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            chat(up, key)
            return True
        except openai.AuthenticationError:
            time.sleep(0.3)
    return False


@pytest.mark.slow
def test_a_forged_unsigned_key_row_is_ignored_and_a_signed_one_is_taken(up: UpStack) -> None:
    user_id = _admin_user_id(up)
    # A client that reaches the bucket (here with the admin's bus user, i.e. past the permissions) plants
    # a key for the admin: without the fleet secret's signature the gateway ignores it, and says so once.
    forged = "sk-forged-" + "a" * 30
    _put(up, "api_keys.forged1", _key_row(user_id, forged, "forged1"))
    assert not _accepted(up, forged, timeout_s=3.0)
    up.followed.line_with("its signature is missing", timeout_s=10)
    bad = "sk-forged-" + "b" * 30
    wrong_secret = identity_signing.sign(b"not-the-fleet-secret", "api_keys.forged2", _key_row(user_id, bad, "forged2"))
    _put(up, "api_keys.forged2", wrong_secret)
    assert not _accepted(up, bad, timeout_s=3.0)
    up.followed.line_with("its signature is bad", timeout_s=10)
    # The same row signed with the fleet's secret is what a gateway writes: taken (the check can fail).
    good = "sk-signed-" + "c" * 30
    secret = (up.data / "fleet.secret").read_text().strip().encode()
    _put(up, "api_keys.signed1", identity_signing.sign(secret, "api_keys.signed1", _key_row(user_id, good, "signed1")))
    assert _accepted(up, good)


@pytest.mark.slow
def test_the_engines_own_http_port_wants_the_internal_key(up: UpStack) -> None:
    line = up.followed.line_with("llmgw engine ready: ")
    engine_url = re.search(r"listening on (http://\S+)", line)
    assert engine_url is not None, line
    for key in ("not-the-key", up.key):  # a gateway key is no engine key
        client = openai.OpenAI(base_url=engine_url.group(1) + "/v1", api_key=key, max_retries=0)
        with pytest.raises(openai.AuthenticationError) as refused:
            client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert refused.value.status_code == 401
        assert isinstance(refused.value.body, dict) and refused.value.body.get("code") == "invalid_api_key"
    internal = (up.data / "engine.key").read_text().strip()
    client = openai.OpenAI(base_url=engine_url.group(1) + "/v1", api_key=internal, max_retries=0)
    reply = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert reply.choices[0].finish_reason in ("stop", "length")
