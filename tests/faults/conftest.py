"""Fault-test helpers: real engine/gateway/accounting/telemetry processes that a test can SIGKILL, an
in-process gateway on a real nats-server, a counter of error log lines, a reader of the USAGE stream, and
the run-wide secrets check.

Every test under tests/faults gets the ``faults`` marker here (``pytest -m faults`` runs them alone).

Secrets never logged (issue #12, 6): :data:`WATCH` keeps every log record of the run (INFO and up, every
logger: the in-process gateways' access and error logs included) and the output of every service process
the tests start. Tests register each key and password they use; when the run ends, none may appear in
that text, except the gateway's one first-start line on stdout, which exists to show them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import signal
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from proto import SqlQuery, UsageRecord, decode, encode_json, subjects
from proto import pools as pool_config
from services.common.bus import connect, ensure_bus
from services.common.runtime import raise_if_cancelling
from services.gateway.service import GatewayConfig, GatewayService
from tests.e2e.procs import Followed

if TYPE_CHECKING:  # threaded.py imports this module
    from tests.faults.threaded import ThreadedGateway

PYTHON = sys.executable
FAULTS_DIR = Path(__file__).resolve().parent
BOOTSTRAP_LINE = "llmgw gateway: first start"  # the one place a gateway shows a password and a key
CLIENT_LOGGERS = ("httpx", "httpcore", "hypothesis")


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if FAULTS_DIR in item.path.parents:
            item.add_marker(pytest.mark.faults)


class SecretWatch(logging.Handler):
    """The log records and process outputs of a whole fault-test run, and the secrets they must not hold."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.secrets: dict[str, str] = {}  # value -> what it is
        self.lines: list[str] = []
        self.outputs: list[Followed] = []
        self.access_lines = 0

    def add(self, what: str, value: str | None) -> None:
        if value:
            self.secrets.setdefault(value, what)

    def add_bootstrap(self, text: str) -> None:
        """The password and key of a gateway's first-start line (a process's output, or stdout)."""
        for line in text.splitlines():
            if line.startswith(BOOTSTRAP_LINE):
                found = re.search(r"\(password (\S+)\) and API key (\S+);", line)
                assert found, line
                self.add("bootstrap admin password", found.group(1))
                self.add("bootstrap API key", found.group(2))

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.startswith(CLIENT_LOGGERS):
            return  # the tests' own HTTP clients: a line per request, none of it from a service
        try:
            text = f"{record.levelname} {record.name}: {record.getMessage()}"
        except Exception:  # a record whose args do not format: keep what there is
            text = f"{record.levelname} {record.name}: {record.msg!r} {record.args!r}"
        if record.exc_info and record.exc_info[1] is not None:
            text += f" {record.exc_info[1]!r}"
        if record.name == "llmgw.access":
            self.access_lines += 1
        self.lines.append(text)

    def texts(self) -> list[tuple[str, str]]:
        """(where, text): the log, and each process's output without its first-start line."""
        found = [("log", "\n".join(self.lines))]
        for followed in self.outputs:
            lines = [ln for ln in followed.lines if not ln.startswith(BOOTSTRAP_LINE)]
            found.append((" ".join(followed.proc.args[:4]), "".join(lines)))
        return found

    def leaks(self) -> list[str]:
        return [f"{what} in {where}" for where, text in self.texts()
                for value, what in self.secrets.items() if value in text]


WATCH = SecretWatch()


@pytest.fixture(scope="session", autouse=True)
def secrets_never_logged() -> Iterator[SecretWatch]:
    """Watch the whole run's logs (INFO and up) and check them for every registered secret at its end."""
    root, client = logging.getLogger(), logging.getLogger("httpx")
    old, old_client = root.level, client.level
    root.addHandler(WATCH)
    if root.level == logging.NOTSET or root.level > logging.INFO:
        root.setLevel(logging.INFO)  # the access log is INFO
    client.setLevel(logging.WARNING)  # not a line per fuzz request in every failure report
    try:
        yield WATCH
    finally:
        root.removeHandler(WATCH)
        root.setLevel(old)
        client.setLevel(old_client)
    leaks = WATCH.leaks()
    num_chars = sum(len(text) for _, text in WATCH.texts())
    print(f"\nFIGURES secrets-in-logs: secrets={len(WATCH.secrets)} log_records={len(WATCH.lines)}"
          f" access_lines={WATCH.access_lines} processes={len(WATCH.outputs)} chars_checked={num_chars}"
          f" found={len(leaks)}")
    assert leaks == [], leaks


