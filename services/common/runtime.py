"""Process-level helpers: data directory, logging, readiness lines, atomic files, worker ids."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from proto.pools import ConfigError  # defined in proto: the pools file, which proto holds, raises it too


def data_dir(flag: str | None = None) -> Path:
    """``--data-dir``, else ``LLMGW_DATA_DIR``, else ``./data``."""
    path = Path(flag or os.environ.get("LLMGW_DATA_DIR") or "data").resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path


class BufferedStderrHandler(logging.StreamHandler[TextIO]):
    """Log lines to stderr through a buffer, written out at least every ``flush_every_s``.

    ``sys.stderr`` is line-buffered, so a plain handler makes one ``write`` system call per line: at
    thousands of requests a second the gateway's access log alone took ~5 % of its CPU in those calls.
    Here lines collect in a 64 KiB buffer that a daemon thread flushes while there is something in it
    (and ``logging.shutdown`` at exit flushes the rest). Warnings and errors are flushed at once.
    """

    def __init__(self, flush_every_s: float = 0.05) -> None:
        stream = open(sys.stderr.fileno(), "w", buffering=65536, closefd=False, encoding="utf-8",
                      errors="backslashreplace")
        super().__init__(stream)
        self._dirty = threading.Event()
        self._flush_every_s = flush_every_s
        threading.Thread(target=self._flusher, name="log-flush", daemon=True).start()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.stream.write(self.format(record) + self.terminator)
        except Exception:
            self.handleError(record)
            return
        if record.levelno >= logging.WARNING:
            self.flush()
        else:
            self._mark_dirty()

    def write_info_line(self, name: str, message: str) -> None:
        """What ``emit`` writes for an INFO record of logger ``name``, when the formatter is setup_logging's
        (:class:`HotPathLog` checks that before it calls)."""
        formatter, lock = self.formatter, self.lock
        assert isinstance(formatter, _Formatter) and lock is not None  # HotPathLog checked; Handler made the lock
        line = formatter.info_line(name, message, time.time())
        with lock:
            self.stream.write(line)
        self._mark_dirty()

    def _mark_dirty(self) -> None:
        if not self._dirty.is_set():  # set() takes a lock and notifies: once per flush, not once per line
            self._dirty.set()

    def _flusher(self) -> None:
        while self._dirty.wait():
            time.sleep(self._flush_every_s)
            self._dirty.clear()
            self.flush()


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _Formatter(logging.Formatter):
    """:data:`LOG_FORMAT`, with the date and time text made once per second instead of once per line."""

    _cache: tuple[int, str] = (-1, "")  # (second, its text): one tuple, so threads never see a torn pair

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return self._asctime(record.created, record.msecs)

    def _asctime(self, created: float, msecs: float) -> str:
        second = int(created)
        cached_second, text = self._cache
        if second != cached_second:
            text = time.strftime(self.default_time_format, self.converter(second))
            self._cache = (second, text)
        msec_format = self.default_msec_format
        assert msec_format is not None  # a class constant of logging.Formatter ("%s,%03d")
        return msec_format % (text, msecs)

    def info_line(self, name: str, message: str, created: float) -> str:
        """The line ``format`` makes of an INFO record (of ``name``, with ``message``, made at ``created``)."""
        msecs = int((created - int(created)) * 1000) + 0.0  # as LogRecord computes it
        return f"{self._asctime(created, msecs)} INFO {name}: {message}\n"


class HotPathLog:
    """INFO lines written many times a second (the gateway's access line) at a fraction of logging's cost.

    A log record costs ~5 µs (record, handler lock, formatting): at 6,000 requests a second the access
    line was a tenth of the gateway's CPU. When logging is set up as :func:`setup_logging` leaves it
    (one buffered stderr handler on the root logger, nothing else on the way), the line goes straight
    into that handler, the same text as logging would write. Anything else (a test's capture handler, a
    filter, another handler) gets an ordinary record.
    """

    def __init__(self, name: str) -> None:
        self.logger = logging.getLogger(name)

    def info(self, message: str) -> None:
        logger = self.logger
        if not logger.isEnabledFor(logging.INFO):
            return
        handler = self._direct_handler()
        if handler is None:
            logger.info("%s", message)
        else:
            handler.write_info_line(logger.name, message)

    def _direct_handler(self) -> BufferedStderrHandler | None:
        node: logging.Logger | None = self.logger
        while node is not None and node.parent is not None:  # up to (not including) the root
            if node.handlers or node.filters or not node.propagate:
                return None
            node = node.parent
        if node is None or node.filters or len(node.handlers) != 1:
            return None
        handler = node.handlers[0]
        if (type(handler) is not BufferedStderrHandler or handler.filters or handler.level > logging.INFO
                or not isinstance(handler.formatter, _Formatter)):
            return None
        return handler


def setup_logging(level: str | None = None) -> None:
    """Only ``__main__`` modules call this. Logs go to stderr; readiness lines go to stdout."""
    # The format uses none of these, and gathering them is most of the cost of a log record (the
    # logging HOWTO's "Optimization" section).
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    logging._srcfile = None  # no caller lookup (file and line) per record
    handler: logging.Handler
    try:
        handler = BufferedStderrHandler()
    except (AttributeError, OSError, ValueError):  # no stderr file descriptor (a detached process): plain
        handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Formatter(LOG_FORMAT))
    logging.basicConfig(level=(level or os.environ.get("LLMGW_LOG_LEVEL") or "INFO").upper(), handlers=[handler])


class ThrottledLog:
    """Logs a line of one kind at most once per ``every_s``, then says how many like it were held back.

    For lines that would otherwise repeat per request while a dependency is down (a log storm).
    """

    def __init__(self, logger: logging.Logger, every_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger, self.every_s, self.clock = logger, every_s, clock
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def warning(self, kind: str, msg: str, *args: Any) -> None:
        now = self.clock()
        last = self._last.get(kind)
        if last is not None and now - last < self.every_s:
            self._held[kind] = self._held.get(kind, 0) + 1
            return
        held = self._held.pop(kind, 0)
        self._last[kind] = now
        if held and last is not None:  # lines are held only after one was logged, so last is set then
            msg += f" (and {held} more like it in the last %.0f s)"
            args = (*args, now - last)
        self.logger.warning(msg, *args)


def announce(service: str, message: str) -> None:
    """The one readiness line a service prints when it is serving; test fixtures parse it."""
    print(f"llmgw {service} ready: {message}", flush=True)


def new_session_id() -> str:
    return uuid.uuid4().hex[:16]


def default_worker_id(prefix: str) -> str:
    host = "".join(c if c.isalnum() or c in "-_" else "-" for c in socket.gethostname())[:40]
    return f"{prefix}-{host}-{os.getpid()}"


def atomic_write_text(path: Path, text: str) -> None:
    """Write via a temp file in the same directory + fsync + rename: a crash leaves old or new, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_stack_file(data: Path, info: dict[str, Any]) -> None:
    atomic_write_text(data / "stack.json", json.dumps(info, indent=2))


def read_stack_file(data: Path) -> dict[str, Any] | None:
    try:
        info: dict[str, Any] = json.loads((data / "stack.json").read_text())
        return info
    except (OSError, ValueError):
        return None


def run_async_main(main: Any, service: str, clean_errors: tuple[type[BaseException], ...] = ()) -> None:
    """Run ``main()`` (a coroutine function) until it returns or SIGINT/SIGTERM arrives.

    A signal cancels the main task, so every ``async with``/``finally`` runs (drain NATS, close
    DuckDB, stop child servers) before the process exits. A :class:`ConfigError` or one of
    ``clean_errors`` ends the process with one line naming the problem (exit 2), not a traceback.
    """
    import signal

    async def runner() -> None:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        try:
            await main()
        except asyncio.CancelledError:
            pass

    clean: tuple[type[BaseException], ...] = (ConfigError, *clean_errors)
    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as loop_runner:
            loop_runner.run(runner())
    except clean as exc:
        print(f"llmgw {service}: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop when installed (a dependency on Linux and macOS: about a third more requests per second
    through the gateway, bench/gateway_overhead.py), unless LLMGW_UVLOOP=0; else asyncio's own loop."""
    if os.environ.get("LLMGW_UVLOOP", "1") == "0":
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def raise_if_cancelling() -> None:
    """Re-raise a cancellation that a library or Python 3.11's ``asyncio.timeout`` turned into a
    TimeoutError (when the deadline and the cancel land together), so a shutdown is never swallowed.
    Call it wherever a TimeoutError is caught and the loop goes on, and at the top of every background
    loop that makes bus requests: Python 3.11's ``asyncio.wait_for`` (inside nats-py's ``request``) drops a
    cancel that lands in the same loop turn as the answer, and the loop would then run on, holding
    shutdown forever (seen as a 1-in-3 hang of a gateway test with a 0.1 s identity resync)."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
