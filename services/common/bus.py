"""NATS connection and the idempotent creation of the streams and the KV bucket."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path

import nats
from nats.aio.client import Client
from nats.js.api import DiscardPolicy, KeyValueConfig, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError, NotFoundError

from proto import subjects
from services.common.nats_server import EmbeddedNatsServer

log = logging.getLogger(__name__)

# JetStream de-duplicates messages with the same Nats-Msg-Id inside this window (seconds): a producer
# that retries after a lost ack never stores a record twice.
DUPLICATE_WINDOW_S = 600.0


def _stream_config(name: str, subject: str) -> StreamConfig:
    return StreamConfig(
        name=name,
        subjects=[subject],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        discard=DiscardPolicy.OLD,
        duplicate_window=DUPLICATE_WINDOW_S,
        max_age=30 * 24 * 3600.0,
    )


def stream_configs() -> list[StreamConfig]:
    return [
        _stream_config(subjects.STREAM_USAGE, subjects.USAGE_SUBJECTS),
        _stream_config(subjects.STREAM_ENERGY, subjects.ENERGY_SUBJECTS),
    ]


_COMPARED = ("subjects", "retention", "storage", "discard", "duplicate_window", "max_age")


def _differs(have: StreamConfig, want: StreamConfig) -> list[str]:
    """The fields ``want`` sets that the stored stream holds otherwise."""
    return [f for f in _COMPARED if getattr(have, f) != getattr(want, f)]


async def ensure_bus(nc: Client) -> None:
    """Create the USAGE and ENERGY streams and the workers KV bucket when missing; safe to call from every
    service. A stream that exists with other limits is updated only when they differ, and a service whose
    bus user may not change a stream's limits (every role but accounting and admin:
    services/common/nats_auth.py) logs what differs and carries on with the stream as it is."""
    js = nc.jetstream()
    for config in stream_configs():
        assert config.name is not None  # _stream_config always names the stream
        try:
            info = await js.stream_info(config.name)
        except NotFoundError:
            try:
                await js.add_stream(config)
                continue
            except BadRequestError:  # another service created it in between
                info = await js.stream_info(config.name)
        if fields := _differs(info.config, config):
            try:
                await js.update_stream(config)
            except Exception as exc:  # a bus user without STREAM.UPDATE: no reply comes (a timeout)
                log.warning("stream %s differs in %s from this version's; not updated here (%s): the accounting "
                            "service or an admin updates it", config.name, ", ".join(fields), type(exc).__name__)
    try:
        await js.key_value(subjects.KV_WORKERS)
    except Exception:
        with contextlib.suppress(BadRequestError):
            await js.create_key_value(
                KeyValueConfig(bucket=subjects.KV_WORKERS, history=1, ttl=3600.0, storage=StorageType.FILE)
            )


async def connect(url: str, name: str) -> Client:
    """Connect with unlimited reconnects, so a restarted nats-server is rejoined by itself."""

    async def on_error(exc: Exception) -> None:
        log.warning("nats error (%s): %s", name, exc)

    async def on_disconnect() -> None:
        # Also called on a deliberate close; a real outage shows as the reconnect that follows.
        log.info("nats disconnected (%s)", name)

    async def on_reconnect() -> None:
        log.info("nats reconnected (%s)", name)

    return await nats.connect(
        [u.strip() for u in url.split(",") if u.strip()],  # several cluster nodes: "nats://a:4222,nats://b:4222"
        name=name,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        connect_timeout=5,
        drain_timeout=5,
        error_cb=on_error,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
    )


def nats_url_from_env(flag: str | None) -> str | None:
    return flag or os.environ.get("NATS_URL") or None


async def drain_quietly(nc: Client) -> None:
    """At shutdown: drain the connection, or just close it when the server is gone already (``llmgw up``
    stops everything at once on Ctrl-C); never a traceback for that."""
    try:
        await nc.drain()
    except Exception:
        with contextlib.suppress(Exception):
            await nc.close()


@contextlib.asynccontextmanager
async def bus_session(url: str | None, name: str, data_dir: Path) -> AsyncIterator[Client]:
    """Connect to ``url``; when None, run an embedded nats-server for the session's lifetime."""
    async with contextlib.AsyncExitStack() as stack:
        if url is None:
            server = await stack.enter_async_context(EmbeddedNatsServer(data_dir / "nats"))
            url = server.url
        nc = await connect(url, name)
        try:
            await ensure_bus(nc)
            yield nc
        finally:
            await drain_quietly(nc)
