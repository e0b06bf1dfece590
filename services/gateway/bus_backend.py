"""The bus hop to our engines: GenerateRequest out on ``llm.v1.gen.<worker>``, TokenChunks back on an inbox."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from nats.aio.client import Client
from nats.aio.subscription import Subscription
from nats.errors import TimeoutError as NatsTimeout

from proto import GenerateRequest, ProtoDecodeError, TokenChunk, decode, encode, subjects
from services.common.http import HTTPError
from services.common.openai_stream import chunk_error
from services.common.runtime import raise_if_cancelling


class WorkerUnavailable(Exception):
    """The worker did not accept the request (no responder, silence, or an error before any token)."""

    def __init__(self, worker_id: str, reason: str, error: HTTPError | None = None) -> None:
        super().__init__(f"{worker_id}: {reason}")
        self.worker_id = worker_id
        self.reason = reason
        self.error = error


class BusStream:
    """One accepted request's reply stream; close it to stop listening."""

    def __init__(self, sub: Subscription, first: TokenChunk, chunk_timeout_s: float) -> None:
        self.sub = sub
        self.first = first
        self.chunk_timeout_s = chunk_timeout_s

    async def chunks(self) -> AsyncIterator[TokenChunk]:
        yield self.first
        expected = self.first.index + 1
        chunk = self.first
        while not chunk.is_final:
            try:
                msg = await self.sub.next_msg(timeout=self.chunk_timeout_s)
            except (NatsTimeout, TimeoutError):
                raise_if_cancelling()
                raise HTTPError(503, "the engine stopped responding mid-request", code="upstream_timeout",
                                retry_after_s=5) from None
            try:
                chunk = decode(msg.data, TokenChunk)
            except ProtoDecodeError as exc:
                raise HTTPError(503, f"the engine sent a malformed chunk: {exc.reason}", code="upstream_garbled",
                                retry_after_s=1) from None
            if chunk.index != expected:
                raise HTTPError(503, f"lost part of the engine's reply (chunk {expected} missing)",
                                code="upstream_gap", retry_after_s=1)
            expected += 1
            yield chunk

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.sub.unsubscribe()


async def start(nc: Client, worker_id: str, generate: GenerateRequest, first_chunk_timeout_s: float,
                chunk_timeout_s: float) -> BusStream:
    """Send the request and wait for the worker's acceptance (chunk 0) or refusal."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    try:
        await nc.publish(subjects.gen(worker_id), encode(generate), reply=inbox)
        try:
            msg = await sub.next_msg(timeout=first_chunk_timeout_s)
        except (NatsTimeout, TimeoutError):
            raise_if_cancelling()  # the client left: not a reason to fail over
            raise WorkerUnavailable(worker_id, "silent past the first-chunk deadline") from None
        if msg.headers and msg.headers.get("Status") == "503":
            raise WorkerUnavailable(worker_id, "no responder on its subject")
        try:
            first = decode(msg.data, TokenChunk)
        except ProtoDecodeError as exc:
            raise WorkerUnavailable(worker_id, exc.reason) from None
        if first.error is not None:
            raise WorkerUnavailable(worker_id, first.error.message, chunk_error(first))
        return BusStream(sub, first, chunk_timeout_s)
    except BaseException:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
        raise


async def cancel(nc: Client, worker_id: str, request_id: str) -> None:
    with contextlib.suppress(Exception):
        await nc.publish(subjects.cancel(worker_id), request_id.encode())
