"""The engine's bus face: answers ``llm.v1.gen.<worker_id>``, honours cancels, publishes heartbeats.

Reply protocol on the request's inbox (all TokenChunks, ``index`` counting from 0): chunk 0 is the acceptance
(empty) or a refusal (``error`` set: 400 bad request, 429 queue full with ``retry_after_s``, 504
``deadline_exceeded`` when ``deadline_s`` had passed); then one chunk per step with new text; the final chunk
carries ``finish_reason``, ``usage`` and ``timings``. The acceptance carries ``usage`` with the prompt's token
count and ``num_choices``: with n > 1 (serve/choices.py) every chunk names its ``choice`` and each choice ends
with its own final chunk. A cancelled request (``llm.v1.cancel.<worker_id>``) ends with a final ``abort``
chunk (one per unfinished choice) whose ``usage`` is what the engine produced up to the cut, so the gateway
bills the work done. A request whose ``deadline_s`` passes while it still waits for its first token is
aborted and ends with a final ``error`` chunk (504
``deadline_exceeded``); both kinds of deadline drop are counted (``EngineHandle.num_deadline_dropped``,
``ninfer:requests_deadline_dropped_total`` in ``/metrics``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg

from proto import (
    Cancel,
    EmbedReply,
    EmbedRequest,
    ErrorInfo,
    GenerateRequest,
    ProtoDecodeError,
    SlotHeartbeat,
    TokenChunk,
    Usage,
    decode,
    encode,
    subjects,
)
from proto.fleet import (
    CAPABILITY_CHOICES,
    CAPABILITY_EMBEDDINGS,
    CAPABILITY_REASONING,
    CAPABILITY_RESPONSES,
    CAPABILITY_STRUCTURED_OUTPUTS,
    CAPABILITY_TOOLS,
    WorkerState,
)
from services.common.runtime import new_session_id, raise_if_cancelling
from services.engine.errors import DeadlineExceededError, EngineError
from services.engine.outputs import RequestOutput
from services.engine.serve.async_engine import EngineHandle, RequestStream
from services.engine.serve.choices import Choices, admit_first, admit_rest, choice_chunks, prepare_choices
from services.engine.serve.embedder import embed_reply
from services.engine.serve.frontend import error_info, output_chunk

log = logging.getLogger(__name__)

MIN_HEARTBEAT_SPACING_S = 0.05  # on-change heartbeats are rate-limited to 20 Hz
# How long a cancelled request waits for the engine's count of what it used (one step, normally ms).
ABORT_REPORT_TIMEOUT_S = 8.0


# What this engine serves beyond plain chat and completions (SlotHeartbeat.capabilities: the gateway sends
# tools and structured outputs only to members that say so)
ENGINE_CAPABILITIES = (CAPABILITY_TOOLS, CAPABILITY_STRUCTURED_OUTPUTS, CAPABILITY_EMBEDDINGS, CAPABILITY_RESPONSES,
                       CAPABILITY_REASONING, CAPABILITY_CHOICES)


@dataclass(frozen=True)
class WorkerConfig:
    worker_id: str
    heartbeat_interval_s: float = 0.5


class BusWorker:
    def __init__(self, nc: Client, engine: EngineHandle, config: WorkerConfig,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.nc = nc
        self._wall_clock = wall_clock  # what GenerateRequest.deadline_s is compared with (absolute UTC)
        self.engine = engine
        self.config = config
        self.session_id = new_session_id()
        self.model_id = engine.core.model_id
        self._seq = 0
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._changed = asyncio.Event()
        self._state: WorkerState = "ready"
        self._last_hb_s = 0.0
        engine.on_change(self._changed.set)

    async def run(self) -> None:
        subs = [
            await self.nc.subscribe(subjects.gen(self.config.worker_id), cb=self._on_generate),
            await self.nc.subscribe(subjects.cancel(self.config.worker_id), cb=self._on_cancel),
            await self.nc.subscribe(subjects.embed(self.config.worker_id), cb=self._on_embed),
        ]
        try:
            await self._heartbeats()
        finally:
            # Graceful stop: refuse new work, let heartbeats say so, abort what is still running.
            self._state = "stopped"
            for sub in subs:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
            for task in list(self._tasks.values()):
                task.cancel()
            if self._tasks:
                await asyncio.gather(*self._tasks.values(), return_exceptions=True)
            with contextlib.suppress(Exception):
                await self._publish_heartbeat()
                await self.nc.flush(timeout=2)

    # ---- heartbeats --------------------------------------------------------------------------------

    def heartbeat(self) -> SlotHeartbeat:
        snap = self.engine.snapshot()
        s = snap.stats
        self._seq += 1
        return SlotHeartbeat(
            worker_id=self.config.worker_id, session_id=self.session_id, seq=self._seq, ts_s=time.time(),
            model_id=self.model_id, engine_kind="native", backend="nats", state=self._state,
            lanes=snap.lanes, running=s.num_running, waiting=s.num_waiting, max_pending=snap.max_pending,
            max_context=snap.max_context, kv_usage=s.kv_usage, kv_blocks_used=s.num_kv_blocks_used,
            kv_blocks_total=s.num_kv_blocks_total, kv_evictions_total=s.num_evictions_total,
            kv_spills_total=0, preemptions_total=s.num_preemptions_total, admitted_total=snap.admitted_total,
            admitted_by_gateway=snap.admitted_by_source,
            prompt_tokens_queried_total=s.num_prompt_tokens_queried,
            prompt_tokens_hit_total=s.num_prompt_tokens_hit, prefill_tok_per_s=snap.prefill_tok_per_s,
            decode_tok_per_s=snap.decode_tok_per_s, heartbeat_interval_s=self.config.heartbeat_interval_s,
            kv_capacity_tokens=snap.kv_capacity_tokens,
            capabilities=list(ENGINE_CAPABILITIES), tool_call_format=self.engine.core.tokenizer.tool_call_format,
        )

    async def _publish_heartbeat(self) -> None:
        data = encode(self.heartbeat())
        self._last_hb_s = time.monotonic()
        await self.nc.publish(subjects.heartbeat(self.config.worker_id), data)
        with contextlib.suppress(Exception):
            kv = await self.nc.jetstream().key_value(subjects.KV_WORKERS)
            await kv.put(self.config.worker_id, data)

    async def _heartbeats(self) -> None:
        """Every interval, and soon after any state change (rate-limited)."""
        while True:
            try:
                async with asyncio.timeout(self.config.heartbeat_interval_s):
                    await self._changed.wait()
                    spacing = MIN_HEARTBEAT_SPACING_S - (time.monotonic() - self._last_hb_s)
                    if spacing > 0:
                        await asyncio.sleep(spacing)
            except TimeoutError:
                raise_if_cancelling()  # a stop that landed with the deadline must still stop us
            self._changed.clear()
            try:
                await self._publish_heartbeat()
            except Exception as exc:  # bus down: keep serving, heartbeats resume on reconnect
                log.debug("heartbeat not published: %s", exc)

    # ---- requests ----------------------------------------------------------------------------------

    async def _on_generate(self, msg: Msg) -> None:
        if not msg.reply:
            log.warning("generate request without a reply inbox on %s: dropped", msg.subject)
            return
        try:
            req = decode(msg.data, GenerateRequest)
        except ProtoDecodeError as exc:
            log.warning("rejected malformed GenerateRequest: %s", exc.reason)
            await self._reply(msg.reply, TokenChunk(request_id="", index=0, finish_reason="error",
                                                    error=ErrorInfo(message=str(exc), type="invalid_request_error",
                                                                    status=400)))
            return
        if self._state != "ready" or req.request_id in self._tasks:
            await self._reply(msg.reply, TokenChunk(
                request_id=req.request_id, index=0, finish_reason="error",
                error=ErrorInfo(message="engine is shutting down", type="service_unavailable", status=503,
                                retry_after_s=1)))
            return
        task = asyncio.create_task(self._serve(req, msg.reply), name=f"gen-{req.request_id}")
        self._tasks[req.request_id] = task
        task.add_done_callback(functools.partial(self._forget_task, req.request_id))

    async def _on_embed(self, msg: Msg) -> None:
        """``llm.v1.embed.<worker_id>``: one EmbedReply per EmbedRequest (serve/embedder.py)."""
        if not msg.reply:
            log.warning("embed request without a reply inbox on %s: dropped", msg.subject)
            return
        try:
            req = decode(msg.data, EmbedRequest)
        except ProtoDecodeError as exc:
            log.warning("rejected malformed EmbedRequest: %s", exc.reason)
            await self.nc.publish(msg.reply, encode(EmbedReply(request_id="", error=ErrorInfo(
                message=str(exc), type="invalid_request_error", status=400), worker_id=self.config.worker_id)))
            return
        if self._state != "ready" or req.request_id in self._tasks:
            await self.nc.publish(msg.reply, encode(EmbedReply(request_id=req.request_id, error=ErrorInfo(
                message="engine is shutting down", type="service_unavailable", status=503, retry_after_s=1),
                worker_id=self.config.worker_id)))
            return
        task = asyncio.create_task(self._serve_embed(req, msg.reply), name=f"embed-{req.request_id}")
        self._tasks[req.request_id] = task
        task.add_done_callback(functools.partial(self._forget_task, req.request_id))

    async def _serve_embed(self, req: EmbedRequest, inbox: str) -> None:
        if req.deadline_s is not None and (now_s := self._wall_clock()) >= req.deadline_s:
            self.engine.count_deadline_dropped()
            late = DeadlineExceededError(req.deadline_s, now_s, "before admission")
            reply = EmbedReply(request_id=req.request_id, error=error_info(late), worker_id=self.config.worker_id)
        else:
            reply = await embed_reply(self.engine, req, self.config.worker_id)
        data = encode(reply)
        max_payload = int(getattr(self.nc, "max_payload", 0) or 1024 * 1024)
        if len(data) > max_payload:  # would never arrive: say why instead of leaving the gateway to time out
            data = encode(EmbedReply(request_id=req.request_id, worker_id=self.config.worker_id, error=ErrorInfo(
                message=f"the {len(reply.embeddings)} vectors take {len(data):,} bytes, over the bus's payload "
                        f"limit of {max_payload:,}: send fewer inputs per request", type="invalid_request_error",
                code="too_many_inputs", param="input", status=413)))
        await self.nc.publish(inbox, data)

    def _forget_task(self, request_id: str, _task: asyncio.Task[None]) -> None:
        self._tasks.pop(request_id, None)

    async def _on_cancel(self, msg: Msg) -> None:
        try:
            request_id = decode(msg.data, Cancel).request_id
        except ProtoDecodeError as exc:
            # A gateway older than the typed Cancel sends the request id as raw bytes: honour it during an upgrade
            request_id = msg.data.decode("ascii", "replace")
            if request_id not in self._tasks:
                log.debug("ignored a malformed cancel: %s", exc)
                return
        task = self._tasks.get(request_id)
        if task is not None:
            task.cancel()

    async def _reply(self, inbox: str, chunk: TokenChunk) -> None:
        await self.nc.publish(inbox, encode(chunk))

    async def _serve(self, req: GenerateRequest, inbox: str) -> None:
        choices: Choices | None = None
        try:
            if req.deadline_s is not None and (now_s := self._wall_clock()) >= req.deadline_s:
                self.engine.count_deadline_dropped()  # the gateway has given up: do not admit it
                raise DeadlineExceededError(req.deadline_s, now_s, "before admission")
            prompt_ids, choice_params = prepare_choices(self.engine.core, req)
            choices = await admit_first(self.engine, req.request_id, prompt_ids, choice_params, req.gateway_id)
        except Exception as exc:  # an answer, always: a gateway left waiting would wait out its first-chunk deadline
            if not isinstance(exc, EngineError | ValueError):
                log.exception("admitting %s failed", req.request_id)
            await self._reply(inbox, TokenChunk(request_id=req.request_id, index=0, finish_reason="error",
                                                error=error_info(exc), worker_id=self.config.worker_id))
            return
        # The acceptance carries the prompt's token count: a gateway that loses this engine mid-answer still
        # bills the prompt as admitted (docs/accounting.md, "How usage is counted"); and how many choices
        # (each ends with its own final chunk).
        await self._reply(inbox, TokenChunk(request_id=req.request_id, index=0, worker_id=self.config.worker_id,
                                            num_choices=choices.num_choices,
                                            usage=Usage(prompt_tokens=len(prompt_ids), completion_tokens=0)))
        index = 0
        try:
            if req.deadline_s is not None or choices.num_choices > 1:
                first = await self._first_output_by(choices.streams[0], req.deadline_s)
                if first is None:  # still waiting for its first token at the deadline: dropped, its slot freed
                    self.engine.count_deadline_dropped()
                    assert req.deadline_s is not None
                    late = DeadlineExceededError(req.deadline_s, self._wall_clock(), "while queued")
                    await self._reply(inbox, TokenChunk(request_id=req.request_id, index=1, finish_reason="error",
                                                        error=error_info(late), worker_id=self.config.worker_id))
                    return
                choices.first = first
                if choices.num_choices > 1:  # the others now find the first one's prompt blocks (choices.py)
                    try:
                        await admit_rest(self.engine, choices, prompt_ids, req.gateway_id)
                    except (EngineError, ValueError) as exc:
                        await self._reply(inbox, TokenChunk(request_id=req.request_id, index=1, finish_reason="error",
                                                            error=error_info(exc), worker_id=self.config.worker_id))
                        return
            echo = (req.prompt or "") if req.echo else None
            async for chunk in choice_chunks(self.engine.core.tokenizer, choices, self.config.worker_id, echo):
                index = chunk.index
                await self._reply(inbox, chunk)
        except asyncio.CancelledError:
            # Cancelled (the gateway's cancel: its client went away; or shutdown): abort in the engine and tell
            # the gateway what each unfinished choice used up to the cut, in a final "abort" chunk it waits for.
            with contextlib.suppress(Exception):
                finals = await asyncio.shield(asyncio.gather(
                    *(stream.abort_and_wait(ABORT_REPORT_TIMEOUT_S) for stream in choices.streams)))
                tokenizer = self.engine.core.tokenizer
                for i, final in enumerate(finals):
                    if final is not None:
                        index += 1
                        chunk = output_chunk(tokenizer, req.request_id, index,
                                             dataclasses.replace(final, finish_reason="abort"), self.config.worker_id)
                        await self._reply(inbox, msgspec.structs.replace(chunk, choice=i))
            raise
        finally:
            choices.close()  # free their blocks (idempotent after an abort)

    async def _first_output_by(self, stream: RequestStream, deadline_s: float | None) -> RequestOutput | None:
        """The request's first output, or None when ``deadline_s`` (wall clock) passes first: the request
        is then aborted in the engine (its blocks and lane freed) and its last output read."""
        if deadline_s is None:
            return await stream.next_output()
        try:
            async with asyncio.timeout(max(0.0, deadline_s - self._wall_clock())):
                return await stream.next_output()
        except TimeoutError:
            await stream.abort_and_wait(ABORT_REPORT_TIMEOUT_S)
            return None
