"""Gateway overhead (issue #5): a null upstream called directly vs through the gateway (and LiteLLM's proxy).

One run, all on loopback:

* the null upstreams (``--upstreams``, default both):

  - ``aiohttp``: a **null engine** (aiohttp, OpenAI-compatible, in its own process: this file with
    ``--serve-null``) that answers ``/v1/chat/completions`` at once: non-streaming JSON with ``usage``;
    streaming 16 SSE content chunks (the last with ``finish_reason``), a usage chunk
    (``stream_options.include_usage``) and ``[DONE]``. It costs about as much CPU per request as the
    gateway's own upstream side;
  - ``nginx``: the same answers in vLLM's exact shapes, as fixed bodies from one nginx worker
    (bench/null_nginx.py): ~10 µs of CPU per request, so on a small host the CPU goes to the gateway. When
    nginx is missing the run says how to install it and skips those cells;

* a ``nats-server`` (JetStream) and the **gateway** (``python -m services.gateway``) with a pools file whose
  pools have the null upstreams as their only HTTP members (so every request also publishes a usage record
  to JetStream, as in production);
* optionally **LiteLLM's proxy** (``litellm --config … --num_workers K``, ``--litellm-workers``, default 1;
  master key, no database,
  ``LITELLM_LOCAL_MODEL_COST_MAP=True``, model ``openai/null`` with ``api_base`` = the aiohttp null engine),
  when the ``litellm`` command is installed (``pip install 'litellm[proxy]'``). If it is missing or does not
  start, the output says so and no LiteLLM figure is printed.

Load: ``wrk`` (closed loop, 1 thread, N connections, fixed duration per cell, POST body from a Lua script;
the percentiles come from wrk's own histogram) when it is on PATH (``apt-get install -y wrk``), else an
aiohttp client in a separate process with the same fixed duration. The output names the one used. For each
upstream x target x {non-streaming, streaming} x concurrency {1, 16, 64}: requests/s, latency p50/p99 (whole
response, stream included), and the added latency p50/p99 (target minus direct at the same concurrency and
mode). A short warm-up precedes each target x mode. Each cell also counts the CPU every process group used
(gateway with its workers, upstream, nats-server, load generator) per request: the table that says where a
2-core host's CPU went.

The gateway is measured once per ``--workers`` count (default 1 and one per core: ``llmgw gateway
--workers``), one gateway at a time; ``--rounds K`` repeats the worker counts K times, alternating, and the
workers table gives each round's ratio and their median (a 2-core VM drifts by 20 % between cells).
Open-loop cells (bench/open_loop.py in its own process, requests due on
a fixed schedule): ``--rate`` req/s offered to each direct upstream and each gateway, and an **overload**
cell per gateway, upstream and mode at 2x the best closed-loop req/s that gateway reached in this run. They
report served req/s, the explicit 503s (the gateway's overload answer) apart from every other failure, the
served requests' p50/p99, and how late the client itself wrote its requests. A peer that serves 0 req/s (a
stalled LiteLLM) gives "n/a" ratios, never a crash.

    .venv/bin/python bench/gateway_overhead.py [--quick] [--duration 5] [--concurrency 1,16,64] [--workers 1,2]
                                              [--rounds 3]
                                              [--upstreams aiohttp,nginx] [--rate 1000] [--no-litellm]
                                              [--max-in-flight N] [--open-loop-connections 512]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import queue
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

try:
    from bench import null_nginx
except ImportError:  # run as a script: bench/ is on sys.path, not the repository
    import null_nginx  # type: ignore[no-redef]

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
MODEL = "null"
STREAM_CHUNKS = 16
LITELLM_KEY = "sk-bench-overhead"
MAX_CONCURRENCY = 1024
MAX_DURATION_S = 120.0
# the open-loop client's connections: requests due beyond that many open ones wait in the client, and that
# wait counts in their latency (from the due time); the gateway sees at most this many in flight
OPEN_LOOP_CONNECTIONS = 512
UPSTREAMS = {"aiohttp": "the Python null engine (aiohttp, this file's --serve-null)",
             "nginx": "nginx with fixed bodies (bench/null_nginx.py)"}
NGINX_JSON_POOL, NGINX_STREAM_POOL = "null-nginx", "null-nginx-sse"  # nginx cannot branch on a body: a pool per mode


# --------------------------------------------------------------------------------------------------------------
# null engine (runs in its own process)


def serve_null(port: int) -> None:
    import asyncio

    from aiohttp import web

    created = int(time.time())
    usage = {"prompt_tokens": 8, "completion_tokens": STREAM_CHUNKS, "total_tokens": 8 + STREAM_CHUNKS}
    full = json.dumps({
        "id": "chatcmpl-null", "object": "chat.completion", "created": created, "model": MODEL,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "x" * STREAM_CHUNKS},
                     "finish_reason": "stop"}],
        "usage": usage,
    }).encode()

    def chunk(delta: dict, finish: str | None) -> bytes:
        obj = {"id": "chatcmpl-null", "object": "chat.completion.chunk", "created": created, "model": MODEL,
               "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        return b"data: " + json.dumps(obj).encode() + b"\n\n"

    chunks = [chunk({"role": "assistant", "content": "x"} if i == 0 else {"content": "x"},
                    "stop" if i == STREAM_CHUNKS - 1 else None) for i in range(STREAM_CHUNKS)]
    usage_chunk = b"data: " + json.dumps({"id": "chatcmpl-null", "object": "chat.completion.chunk",
                                          "created": created, "model": MODEL, "choices": [],
                                          "usage": usage}).encode() + b"\n\n"

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            return web.Response(body=full, content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        for c in chunks:
            await resp.write(c)
        if (body.get("stream_options") or {}).get("include_usage"):
            await resp.write(usage_chunk)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "bench"}]})

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        app.router.add_get("/v1/models", models)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", port)
        await site.start()
        print(f"null engine ready: http://127.0.0.1:{runner.addresses[0][1]}", flush=True)
        await asyncio.Event().wait()

    try:
        import uvloop  # the gateway's runtime uses it when present; give the baseline the same loop
        uvloop.install()
    except ImportError:
        pass
    asyncio.run(main())


# --------------------------------------------------------------------------------------------------------------
# aiohttp fallback load generator (runs in its own process)


class _Recorder:
    """Latencies (µs) of the successful requests and the count of failed ones, for one load run."""

    def __init__(self, url: str, body: str, headers_json: str) -> None:
        self.url, self.data = url, body.encode()
        self.headers = {"Content-Type": "application/json", **json.loads(headers_json)}
        self.latencies_us: list[float] = []
        self.errors = 0  # every request not answered 200 (the 503s included)
        self.shed = 0  # of those, the explicit 503s (the gateway's overload answer, services/gateway/shedding.py)
        self.failures: dict[str, int] = {}  # every failure by kind: "HTTP 503", "ServerDisconnectedError" ...

    async def post(self, session, started: float) -> None:  # type: ignore[no-untyped-def]
        """One request; its latency runs from ``started`` (perf_counter seconds)."""
        import aiohttp

        status, kind = 0, ""
        try:
            async with session.post(self.url, data=self.data, headers=self.headers) as resp:
                status = resp.status
                kind = f"HTTP {status}"
                await resp.read()
        except (TimeoutError, aiohttp.ClientError) as exc:
            status, kind = 0, type(exc).__name__  # a broken connection or stream, or no answer in time: not a 503
        if status == 200:
            self.latencies_us.append((time.perf_counter() - started) * 1e6)
        else:
            self.errors += 1
            self.shed += status == 503
            self.failures[kind] = self.failures.get(kind, 0) + 1

    def print_result(self, duration_s: float) -> None:
        lat = sorted(self.latencies_us)

        def pct(q: float) -> float:
            return lat[min(len(lat) - 1, int(q / 100 * len(lat)))] if lat else float("nan")

        print("RESULT " + json.dumps({"requests": len(lat) + self.errors, "duration_s": duration_s,
                                      "errors": self.errors, "shed": self.shed, "failures": self.failures,
                                      "p50_us": pct(50), "p99_us": pct(99)}), flush=True)


def serve_load(url: str, body: str, concurrency: int, duration: float, headers_json: str) -> None:
    """Closed loop: ``concurrency`` workers, each sending its next request when the last one finished."""
    import asyncio

    import aiohttp

    recorder = _Recorder(url, body, headers_json)

    async def main() -> None:
        stop_at = time.monotonic() + duration
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
            async def worker() -> None:
                while time.monotonic() < stop_at:
                    await recorder.post(session, time.perf_counter())

            started = time.monotonic()
            await asyncio.gather(*(worker() for _ in range(concurrency)))
            recorder.print_result(time.monotonic() - started)

    asyncio.run(main())


# --------------------------------------------------------------------------------------------------------------
# processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A child process whose stdout is read by a thread (so the pipe never fills); terminate + wait on close."""

    def __init__(self, name: str, argv: list[str], log_dir: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.stderr.log"
        self._log = open(self.log_path, "wb")
        self.lines: queue.Queue[str] = queue.Queue()
        self.p = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=self._log, env=env,
                                  text=True, bufsize=1, start_new_session=True)
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            self.lines.put(line.rstrip("\n"))

    def wait_line(self, needle: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.2)
            except queue.Empty:
                if self.p.poll() is not None:
                    break
                continue
            if needle in line:
                return line
        raise RuntimeError(f"{self.name} not ready (exit {self.p.poll()}); see {self.log_path}:\n"
                           + self.tail())

    def tail(self, n: int = 15) -> str:
        self._log.flush()
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def close(self) -> None:
        if self.p.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(self.p.pid, signal.SIGTERM)  # its own session: also reaches e.g. LiteLLM's workers
            try:
                self.p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(OSError):
                    os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait(timeout=10)
        self._log.close()


