"""The EngineCore off the event loop, with per-request async streams for asyncio code.

The step loop never runs on the event loop (a forward pass blocks for milliseconds to seconds). Two
ways to run it, with one interface (``add_request``, ``abort``, ``snapshot``, ``on_outputs``,
``on_change``, ``core``):

* :class:`AsyncEngine` runs the core on a thread of this process. Simple, and what tests and the offline
  API use; but the step thread and the event loop share one GIL, so HTTP work and engine steps slow
  each other down.
* :class:`~services.engine.serve.process_engine.ProcessEngine` (``process_engine.py``, on the
  :class:`EngineHandle` and :func:`run_step_loop` defined here) runs the core in a child process
  (vLLM v1's split) and talks to it over a pipe:
  the event loop serves HTTP and SSE while the child keeps every torch thread busy. ``ninfer-serve``
  uses it.

Both hand each step's outputs back in one batch, and tell listeners when the scheduler's state changed
(so heartbeats go out on change, not only on a timer).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import torch

from services.engine.core.sampling_params import SamplingParams
from services.engine.engine_core import EngineCore
from services.engine.outputs import EngineSnapshot, RequestOutput
from services.engine.serve.frontend import PromptEncoder

log = logging.getLogger(__name__)


# The commands the step loop takes: its protocol with both engines (a queue in AsyncEngine, a pipe to
# ProcessEngine's child, which pickles them).
@dataclass(frozen=True)
class AddCommand:
    request_id: str
    prompt_token_ids: Sequence[int]
    params: SamplingParams
    source: str


@dataclass(frozen=True)
class AbortCommand:
    request_id: str


@dataclass(frozen=True)
class EmbedCommand:
    """Embed ``inputs`` (token ids, one list per input) between two steps; answered through ``on_embedded``."""

    request_id: str
    inputs: Sequence[Sequence[int]]


Command = AddCommand | AbortCommand | EmbedCommand | None  # None: stop (abort what is left and return)

# What an embedding comes back as: little-endian float32 bytes per input (proto EmbedReply's form), or the error.
EmbedResult = list[bytes] | BaseException


def embed_now(core: EngineCore, cmd: EmbedCommand, now: float) -> EmbedResult:
    """Run one EmbedCommand on the core: each vector as little-endian float32 bytes, or the error it raised."""
    try:
        vectors = core.embed(cmd.request_id, cmd.inputs, now)
    except Exception as exc:  # the caller re-raises it: context length, bad token id, no free blocks
        return exc
    return [v.to(torch.float32).numpy().astype("<f4").tobytes() for v in vectors]


def merge_outputs(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """Two consecutive outputs of one request as one: the deltas joined, the counters of the later."""
    logprobs = None
    if earlier.logprobs is not None or later.logprobs is not None:
        logprobs = (earlier.logprobs or ()) + (later.logprobs or ())
    return dataclasses.replace(later, text=earlier.text + later.text, token_ids=earlier.token_ids + later.token_ids,
                               logprobs=logprobs)


class StreamInterval:
    """Holds a request's outputs back for up to ``interval_s`` and hands them on merged.

    Every output costs the API process an SSE event (or a bus message) and the client a read; at one
    token per step and many streams that host work competes with the model for the same cores. So
    outputs of a request whose text has started are held and released together at most every
    ``interval_s`` (one clock for all requests: what is held goes out together, ``interval_s`` after the
    first of it was held); outputs up to the first text (time to first token) and the
    last output are never held. 0 releases every output at once.
    """

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._held: dict[str, RequestOutput] = {}
        self._streaming: set[str] = set()  # requests that have released text and not finished
        self._due: float | None = None  # when what is held goes out: ``interval_s`` after the first of it

    def release(self, outputs: list[RequestOutput], now: float) -> list[RequestOutput]:
        if self.interval_s <= 0:
            return outputs
        ready: list[RequestOutput] = []
        for output in outputs:
            rid = output.request_id
            if (held := self._held.pop(rid, None)) is not None:
                output = merge_outputs(held, output)
            if output.finished:
                self._streaming.discard(rid)
                ready.append(output)
            elif rid not in self._streaming:
                if output.text:
                    self._streaming.add(rid)
                ready.append(output)
            else:
                if self._due is None:
                    self._due = now + self.interval_s
                self._held[rid] = output
        if self._due is not None and (now >= self._due or not self._held):
            ready += self._held.values()
            self._held.clear()
            self._due = None
        return ready


def run_step_loop(core: EngineCore, clock: Callable[[], float], next_command: Callable[[float], Command],
                  on_added: Callable[[str, BaseException | None], None],
                  publish: Callable[[list[RequestOutput], EngineSnapshot, bool], None],
                  on_step_error: Callable[[BaseException], None],
                  on_embedded: Callable[[str, EmbedResult], None] = lambda _rid, _result: None) -> None:
    """Take commands, step while there is work, publish the steps' outputs with a fresh snapshot.

    ``next_command(timeout_s)`` returns the next command, waiting up to ``timeout_s`` (0: not at all), and
    raises :class:`queue.Empty` when none came. An EmbedCommand runs at once, between steps, and its
    vectors (or error) go to ``on_embedded``. ``publish(outputs, snapshot, changed)`` is called after any
    step that released outputs (see :class:`StreamInterval`; the core's ``config.stream_interval_ms``) or
    changed the scheduler's state. A step that raises is reported to ``on_step_error``; every request is
    then aborted, so no client hangs, and the loop goes on.
    """
    interval = StreamInterval(core.config.stream_interval_ms / 1000.0)
    last_key: tuple[int, ...] | None = None
    while True:
        outputs: list[RequestOutput] = []
        wait_s = 0.0 if core.has_unfinished_requests() else 1.0
        while True:
            try:
                cmd = next_command(wait_s)
            except queue.Empty:
                break
            wait_s = 0.0
            if cmd is None:
                for rid in core.unfinished_request_ids():
                    core.abort(rid, clock())
                return
            if isinstance(cmd, AddCommand):
                try:
                    core.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.params, clock(), cmd.source)
                    on_added(cmd.request_id, None)
                except BaseException as exc:  # the caller re-raises it: queue full, duplicate id, ...
                    on_added(cmd.request_id, exc)
            elif isinstance(cmd, EmbedCommand):
                on_embedded(cmd.request_id, embed_now(core, cmd, clock()))
            else:
                try:
                    output = core.abort(cmd.request_id, clock())
                except Exception as exc:  # a bug: fail every request rather than lose the core
                    log.exception("aborting %s failed; aborting all requests", cmd.request_id)
                    on_step_error(exc)
                    output = None
                    outputs += [o for rid in core.unfinished_request_ids() if (o := core.abort(rid, clock()))]
                if output is not None:
                    outputs.append(output)
        if core.has_unfinished_requests():
            try:
                outputs += core.step(clock)
            except Exception as exc:  # a bug must not leave clients hanging: fail every request
                log.exception("engine step failed; aborting all requests")
                on_step_error(exc)
                outputs += [o for rid in core.unfinished_request_ids() if (o := core.abort(rid, clock()))]
        outputs = interval.release(outputs, clock())
        s = core.scheduler.stats()
        key = (s.num_running, s.num_waiting, s.num_prefilling, s.num_kv_blocks_used // 8)
        changed = key != last_key
        last_key = key
        if outputs or changed:
            publish(outputs, core.snapshot(clock()), changed)


class RequestStream:
    """The outputs of one request, in order; the last has ``finished`` set. Aborts when closed early."""

    def __init__(self, engine: EngineHandle, request_id: str) -> None:
        self.engine = engine
        self.request_id = request_id
        self.queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.finished = False
        # the abort was sent but its last output (the engine's counts) not read yet: abort_and_wait reads it
        self.aborting = False

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                output = await self.queue.get()
                # A reader that fell behind gets what piled up as one output (as vLLM's output collector
                # does): fewer, larger SSE events and bus chunks under load, the same text and tokens.
                while not output.finished and not self.queue.empty():
                    output = merge_outputs(output, self.queue.get_nowait())
                self.finished = output.finished
                yield output
        except asyncio.CancelledError:
            # The reader was cancelled (client gone): abort, but leave the engine's last output to
            # abort_and_wait, which reports what the request used; the stream leaves the table when it lands.
            if not self.finished and not self.aborting:
                self.aborting = True
                self.engine.abort(self.request_id)
            raise
        finally:
            if not self.aborting:
                self.close()

    async def next_output(self) -> RequestOutput:
        """The next output, read without iterating (a request with n > 1 waits on its first choice's first
        output with it); a later ``async for`` goes on from there."""
        output = await self.queue.get()
        self.finished = output.finished
        return output

    async def abort_and_wait(self, timeout_s: float) -> RequestOutput | None:
        """Abort the request and wait (at most ``timeout_s``) for the engine's last output for it: its
        ``num_prompt_tokens`` / ``num_output_tokens`` are what the request used, so a cut-short request
        is billed for the work done. None when it had finished already or no answer came in time."""
        if self.finished:
            return None
        if not self.aborting:
            self.aborting = True
            self.engine.abort(self.request_id)
        last: RequestOutput | None = None
        try:
            async with asyncio.timeout(timeout_s):
                while last is None or not last.finished:
                    last = await self.queue.get()
        except TimeoutError:
            last = None
        finally:
            self.finished = True
            self.engine._streams.pop(self.request_id, None)
        return last

    def close(self) -> None:
        """Abort the request unless it finished; idempotent."""
        if not self.finished:
            self.finished = True
            if not self.aborting:
                self.engine.abort(self.request_id)
        self.engine._streams.pop(self.request_id, None)


class EngineHandle:
    """Streams, listeners and the latest snapshot: what both ways of running the core share."""

    core: PromptEncoder

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._listeners: list[Callable[[], None]] = []
        self._output_listeners: list[Callable[[list[RequestOutput]], None]] = []
        self._snapshot: EngineSnapshot | None = None
        self._snapshot_lock = threading.Lock()
        self.step_error: BaseException | None = None
        # Requests the bus face dropped because their deadline_s passed (before admission or still queued).
        self.num_deadline_dropped = 0

    def count_deadline_dropped(self) -> None:
        """Count one request dropped for its deadline (``/metrics``: ninfer:requests_deadline_dropped_total)."""
        self.num_deadline_dropped += 1

    def on_outputs(self, callback: Callable[[list[RequestOutput]], None]) -> None:
        """``callback`` runs on the event loop with every step's outputs (telemetry, energy attribution)."""
        self._output_listeners.append(callback)

    def on_change(self, callback: Callable[[], None]) -> None:
        """``callback`` runs on the event loop after any step that changed the scheduler's state."""
        self._listeners.append(callback)

    def snapshot(self) -> EngineSnapshot:
        with self._snapshot_lock:
            assert self._snapshot is not None, "the engine has not started"
            return self._snapshot

    def _set_snapshot(self, snapshot: EngineSnapshot) -> None:
        with self._snapshot_lock:
            self._snapshot = snapshot

    async def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                          source: str = "") -> RequestStream:
        """Admit a request and return its stream; raises the engine's admission errors (queue full, …)."""
        stream = RequestStream(self, request_id)
        self._streams[request_id] = stream
        try:
            await self._submit(AddCommand(request_id, prompt_token_ids, params, source))
        except BaseException:
            stream.finished = True
            self._streams.pop(request_id, None)
            raise
        return stream

    async def _submit(self, add: AddCommand) -> None:
        raise NotImplementedError

    async def embed(self, request_id: str, inputs: Sequence[Sequence[int]]) -> list[bytes]:
        """One L2-normalised vector per input, as little-endian float32 bytes; raises the engine's errors
        (context length exceeded, a token id outside the vocabulary, no free KV blocks: queue full)."""
        raise NotImplementedError

    def abort(self, request_id: str) -> None:
        raise NotImplementedError

    async def core_lost(self) -> BaseException:
        """Returns (the error) when the core can serve nothing any more; the service then stops so that
        its supervisor starts it again. A core on a thread of this process is never lost alone."""
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    def _deliver(self, outputs: list[RequestOutput], changed: bool) -> None:
        if outputs:
            for listener in self._output_listeners:
                listener(outputs)
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.queue.put_nowait(output)
                if output.finished and stream.aborting:  # its reader holds the stream: the table need not
                    self._streams.pop(output.request_id, None)
        if changed:
            for callback in self._listeners:
                callback()