async def wait_until(predicate: Any, timeout_s: float = 10.0, interval_s: float = 0.02, what: str = "") -> float:
    """Poll ``predicate`` until true; return the seconds it took (fails the test past ``timeout_s``)."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    while not predicate():
        if loop.time() - started > timeout_s:
            raise AssertionError(f"not within {timeout_s}s: {what or predicate}")
        await asyncio.sleep(interval_s)
    return loop.time() - started


class Proc:
    """A service started as its real command; ``kill()`` is SIGKILL (no cleanup, like a crash)."""

    def __init__(self, argv: list[str], marker: str, env: dict[str, str] | None = None) -> None:
        self.argv = argv
        self.marker = marker
        self.env = env
        self.followed: Followed | None = None

    # A start-up wait returns as soon as the readiness line comes; 240 s covers a first kernel build on a
    # machine loaded by the rest of the suite (60 s was exceeded at load 11 on 2 cores).
    async def start(self, timeout_s: float = 240.0) -> str:
        return await asyncio.to_thread(self.start_sync, timeout_s)

    def start_sync(self, timeout_s: float = 240.0) -> str:
        self.followed = Followed(self.argv, self.marker, env=self.env)
        WATCH.outputs.append(self.followed)
        ready = self.followed.wait_ready(timeout_s)
        WATCH.add_bootstrap(self.followed.output)
        return ready

    @property
    def url(self) -> str:
        """The base URL the service's readiness line names."""
        assert self.followed is not None
        line = self.followed.wait_ready(0)
        found = re.search(r"(http://[0-9.]+:[0-9]+)", line)
        assert found, line
        return found.group(1)

    @property
    def pid(self) -> int:
        assert self.followed is not None
        return self.followed.proc.pid

    def kill(self) -> None:
        if self.followed is not None and self.followed.proc.poll() is None:
            self.followed.proc.send_signal(signal.SIGKILL)
            self.followed.proc.wait(10)

    def stop(self) -> None:
        """SIGTERM (graceful), SIGKILL after 10 s."""
        if self.followed is not None and self.followed.proc.poll() is None:
            self.followed.proc.terminate()
            try:
                self.followed.proc.wait(10)
            except Exception:
                self.kill()

    @property
    def output(self) -> str:
        return self.followed.output if self.followed is not None else ""

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS")


def engine_proc(model: Path, nats_url: str, worker_id: str, data_dir: Path, *extra: str) -> Proc:
    if "--api-key" in extra:
        WATCH.add("engine API key", extra[extra.index("--api-key") + 1])
    return Proc([PYTHON, "-m", "services.engine", str(model), "--model-id", "tiny", "--nats", nats_url,
                 "--worker-id", worker_id, "--port", "0", "--data-dir", str(data_dir), *extra],
                "llmgw engine ready")


def accounting_proc(nats_url: str, db: Path, data_dir: Path, *extra: str) -> Proc:
    return Proc([PYTHON, "-m", "services.accounting", "--nats", nats_url, "--db", str(db),
                 "--data-dir", str(data_dir), *extra], "llmgw accounting ready")


def telemetry_proc(nats_url: str, data_dir: Path, *extra: str) -> Proc:
    return Proc([PYTHON, "-m", "services.telemetry", "--nats", nats_url, "--port", "0", "--data-dir", str(data_dir),
                 *extra], "llmgw telemetry ready")


def gateway_proc(nats_url: str, data_dir: Path, config: Path | None = None) -> Proc:
    argv = [PYTHON, "-m", "services.gateway", "--nats", nats_url, "--port", "0", "--data-dir", str(data_dir),
            "--gateway-id", "gwp", "--workers", "1"]  # one process: the tests read its pid, memory and logs
    if config is not None:
        argv += ["--config", str(config)]
    return Proc(argv, "llmgw gateway ready", env={**os.environ, "LLMGW_LOG_LEVEL": "INFO"})


@contextlib.contextmanager
def procs() -> Iterator[list[Proc]]:
    """Every process a test started is killed at the end, whatever happened; when the test failed, each
    one's last output lines are printed (a CI log then says what the engine saw)."""
    started: list[Proc] = []
    try:
        yield started
    except BaseException:
        for p in started:
            exited = p.followed.proc.poll() if p.followed is not None else None
            tail = "\n".join(p.output.splitlines()[-40:])
            print(f"\n--- {' '.join(p.argv[1:4])} (exit {exited}) last output:\n{tail}")
        raise
    finally:
        for p in started:
            p.kill()