def http_get_ok(url: str, headers: dict[str, str] | None = None) -> bool:
    import urllib.request

    try:
        req = urllib.request.Request(url, headers=headers or {})
        with urllib.request.urlopen(req, timeout=2) as resp:
            return resp.status == 200
    except Exception:
        return False


def http_post(url: str, body: dict, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


# --------------------------------------------------------------------------------------------------------------
# measurement


@dataclass
class Cell:
    target: str
    stream: bool
    concurrency: int
    rps: float
    p50_ms: float
    p99_ms: float
    errors: int  # requests not answered 200, the 503s included
    requests: int
    shed: int = 0  # explicit 503s (with Retry-After): the gateway's overload answer
    failures: dict[str, int] = dataclasses.field(default_factory=dict)  # open-loop cells: failures by kind
    offered_rps: float = 0.0  # open-loop cells: the rate requests were sent at
    upstream: str = "aiohttp"  # the null upstream behind the target (UPSTREAMS)
    late_p99_ms: float = float("nan")  # open-loop cells: the client's own lag (bench/open_loop.py)
    late_max_ms: float = float("nan")
    cpu_us: dict[str, float] = dataclasses.field(default_factory=dict)  # CPU µs per request, by process group
    round: int = 1  # --rounds: which pass over the worker counts measured it

    @property
    def other_failures(self) -> int:
        """Failures other than an explicit 503: refused connections, broken streams, timeouts, other statuses."""
        return self.errors - self.shed


def request_body(stream: bool, model: str = MODEL) -> dict:
    body: dict = {"model": model, "messages": [{"role": "user", "content": "ping"}], "max_tokens": STREAM_CHUNKS}
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


def lua_script(path: Path, body: dict, headers: dict[str, str]) -> None:
    hdrs = "".join(f'wrk.headers["{k}"] = {json.dumps(v)}\n' for k, v in headers.items())
    path.write_text(
        'wrk.method = "POST"\n'
        f"wrk.body = {json.dumps(json.dumps(body))}\n"
        'wrk.headers["Content-Type"] = "application/json"\n'
        + hdrs
        + "done = function(summary, latency, requests)\n"
        '  io.write(string.format("RESULT %d %d %d %d %d %d %d %.1f %.1f\\n", summary.requests, summary.duration,\n'
        "    summary.errors.connect, summary.errors.read, summary.errors.write, summary.errors.status,\n"
        "    summary.errors.timeout, latency:percentile(50), latency:percentile(99)))\n"
        "end\n"
    )


@dataclass
class Target:
    """What a cell loads: its name in the tables, its upstream kind, the URLs and models of its two modes."""

    name: str
    upstream: str
    json_url: str
    stream_url: str
    json_model: str = MODEL
    stream_model: str = MODEL
    headers: dict[str, str] = dataclasses.field(default_factory=dict)
    # process groups whose CPU is counted per request (name -> the pids, looked up when a cell starts)
    processes: dict[str, Callable[[], list[int]]] = dataclasses.field(default_factory=dict)

    def url(self, stream: bool) -> str:
        return self.stream_url if stream else self.json_url

    def body(self, stream: bool) -> dict:
        return request_body(stream, self.stream_model if stream else self.json_model)


def cpu_s(pid: int) -> float:
    """utime + stime of a live process, seconds (0 when it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def with_descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (a gateway's workers), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo.extend(children.get(p, []))
    return found


class CpuMeter:
    """CPU seconds each process group of a target used over one load run; the load generator's own (this
    process's waited-for children: wrk or the aiohttp client) comes from ``RUSAGE_CHILDREN``."""

    def __init__(self, target: Target) -> None:
        self.pids = {group: find() for group, find in target.processes.items()}
        self.start = {group: sum(cpu_s(p) for p in pids) for group, pids in self.pids.items()}
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        self.start_load = usage.ru_utime + usage.ru_stime

    def us_per_request(self, num_requests: int) -> dict[str, float]:
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        spent = {group: sum(cpu_s(p) for p in pids) - self.start[group] for group, pids in self.pids.items()}
        spent["load generator"] = usage.ru_utime + usage.ru_stime - self.start_load
        return {group: s / num_requests * 1e6 for group, s in spent.items()} if num_requests else {}


def run_load(tool: str, target: Target, stream: bool, concurrency: int, duration: int,
             work: Path) -> tuple[int, float, int, float, float]:
    """(requests, seconds, errors, p50_us, p99_us) of one closed-loop run."""
    body = target.body(stream)
    url = target.url(stream)
    timeout = duration + 60
    if tool == "wrk":
        tag = abs(hash((url, json.dumps(body), *target.headers.items())))
        script = work / f"load_{'s' if stream else 'n'}_{tag}.lua"
        lua_script(script, body, target.headers)
        out = subprocess.run(["wrk", "-t1", f"-c{concurrency}", f"-d{duration}s", "--timeout", "30s",
                              "-s", str(script), url], capture_output=True, text=True, timeout=timeout)
        line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            raise RuntimeError(f"wrk failed: {out.stdout}\n{out.stderr}")
        f = line.split()
        reqs, dur_us = int(f[1]), int(f[2])
        errors = sum(int(x) for x in f[3:8])
        return reqs, dur_us / 1e6, errors, float(f[8]), float(f[9])
    out = subprocess.run([PY, __file__, "--serve-load", url, json.dumps(body), str(concurrency), str(duration),
                          json.dumps(target.headers)], capture_output=True, text=True, timeout=timeout, cwd=REPO)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"load generator failed: {out.stdout}\n{out.stderr}")
    r = json.loads(line[7:])
    return r["requests"], r["duration_s"], r["errors"], r["p50_us"], r["p99_us"]


