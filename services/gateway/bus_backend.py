"""The bus hop to our engines: GenerateRequest out on ``llm.v1.gen.<worker>``, TokenChunks back on an inbox;
EmbedRequest on ``llm.v1.embed.<worker>``, one EmbedReply back."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable

from nats.aio.client import Client
from nats.aio.subscription import Subscription
from nats.errors import MaxPayloadError, NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from proto import (
    Cancel,
    EmbedReply,
    EmbedRequest,
    GenerateRequest,
    ProtoDecodeError,
    TokenChunk,
    decode,
    encode,
    subjects,
)
from services.common.http import HTTPError
from services.common.openai_stream import chunk_error
from services.common.runtime import raise_if_cancelling
from services.gateway.errors import WorkerUnavailable

LIVENESS_POLL_S = 0.25  # how often a wait for the next chunk checks that the worker still lives


class BusStream:
    """One accepted request's reply stream; close it to stop listening.

    Waits for chunks in slices of at most ``LIVENESS_POLL_S`` and asks ``is_alive`` in between: a worker
    that died (its heartbeats stopped, or it restarted under a new session) ends the stream within the
    gateway's staleness threshold instead of after ``chunk_timeout_s`` of silence. ``deadline_s``
    (monotonic) is the gateway's request timeout. With n > 1 the reply ends once each of the acceptance's
    ``num_choices`` choices has sent its final chunk (or at an error).
    """

    def __init__(self, sub: Subscription, first: TokenChunk, chunk_timeout_s: float,
                 is_alive: Callable[[], bool] | None = None, deadline_s: float | None = None) -> None:
        self.sub = sub
        self.first = first
        self.chunk_timeout_s = chunk_timeout_s
        self.is_alive = is_alive
        self.deadline_s = deadline_s
        self._read: list[TokenChunk] = [first]  # read ahead by prime(), not yet yielded
        self._expected = first.index + 1
        self.num_choices = first.num_choices or 1  # None: an engine from before n > 1 (one choice)
        self._ended: set[int] = set()  # the choices whose final chunk has been read

    def _is_last(self, chunk: TokenChunk) -> bool:
        """Whether ``chunk`` ends the reply: an error, or the final chunk of the last open choice."""
        if chunk.error is not None:
            return True
        if chunk.is_final:
            self._ended.add(chunk.choice)
        return len(self._ended) >= self.num_choices

    async def _next(self) -> TokenChunk:
        silent_until = time.monotonic() + self.chunk_timeout_s
        while True:
            now = time.monotonic()
            if self.deadline_s is not None and now >= self.deadline_s:
                raise HTTPError(504, "the request ran past the gateway's request timeout", code="request_timeout")
            if now >= silent_until:
                raise HTTPError(503, "the engine stopped responding mid-request", code="upstream_timeout",
                                retry_after_s=5)
            if self.is_alive is not None and not self.is_alive():
                raise HTTPError(503, "the engine went away mid-request", code="upstream_lost", retry_after_s=1)
            wait_s = min(silent_until, self.deadline_s or silent_until) - now
            try:
                msg = await self.sub.next_msg(timeout=min(wait_s, LIVENESS_POLL_S))
                break
            except (NatsTimeout, TimeoutError):
                raise_if_cancelling()
        try:
            return decode(msg.data, TokenChunk)
        except ProtoDecodeError as exc:
            raise HTTPError(503, f"the engine sent a malformed chunk: {exc.reason}", code="upstream_garbled",
                            retry_after_s=1) from None

    def _accept(self, chunk: TokenChunk) -> TokenChunk:
        if chunk.index != self._expected:
            raise HTTPError(503, f"lost part of the engine's reply (chunk {self._expected} missing)",
                            code="upstream_gap", retry_after_s=1)
        self._expected += 1
        return chunk

    async def prime(self, worker_id: str) -> None:
        """Read ahead to the first chunk with text (or the final one). Nothing reached the client yet, so a
        failure here is :class:`WorkerUnavailable`: the gateway may still try another member."""
        while not (self._read[-1].text or self._read[-1].is_final):
            try:
                self._read.append(self._accept(await self._next()))
            except HTTPError as err:
                if err.code == "request_timeout":
                    raise
                raise WorkerUnavailable(worker_id, f"before its first token: {err.message}") from None

    async def chunks(self) -> AsyncIterator[TokenChunk]:
        is_last = False
        while self._read:
            chunk = self._read.pop(0)
            is_last = self._is_last(chunk)
            yield chunk
        while not is_last:
            chunk = self._accept(await self._next())
            is_last = self._is_last(chunk)
            yield chunk

    async def rest(self, timeout_s: float) -> AsyncIterator[TokenChunk]:
        """After a cancel: what the worker still sends, up to its final chunk (our engine ends a cancelled
        request with an ``abort`` chunk carrying its count of the work done) or ``timeout_s``, whichever is
        first. Order is not checked here: a lost chunk cannot mislead a count the final chunk restates."""
        for chunk in self._read:
            yield chunk
            if self._is_last(chunk):
                return
        self._read = []
        deadline = time.monotonic() + timeout_s
        while (wait_s := deadline - time.monotonic()) > 0:
            try:
                msg = await self.sub.next_msg(timeout=wait_s)
            except (NatsTimeout, TimeoutError):
                return
            try:
                chunk = decode(msg.data, TokenChunk)
            except ProtoDecodeError:
                continue
            yield chunk
            if self._is_last(chunk):
                return

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.sub.unsubscribe()


async def start(nc: Client, worker_id: str, generate: GenerateRequest, first_chunk_timeout_s: float,
                chunk_timeout_s: float, is_alive: Callable[[], bool] | None = None,
                deadline_s: float | None = None) -> BusStream:
    """Send the request and wait for the worker's acceptance (chunk 0) or refusal."""
    if not nc.is_connected:
        # nats.py would buffer the publish until a reconnect and we would wait out the first-chunk deadline:
        # answer now (the caller turns this into 503 + Retry-After) and do not hold it against the worker.
        raise WorkerUnavailable(worker_id, "the bus is disconnected", is_bus_down=True)
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    try:
        await nc.publish(subjects.gen(worker_id), encode(generate), reply=inbox)
        silent_until = time.monotonic() + first_chunk_timeout_s
        while True:
            wait_s = silent_until - time.monotonic()
            if wait_s <= 0:
                raise WorkerUnavailable(worker_id, "silent past the first-chunk deadline")
            if not nc.is_connected:  # the request or its answer went down with the connection
                raise WorkerUnavailable(worker_id, "the bus connection dropped", is_bus_down=True)
            try:
                msg = await sub.next_msg(timeout=min(wait_s, LIVENESS_POLL_S))
                break
            except (NatsTimeout, TimeoutError):
                raise_if_cancelling()  # the client left: not a reason to fail over
        if msg.headers and msg.headers.get("Status") == "503":
            raise WorkerUnavailable(worker_id, "no responder on its subject")
        try:
            first = decode(msg.data, TokenChunk)
        except ProtoDecodeError as exc:
            raise WorkerUnavailable(worker_id, exc.reason) from None
        if first.error is not None:
            raise WorkerUnavailable(worker_id, first.error.message, chunk_error(first))
        if first.num_choices is None and (generate.n > 1 or generate.echo or generate.suffix):
            # an engine from before n > 1 / echo / suffix reads past those fields: one choice, no echo, no FIM
            await cancel(nc, worker_id, generate.request_id)
            raise WorkerUnavailable(worker_id, "its engine predates n > 1, echo and suffix",
                                    not_supported(worker_id, "n > 1, echo or suffix"))
        return BusStream(sub, first, chunk_timeout_s, is_alive, deadline_s)
    except BaseException:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
        raise


