"""``llmgw gateway --workers N``: N gateway processes on one port, supervised by this one.

One Python process serves one core's worth of requests (bench/gateway_overhead.py); the gateway's state
already lives on the bus (identity, limit counters, config: replicas share them), so N processes, each
a full gateway replica with its own id, serve N cores' worth.

The parent:

- prepares what the workers share before any starts: the data directory's ``fleet.secret`` and the
  identity database (its schema and cookie secret), so no two workers race to create them; and the bus:
  without ``--nats`` it runs the embedded nats-server that every worker joins;
- binds the port (port 0 is resolved here, once). With ``SO_REUSEPORT`` (Linux, the BSDs) it keeps a
  bound socket that does not listen, and each worker binds its own listening socket to the same port: the
  kernel spreads connections over the workers' accept queues. Where ``SO_REUSEPORT`` is missing it listens
  itself and hands the socket down (``--listen-fd``): the workers accept from one shared queue;
- starts worker ``i`` as ``--gateway-id <id>-w<i> --worker-slot i``: the same id (and so the same usage
  spool directory) across restarts of slot ``i``; the worker label ``w<i>`` tags its /metrics samples and
  its saved limit counters;
- prints one readiness line when every worker has printed its own, and swallows theirs;
- restarts a worker that exits, with a back-off (:func:`restart_delay_s`), and logs it; a worker that
  exits before the gateway was ever ready stops the start (a bad flag fails once, not N times a second);
- on SIGINT/SIGTERM sends SIGTERM to every worker and waits for them (each drains as a gateway does).

Workers' stdout lines other than their readiness line (the first start's admin credentials) are passed
on; their stderr (logs) is passed on in whole lines, so lines of two workers never interleave mid-line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from services.common.nats_server import EmbeddedNatsServer, set_parent_death_signal
from services.common.runtime import ConfigError, announce, data_dir, default_worker_id

log = logging.getLogger(__name__)

MAX_DEFAULT_WORKERS = 8  # beyond this the bus and the engines, not the gateway's CPU, bound a host
READY_PREFIX = "llmgw gateway ready: "
STOP_TIMEOUT_S = 30.0  # a worker drains in-flight requests first (service.py), then is killed


def default_workers() -> int:
    """One per core this process may run on, at most :data:`MAX_DEFAULT_WORKERS`."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(cores, MAX_DEFAULT_WORKERS))


def restart_delay_s(num_quick_exits: int, base_s: float = 0.5, max_s: float = 30.0) -> float:
    """Back-off before restarting a worker: ``base_s`` after its first quick exit, doubling with every
    further one in a row, at most ``max_s``. (A worker that ran a minute resets the count.)"""
    return min(max_s, base_s * 2 ** max(num_quick_exits - 1, 0))


QUICK_EXIT_S = 60.0  # a worker that ran less than this before it exited counts as a quick exit


@dataclass
class Slot:
    index: int
    label: str
    gateway_id: str
    proc: asyncio.subprocess.Process | None = None
    started_s: float = 0.0
    num_quick_exits: int = 0
    num_restarts: int = 0
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    pumps: list[asyncio.Task[None]] = field(default_factory=list)


