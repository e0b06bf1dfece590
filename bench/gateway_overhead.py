"""Gateway overhead (issue #5): a null engine called directly vs through the gateway (and LiteLLM's proxy).

One run, all on loopback:

* a **null engine** (aiohttp, OpenAI-compatible, in its own process: this file with ``--serve-null``) that
  answers ``/v1/chat/completions`` at once: non-streaming JSON with ``usage``; streaming 16 SSE content
  chunks (the last with ``finish_reason``), a usage chunk (``stream_options.include_usage``) and ``[DONE]``;
* a ``nats-server`` (JetStream) and the **gateway** (``python -m services.gateway``) with a pools file whose
  one pool ``null`` has the null engine as its only HTTP member (so every request also publishes a usage
  record to JetStream, as in production);
* optionally **LiteLLM's proxy** (``litellm --config … --num_workers 1``, master key, no database,
  ``LITELLM_LOCAL_MODEL_COST_MAP=True``, model ``openai/null`` with ``api_base`` = the null engine), when
  the ``litellm`` command is installed (``pip install 'litellm[proxy]'``). If it is missing or does not
  start, the output says so and no LiteLLM figure is printed.

Load: ``wrk`` (closed loop, 1 thread, N connections, fixed duration per cell, POST body from a Lua script;
the percentiles come from wrk's own histogram) when it is on PATH, else an aiohttp client in a separate
process with the same fixed duration. The output names the one used. For each target x {non-streaming,
streaming} x concurrency {1, 16, 64}: requests/s, latency p50/p99 (whole response, stream included), and
the added latency p50/p99 (target minus direct at the same concurrency and mode). A short warm-up precedes
each target x mode.

    .venv/bin/python bench/gateway_overhead.py [--quick] [--duration 5] [--concurrency 1,16,64] [--no-litellm]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
MODEL = "null"
STREAM_CHUNKS = 16
LITELLM_KEY = "sk-bench-overhead"
MAX_CONCURRENCY = 1024
MAX_DURATION_S = 120.0


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
        self.errors = 0

    async def post(self, session, started: float) -> None:  # type: ignore[no-untyped-def]
        """One request; its latency runs from ``started`` (perf_counter seconds)."""
        import aiohttp

        try:
            async with session.post(self.url, data=self.data, headers=self.headers) as resp:
                await resp.read()
                ok = resp.status == 200
        except aiohttp.ClientError:
            ok = False
        if ok:
            self.latencies_us.append((time.perf_counter() - started) * 1e6)
        else:
            self.errors += 1

    def print_result(self, duration_s: float) -> None:
        lat = sorted(self.latencies_us)

        def pct(q: float) -> float:
            return lat[min(len(lat) - 1, int(q / 100 * len(lat)))] if lat else float("nan")

        print("RESULT " + json.dumps({"requests": len(lat) + self.errors, "duration_s": duration_s,
                                      "errors": self.errors, "p50_us": pct(50), "p99_us": pct(99)}), flush=True)


def serve_rate(url: str, body: str, rate: float, duration: float, headers_json: str) -> None:
    """Open loop: request i is due at t0 + i/rate whether or not earlier ones finished; its latency runs
    from when it was due (so a stall is charged to every request it delayed: no coordinated omission)."""
    import asyncio

    import aiohttp

    recorder = _Recorder(url, body, headers_json)

    async def main() -> None:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=512)) as session:
            tasks = []
            t0 = time.perf_counter() + 0.05
            for i in range(int(rate * duration)):
                due = t0 + i / rate
                delay = due - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(recorder.post(session, due)))
            await asyncio.gather(*tasks)
            recorder.print_result(time.perf_counter() - t0)

    asyncio.run(main())


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
    errors: int
    requests: int


def request_body(stream: bool) -> dict:
    body: dict = {"model": MODEL, "messages": [{"role": "user", "content": "ping"}], "max_tokens": STREAM_CHUNKS}
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


def run_load(tool: str, url: str, stream: bool, concurrency: int, duration: int, headers: dict[str, str],
             work: Path) -> tuple[int, float, int, float, float]:
    """(requests, seconds, errors, p50_us, p99_us) of one closed-loop run."""
    body = request_body(stream)
    timeout = duration + 60
    if tool == "wrk":
        script = work / f"load_{'s' if stream else 'n'}_{abs(hash(tuple(headers.items())))}.lua"
        lua_script(script, body, headers)
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
                          json.dumps(headers)], capture_output=True, text=True, timeout=timeout, cwd=REPO)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"load generator failed: {out.stdout}\n{out.stderr}")
    r = json.loads(line[7:])
    return r["requests"], r["duration_s"], r["errors"], r["p50_us"], r["p99_us"]


def run_rate(url: str, stream: bool, rate: float, duration: int, headers: dict[str, str]) -> Cell:
    """One open-loop fixed-rate run (its own process, so its CPU is not the gateway's)."""
    out = subprocess.run([PY, __file__, "--serve-rate", url, json.dumps(request_body(stream)), str(rate),
                          str(duration), json.dumps(headers)], capture_output=True, text=True,
                         timeout=duration + 120, cwd=REPO)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"rate generator failed: {out.stdout}\n{out.stderr}")
    r = json.loads(line[7:])
    return Cell("", stream, 0, (r["requests"] - r["errors"]) / r["duration_s"], r["p50_us"] / 1000,
                r["p99_us"] / 1000, r["errors"], r["requests"])