@dataclass
class InProcessGateway:
    gateway: GatewayService
    url: str
    api_key: str

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}


@contextlib.asynccontextmanager
async def gateway_in_process(nats_url: str, data_dir: Path, raw_config: dict[str, Any] | None = None,
                             **config: Any) -> AsyncIterator[InProcessGateway]:
    async with contextlib.AsyncExitStack() as es:
        nc = await connect(nats_url, "gateway")
        es.push_async_callback(nc.close)
        await ensure_bus(nc)
        file_config = pool_config.parse(raw_config) if raw_config is not None else None
        gateway = GatewayService(nc, GatewayConfig(gateway_id=config.pop("gateway_id", "gwt"), port=0,
                                                   data_dir=data_dir, **config), file_config)
        await es.enter_async_context(gateway.running())
        url = await es.enter_async_context(gateway.serving())
        assert gateway.bootstrap is not None
        WATCH.add("bootstrap admin password", gateway.bootstrap[0])
        WATCH.add("bootstrap API key", gateway.bootstrap[1])
        yield InProcessGateway(gateway, url, gateway.bootstrap[1])


class LogCounter(logging.Handler):
    """Counts log records by level from the loggers under ``prefixes``."""

    def __init__(self, prefixes: tuple[str, ...] = ("services.gateway", "llmgw", "aiohttp")) -> None:
        super().__init__(logging.DEBUG)
        self.prefixes = prefixes
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.startswith(self.prefixes):
            self.records.append(record)

    def count(self, level: int) -> int:
        return sum(1 for r in self.records if r.levelno >= level)

    def lines(self, level: int) -> list[str]:
        return [f"{r.levelname} {r.name}: {r.getMessage()}" for r in self.records if r.levelno >= level]


@contextlib.contextmanager
def counting_logs() -> Iterator[LogCounter]:
    """A :class:`LogCounter` on the root logger while the block runs."""
    counter = LogCounter()
    root = logging.getLogger()
    root.addHandler(counter)
    try:
        yield counter
    finally:
        root.removeHandler(counter)


@pytest.fixture(scope="module")
def module_logs() -> Iterator[LogCounter]:
    """What the services logged over one test module (the fuzz modules check it once at the end)."""
    with counting_logs() as counter:
        yield counter


@pytest.fixture(scope="module")
def client(tg: ThreadedGateway) -> Iterator[httpx.Client]:
    """A plain HTTP client of the module's threaded gateway (each fuzz module defines its own ``tg``); no
    cookie jar use: each case sends its own."""
    with httpx.Client(base_url=tg.url, timeout=30) as c:
        yield c


@pytest.fixture
def gateway_logs() -> Iterator[LogCounter]:
    counter = LogCounter()
    root = logging.getLogger()
    old = root.level
    root.setLevel(logging.INFO)
    root.addHandler(counter)
    try:
        yield counter
    finally:
        root.removeHandler(counter)
        root.setLevel(old)


async def read_usage(nats_url: str, timeout_s: float = 10.0) -> list[UsageRecord]:
    """Every UsageRecord in the USAGE stream (an ephemeral consumer from the start)."""
    nc = await connect(nats_url, "usage-reader")
    try:
        js = nc.jetstream()
        info = await js.stream_info(subjects.STREAM_USAGE)
        total = info.state.messages
        sub = await js.pull_subscribe(subjects.USAGE_SUBJECTS, stream=subjects.STREAM_USAGE)
        records: list[UsageRecord] = []
        while len(records) < total:
            try:
                msgs = await sub.fetch(min(256, total - len(records)), timeout=timeout_s)
            except TimeoutError:
                raise_if_cancelling()
                break
            records += [decode(m.data, UsageRecord) for m in msgs]
        return records
    finally:
        await nc.close()


async def stream_count(nats_url: str, stream: str) -> int:
    nc = await connect(nats_url, "counter")
    try:
        return int((await nc.jetstream().stream_info(stream)).state.messages)
    finally:
        await nc.close()


async def sql(nats_url: str, query: str, timeout_s: float = 15.0) -> dict[str, Any]:
    """One query over the bus (what ``llmgw sql`` sends)."""
    import msgspec

    nc = await connect(nats_url, "sql")
    try:
        msg = await nc.request(subjects.ACCOUNTING_SQL, encode_json(SqlQuery(sql=query)), timeout=timeout_s)
        return msgspec.json.decode(msg.data)  # type: ignore[no-any-return]
    finally:
        await nc.close()
