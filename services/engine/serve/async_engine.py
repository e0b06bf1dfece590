"""The EngineCore off the event loop, with per-request async streams for asyncio code.

The step loop never runs on the event loop (a forward pass blocks for milliseconds to seconds). Two
ways to run it, with one interface (``add_request``, ``abort``, ``snapshot``, ``on_outputs``,
``on_change``, ``core``):

* :class:`AsyncEngine` runs the core on a thread of this process. Simple, and what tests and the offline
  API use; but the step thread and the event loop share one GIL, so HTTP work and engine steps slow
  each other down.
* :class:`ProcessEngine` runs the core in a child process (vLLM v1's split) and talks to it over a pipe:
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
import multiprocessing
import os
import pickle
import queue
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from services.common.runtime import setup_logging
from services.engine.config import EngineConfig
from services.engine.core.sampling_params import SamplingParams
from services.engine.engine_core import EngineCore
from services.engine.model.tokenizer import Tokenizer
from services.engine.outputs import EngineSnapshot, RequestOutput
from services.engine.serve.frontend import PromptEncoder

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt_token_ids: Sequence[int]
    params: SamplingParams
    source: str


@dataclass(frozen=True)
class _Abort:
    request_id: str


_Command = _Add | _Abort | None  # None: stop (abort what is left and return)


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


def run_step_loop(core: EngineCore, clock: Callable[[], float], next_command: Callable[[float], _Command],
                  on_added: Callable[[str, BaseException | None], None],
                  publish: Callable[[list[RequestOutput], EngineSnapshot, bool], None],
                  on_step_error: Callable[[BaseException], None]) -> None:
    """Take commands, step while there is work, publish the steps' outputs with a fresh snapshot.

    ``next_command(timeout_s)`` returns the next command, waiting up to ``timeout_s`` (0: not at all), and
    raises :class:`queue.Empty` when none came. ``publish(outputs, snapshot, changed)`` is called after any
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
            if isinstance(cmd, _Add):
                try:
                    core.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.params, clock(), cmd.source)
                    on_added(cmd.request_id, None)
                except BaseException as exc:  # the caller re-raises it: queue full, duplicate id, ...
                    on_added(cmd.request_id, exc)
            elif (output := core.abort(cmd.request_id, clock())) is not None:
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
            await self._submit(_Add(request_id, prompt_token_ids, params, source))
        except BaseException:
            stream.finished = True
            self._streams.pop(request_id, None)
            raise
        return stream

    async def _submit(self, add: _Add) -> None:
        raise NotImplementedError

    def abort(self, request_id: str) -> None:
        raise NotImplementedError

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

    def __init__(self, core: EngineCore, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(clock)
        self.core = core
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._adds: dict[str, concurrent.futures.Future[None]] = {}
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

    async def _submit(self, add: _Add) -> None:
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._adds[add.request_id] = done
        self._commands.put(add)
        await asyncio.wrap_future(done)

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def _run(self) -> None:
        def next_command(timeout_s: float) -> _Command:
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

        run_step_loop(self.core, self.clock, next_command, on_added, publish, on_step_error)


# ---- the core in a child process -------------------------------------------------------------------------


@dataclass(frozen=True)
class _Ready:
    model_id: str
    max_context: int
    description: str
    snapshot: EngineSnapshot


@dataclass(frozen=True)
class _Added:
    request_id: str
    error: BaseException | None


@dataclass(frozen=True)
class _Step:
    outputs: list[RequestOutput]
    snapshot: EngineSnapshot
    changed: bool


@dataclass(frozen=True)
class _Failed:
    error: BaseException


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling, else a RuntimeError with its text."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


class _PipeWriter:
    """Sends objects down a pipe from its own thread, so a full pipe (a reader that is behind) never
    blocks the caller: an engine step on the child's side, the event loop on the API side.

    Whatever queued up while the pipe was busy goes in one write, consecutive steps merged into one
    (their outputs in order, the last snapshot): a small model's child makes thousands of steps a second
    (the tiny test model ~7,000 tokens/s on 2 cores), more messages than the API process unpickles, which
    left its view of the engine seconds stale. A reader that keeps up still gets one message per step.
    """

    def __init__(self, conn: Connection, name: str) -> None:
        self.conn = conn
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._write, name=name, daemon=True)
        self._thread.start()

    def put(self, obj: object) -> None:
        self._queue.put(obj)

    def close(self, timeout_s: float = 10.0) -> None:
        """Write what was put, then end the thread."""
        self._queue.put(_CLOSE)
        self._thread.join(timeout_s)

    def _write(self) -> None:
        while True:
            batch = [self._queue.get()]
            while True:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            for obj in _merge_steps(batch):
                if obj is _CLOSE:
                    return
                try:
                    self.conn.send_bytes(pickle.dumps(obj))
                except (OSError, ValueError):  # the other side is gone; its reader sees the EOF
                    return