def check_target(name: str, base: str, headers: dict[str, str]) -> None:
    """One request of each mode, checked, before any timing (a broken path must not look fast)."""
    status, raw = http_post(base + "/v1/chat/completions", request_body(False), headers)
    if status != 200 or json.loads(raw)["choices"][0]["message"]["content"] != "x" * STREAM_CHUNKS:
        raise RuntimeError(f"{name}: non-streaming check failed: {status} {raw[:300]!r}")
    status, raw = http_post(base + "/v1/chat/completions", request_body(True), headers)
    events = [ln[6:] for ln in raw.decode().splitlines() if ln.startswith("data: ")]
    text = "".join((json.loads(e)["choices"] or [{}])[0].get("delta", {}).get("content") or ""
                   for e in events if e != "[DONE]")
    if status != 200 or events[-1:] != ["[DONE]"] or text != "x" * STREAM_CHUNKS:
        raise RuntimeError(f"{name}: streaming check failed: {status} {raw[:300]!r}")


# --------------------------------------------------------------------------------------------------------------
# stack


def start_litellm(null_url: str, work: Path, procs: list[Proc]) -> tuple[str | None, str]:
    """(base URL, note); base is None when LiteLLM is not installed or does not start."""
    exe = Path(PY).parent / "litellm"
    exe_s = str(exe) if exe.exists() else shutil.which("litellm")
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
                            "--num_workers", "1"], work, env)
    procs.append(proc)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.p.poll() is not None:
            return None, f"LiteLLM: did not start (exit {proc.p.returncode}): {proc.tail(5)!r} — no LiteLLM figures."
        if http_get_ok(base + "/health/liveliness"):
            try:
                check_target("litellm", base, {"Authorization": f"Bearer {LITELLM_KEY}"})
            except Exception as exc:
                return None, f"LiteLLM: started but the check request failed ({exc}) — no LiteLLM figures."
            version = "?"
            with contextlib.suppress(Exception):
                from importlib.metadata import version as _v
                version = _v("litellm")
            return base, f"LiteLLM {version} proxy: 1 worker, master key, no DB, LITELLM_LOCAL_MODEL_COST_MAP=True."
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
    ap.add_argument("--load", choices=["auto", "wrk", "aiohttp"], default="auto")
    ap.add_argument("--serve-null", type=int, metavar="PORT", help=argparse.SUPPRESS)
    ap.add_argument("--serve-load", nargs=5, metavar="X", help=argparse.SUPPRESS)
    ap.add_argument("--serve-rate", nargs=5, metavar="X", help=argparse.SUPPRESS)
    ap.add_argument("--rate", type=float, default=1000.0,
                    help="open-loop rate for the fixed-rate cells (req/s; default 1000; 0 skips them)")
    args = ap.parse_args()
    if args.serve_null is not None:
        serve_null(args.serve_null)
        return
    if args.serve_rate:
        url, body, rate, dur, hdrs = args.serve_rate
        serve_rate(url, body, float(rate), float(dur), hdrs)
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
    tool = ("wrk" if shutil.which("wrk") else "aiohttp") if args.load == "auto" else args.load
    if tool == "wrk" and not shutil.which("wrk"):
        ap.error("wrk not on PATH")

    # SIGTERM/SIGHUP → normal exit through the finally below.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: sys.exit(143))

    procs: list[Proc] = []
    cells: list[Cell] = []
    rate_cells: list[Cell] = []
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="gw-overhead-") as tmp:
        work = Path(tmp)
        try:
            null = Proc("null-engine", [PY, __file__, "--serve-null", "0"], work)
            procs.append(null)
            null_url = null.wait_line("null engine ready:", 30).split()[-1]

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

            pools = work / "pools.json"
            pools.write_text(json.dumps({"model_pools": {MODEL: {"members": [
                {"model_id": MODEL, "backend": null_url}]}}}))
            gw = Proc("gateway", [PY, "-m", "services.gateway", "--port", "0", "--nats",
                                  f"nats://127.0.0.1:{nats_port}", "--config", str(pools),
                                  "--data-dir", str(work / "gw-data")], work)
            procs.append(gw)
            # everything on: the gateway checks the bootstrap admin's API key on every request (printed
            # once, before its ready line)
            gw_key = gw.wait_line("first start:", 60).split("API key ", 1)[1].split(";")[0]
            gw_url = gw.wait_line("llmgw gateway ready:", 60).split()[-1]
            gw_auth = {"Authorization": f"Bearer {gw_key}"}

            targets: list[tuple[str, str, dict[str, str]]] = [("direct", null_url, {}), ("gateway", gw_url, gw_auth)]
            for name, base, hdrs in targets:
                check_target(name, base, hdrs)
            if args.no_litellm:
                notes.append("LiteLLM: skipped (--no-litellm) — no LiteLLM figures.")
            else:
                lite_url, note = start_litellm(null_url, work, procs)
                notes.append(note)
                if lite_url:
                    targets.append(("litellm", lite_url, {"Authorization": f"Bearer {LITELLM_KEY}"}))

            plan = [(t, s, c) for t in targets for s in (False, True) for c in concurrencies]
            bar = tqdm(plan, desc="cells", unit="cell")
            warmed: set[tuple[str, bool]] = set()
            for (name, base, hdrs), stream, conc in bar:
                bar.set_postfix_str(f"{name} {'stream' if stream else 'json'} c={conc}")
                url = base + "/v1/chat/completions"
                if (name, stream) not in warmed:
                    run_load(tool, url, stream, max(concurrencies), warmup, hdrs, work)
                    warmed.add((name, stream))
                reqs, secs, errors, p50, p99 = run_load(tool, url, stream, conc, duration, hdrs, work)
                cells.append(Cell(name, stream, conc, (reqs - errors) / secs, p50 / 1000, p99 / 1000, errors, reqs))
            bar.close()
            if args.rate > 0:  # the latency target is stated at a fixed offered rate
                rate_plan = [(t, s) for t in targets[:2] for s in (False, True)]
                for (name, base, hdrs), stream in tqdm(rate_plan, desc=f"{args.rate:g} req/s cells", unit="cell"):
                    cell = run_rate(base + "/v1/chat/completions", stream, args.rate, duration, hdrs)
                    rate_cells.append(dataclasses.replace(cell, target=name))
        finally:
            for proc in reversed(procs):
                proc.close()

    report(cells, notes, tool, duration, concurrencies)
    report_rate(rate_cells, args.rate)