def bind_listener(host: str, port: int) -> tuple[socket.socket, bool]:
    """The gateway's port, bound here: (the socket, whether workers bind their own with SO_REUSEPORT).
    With SO_REUSEPORT the socket only holds the port (it does not listen, so it takes no connections);
    without, it listens and the workers share it."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    reuse_port = hasattr(socket, "SO_REUSEPORT")
    if reuse_port:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        except OSError:  # defined but refused (some kernels, some sandboxes)
            reuse_port = False
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise ConfigError("port", f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    if not reuse_port:
        sock.listen(1024)
        sock.set_inheritable(True)
    return sock, reuse_port


def prepare_shared_files(data: Path) -> None:
    """Create what the workers share before any of them starts, so none races another to create it."""
    from services.gateway.identity import IdentityStore
    from services.gateway.identity_signing import fleet_secret

    fleet_secret(data)
    IdentityStore(data / "identity").close()


class Supervisor:
    def __init__(self, argv: list[str], args: argparse.Namespace, num_workers: int, port: int) -> None:
        self.argv = argv
        self.port = port
        self.args = args
        self.num_workers = num_workers
        self.group = args.gateway_id or default_worker_id("gw")
        self.slots = [Slot(i, f"w{i}", f"{self.group}-w{i}") for i in range(num_workers)]
        self.stopping = False
        self.url = ""

    def worker_argv(self, slot: Slot, port: int, nats_url: str | None, listen_fd: int | None) -> list[str]:
        # argparse keeps the last value of a repeated option: these override what the operator gave
        extra = ["--workers", str(self.num_workers), "--worker-slot", str(slot.index), "--worker-group", self.group,
                 "--gateway-id", slot.gateway_id, "--port", str(port)]
        if nats_url is not None:
            extra += ["--nats", nats_url]
        if listen_fd is not None:
            extra += ["--listen-fd", str(listen_fd)]
        return [sys.executable, "-m", "services.gateway", *self.argv, *extra]

    async def run(self) -> None:
        data = data_dir(self.args.data_dir)
        prepare_shared_files(data)
        async with contextlib.AsyncExitStack() as stack:
            nats_url = self.args.nats or os.environ.get("NATS_URL") or None
            embedded = None
            if nats_url is None:  # one embedded server for all the workers, as a single gateway runs one
                server = await stack.enter_async_context(EmbeddedNatsServer(data / "nats"))
                embedded = nats_url = server.url
            sock, reuse_port = bind_listener(self.args.host, self.port)
            stack.callback(sock.close)
            bound_port = sock.getsockname()[1]
            listen_fd = None if reuse_port else sock.fileno()
            log.info("starting %d gateway workers on port %d (%s)", self.num_workers, bound_port,
                     "SO_REUSEPORT" if reuse_port else "one listening socket handed down")
            stack.push_async_callback(self.stop_all)
            argv = {s.index: self.worker_argv(s, bound_port, embedded, listen_fd) for s in self.slots}
            for slot in self.slots:
                await self.start(slot, argv[slot.index], listen_fd)
            await self.wait_until_ready()
            host = self.args.host if ":" not in self.args.host else f"[{self.args.host}]"
            self.url = f"http://{host}:{bound_port}"
            log.info("all %d gateway workers serving", self.num_workers)
            announce("gateway", f"listening on {self.url}")  # the line a single gateway prints: parsers read both
            async with asyncio.TaskGroup() as tasks:
                for slot in self.slots:
                    tasks.create_task(self.keep_running(slot, argv[slot.index], listen_fd))

    async def start(self, slot: Slot, argv: list[str], listen_fd: int | None) -> None:
        slot.ready.clear()
        slot.proc = await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            pass_fds=(listen_fd,) if listen_fd is not None else (),
            # their own process group: a terminal's Ctrl-C reaches only us, and we stop them (SIGTERM)
            preexec_fn=set_parent_death_signal, start_new_session=True)
        slot.started_s = time.monotonic()
        log.info("gateway worker %s started (pid %d, gateway id %s)", slot.label, slot.proc.pid, slot.gateway_id)
        assert slot.proc.stdout is not None and slot.proc.stderr is not None
        slot.pumps = [asyncio.create_task(self._stdout(slot, slot.proc.stdout)),
                      asyncio.create_task(self._stderr(slot.proc.stderr))]

    async def _stdout(self, slot: Slot, stream: asyncio.StreamReader) -> None:
        while line := await stream.readline():
            if line.decode(errors="replace").startswith(READY_PREFIX):
                slot.ready.set()
                if self.url:  # a restarted worker: the gateway's own readiness line was printed long ago
                    log.info("gateway worker %s (pid %s) serving again", slot.label, slot.proc and slot.proc.pid)
                continue
            sys.stdout.buffer.write(line)
            sys.stdout.buffer.flush()

    @staticmethod
    async def _stderr(stream: asyncio.StreamReader) -> None:
        """Pass a worker's logs on in whole lines: chunks, not lines, so busy access logs cost us little."""
        partial = b""
        while chunk := await stream.read(65536):
            text = partial + chunk
            cut = text.rfind(b"\n") + 1
            partial = text[cut:]
            if cut:
                sys.stderr.buffer.write(text[:cut])
                sys.stderr.buffer.flush()
        if partial:
            sys.stderr.buffer.write(partial + b"\n")
            sys.stderr.buffer.flush()

    async def wait_until_ready(self) -> None:
        """Every worker's readiness line; a worker that exits first stops the start with its exit code."""
        for slot in self.slots:
            assert slot.proc is not None
            ready = asyncio.ensure_future(slot.ready.wait())
            exited = asyncio.ensure_future(slot.proc.wait())
            done, _ = await asyncio.wait({ready, exited}, return_when=asyncio.FIRST_COMPLETED)
            ready.cancel()
            exited.cancel()
            if ready not in done:
                for pump in slot.pumps:
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(pump, 2.0)
                code = slot.proc.returncode
                raise SystemExit(code if code and code > 0 else 1)

    async def keep_running(self, slot: Slot, argv: list[str], listen_fd: int | None) -> None:
        while True:
            assert slot.proc is not None
            code = await slot.proc.wait()
            for pump in slot.pumps:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(pump, 2.0)
            if self.stopping:
                return
            ran_s = time.monotonic() - slot.started_s
            slot.num_quick_exits = slot.num_quick_exits + 1 if ran_s < QUICK_EXIT_S else 0
            delay_s = restart_delay_s(slot.num_quick_exits)
            how = f"signal {-code}" if code < 0 else f"code {code}"
            log.warning("gateway worker %s (pid %s) exited with %s after %.1f s; restarting it in %.1f s",
                        slot.label, slot.proc.pid, how, ran_s, delay_s)
            await asyncio.sleep(delay_s)
            if self.stopping:
                return
            slot.num_restarts += 1
            await self.start(slot, argv, listen_fd)

    async def stop_all(self) -> None:
        """SIGTERM to every worker, then wait (each drains like a single gateway); kill what outlasts the wait."""
        self.stopping = True
        running = [s.proc for s in self.slots if s.proc is not None and s.proc.returncode is None]
        for proc in running:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        for proc in running:
            try:
                async with asyncio.timeout(STOP_TIMEOUT_S):
                    await proc.wait()
            except TimeoutError:
                log.warning("gateway worker pid %s did not stop within %.0f s: killing it", proc.pid, STOP_TIMEOUT_S)
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        for slot in self.slots:
            for pump in slot.pumps:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(pump, 2.0)