_CLOSE = object()  # _PipeWriter's end of the queue


def _merge_steps(batch: list[object]) -> list[object]:
    """``batch`` in order, each run of consecutive _Step messages as one."""
    out: list[object] = []
    for obj in batch:
        last = out[-1] if out else None
        if isinstance(obj, _Step) and isinstance(last, _Step):
            out[-1] = _Step(last.outputs + obj.outputs, obj.snapshot, last.changed or obj.changed)
        else:
            out.append(obj)
    return out


def _child_main(config: EngineConfig, conn: Connection) -> None:
    """The engine process: build the core, say ready (or why not), then step until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it stops us through the pipe
    setup_logging()
    try:
        core = EngineCore(config)
    except BaseException as exc:
        conn.send(_Failed(_portable(exc)))
        return
    clock = time.monotonic
    conn.send(_Ready(core.model_id, core.max_context, core.describe(), core.snapshot(clock())))
    replies = _PipeWriter(conn, "engine-replies")

    def next_command(timeout_s: float) -> _Command:
        try:
            if not conn.poll(timeout_s):
                raise queue.Empty
            cmd: _Command = conn.recv()
        except (EOFError, OSError):  # the parent is gone: stop
            return None
        return cmd

    def on_added(request_id: str, exc: BaseException | None) -> None:
        replies.put(_Added(request_id, None if exc is None else _portable(exc)))

    def publish(outputs: list[RequestOutput], snapshot: EngineSnapshot, changed: bool) -> None:
        replies.put(_Step(outputs, snapshot, changed))

    def on_step_error(exc: BaseException) -> None:
        replies.put(_Failed(_portable(exc)))

    try:
        run_step_loop(core, clock, next_command, on_added, publish, on_step_error)
    finally:
        replies.close()


# On the CPU the child's OpenMP threads spin this many iterations waiting for work before they sleep
# (GNU OpenMP's default is 300,000). A spinning thread that the API process or a client preempts stalls
# the next parallel region; a thread that sleeps too soon pays a wake-up per region. Measured on 2 cores
# with the 20 ms stream interval (docs/benchmarks.md, served/offline at c = 1 / 8 / 32): 300,000 gave
# - / 0.84 / 0.71, 30,000 - / 0.74 / 0.82, 100,000 0.83 / 0.84 / 0.83 and 0.88 / 0.83 / 0.79.
# GOMP_SPINCOUNT or OMP_WAIT_POLICY set by the operator win.
CPU_SPINCOUNT = "100000"


@contextlib.contextmanager
def _child_environment(config: EngineConfig) -> Iterator[None]:
    """The environment a spawned child starts with (it inherits ``os.environ`` at start)."""
    added: list[str] = []
    if (str(config.device).startswith("cpu") and "GOMP_SPINCOUNT" not in os.environ
            and "OMP_WAIT_POLICY" not in os.environ):
        os.environ["GOMP_SPINCOUNT"] = CPU_SPINCOUNT
        added.append("GOMP_SPINCOUNT")
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


class ProcessEngine(EngineHandle):
    """The core in a child process; the event loop keeps this process's GIL to itself.

    ``core`` is the API side (:class:`PromptEncoder`: tokenizer, model id, context limit); the model,
    the KV cache and the scheduler live in the child. Requests and aborts go down a pipe (a
    :class:`_PipeWriter`, so the loop never blocks on a full pipe); step outputs and snapshots come back on
    the same pipe and are read when it is readable. If the child dies, every open stream ends with
    ``abort`` and ``step_error`` says why.
    """

    START_TIMEOUT_S = 600.0

    def __init__(self, config: EngineConfig, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(clock)
        self.config = config
        self.description = ""
        self._conn: Connection | None = None
        self._process: multiprocessing.process.BaseProcess | None = None
        self._commands: _PipeWriter | None = None
        self._gone = False  # the child's end of the pipe closed
        self._adds: dict[str, asyncio.Future[None]] = {}

    async def __aenter__(self) -> ProcessEngine:
        self._loop = asyncio.get_running_loop()
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        self._process = ctx.Process(target=_child_main, args=(self.config, child), name="ninfer-engine-core",
                                    daemon=True)
        with _child_environment(self.config):
            self._process.start()
        child.close()
        self._conn = parent
        try:
            first = await asyncio.to_thread(self._await_first)
        except BaseException:
            self._stop_process()
            raise
        if isinstance(first, _Failed):
            self._stop_process()
            raise first.error
        tokenizer = await asyncio.to_thread(Tokenizer.from_dir, self.config.model_path)
        self.core = _ApiSide(self.config, tokenizer, first.model_id, first.max_context)
        self.description = first.description
        self._set_snapshot(first.snapshot)
        self._commands = _PipeWriter(parent, "engine-commands")
        self._loop.add_reader(parent.fileno(), self._on_readable)
        return self

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def _await_first(self) -> _Ready | _Failed:
        assert self._conn is not None and self._process is not None
        deadline = time.monotonic() + self.START_TIMEOUT_S
        while not self._conn.poll(0.2):
            if not self._process.is_alive():
                return _Failed(RuntimeError(f"the engine process exited while starting "
                                            f"(exit code {self._process.exitcode}); see the log above"))
            if time.monotonic() > deadline:
                return _Failed(RuntimeError("the engine process did not start in time"))
        try:
            msg = self._conn.recv()
        except EOFError:
            return _Failed(RuntimeError("the engine process exited while starting; see the log above"))
        assert isinstance(msg, _Ready | _Failed)
        return msg

    async def __aexit__(self, *exc: object) -> None:
        if self._loop is not None and self._conn is not None:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self._conn.fileno())
        if self._commands is not None:
            self._commands.put(None)  # stop: the child aborts what is left
            await asyncio.to_thread(self._commands.close)
        if self._process is not None:
            await asyncio.to_thread(self._process.join, 30)
        self._stop_process()

    def _stop_process(self) -> None:
        if self._process is not None and self._process.is_alive():
            self._process.kill()
            self._process.join(5)
        if self._conn is not None:
            self._conn.close()

    async def _submit(self, add: _Add) -> None:
        if self._gone:  # (the process may not be reaped yet: its pipe closing is what says it is gone)
            raise RuntimeError(f"the engine process is gone: {self.step_error}")
        assert self._loop is not None
        done: asyncio.Future[None] = self._loop.create_future()
        self._adds[add.request_id] = done
        assert self._commands is not None
        self._commands.put(add)
        await done

    def abort(self, request_id: str) -> None:
        if self._commands is not None:
            self._commands.put(_Abort(request_id))

    def _on_readable(self) -> None:
        assert self._conn is not None
        try:
            while self._conn.poll():
                self._handle(self._conn.recv())
        except (EOFError, OSError):
            self._child_gone()

    def _handle(self, msg: Any) -> None:
        if isinstance(msg, _Step):
            self._set_snapshot(msg.snapshot)
            self._deliver(msg.outputs, msg.changed)
        elif isinstance(msg, _Added):
            done = self._adds.pop(msg.request_id, None)
            if done is not None and not done.done():
                done.set_result(None) if msg.error is None else done.set_exception(msg.error)
        elif isinstance(msg, _Failed):
            self.step_error = msg.error

    def _child_gone(self) -> None:
        assert self._loop is not None and self._conn is not None
        with contextlib.suppress(Exception):
            self._loop.remove_reader(self._conn.fileno())
        self._gone = True
        pid = self._process.pid if self._process is not None else None
        log.error("the engine process %s exited; failing its requests", pid)
        self.step_error = self.step_error or RuntimeError(f"the engine process {pid} exited")
        for done in self._adds.values():
            if not done.done():
                done.set_exception(RuntimeError("the engine process is gone"))
        self._adds.clear()
        aborted = [RequestOutput(rid, "", (), "abort", 0, 0, 0) for rid, s in self._streams.items() if not s.finished]
        self._deliver(aborted, True)


class _ApiSide:
    """The API process's view of an engine whose core runs elsewhere."""

    def __init__(self, config: EngineConfig, tokenizer: Tokenizer, model_id: str, max_context: int) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.max_context = max_context