def run_rate(target: Target, stream: bool, rate: float, duration: int, connections: int) -> Cell:
    """One open-loop fixed-rate run (bench/open_loop.py in its own process, so its CPU is not the gateway's)."""
    out = subprocess.run([PY, str(REPO / "bench" / "open_loop.py"), target.url(stream),
                          json.dumps(target.body(stream)), str(rate), str(duration), json.dumps(target.headers),
                          str(connections)], capture_output=True, text=True, timeout=duration + 120, cwd=REPO)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"open-loop generator failed: {out.stdout}\n{out.stderr}")
    r = json.loads(line[7:])
    return Cell(target.name, stream, 0, per_s(r["requests"] - r["errors"], r["duration_s"]), r["p50_us"] / 1000,
                r["p99_us"] / 1000, r["errors"], r["requests"], shed=r.get("shed", 0), offered_rps=rate,
                failures=r.get("failures", {}), upstream=target.upstream, late_p99_ms=r["late_p99_ms"],
                late_max_ms=r["late_max_ms"])


def per_s(count: float, seconds: float) -> float:
    """A rate that is 0, never a ZeroDivisionError, when a run measured no time (a peer that stalled)."""
    return count / seconds if seconds > 0 else 0.0


def ratio_text(num: float, den: float, what: str, digits: int = 1) -> str:
    """``num / den`` as "12.3x", or why not (a peer that served 0 req/s has no ratio: say so)."""
    return f"{num / den:.{digits}f}x" if den > 0 else f"n/a ({what} served 0 req/s)"


