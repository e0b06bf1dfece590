"""``llmgw up``: the whole stack on one machine, no Docker.

Starts an embedded nats-server (unless ``NATS_URL`` is set), then the accounting, telemetry, engine and
gateway services as child processes, each with its own log prefix. Prints where the gateway listens
and how to call it once every child has printed its readiness line. Ctrl-C (or SIGTERM) stops every
child, then the NATS server: nothing is left running. A child (or the NATS server) that exits on its own
is restarted; one that keeps exiting (5 times in a minute) stops the whole stack with its name.

The embedded NATS requires a user per service with per-role subject permissions
(:mod:`services.common.nats_auth`); each child gets its own user in ``NATS_URL``. The engine's own HTTP
API requires the internal key in ``DATA/engine.key``. A second ``llmgw up`` on the same data directory
stops with one line (``DATA/up.lock``); a start that fails after creating the first admin prints the
admin password and API key it made.

Part of the composition root (:mod:`services.cli`), the one place that knows every service: it imports
``services.gateway.identity`` to create the first admin user and API key before the gateway starts, so the
banner can show them. That import from one service's package is acceptable only here, because this package
sits above every service and nothing imports it; services themselves never import each other.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from proto import subjects
from services.common import nats_auth
from services.common.nats_server import EmbeddedNatsServer, NatsServerError, set_parent_death_signal
from services.common.runtime import (
    atomic_write_text,
    data_dir,
    default_worker_id,
    read_stack_file,
    run_async_main,
    setup_logging,
    write_stack_file,
)

log = logging.getLogger("llmgw.up")

REPO_ROOT = Path(__file__).resolve().parents[2]
DEMO_MODEL = REPO_ROOT / "models" / "demo-qwen3"  # trained by tools/train_demo_model.py (issue #9)
DEFAULT_PORT = 8080
MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0


class StackError(RuntimeError):
    pass


def default_model(data: Path) -> Path:
    """The shipped demo model (``models/demo-qwen3``) when present, else a tiny random-weight checkpoint made
    once in the data dir (a checkout without the model files, e.g. a sparse or LFS-less clone)."""
    if (DEMO_MODEL / "config.json").exists() and (DEMO_MODEL / "model.safetensors").exists():
        return DEMO_MODEL
    tiny = data / "models" / "tiny-qwen3"
    if not (tiny / "config.json").exists():
        log.warning("no trained demo model in %s: writing a tiny random-weight Qwen3 checkpoint to %s "
                    "(its output is noise; pass --model PATH for a real checkpoint)", DEMO_MODEL, tiny)
        subprocess.run([sys.executable, "-m", "services.engine.tiny_checkpoint", str(tiny)], check=True)
    return tiny


class Child:
    def __init__(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        self.name = name
        self.argv = argv
        self.env = env
        self.proc: asyncio.subprocess.Process | None = None
        self.ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._pumps: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv, env=self.env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            # Own session: Ctrl-C reaches only the supervisor, which stops children in order.
            preexec_fn=set_parent_death_signal, start_new_session=True,
        )
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self._pumps = [
            asyncio.create_task(self._pump(self.proc.stdout, sys.stdout)),
            asyncio.create_task(self._pump(self.proc.stderr, sys.stderr)),
        ]

    async def _pump(self, stream: asyncio.StreamReader, out: TextIO) -> None:
        prefix = f"[{self.name}] ".encode()
        while line := await stream.readline():
            text = line.decode(errors="replace")
            if not self.ready.done() and f"llmgw {self.name} ready: " in text:
                self.ready.set_result(text.split("ready: ", 1)[1].strip())
            sink = out.buffer
            sink.write(prefix + line)
            sink.flush()

    async def stop(self, timeout_s: float = 15.0) -> None:
        if self.proc is None or self.proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(timeout_s):
                await self.proc.wait()
        except TimeoutError:
            log.warning("%s did not stop within %.0fs: killing it", self.name, timeout_s)
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            await self.proc.wait()
        for pump in self._pumps:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(pump, 2)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=os.environ.get("LLMGW_MODEL"),
                        help="HF checkpoint directory to serve (default: the shipped demo model)")
    parser.add_argument("--model-id", default=os.environ.get("LLMGW_MODEL_ID"),
                        help="name clients use (default: the model directory's name)")
    parser.add_argument("--port", type=int, default=int(os.environ.get("LLMGW_PORT", DEFAULT_PORT)),
                        help=f"gateway port (default {DEFAULT_PORT})")
    parser.add_argument("--host", default=os.environ.get("LLMGW_HOST", "127.0.0.1"))
    parser.add_argument("--data-dir", help="data directory (default: $LLMGW_DATA_DIR or ./data)")
    parser.add_argument("--gateway-workers", type=int, default=None, metavar="N",
                        help="gateway processes on its port (default: $LLMGW_WORKERS, else one per core, at most 8; "
                             "see llmgw gateway --workers)")


async def run(args: argparse.Namespace) -> None:
    data = data_dir(args.data_dir)
    with _single_stack(data):
        model = Path(args.model).resolve() if args.model else default_model(data)
        model_id = args.model_id or model.name
        credentials = _bootstrap_identity(data)
        shown: list[bool] = []  # set once the banner (with any credentials) is out, however the stack ends after
        try:
            await _run_stack(args, data, model, model_id, credentials, shown)
        finally:
            if credentials is not None and not shown:
                # the admin and the first key exist now; a later start will not show them again
                print(_unshown_credentials(credentials, data), file=sys.stderr, flush=True)


async def _run_stack(args: argparse.Namespace, data: Path, model: Path, model_id: str,
                     credentials: tuple[str, str] | None, shown: list[bool]) -> None:
    """Start everything, print the banner (then ``shown`` holds True: a Ctrl-C later does not repeat the
    credentials as unshown), supervise."""
    engine_key = _engine_key(data)
    # one id for the engine across restarts (its ledger rows and bus subjects); the embedded bus lets the engine
    # user speak for this id only
    engine_id = subjects.check_id(os.environ.get("LLMGW_WORKER_ID") or default_worker_id("engine").rsplit("-", 1)[0])
    async with contextlib.AsyncExitStack() as stack:
        url = os.environ.get("NATS_URL")
        server: EmbeddedNatsServer | None = None
        if url:  # an operator's own bus: its URL carries whatever credentials that bus wants
            urls = dict.fromkeys(nats_auth.ROLES, url)
        else:
            bus_creds = nats_auth.load_or_create_credentials(data / "nats")
            server = await stack.enter_async_context(
                EmbeddedNatsServer(data / "nats", authorization=nats_auth.authorization_conf(bus_creds, engine_id)))
            url = server.url
            urls = {role: nats_auth.url_with_credentials(url, role, bus_creds[role]) for role in nats_auth.ROLES}
        base_env = {k: v for k, v in os.environ.items() if k != "NINFER_API_KEY"}
        base_env |= {"LLMGW_DATA_DIR": str(data), "PYTHONUNBUFFERED": "1"}

        def env(role: str, **extra: str) -> dict[str, str]:
            return {**base_env, "NATS_URL": urls[role], **extra}

        py = [sys.executable, "-m"]
        children = [
            Child("accounting", [*py, "services.accounting"], env("accounting")),
            Child("telemetry", [*py, "services.telemetry"], env("telemetry")),
            # its own HTTP port answers only with the internal key (the gateway reaches it over the bus)
            Child("engine", [*py, "services.engine", str(model), "--model-id", model_id, "--port", "0",
                          "--worker-id", engine_id],
                  env("engine", NINFER_API_KEY=engine_key)),
            Child("gateway", [*py, "services.gateway", "--host", args.host, "--port", str(args.port),
                              *(["--workers", str(args.gateway_workers)] if args.gateway_workers is not None else [])],
                  env("gateway")),
        ]
        for child in children:  # the exit stack runs its callbacks last-in first: gateway first, accounting last
            stack.push_async_callback(child.stop)
        for child in children:
            await child.start()
        waits: dict[asyncio.Future[int], Child] = {asyncio.ensure_future(c.proc.wait()): c for c in children if c.proc}
        ready = asyncio.gather(*(c.ready for c in children))
        started: list[asyncio.Future[Any]] = [ready, *waits]
        done, _ = await asyncio.wait(started, return_when=asyncio.FIRST_COMPLETED)
        if ready not in done:
            dead = next(waits[t] for t in done if t in waits)
            ready.cancel()
            assert dead.proc is not None  # it is in waits: it was started
            raise StackError(f"{dead.name} exited during start-up (code {dead.proc.returncode}); see its log above")
        gateway_url = children[-1].ready.result().removeprefix("listening on ").strip()
        accounting_url = children[0].ready.result().removeprefix("listening on ").split(";", 1)[0].strip()
        await _wait_for_model(gateway_url, model_id)
        # stack.json is 0600 (atomic_write_text): `llmgw sql` takes the admin's bus URL from it
        write_stack_file(data, {"nats_url": urls["admin"], "gateway_url": gateway_url,
                                "accounting_url": accounting_url, "model_id": model_id, "pid": os.getpid()})
        stack.callback(lambda: (data / "stack.json").unlink(missing_ok=True))
        print(_banner(gateway_url, accounting_url, model_id, url, data, credentials), flush=True)
        shown.append(True)
        await _supervise(waits, server)


@contextlib.contextmanager
def _single_stack(data: Path) -> Iterator[None]:
    """Hold ``DATA/up.lock`` (an flock, released by the kernel however this process ends) while the stack runs:
    a second ``llmgw up`` on the same data directory stops with one line instead of starting a second NATS on
    the same JetStream directory."""
    path = data / "up.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StackError(_already_running(data, os.pread(fd, 64, 0).decode(errors="replace").strip())) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _already_running(data: Path, pid: str) -> str:
    info = read_stack_file(data) or {}
    gateway = info.get("gateway_url") or "still starting"
    return (f"the stack already runs (pid {pid or '?'}, gateway {gateway}, data dir {data}); "
            f"stop it first (Ctrl-C in its terminal, or kill {pid or '<pid>'})")


def _engine_key(data: Path) -> str:
    """The internal key of the engine's own HTTP API (``DATA/engine.key``, 0600, made once)."""
    path = data / "engine.key"
    with contextlib.suppress(FileNotFoundError):
        if key := path.read_text().strip():
            return key
    key = "sk-engine-" + secrets.token_urlsafe(24)
    atomic_write_text(path, key + "\n")
    return key