async def cancel(nc: Client, worker_id: str, request_id: str) -> None:
    with contextlib.suppress(Exception):
        await nc.publish(subjects.cancel(worker_id), encode(Cancel(request_id=request_id)))


# The code of the 400 for a member that cannot do what the request asks (an engine with no embeddings).
MODEL_NOT_SUPPORTED = "model_not_supported"


def not_supported(member_id: str, what: str) -> HTTPError:
    """The 400 for a member that cannot serve ``what`` (e.g. an engine from before embeddings)."""
    return HTTPError(400, f"member '{member_id}' cannot serve {what}", code=MODEL_NOT_SUPPORTED, param="model")


async def embed(nc: Client, worker_id: str, req: EmbedRequest, timeout_s: float) -> EmbedReply:
    """Send an EmbedRequest and wait (up to ``timeout_s``) for its one EmbedReply.

    A refusal comes back as :class:`WorkerUnavailable` carrying the engine's error; no responder on the
    subject while the worker is otherwise alive means an engine without embeddings (a 400
    ``model_not_supported`` naming it, never a 503 the client would retry)."""
    if not nc.is_connected:
        raise WorkerUnavailable(worker_id, "the bus is disconnected", is_bus_down=True)
    try:
        msg = await nc.request(subjects.embed(worker_id), encode(req), timeout=timeout_s)
    except MaxPayloadError:
        raise HTTPError(413, f"the embeddings request is over the bus's payload limit ({nc.max_payload:,} bytes): "
                             "send fewer or shorter inputs", code="body_too_large") from None
    except NoRespondersError:
        raise WorkerUnavailable(worker_id, "no responder on its embed subject",
                                not_supported(worker_id, "embeddings")) from None
    except (NatsTimeout, TimeoutError):
        raise_if_cancelling()
        raise WorkerUnavailable(worker_id, f"no embeddings reply within {timeout_s:g} s") from None
    try:
        reply = decode(msg.data, EmbedReply)
    except ProtoDecodeError as exc:
        raise WorkerUnavailable(worker_id, exc.reason) from None
    if reply.error is not None:
        e = reply.error
        raise WorkerUnavailable(worker_id, e.message, HTTPError(e.status, e.message, code=e.code, param=e.param,
                                                                type=e.type, retry_after_s=e.retry_after_s))
    return reply
