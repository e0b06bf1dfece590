"""Telemetry at scale (issue #6): scrape N simulated HTTP members at 1 Hz; telemetry's CPU share and heartbeat age.

Three processes besides a ``nats-server``, so only telemetry's own CPU is counted:

* **members** (this file with ``--serve-members N``): one aiohttp process listening on N loopback ports,
  an equal mix of NInfer (``/slots`` + ``/usage``), vLLM (a ``/metrics`` of ~380 lines, histograms as
  a real one has), llama.cpp (``/slots`` array + ``/metrics``), SGLang (``/metrics``) and stock
  (``/v1/models``) servers, in the shapes of tests/unit/telemetry/samples.py;
* **telemetry**: ``python -m services.telemetry`` watching all N, as deployed;
* **this process**: subscribes to ``llm.v1.hb.*`` like a gateway does and measures, per heartbeat, its
  transit age (receive time - ``ts_s``), and every 50 ms the age of each member's newest heartbeat
  (what a gateway sees when a request arrives: transit + up to one interval).

CPU share = telemetry's utime + stime (``/proc/<pid>/stat``) over the measured wall time, after a warm-up
that lets every member be detected. Targets: < 25 % of one core, heartbeat age p99 < 1.5 s.

    .venv/bin/python -m bench.telemetry_scale [--members 200] [--duration 20] [--interval 1.0] [--kinds vllm]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
KINDS = ("ninfer", "vllm", "llamacpp", "sglang", "stock")
CLK_TCK = os.sysconf("SC_CLK_TCK")
CPU_TARGET = 0.25
AGE_P99_TARGET_S = 1.5


# ---- the simulated members (child process) --------------------------------------------------------------


def _vllm_metrics_text() -> str:
    """The sample vLLM exposition plus the histogram families a real vLLM exports (~20 buckets each)."""
    from tests.unit.telemetry import samples

    lines = [samples.VLLM_METRICS]
    buckets = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
    for name in ("e2e_request_latency_seconds", "request_queue_time_seconds", "inter_token_latency_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds", "request_inference_time_seconds",
                 "request_prompt_tokens", "request_generation_tokens", "iteration_tokens_total",
                 "request_max_num_generation_tokens", "request_params_max_tokens", "request_params_n",
                 "time_per_output_token_seconds", "request_time_per_output_token_seconds", "request_params_seed"):
        family = f"vllm:{name}"
        lines.append(f"# HELP {family} Histogram of {name}.\n# TYPE {family} histogram")
        labels = 'engine="0",model_name="Qwen/Qwen3-8B"'
        for i, b in enumerate(buckets):
            lines.append(f'{family}_bucket{{{labels},le="{b}"}} {float(i * 3)}')
        lines.append(f'{family}_bucket{{{labels},le="+Inf"}} 60.0')
        lines.append(f"{family}_count{{{labels}}} 60.0\n{family}_sum{{{labels}}} 123.4")
    return "\n".join(lines) + "\n"


async def _serve_members(n: int, kinds: tuple[str, ...]) -> None:
    from aiohttp import web

    from tests.unit.telemetry import samples

    vllm_text = _vllm_metrics_text()
    llama_slots = samples.llamacpp_slots([True, False, False, True])
    bodies: dict[str, dict[str, Any]] = {
        "ninfer": {"/slots": samples.ninfer_slots(), "/usage": samples.ninfer_usage({"2026-01-01": 10.0}),
                   "/v1/models": {"data": [{"id": "qwen3.8-27b"}]}},
        "vllm": {"/metrics": vllm_text, "/v1/models": samples.VLLM_MODELS},
        "llamacpp": {"/slots": llama_slots, "/metrics": samples.LLAMACPP_METRICS,
                     "/v1/models": samples.LLAMACPP_MODELS},
        "sglang": {"/metrics": samples.SGLANG_METRICS, "/v1/models": {"data": [{"id": "llama"}]}},
        "stock": {"/v1/models": {"data": [{"id": "stock-model"}]}},
    }
    encoded = {kind: {path: (body.encode(), "text/plain") if isinstance(body, str)
                      else (json.dumps(body).encode(), "application/json") for path, body in routes.items()}
               for kind, routes in bodies.items()}
    runners, urls = [], []
    for kind in kinds:
        app = web.Application()
        for path, (payload, ctype) in encoded[kind].items():
            async def handler(request: web.Request, payload: bytes = payload, ctype: str = ctype) -> web.Response:
                return web.Response(body=payload, content_type=ctype)
            app.router.add_get(path, handler)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        runners.append(runner)
    for i in range(n):
        kind = kinds[i % len(kinds)]
        runner = runners[i % len(kinds)]
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        urls.append({"id": f"{kind}-{i}", "url": f"http://127.0.0.1:{port}", "kind": kind})
    print(json.dumps(urls), flush=True)
    await asyncio.Event().wait()


# ---- measurement -----------------------------------------------------------------------------------------


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime (fields 14 and 15 of the whole line)


def _pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))] if ordered else float("nan")


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm import tqdm

    from proto import SlotHeartbeat, decode, subjects
    from services.common.bus import connect
    from services.common.nats_server import EmbeddedNatsServer

    work = Path(tempfile.mkdtemp(prefix="telemetry-scale-"))
    async with contextlib.AsyncExitStack() as es:
        server = await es.enter_async_context(EmbeddedNatsServer(work / "nats"))
        members_proc = subprocess.Popen([sys.executable, "-m", "bench.telemetry_scale", "--serve-members",
                                         str(args.members), "--kinds", args.kinds], cwd=REPO, stdout=subprocess.PIPE,
                                        text=True)
        es.callback(members_proc.kill)
        assert members_proc.stdout is not None
        members = json.loads(await asyncio.to_thread(members_proc.stdout.readline))
        env = {**os.environ, "LLMGW_TELEMETRY_MEMBERS": ",".join(f"{m['id']}={m['url']}" for m in members),
               "LLMGW_LOG_LEVEL": "WARNING"}
        telemetry = subprocess.Popen([sys.executable, "-m", "services.telemetry", "--nats", server.url,
                                      "--interval", str(args.interval), "--data-dir", str(work), "--port", "0"],
                                     cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
        es.callback(telemetry.kill)
        assert telemetry.stdout is not None
        ready = await asyncio.to_thread(telemetry.stdout.readline)
        assert "ready" in ready, ready

        nc = await connect(server.url, "bench")
        es.push_async_callback(nc.drain)
        transit: list[float] = []
        newest: dict[str, float] = {}
        kinds: dict[str, str] = {}
        states: dict[str, str] = {}
        measuring = False

        async def on_heartbeat(msg: Any) -> None:
            now = time.time()
            hb = decode(msg.data, SlotHeartbeat)
            newest[hb.worker_id] = hb.ts_s
            kinds[hb.worker_id] = hb.engine_kind
            states[hb.worker_id] = hb.state
            if measuring:
                transit.append(now - hb.ts_s)

        await nc.subscribe(subjects.HEARTBEAT_ALL, cb=on_heartbeat)
        deadline = time.monotonic() + 30
        while len([s for s in states.values() if s == "ready"]) < args.members and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        await asyncio.sleep(args.warmup)  # every member detected; scrape phases settled

        measuring = True
        ages: list[float] = []
        cpu0, wall0 = _cpu_s(telemetry.pid), time.monotonic()
        with tqdm(total=args.duration, unit="s", desc="measuring", bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} s") \
                as bar:
            while time.monotonic() - wall0 < args.duration:
                await asyncio.sleep(0.05)
                now = time.time()
                ages.extend(now - newest.get(m["id"], 0.0) for m in members)
                bar.update(min(time.monotonic() - wall0, args.duration) - bar.n)
        cpu1, wall1 = _cpu_s(telemetry.pid), time.monotonic()
        measuring = False
        detected = {k: sum(1 for m in members if kinds.get(m["id"]) == k) for k in KINDS}
        return {
            "members": args.members, "interval_s": args.interval, "duration_s": round(wall1 - wall0, 2),
            "cpu_share": (cpu1 - cpu0) / (wall1 - wall0), "heartbeats_per_s": len(transit) / (wall1 - wall0),
            "transit_p50_s": _pct(transit, 50), "transit_p99_s": _pct(transit, 99),
            "age_p50_s": _pct(ages, 50), "age_p99_s": _pct(ages, 99), "age_max_s": max(ages),
            "down": sum(1 for s in states.values() if s != "ready"), "detected": detected,
        }


def _report(r: dict[str, Any]) -> str:
    ok = {True: "met", False: "NOT met"}
    rows = [
        ("telemetry CPU (share of one core)", f"{100 * r['cpu_share']:.1f} %", f"< {100 * CPU_TARGET:.0f} %",
         ok[r["cpu_share"] < CPU_TARGET]),
        ("heartbeat age at a subscriber, p50", f"{r['age_p50_s']:.3f} s", "", ""),
        ("heartbeat age at a subscriber, p99", f"{r['age_p99_s']:.3f} s", f"< {AGE_P99_TARGET_S} s",
         ok[r["age_p99_s"] < AGE_P99_TARGET_S]),
        ("heartbeat age, max", f"{r['age_max_s']:.3f} s", "", ""),
        ("transit (receive - ts_s), p50 / p99", f"{1000 * r['transit_p50_s']:.1f} / {1000 * r['transit_p99_s']:.1f} ms",
         "", ""),
        ("heartbeats received per second", f"{r['heartbeats_per_s']:.1f}", f"{r['members'] / r['interval_s']:.0f}",
         ""),
    ]
    out = [f"{r['members']} members ({', '.join(f'{v} {k}' for k, v in r['detected'].items())} detected), "
           f"interval {r['interval_s']:g} s, measured {r['duration_s']:.1f} s, {r['down']} down; "
           f"{platform.machine()}, {os.cpu_count()} CPUs", "",
           "| metric | measured | target | |", "|---|---|---|---|"]
    out += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--members", type=int, default=200)
    ap.add_argument("--duration", type=float, default=20.0, help="seconds measured (after the warm-up)")
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--kinds", default=",".join(KINDS), help="the member mix, round-robin (default: all five)")
    ap.add_argument("--json", action="store_true", help="also print the raw figures as JSON")
    ap.add_argument("--serve-members", type=int, metavar="N", help=argparse.SUPPRESS)
    args = ap.parse_args()
    kinds = tuple(args.kinds.split(","))
    if not set(kinds) <= set(KINDS):
        ap.error(f"--kinds: choose from {','.join(KINDS)}")
    if args.serve_members:
        asyncio.run(_serve_members(args.serve_members, kinds))
        return
    result = asyncio.run(_run(args))
    print(_report(result))
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