def _unshown_credentials(credentials: tuple[str, str], data: Path) -> str:
    password, key = credentials
    return ("llmgw up: the stack did not come up, but this first start created the admin user and an API key "
            "(they will not be shown again):\n"
            f"   admin sign-in: user admin  password {password}\n"
            f"   API key: {key}\n"
            f"   (lost them? LLMGW_DATA_DIR={data} .venv/bin/llmgw admin reset-password admin)")


async def _supervise(waits: dict[asyncio.Future[int], Child], server: EmbeddedNatsServer | None = None) -> None:
    """Restart a child (or the embedded nats-server) that exits on its own; give up when one exits 5 times
    within a minute. The server comes back on the same port, so every client's URL still holds."""
    restarts: dict[str, list[float]] = {}
    nats_wait: asyncio.Future[int] | None = asyncio.ensure_future(server.wait()) if server is not None else None

    def count(name: str, code: object) -> None:
        now = time.monotonic()
        recent = [t for t in restarts.get(name, []) if now - t < RESTART_WINDOW_S]
        if len(recent) >= MAX_RESTARTS:
            raise StackError(f"{name} exited {len(recent) + 1} times within a minute "
                             f"(last code {code}); stopping the stack")
        log.warning("%s exited (code %s); restarting it", name, code)
        restarts[name] = [*recent, now]

    try:
        while True:
            pending: list[asyncio.Future[int]] = [*waits, *([nats_wait] if nats_wait is not None else [])]
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for finished in done:
                if finished is nats_wait:
                    assert server is not None
                    count("nats-server", finished.result())
                    try:
                        await server.restart()
                    except NatsServerError as exc:
                        raise StackError(f"the NATS server could not be restarted: {exc}") from None
                    nats_wait = asyncio.ensure_future(server.wait())
                    continue
                child = waits.pop(finished)
                count(child.name, finished.result())
                await asyncio.sleep(1.0)
                await child.start()
                assert child.proc is not None
                waits[asyncio.ensure_future(child.proc.wait())] = child
    finally:
        if nats_wait is not None:
            nats_wait.cancel()