def check_target(target: Target) -> None:
    """One request of each mode, checked, before any timing (a broken path must not look fast)."""
    status, raw = http_post(target.url(False), target.body(False), target.headers)
    if status != 200 or json.loads(raw)["choices"][0]["message"]["content"] != "x" * STREAM_CHUNKS:
        raise RuntimeError(f"{target.name}: non-streaming check failed: {status} {raw[:300]!r}")
    status, raw = http_post(target.url(True), target.body(True), target.headers)
    events = [ln[6:] for ln in raw.decode().splitlines() if ln.startswith("data: ")]
    text = "".join((json.loads(e)["choices"] or [{}])[0].get("delta", {}).get("content") or ""
                   for e in events if e != "[DONE]")
    if status != 200 or events[-1:] != ["[DONE]"] or text != "x" * STREAM_CHUNKS:
        raise RuntimeError(f"{target.name}: streaming check failed: {status} {raw[:300]!r}")


# --------------------------------------------------------------------------------------------------------------
# stack


def litellm_exe() -> str | None:
    """The ``litellm`` command: this venv's, else the one on PATH (usually a venv of its own), else None."""
    exe = Path(PY).parent / "litellm"
    return str(exe) if exe.exists() else shutil.which("litellm")


def litellm_version() -> str:
    """The version of :func:`litellm_exe`: asked of the interpreter its script names (LiteLLM usually lives
    in a venv of its own, not this one), "?" when that cannot be told."""
    with contextlib.suppress(Exception):
        exe = litellm_exe()
        if exe:
            first = Path(exe).read_bytes().split(b"\n", 1)[0].decode()
            interp = first[2:].strip() if first.startswith("#!") else PY
            out = subprocess.run([interp, "-c", "import importlib.metadata as m; print(m.version('litellm'))"],
                                 capture_output=True, text=True, timeout=60)
            if out.returncode == 0 and out.stdout.strip():
                return out.stdout.strip()
    return "?"


def start_litellm(null_url: str, work: Path, procs: list[Proc], num_workers: int = 1) -> tuple[str | None, str]:
    """(base URL, note); base is None when LiteLLM is not installed or does not start."""
    exe_s = litellm_exe()
    if exe_s is None:
        return None, "LiteLLM: not installed (`litellm` command not found) — no LiteLLM figures."
    cfg = work / "litellm.yaml"
    cfg.write_text(
        "model_list:\n"
        '  - model_name: "null"\n'
        "    litellm_params:\n"
        '      model: "openai/null"\n'
        f'      api_base: "{null_url}/v1"\n'
        '      api_key: "unused"\n'
        "litellm_settings:\n"
        "  telemetry: false\n"
        "general_settings:\n"
        f'  master_key: "{LITELLM_KEY}"\n'
    )
    port = free_port()
    env = dict(os.environ, LITELLM_LOCAL_MODEL_COST_MAP="True", LITELLM_LOG="ERROR")
    env.pop("DATABASE_URL", None)
    proc = Proc("litellm", [exe_s, "--config", str(cfg), "--port", str(port), "--host", "127.0.0.1",
                            "--num_workers", str(num_workers)], work, env)
    procs.append(proc)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.p.poll() is not None:
            return None, f"LiteLLM: did not start (exit {proc.p.returncode}): {proc.tail(5)!r} — no LiteLLM figures."
        if http_get_ok(base + "/health/liveliness"):
            try:
                path = base + "/v1/chat/completions"
                check_target(Target("litellm", "aiohttp", path, path,
                                    headers={"Authorization": f"Bearer {LITELLM_KEY}"}))
            except Exception as exc:
                return None, f"LiteLLM: started but the check request failed ({exc}) — no LiteLLM figures."
            version = litellm_version()
            return base, (f"LiteLLM {version} proxy: {num_workers} worker(s), master key, no DB, "
                          "LITELLM_LOCAL_MODEL_COST_MAP=True.")
        time.sleep(0.5)
    return None, "LiteLLM: no /health/liveliness within 180 s — no LiteLLM figures."


