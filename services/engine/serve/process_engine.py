"""ProcessEngine: the EngineCore in a child process (vLLM v1's split), behind the same EngineHandle.

The event loop serves HTTP and SSE while the child keeps every torch thread busy; ``ninfer-serve`` runs
it. Requests and aborts go down a pipe from a writer thread; each step's outputs and a snapshot come
back on it (written by the child's own writer thread, so a slow reader never stalls a step). A child
that dies ends every open stream with ``abort``; typed engine errors cross the boundary intact.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import pickle
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from services.common.runtime import setup_logging
from services.engine.config import EngineConfig
from services.engine.engine_core import EngineCore
from services.engine.errors import CoreLostError
from services.engine.model.tokenizer import Tokenizer
from services.engine.outputs import EngineSnapshot, RequestOutput
from services.engine.serve.async_engine import (
    AbortCommand,
    AddCommand,
    Command,
    EmbedCommand,
    EmbedResult,
    EngineHandle,
    run_step_loop,
)

log = logging.getLogger(__name__)


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
class _Embedded:
    request_id: str
    vectors: list[bytes]
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
    # Ctrl-C and a SIGTERM sent to the whole process group (systemd, a terminal, compose) are the parent's: it
    # stops us through the pipe, after its requests ended; a child killed first would read as a crash.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    setup_logging()
    try:
        core = EngineCore(config)
    except BaseException as exc:
        conn.send(_Failed(_portable(exc)))
        return
    clock = time.monotonic
    conn.send(_Ready(core.model_id, core.max_context, core.describe(), core.snapshot(clock())))
    replies = _PipeWriter(conn, "engine-replies")

    def next_command(timeout_s: float) -> Command:
        try:
            if not conn.poll(timeout_s):
                raise queue.Empty
            cmd: Command = conn.recv()
        except (EOFError, OSError):  # the parent is gone: stop
            return None
        return cmd

    def on_added(request_id: str, exc: BaseException | None) -> None:
        replies.put(_Added(request_id, None if exc is None else _portable(exc)))

    def publish(outputs: list[RequestOutput], snapshot: EngineSnapshot, changed: bool) -> None:
        replies.put(_Step(outputs, snapshot, changed))

    def on_step_error(exc: BaseException) -> None:
        replies.put(_Failed(_portable(exc)))

    def on_embedded(request_id: str, result: EmbedResult) -> None:
        if isinstance(result, BaseException):
            replies.put(_Embedded(request_id, [], _portable(result)))
        else:
            replies.put(_Embedded(request_id, result, None))

    try:
        run_step_loop(core, clock, next_command, on_added, publish, on_step_error, on_embedded)
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
        self._lost: asyncio.Future[CoreLostError] | None = None  # set when the child is gone
        self._adds: dict[str, asyncio.Future[None]] = {}
        self._embeds: dict[str, asyncio.Future[list[bytes]]] = {}

    async def __aenter__(self) -> ProcessEngine:
        self._loop = asyncio.get_running_loop()
        self._lost = self._loop.create_future()
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

    async def _submit(self, add: AddCommand) -> None:
        if self._gone:  # (the process may not be reaped yet: its pipe closing is what says it is gone)
            raise self._lost_error()
        assert self._loop is not None
        done: asyncio.Future[None] = self._loop.create_future()
        self._adds[add.request_id] = done
        assert self._commands is not None
        self._commands.put(add)
        await done

    async def embed(self, request_id: str, inputs: Sequence[Sequence[int]]) -> list[bytes]:
        if self._gone:
            raise self._lost_error()
        assert self._loop is not None and self._commands is not None
        done: asyncio.Future[list[bytes]] = self._loop.create_future()
        self._embeds[request_id] = done
        self._commands.put(EmbedCommand(request_id, [list(ids) for ids in inputs]))
        try:
            return await done
        finally:
            self._embeds.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        if self._commands is not None:
            self._commands.put(AbortCommand(request_id))

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
        elif isinstance(msg, _Embedded):
            waiting = self._embeds.pop(msg.request_id, None)
            if waiting is not None and not waiting.done():
                waiting.set_result(msg.vectors) if msg.error is None else waiting.set_exception(msg.error)
        elif isinstance(msg, _Failed):
            self.step_error = msg.error

    def _lost_error(self) -> CoreLostError:
        process = self._process
        return CoreLostError(process.pid if process is not None else None,
                             process.exitcode if process is not None else None)

    async def core_lost(self) -> BaseException:
        assert self._lost is not None, "the engine has not started"
        lost = await self._lost
        if self._process is not None:  # reaped, so the error can say how it ended (a signal: the OOM killer?)
            await asyncio.to_thread(self._process.join, 5)
        del lost
        return self._lost_error()

    def _child_gone(self) -> None:
        assert self._loop is not None and self._conn is not None
        with contextlib.suppress(Exception):
            self._loop.remove_reader(self._conn.fileno())
        self._gone = True
        lost = self._lost_error()
        log.error("%s; failing its requests", lost.message)
        self.step_error = self.step_error or lost
        for done in self._adds.values():
            if not done.done():
                done.set_exception(lost)
        self._adds.clear()
        for waiting in self._embeds.values():
            if not waiting.done():
                waiting.set_exception(lost)
        self._embeds.clear()
        if self._lost is not None and not self._lost.done():
            self._lost.set_result(lost)
        aborted = [RequestOutput(rid, "", (), "abort", 0, 0, 0) for rid, s in self._streams.items() if not s.finished]
        self._deliver(aborted, True)


class _ApiSide:
    """The API process's view of an engine whose core runs elsewhere."""

    def __init__(self, config: EngineConfig, tokenizer: Tokenizer, model_id: str, max_context: int) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.max_context = max_context