class AsyncEngine(EngineHandle):
    """The core on a thread of this process."""

    core: EngineCore  # the whole core, not only its prompt-encoding face: the step loop drives it

    def __init__(self, core: EngineCore, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(clock)
        self.core = core
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._adds: dict[str, concurrent.futures.Future[None]] = {}
        self._embeds: dict[str, concurrent.futures.Future[list[bytes]]] = {}
        self._thread: threading.Thread | None = None
        self._set_snapshot(core.snapshot(clock()))

    async def __aenter__(self) -> AsyncEngine:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine-step", daemon=True)
        self._thread.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._commands.put(None)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    async def _submit(self, add: AddCommand) -> None:
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._adds[add.request_id] = done
        self._commands.put(add)
        await asyncio.wrap_future(done)

    async def embed(self, request_id: str, inputs: Sequence[Sequence[int]]) -> list[bytes]:
        done: concurrent.futures.Future[list[bytes]] = concurrent.futures.Future()
        self._embeds[request_id] = done
        self._commands.put(EmbedCommand(request_id, inputs))
        return await asyncio.wrap_future(done)

    def abort(self, request_id: str) -> None:
        self._commands.put(AbortCommand(request_id))

    def _run(self) -> None:
        def next_command(timeout_s: float) -> Command:
            return self._commands.get(timeout=timeout_s) if timeout_s > 0 else self._commands.get_nowait()

        def on_added(request_id: str, exc: BaseException | None) -> None:
            done = self._adds.pop(request_id)
            done.set_result(None) if exc is None else done.set_exception(exc)

        def publish(outputs: list[RequestOutput], snapshot: EngineSnapshot, changed: bool) -> None:
            self._set_snapshot(snapshot)
            assert self._loop is not None
            with contextlib.suppress(RuntimeError):  # loop closed during shutdown
                self._loop.call_soon_threadsafe(self._deliver, outputs, changed)

        def on_step_error(exc: BaseException) -> None:
            self.step_error = exc

        def on_embedded(request_id: str, result: EmbedResult) -> None:
            done = self._embeds.pop(request_id)
            done.set_exception(result) if isinstance(result, BaseException) else done.set_result(result)

        run_step_loop(self.core, self.clock, next_command, on_added, publish, on_step_error, on_embedded)