def pct_fmt(x: float) -> str:
    return "—" if x != x else f"{x:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 s per cell (instead of 5)")
    ap.add_argument("--duration", type=int, default=5, help="whole seconds per cell (default 5)")
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--no-litellm", action="store_true", help="skip LiteLLM even if installed")
    ap.add_argument("--litellm-workers", type=int, default=1,
                    help="LiteLLM's --num_workers (default 1: the per-process comparison; give the gateway's worker "
                         "count for a same-cores one)")
    ap.add_argument("--load", choices=["auto", "wrk", "aiohttp"], default="auto")
    ap.add_argument("--serve-null", type=int, metavar="PORT", help=argparse.SUPPRESS)
    ap.add_argument("--serve-load", nargs=5, metavar="X", help=argparse.SUPPRESS)
    ap.add_argument("--upstreams", default=",".join(UPSTREAMS),
                    help="null upstreams to measure behind the gateway, comma-separated (default: aiohttp,nginx): "
                         "aiohttp = the Python null engine below; nginx = fixed bodies from nginx "
                         "(bench/null_nginx.py; skipped with a line saying how to install it when missing)")
    ap.add_argument("--open-loop-connections", type=int, default=OPEN_LOOP_CONNECTIONS,
                    help=f"connections the open-loop client opens (default {OPEN_LOOP_CONNECTIONS})")
    ap.add_argument("--rate", type=float, default=1000.0,
                    help="open-loop rate for the fixed-rate cells (req/s; default 1000; 0 skips them)")
    ap.add_argument("--max-in-flight", type=int, default=None,
                    help="the gateways' --max-in-flight (open requests per worker before an immediate 503; default: "
                         "the gateway's own). The open-loop client holds at most --open-loop-connections")
    ap.add_argument("--max-loop-lag", type=float, default=None, metavar="SECONDS",
                    help="the gateways' --max-loop-lag (event-loop lag, sustained, before an immediate 503; default: "
                         "the gateway's own)")
    ap.add_argument("--workers", default=None,
                    help="gateway worker counts to measure, one gateway at a time (default: 1 and one per core, "
                         "as llmgw gateway --workers defaults to)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="measure the worker counts this many times, alternating (1, N, 1, N, ...): the workers "
                         "table gives each round's ratio and their median, so a noisy host's drift between "
                         "cells shows as spread instead of deciding the ratio (default 1)")
    args = ap.parse_args()
    if args.serve_null is not None:
        serve_null(args.serve_null)
        return
    if args.serve_load:
        url, body, conc, dur, hdrs = args.serve_load
        serve_load(url, body, int(conc), float(dur), hdrs)
        return

    duration = 2 if args.quick else args.duration  # whole seconds: wrk's -d takes no fractions
    warmup = 1
    if not 0 < duration <= MAX_DURATION_S:
        ap.error(f"--duration must be in (0, {MAX_DURATION_S}]")
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    if any(not 1 <= c <= MAX_CONCURRENCY for c in concurrencies):
        ap.error(f"--concurrency values must be 1..{MAX_CONCURRENCY}")
    try:
        worker_counts = ([int(w) for w in args.workers.split(",")] if args.workers
                         else sorted({1, default_workers()}))
    except ValueError:
        ap.error("--workers takes whole numbers, comma-separated")
    if any(w < 1 for w in worker_counts):
        ap.error("--workers values must be at least 1")
    if not 1 <= args.rounds <= 20:
        ap.error("--rounds must be 1..20")
    tool = ("wrk" if shutil.which("wrk") else "aiohttp") if args.load == "auto" else args.load
    if tool == "wrk" and not shutil.which("wrk"):
        ap.error("wrk not on PATH (apt-get install -y wrk)")
    upstreams = [u.strip() for u in args.upstreams.split(",") if u.strip()]
    if not upstreams or any(u not in UPSTREAMS for u in upstreams):
        ap.error(f"--upstreams takes {', '.join(UPSTREAMS)}")

    # SIGTERM/SIGHUP → normal exit through the finally below.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: sys.exit(143))

    procs: list[Proc] = []
    cells: list[Cell] = []
    rate_cells: list[Cell] = []
    overload_cells: list[Cell] = []
    notes: list[str] = []
    if tool != "wrk":
        notes.append("wrk not found: `apt-get install -y wrk` for the cheaper closed-loop client (aiohttp used).")
    with tempfile.TemporaryDirectory(prefix="gw-overhead-") as tmp:
        work = Path(tmp)
        try:
            nats_port = free_port()
            (work / "nats").mkdir()
            nats = Proc("nats-server", [str(Path(PY).parent / "nats-server"), "-a", "127.0.0.1", "-p",
                                        str(nats_port), "-js", "-sd", str(work / "nats")], work)
            procs.append(nats)
            deadline = time.monotonic() + 15
            while True:
                with socket.socket() as s:
                    if s.connect_ex(("127.0.0.1", nats_port)) == 0:
                        break
                if time.monotonic() > deadline or nats.p.poll() is not None:
                    raise RuntimeError("nats-server did not start:\n" + nats.tail())
                time.sleep(0.1)

            directs: list[Target] = []
            pools_entries: dict[str, dict] = {}
            if "aiohttp" in upstreams:
                null = Proc("null-engine", [PY, __file__, "--serve-null", "0"], work)
                procs.append(null)
                null_url = null.wait_line("null engine ready:", 60).split()[-1]
                directs.append(Target("direct", "aiohttp", null_url + "/v1/chat/completions",
                                      null_url + "/v1/chat/completions",
                                      processes={"upstream": lambda p=null.p.pid: [p]}))
                pools_entries[MODEL] = {"members": [{"model_id": MODEL, "backend": null_url}]}
            if "nginx" in upstreams:
                exe = null_nginx.nginx_path()
                if exe is None:
                    print(null_nginx.INSTALL_HINT, flush=True)
                    notes.append(null_nginx.INSTALL_HINT + " — no nginx cells.")
                else:
                    ngx_dir = work / "nginx"
                    ngx_dir.mkdir()
                    ngx_port = free_port()
                    (ngx_dir / "nginx.conf").write_text(null_nginx.config(ngx_dir, ngx_port, MODEL, STREAM_CHUNKS))
                    ngx = Proc("nginx", [exe, "-c", str(ngx_dir / "nginx.conf"), "-e", str(ngx_dir / "error.log")],
                               work)
                    procs.append(ngx)
                    ngx_url = f"http://127.0.0.1:{ngx_port}"
                    deadline = time.monotonic() + 15
                    while not http_get_ok(ngx_url + "/v1/models"):
                        if time.monotonic() > deadline or ngx.p.poll() is not None:
                            raise RuntimeError("nginx did not start:\n" + ngx.tail())
                        time.sleep(0.1)
                    directs.append(Target("direct", "nginx", ngx_url + "/v1/chat/completions",
                                          ngx_url + "/sse/v1/chat/completions",
                                          processes={"upstream": lambda p=ngx.p.pid: with_descendants(p)}))
                    pools_entries[NGINX_JSON_POOL] = {"members": [{"model_id": MODEL, "backend": ngx_url}]}
                    pools_entries[NGINX_STREAM_POOL] = {"members": [{"model_id": MODEL,
                                                                     "backend": ngx_url + "/sse"}]}
                    notes.append(f"nginx {nginx_version(exe)}: one worker process, fixed bodies "
                                 "(bench/null_nginx.py).")
            if not directs:
                raise RuntimeError("no upstream to measure")
            nats_proc = {"nats-server": lambda: [nats.p.pid]}
            for d in directs:
                d.processes.update(nats_proc)
                check_target(d)

            pools = work / "pools.json"
            # one API key carries all the load: its open-requests cap (gateway.max_concurrent_per_key, 64 by
            # default, a 429 beyond) would otherwise be what the open-loop cells measure, not the gateway
            pools.write_text(json.dumps({"gateway": {"max_concurrent_per_key": 100_000},
                                         "model_pools": pools_entries}))
            nats_url = f"nats://127.0.0.1:{nats_port}"

            want_litellm = not args.no_litellm and "aiohttp" in upstreams and litellm_exe() is not None
            if args.no_litellm or "aiohttp" not in upstreams:
                notes.append("LiteLLM: skipped (--no-litellm, or no aiohttp upstream) — no LiteLLM figures.")
            num_targets = len(directs) * (1 + len(worker_counts) * args.rounds) + (1 if want_litellm else 0)
            bar = tqdm(total=num_targets * 2 * len(concurrencies), desc="cells", unit="cell")

            current_round = 1

            def closed_loop(target: Target) -> None:
                for stream in (False, True):
                    run_load(tool, target, stream, max(concurrencies), warmup, work)  # warm-up
                    for conc in concurrencies:
                        bar.set_postfix_str(f"{target.name} ({target.upstream}) {'stream' if stream else 'json'} "
                                            f"c={conc}")
                        meter = CpuMeter(target)
                        reqs, secs, errors, p50, p99 = run_load(tool, target, stream, conc, duration, work)
                        cells.append(Cell(target.name, stream, conc, per_s(reqs - errors, secs), p50 / 1000,
                                          p99 / 1000, errors, reqs, upstream=target.upstream,
                                          cpu_us=meter.us_per_request(reqs), round=current_round))
                        bar.update()

            def open_loop(target: Target, overload: bool) -> None:
                for stream in (False, True):
                    if args.rate > 0:  # the latency target is stated at a fixed offered rate
                        rate_cells.append(run_rate(target, stream, args.rate, duration, args.open_loop_connections))
                    if overload:  # 2x what this target served at its best, closed loop, in this run
                        capacity = max((c.rps for c in cells if c.target == target.name and c.stream == stream
                                        and c.upstream == target.upstream and c.round == current_round), default=0)
                        if capacity > 0:
                            overload_cells.append(run_rate(target, stream, 2 * capacity, duration,
                                                           args.open_loop_connections))

            for d in directs:
                closed_loop(d)
                open_loop(d, overload=False)
            gw_key: str | None = None
            for current_round, workers in ((r, w) for r in range(1, args.rounds + 1) for w in worker_counts):
                # one gateway at a time (the same data directory: the first start's API key serves them all),
                # so an idle one takes no CPU from the one measured
                gw = Proc(f"gateway-x{workers}", [PY, "-m", "services.gateway", "--port", "0", "--nats", nats_url,
                                                  "--config", str(pools), "--data-dir", str(work / "gw-data"),
                                                  "--workers", str(workers),
                                                  *(["--max-in-flight", str(args.max_in_flight)]
                                                    if args.max_in_flight else []),
                                                  *(["--max-loop-lag", str(args.max_loop_lag)]
                                                    if args.max_loop_lag else [])], work)
                procs.append(gw)
                if gw_key is None:  # everything on: the gateway checks this API key on every request (printed
                    # once, before the ready line, at the first start)
                    gw_key = gw.wait_line("first start:", 120).split("API key ", 1)[1].split(";")[0]
                gw_url = gw.wait_line("llmgw gateway ready:", 120).split()[-1] + "/v1/chat/completions"
                for d in directs:
                    target = dataclasses.replace(
                        d, name=gateway_name(workers), json_url=gw_url, stream_url=gw_url,
                        json_model=MODEL if d.upstream == "aiohttp" else NGINX_JSON_POOL,
                        stream_model=MODEL if d.upstream == "aiohttp" else NGINX_STREAM_POOL,
                        headers={"Authorization": f"Bearer {gw_key}"},
                        processes={**d.processes, "gateway": lambda p=gw.p.pid: with_descendants(p)})
                    check_target(target)
                    closed_loop(target)
                    open_loop(target, overload=True)
                gw.close()
                procs.remove(gw)
            lite_url: str | None = None
            if not args.no_litellm and "aiohttp" in upstreams:
                # started only for its own cells: nothing but the measured target runs beside a gateway cell
                # (an idle proxy took 0.2 % of a core, 2026-12-08: this is for clean cells, not a finding)
                lite_url, note = start_litellm(null_url, work, procs, args.litellm_workers)
                notes.append(note)
            if lite_url:
                lite_path = lite_url + "/v1/chat/completions"
                closed_loop(Target("litellm", "aiohttp", lite_path, lite_path,
                                   headers={"Authorization": f"Bearer {LITELLM_KEY}"}))
            bar.close()
        finally:
            for proc in reversed(procs):
                proc.close()

    print()
    print(host_line())
    for upstream in upstreams:
        of = [c for c in cells if c.upstream == upstream]
        if of:
            print()
            print(f"## Upstream: {UPSTREAMS[upstream]}")
            report(of, notes, tool, duration, concurrencies, worker_counts, args.litellm_workers)
    report_scaling(cells, worker_counts, args.rounds)
    report_cpu(cells)
    report_rate(rate_cells, f"Open loop at {args.rate:g} req/s offered")
    report_rate(overload_cells, "Overload: open loop at 2x each gateway's best closed-loop req/s in this run")


