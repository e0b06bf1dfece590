"""Serving benchmark: N concurrent streaming clients against a real `ninfer-serve` process.

Reports TTFT p50/p99, inter-token latency p50/p99 (the gap between content events as the client receives
them), tokens per event, output tok/s, and the ratio of served throughput to the offline engine's
throughput on the same prompts in the same run: medians of ``--repeats`` timed runs of each side, every
run listed (target >= 0.8: the HTTP/SSE layer must not be the bottleneck). The server runs with its
defaults (`--stream-interval-ms 20`: a stream's tokens go out at most every 20 ms, merged);
`--server-args '--stream-interval-ms 0'` measures one event per token. The model is issue #3's tiny
Qwen3 shape (hidden 256, 4 layers, 8/4 heads, vocab 8192) with random weights, written into a
temporary directory.

    .venv/bin/python bench/engine_serving.py [--concurrency 1,8,32] [--num-prompts 64] [--repeats 3]
        [--quick] [--server-args '...']
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from services.engine.llm import LLM, greedy  # noqa: E402
from services.engine.tiny_checkpoint import write_tiny_checkpoint  # noqa: E402

# Both sides warm up on the level's first `concurrency` prompts with this many output tokens: a full batch,
# so the timed run does not pay for the first use of each batch shape.
WARMUP_TOKENS = 32
TINY = dict(hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4, intermediate_size=768, vocab_size=8192)


@dataclass
class Run:
    concurrency: int
    tok_s: float
    ttft_ms: list[float]
    itl_ms: list[float]  # gaps between content events as the client receives them
    tokens_per_event: float


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def make_prompts(model_dir: Path, n: int, seed: int) -> list[str]:
    from services.engine.model.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model_dir)
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        ids = [rng.randrange(3, tok.vocab_size - 2) for _ in range(rng.randint(64, 256))]
        prompts.append(tok.decode(ids))
    return prompts


async def one_stream(http: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int,
                     ttft: list[float], itl: list[float]) -> int:
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    last = None
    tokens = 0
    # The client shares the machine's cores with the server, so it does as little as it can: it splits
    # what arrives into SSE events and JSON-decodes only the usage event; a content event is one whose
    # "text" is not empty. Events that arrive in one read share its timestamp (as any client sees them).
    buffer = b""
    async with http.post(url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for data in resp.content.iter_any():
            now = time.perf_counter()
            *events, buffer = (buffer + data).split(b"\n\n")
            for event in events:
                if not event.startswith(b"data: {"):
                    continue
                if b'"choices":[]' in event:
                    tokens = json.loads(event[6:])["usage"]["completion_tokens"]
                    continue
                if b'"text":""' in event:
                    continue
                if last is None:
                    ttft.append((now - start) * 1000)
                else:
                    itl.append((now - last) * 1000)
                last = now
    return tokens


async def drive(url: str, prompts: list[str], concurrency: int, max_tokens: int, bar: tqdm) -> Run:
    ttft: list[float] = []
    itl: list[float] = []
    queue = list(prompts)
    total = 0

    async def client(http: aiohttp.ClientSession) -> None:
        nonlocal total
        while queue:
            prompt = queue.pop()
            n = await one_stream(http, url, prompt, max_tokens, ttft, itl)
            total += n  # not `total += await …`: that reads `total` before the await and loses updates
            bar.update(1)

    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=concurrency)) as http:
        start = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    return Run(concurrency, total / elapsed, ttft, itl, total / max(1, len(ttft) + len(itl)))


def start_server(model: Path, concurrency: int, data: Path, extra: list[str]) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.engine", str(model), "--model-id", "bench", "--port", "0",
         "--max-concurrency", str(concurrency), "--max-pending-requests", "256", "--kv-capacity", "65536",
         "--data-dir", str(data), *extra],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if "ready:" in line:
            return proc, line.split("listening on ")[1].split()[0]
    raise RuntimeError("ninfer-serve did not start")


def offline(model: Path, prompts: list[str], concurrency: int, max_tokens: int, repeats: int) -> list[float]:
    llm = LLM(model, kv_capacity_tokens=65536, max_concurrency=concurrency, max_pending_requests=256)
    llm.generate(prompts[:concurrency], greedy(WARMUP_TOKENS, ignore_eos=True))  # the same warm-up as served
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        outs = llm.generate(prompts, greedy(max_tokens, ignore_eos=True))
        rates.append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start))
    return rates


def merged(runs: list[Run]) -> Run:
    """Several timed runs of one level as one row: median throughput, every latency sample."""
    return Run(runs[0].concurrency, statistics.median(r.tok_s for r in runs), [t for r in runs for t in r.ttft_ms],
               [t for r in runs for t in r.itl_ms], statistics.median(r.tokens_per_event for r in runs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed runs per level and side; the table shows medians (the machine is noisy)")
    parser.add_argument("--server-args", default="", help="more ninfer-serve flags, e.g. '--stream-interval-ms 0'")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    n, max_tokens = (8, 16) if args.quick else (args.num_prompts, args.max_tokens)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_checkpoint(Path(tmp) / "tiny", arch="qwen3", **TINY)  # type: ignore[arg-type]
        for c in levels:
            count = max(n // (4 if c == 1 else 1), c)
            prompts = make_prompts(model, count, seed=c)
            proc, url = start_server(model, c, Path(tmp) / "data", shlex.split(args.server_args))
            try:
                with tqdm(total=count * args.repeats + c, desc=f"served c={c}", unit="req") as bar:
                    asyncio.run(drive(url, prompts[:c], c, WARMUP_TOKENS, bar))  # warm-up
                    served_runs = [asyncio.run(drive(url, prompts, c, max_tokens, bar)) for _ in range(args.repeats)]
            finally:
                proc.terminate()
                proc.wait(30)
            # A fresh process, as the server is: neither side inherits warm caches (oneDNN primitives for
            # the batch shapes, allocator pools) from an earlier level.
            with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
                offline_rates = pool.submit(offline, model, prompts, c, max_tokens, args.repeats).result()
            rows.append((merged(served_runs), statistics.median(offline_rates),
                         [r.tok_s for r in served_runs], offline_rates))
    header = ("| concurrency | served tok/s | offline tok/s | served/offline | TTFT p50 ms | TTFT p99 ms "
              "| ITL p50 ms | ITL p99 ms | tokens/event | runs: served / offline tok/s |")
    lines = [header, "|---|---|---|---|---|---|---|---|---|---|"]
    for served, off, served_rates, off_rates in rows:
        lines.append(
            f"| {served.concurrency} | {served.tok_s:.0f} | {off:.0f} | {served.tok_s / off:.2f} "
            f"| {statistics.median(served.ttft_ms):.1f} | {percentile(served.ttft_ms, 99):.1f} "
            f"| {statistics.median(served.itl_ms):.2f} | {percentile(served.itl_ms, 99):.2f} "
            f"| {served.tokens_per_event:.1f} "
            f"| {' '.join(f'{r:.0f}' for r in served_rates)} / {' '.join(f'{r:.0f}' for r in off_rates)} |"
        )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
