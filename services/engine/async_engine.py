"""AsyncEngine: the EngineCore on its own thread, with per-request async streams for asyncio code.

The step loop never runs on the event loop (a forward pass blocks for milliseconds to seconds). The
event loop talks to the thread through a command queue (add, abort); the thread hands each step's
outputs back with one ``call_soon_threadsafe`` per step, and tells listeners when the scheduler's
state changed (so heartbeats go out on change, not only on a timer).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from services.engine.engine_core import EngineCore, EngineSnapshot, RequestOutput
from services.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt_token_ids: Sequence[int]
    params: SamplingParams
    source: str
    done: concurrent.futures.Future[None]


@dataclass(frozen=True)
class _Abort:
    request_id: str


class RequestStream:
    """The outputs of one request, in order; the last has ``finished`` set. Aborts when closed early."""

    def __init__(self, engine: AsyncEngine, request_id: str) -> None:
        self.engine = engine
        self.request_id = request_id
        self.queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.finished = False

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                output = await self.queue.get()
                self.finished = output.finished
                yield output
        finally:
            self.close()

    def close(self) -> None:
        """Abort the request unless it finished; idempotent."""
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)
        self.engine._streams.pop(self.request_id, None)


class AsyncEngine:
    def __init__(self, core: EngineCore, clock: Callable[[], float] = time.monotonic) -> None:
        self.core = core
        self.clock = clock
        self._commands: queue.SimpleQueue[_Add | _Abort | None] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._listeners: list[Callable[[], None]] = []
        self._output_listeners: list[Callable[[list[RequestOutput]], None]] = []
        self._snapshot: EngineSnapshot = core.snapshot(clock())
        self._snapshot_lock = threading.Lock()
        self.step_error: BaseException | None = None

    # ---- lifecycle -------------------------------------------------------------------------------

    async def __aenter__(self) -> AsyncEngine:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine-step", daemon=True)
        self._thread.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._commands.put(None)
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    def on_outputs(self, callback: Callable[[list[RequestOutput]], None]) -> None:
        """``callback`` runs on the event loop with every step's outputs (telemetry, energy attribution)."""
        self._output_listeners.append(callback)

    def on_change(self, callback: Callable[[], None]) -> None:
        """``callback`` runs on the event loop after any step that changed the scheduler's state."""
        self._listeners.append(callback)

    def snapshot(self) -> EngineSnapshot:
        with self._snapshot_lock:
            return self._snapshot

    # ---- requests ----------------------------------------------------------------------------------

    async def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                          source: str = "") -> RequestStream:
        """Admit a request and return its stream; raises the engine's admission errors (queue full, …)."""
        stream = RequestStream(self, request_id)
        self._streams[request_id] = stream
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._commands.put(_Add(request_id, prompt_token_ids, params, source, done))
        self._wake.set()
        try:
            await asyncio.wrap_future(done)
        except BaseException:
            stream.finished = True
            self._streams.pop(request_id, None)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))
        self._wake.set()

    # ---- the step thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        core = self.core
        last_key: tuple[int, ...] | None = None
        while True:
            if not self._drain_commands():
                return
            outputs: list[RequestOutput] = []
            if core.has_unfinished_requests():
                try:
                    outputs = core.step(self.clock)
                except Exception as exc:  # a bug must not leave clients hanging: fail every request
                    log.exception("engine step failed; aborting all requests")
                    self.step_error = exc
                    outputs = [o for rid in list(self._streams) if (o := core.abort(rid, self.clock()))]
            snapshot = core.snapshot(self.clock())
            with self._snapshot_lock:
                self._snapshot = snapshot
            s = snapshot.stats
            key = (s.num_running, s.num_waiting, s.num_prefilling, s.num_kv_blocks_used // 8)
            changed = key != last_key
            last_key = key
            if outputs or changed:
                assert self._loop is not None
                with contextlib.suppress(RuntimeError):  # loop closed during shutdown
                    self._loop.call_soon_threadsafe(self._deliver, outputs, changed)
            if not core.has_unfinished_requests():
                self._wake.wait(timeout=1.0)
                self._wake.clear()

    def _drain_commands(self) -> bool:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True
            if cmd is None:
                for rid in list(self._streams):
                    self.core.abort(rid, self.clock())
                return False
            if isinstance(cmd, _Add):
                try:
                    self.core.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.params, self.clock(),
                                          cmd.source)
                    cmd.done.set_result(None)
                except BaseException as exc:
                    cmd.done.set_exception(exc)
            else:
                output = self.core.abort(cmd.request_id, self.clock())
                if output is not None:
                    assert self._loop is not None
                    with contextlib.suppress(RuntimeError):
                        self._loop.call_soon_threadsafe(self._deliver, [output], True)

    def _deliver(self, outputs: list[RequestOutput], changed: bool) -> None:
        if outputs:
            for listener in self._output_listeners:
                listener(outputs)
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.queue.put_nowait(output)
        if changed:
            for callback in self._listeners:
                callback()