def nginx_version(exe: str) -> str:
    out = subprocess.run([exe, "-v"], capture_output=True, text=True)
    return (out.stderr or out.stdout).strip().rsplit("/", 1)[-1]


def gateway_name(workers: int) -> str:
    return f"gateway x{workers}"


def default_workers() -> int:
    """What ``llmgw gateway --workers`` defaults to (services/gateway/workers.py: one default, kept there)."""
    sys.path.insert(0, str(REPO))
    from services.gateway.workers import default_workers as gateway_default

    return gateway_default()


def report_rate(cells: list[Cell], title: str) -> None:
    """Open-loop cells: what was served, the explicit 503s, every other failure, the served requests'
    latency, and how far behind its schedule the client itself fell (bench/open_loop.py)."""
    if not cells:
        return
    print()
    print(f"{title} (latency of the requests served 200; from its due time when a request waited for a free "
          "connection, so a stall is charged to every request it delayed; client lag = how late the client "
          "wrote requests, p99 / max):")
    print()
    print("| upstream | target | mode | offered req/s | served req/s | 503s | other failures | p50 ms | p99 ms "
          "| client lag ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for c in cells:
        other = ", ".join(f"{n} {kind}" for kind, n in sorted(c.failures.items()) if kind != "HTTP 503")
        print(f"| {c.upstream} | {c.target} | {'stream' if c.stream else 'json'} | {c.offered_rps:,.0f} | "
              f"{c.rps:,.0f} | {c.shed} | {c.other_failures}{f' ({other})' if other else ''} | "
              f"{pct_fmt(c.p50_ms)} | {pct_fmt(c.p99_ms)} | {pct_fmt(c.late_p99_ms)} / {pct_fmt(c.late_max_ms)} |")


def report_scaling(cells: list[Cell], worker_counts: list[int], rounds: int = 1) -> None:
    """One line per upstream and mode: direct, every gateway's best closed-loop req/s, and the last worker
    count over the first (issue #31's >= 1.6x for 2 workers). With several rounds, a line per round and the
    median of the rounds' ratios: the worker counts alternate, so a host that drifts between cells moves
    both sides of a round alike."""
    gateways = list(dict.fromkeys(gateway_name(w) for w in worker_counts))
    upstreams = list(dict.fromkeys(c.upstream for c in cells))
    if not cells:
        return

    def best(upstream: str, target: str, stream: bool, rnd: int | None = None) -> float:
        return max((c.rps for c in cells if (c.upstream, c.target, c.stream) == (upstream, target, stream)
                    and (rnd is None or c.round == rnd)), default=0.0)

    print()
    print("Workers (best closed-loop req/s over the concurrencies run):")
    print()
    ratio_head = f" {gateways[-1]} / {gateways[0]} |" if len(gateways) > 1 else ""
    round_head = "| round " if rounds > 1 else ""
    print(round_head + "| upstream | mode | direct | " + " | ".join(gateways) + " |" + ratio_head)
    print(("|---" if rounds > 1 else "") + "|---|---|---|" + "---|" * len(gateways) + ("---|" if ratio_head else ""))
    for upstream in upstreams:
        for stream in (False, True):
            mode = "stream" if stream else "json"
            ratios = []
            for rnd in range(1, rounds + 1):
                row = [best(upstream, g, stream, rnd) for g in gateways]
                if row[0] > 0:
                    ratios.append(row[-1] / row[0])
                ratio = f" {ratio_text(row[-1], row[0], gateways[0], 2)} |" if ratio_head else ""
                print((f"| {rnd} " if rounds > 1 else "") + f"| {upstream} | {mode} | "
                      f"{best(upstream, 'direct', stream):,.0f} | " + " | ".join(f"{v:,.0f}" for v in row) + " |"
                      + ratio)
            if rounds > 1 and ratio_head:
                median = f"{statistics.median(ratios):.2f}x" if ratios else "n/a"
                spread = f"{min(ratios):.2f}-{max(ratios):.2f}x" if ratios else "n/a"
                print(f"| median | {upstream} | {mode} | | " + " | ".join("" for _ in gateways)
                      + f" | **{median}** (rounds {spread}) |")


def report_cpu(cells: list[Cell]) -> None:
    """Where the CPU went in each target's best closed-loop cell: µs of CPU per request, by process group
    (utime + stime from /proc; the load generator's from RUSAGE_CHILDREN). On a host with C cores a target
    can serve at most C x 1e6 / (the row's total) req/s."""
    best: dict[tuple[str, str, bool], Cell] = {}
    for c in cells:
        key = (c.upstream, c.target, c.stream)
        if c.cpu_us and (key not in best or c.rps > best[key].rps):
            best[key] = c
    if not best:
        return
    groups = ["gateway", "upstream", "nats-server", "load generator"]
    print()
    print("CPU per request, µs, in each target's best closed-loop cell (by process group):")
    print()
    print("| upstream | target | mode | conc | req/s | " + " | ".join(groups) + " | total |")
    print("|---|---|---|---|---|" + "---|" * (len(groups) + 1))
    for (upstream, target, stream), c in best.items():
        vals = [c.cpu_us.get(g) for g in groups]
        print(f"| {upstream} | {target} | {'stream' if stream else 'json'} | {c.concurrency} | {c.rps:,.0f} | "
              + " | ".join("—" if v is None else f"{v:.0f}" for v in vals)
              + f" | {sum(v for v in vals if v is not None):.0f} |")


def host_line() -> str:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(Exception):
        cpu = next(ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                   if ln.startswith("model name"))
    load = ""
    with contextlib.suppress(OSError, AttributeError):
        one, five, fifteen = os.getloadavg()
        load = f" load average at the end {one:.2f} / {five:.2f} / {fifteen:.2f} (1 / 5 / 15 min);"
    return (f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; host {platform.node()}: {os.cpu_count()} CPUs "
            f"({cpu});{load} Python {platform.python_version()}")


def report(cells: list[Cell], notes: list[str], tool: str, duration: int, concurrencies: list[int],
           worker_counts: list[int], litellm_workers: int = 1) -> None:
    """``gateway xN / LiteLLM`` is a per-process ratio only where both run one process (x1, 1 worker)."""
    by = {(c.target, c.stream, c.concurrency): c for c in cells}
    load_desc = ("wrk 1 thread, closed loop (N connections)" if tool == "wrk"
                 else "aiohttp client in a separate process, closed loop (N tasks)")
    print()
    print(f"Load generator: {load_desc}; {duration:g} s per cell after a warm-up.")
    print(host_line())
    for n in notes:
        print(n)
    print()
    print("| target | mode | conc | req/s | p50 ms | p99 ms | added p50 ms | added p99 ms | errors |")
    print("|---|---|---|---|---|---|---|---|---|")
    for c in cells:
        d = by.get(("direct", c.stream, c.concurrency))
        if c.target == "direct" or d is None:
            a50 = a99 = "—"
        else:
            a50, a99 = f"{c.p50_ms - d.p50_ms:.2f}", f"{c.p99_ms - d.p99_ms:.2f}"
        print(f"| {c.target} | {'stream' if c.stream else 'json'} | {c.concurrency} | {c.rps:,.0f} | "
              f"{pct_fmt(c.p50_ms)} | {pct_fmt(c.p99_ms)} | {a50} | {a99} | {c.errors} |")

    def best(target: str, stream: bool) -> float:
        return max((c.rps for c in cells if c.target == target and c.stream == stream), default=0.0)

    gateways = [gateway_name(w) for w in worker_counts]
    print()
    print("Saturation (each target's best req/s over the concurrencies run):")
    print()
    names = ["direct", *gateways, *(["litellm"] if any(c.target == "litellm" for c in cells) else [])]
    print("| mode | " + " | ".join(f"{n} max req/s" for n in names) + " |")
    print("|---|" + "---|" * len(names))
    for stream in (False, True):
        print(f"| {'stream' if stream else 'json'} | " + " | ".join(f"{best(n, stream):,.0f}" for n in names) + " |")
    if len(gateways) > 1:
        print()
        print("| mode | " + " | ".join(f"{g} / {gateways[0]}" for g in gateways[1:]) + " |")
        print("|---|" + "---|" * (len(gateways) - 1))
        for stream in (False, True):
            print(f"| {'stream' if stream else 'json'} | " + " | ".join(
                ratio_text(best(g, stream), best(gateways[0], stream), gateways[0]) for g in gateways[1:]) + " |")
    if "litellm" in names:
        print()
        print("| mode | " + " | ".join(f"{g} / LiteLLM ({litellm_workers} worker(s)), best req/s"
                                      for g in gateways) + " |")
        print("|---|" + "---|" * len(gateways))
        for stream in (False, True):
            print(f"| {'stream' if stream else 'json'} | " + " | ".join(
                ratio_text(best(g, stream), best("litellm", stream), "LiteLLM") for g in gateways) + " |")
        print()
        print("| gateway | mode | conc | gateway/LiteLLM req/s | LiteLLM/gateway added p50 "
              "| LiteLLM/gateway added p99 |")
        print("|---|---|---|---|---|---|")
        for g_name in gateways:
            for stream in (False, True):
                for conc in concurrencies:
                    d, g, lt = (by.get((t, stream, conc)) for t in ("direct", g_name, "litellm"))
                    if not (d and g and lt):
                        continue

                    def ratio(lv: float, gv: float) -> str:
                        return f"{lv / gv:.1f}x" if gv > 0 else f"n/a (gateway added {gv:.2f} ms)"

                    print(f"| {g_name} | {'stream' if stream else 'json'} | {conc} | "
                          f"{ratio_text(g.rps, lt.rps, 'LiteLLM')} | "
                          f"{ratio(lt.p50_ms - d.p50_ms, g.p50_ms - d.p50_ms)} | "
                          f"{ratio(lt.p99_ms - d.p99_ms, g.p99_ms - d.p99_ms)} |")
    if any(c.errors for c in cells):
        print("\nWARNING: some requests failed (errors column); their cells' figures exclude them.")


if __name__ == "__main__":
    main()