async def _wait_for_model(gateway_url: str, model_id: str, timeout_s: float = 60.0) -> None:
    """The banner promises a working curl: wait until the gateway has seen the engine's heartbeat."""
    import aiohttp

    async with aiohttp.ClientSession() as http:
        try:
            async with asyncio.timeout(timeout_s):
                while True:
                    with contextlib.suppress(aiohttp.ClientError):
                        async with http.get(f"{gateway_url}/v1/models") as resp:
                            if model_id in {m["id"] for m in (await resp.json()).get("data", [])}:
                                return
                    await asyncio.sleep(0.1)
        except TimeoutError:
            raise StackError(f"the gateway did not see the engine serving {model_id!r} "
                             f"within {timeout_s:.0f}s") from None


def _bootstrap_identity(data: Path) -> tuple[str, str] | None:
    """On the first start, create the admin user and an API key here, so the banner can show them once."""
    from services.gateway.identity import IdentityStore

    store = IdentityStore(data / "identity")
    try:
        return None if store.has_users() else store.bootstrap_admin(time.time())
    finally:
        store.close()


def _banner(gateway_url: str, accounting_url: str, model_id: str, nats_url: str, data: Path,
            credentials: tuple[str, str] | None) -> str:
    if credentials is not None:
        password, key = credentials
        first = (f"   First start: admin sign-in at {gateway_url}/  user admin  password {password}\n"
                 f"   API key: {key}\n"
                 "   (both shown only this once: keep them; more keys and users on the admin pages)")
        key_shown = key
    else:
        first = (f"   API key: the one shown at the first start, or create one at {gateway_url}/account\n"
                 "   (lost the admin password? .venv/bin/llmgw admin reset-password admin)")
        key_shown = "$LLMGW_API_KEY"
    return f"""
================================================================================
 llmgw is up.  Gateway: {gateway_url}   (NATS {nats_url}, data in {data})
   The bus is authenticated: one user per service, passwords in {data}/nats/credentials.json
{first}

   curl -s {gateway_url}/v1/chat/completions -H 'Content-Type: application/json' \\
     -H "Authorization: Bearer {key_shown}" \\
     -d '{{"model":"{model_id}","messages":[{{"role":"user","content":"hi"}}]}}'

   OpenAI SDK: OpenAI(base_url="{gateway_url}/v1", api_key="{key_shown}")
   Admin pages: {gateway_url}/backends  /admin/config/page  /admin/costs
   Usage ledger: .venv/bin/llmgw sql "select request_id, model, output_tokens from requests"
   Accounting API (admin key): {accounting_url}/costs   POST {accounting_url}/sql
   Ctrl-C stops everything.
================================================================================""".rstrip()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="llmgw up", description="run the whole stack on this machine")
    add_arguments(parser)
    args = parser.parse_args(argv)
    setup_logging()
    run_async_main(lambda: run(args), "up", clean_errors=(StackError,))