def report_rate(cells: list[Cell], rate: float) -> None:
    if not cells:
        return
    by = {(c.target, c.stream): c for c in cells}
    print()
    print(f"Open loop at {rate:g} req/s offered (latency from each request's due time: no coordinated omission):")
    print()
    print("| target | mode | offered req/s | served req/s | p50 ms | p99 ms | added p50 ms | added p99 ms | errors |")
    print("|---|---|---|---|---|---|---|---|---|")
    for c in cells:
        d = by.get(("direct", c.stream))
        if c.target == "direct" or d is None:
            a50 = a99 = "—"
        else:
            a50, a99 = f"{c.p50_ms - d.p50_ms:.2f}", f"{c.p99_ms - d.p99_ms:.2f}"
        print(f"| {c.target} | {'stream' if c.stream else 'json'} | {rate:,.0f} | {c.rps:,.0f} | "
              f"{pct_fmt(c.p50_ms)} | {pct_fmt(c.p99_ms)} | {a50} | {a99} | {c.errors} |")


def report(cells: list[Cell], notes: list[str], tool: str, duration: int, concurrencies: list[int]) -> None:
    by = {(c.target, c.stream, c.concurrency): c for c in cells}
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(Exception):
        cpu = next(ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                   if ln.startswith("model name"))
    load_desc = ("wrk 1 thread, closed loop (N connections)" if tool == "wrk"
                 else "aiohttp client in a separate process, closed loop (N tasks)")
    print()
    print(f"Load generator: {load_desc}; {duration:g} s per cell after a warm-up; "
          f"{os.cpu_count()} CPUs ({cpu}); Python {platform.python_version()}.")
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

    if any(c.target == "litellm" for c in cells):
        print()
        print("| mode | conc | gateway/LiteLLM req/s | LiteLLM/gateway added p50 | LiteLLM/gateway added p99 |")
        print("|---|---|---|---|---|")
        for stream in (False, True):
            for conc in concurrencies:
                d, g, lt = (by.get((t, stream, conc)) for t in ("direct", "gateway", "litellm"))
                if not (d and g and lt):
                    continue

                def ratio(lv: float, gv: float) -> str:
                    return f"{lv / gv:.1f}x" if gv > 0 else f"n/a (gateway added {gv:.2f} ms)"

                print(f"| {'stream' if stream else 'json'} | {conc} | {g.rps / lt.rps:.1f}x | "
                      f"{ratio(lt.p50_ms - d.p50_ms, g.p50_ms - d.p50_ms)} | "
                      f"{ratio(lt.p99_ms - d.p99_ms, g.p99_ms - d.p99_ms)} |")
    if any(c.target == "litellm" for c in cells):
        print()
        print("Saturation (each target's best req/s over the concurrencies run: its throughput per process):")
        print()
        print("| mode | gateway max req/s | LiteLLM max req/s | gateway/LiteLLM |")
        print("|---|---|---|---|")
        for stream in (False, True):
            best = {t: max((c.rps for c in cells if c.target == t and c.stream == stream), default=0.0)
                    for t in ("gateway", "litellm")}
            if best["gateway"] and best["litellm"]:
                print(f"| {'stream' if stream else 'json'} | {best['gateway']:,.0f} | {best['litellm']:,.0f} | "
                      f"{best['gateway'] / best['litellm']:.1f}x |")
    if any(c.errors for c in cells):
        print("\nWARNING: some requests failed (errors column); their cells' figures exclude them.")


if __name__ == "__main__":
    main()
