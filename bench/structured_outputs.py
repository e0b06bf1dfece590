"""Structured outputs on CPU: what constrained rows cost a batch, and grammar compile times (issue #26).

One process, the bench's "tiny" shape (hidden 256, 4 layers, vocab 8192, random weights). Two figures:

1. **Step cost**: a batch of 32 requests, 64 output tokens each, run twice: all unconstrained (greedy, EOS
   ignored) and half of them JSON-schema constrained (temperature 1, seeded; the other half as before).
   Reported: output tok/s of the whole call, and the seconds spent filling and applying the grammar
   bitmasks (``apply_grammar_masks``, timed by wrapping it; accept_token is not in it) as a share of wall
   time. The goal in the issue: constrained rows cost <= 10 % of step time at batch 32.
   Constrained rows stop when their grammar completes, so the two runs produce different numbers of
   tokens: compare tok/s and the mask share, not wall times.
2. **Compile**: 20 generated JSON schemas (nested objects, enums, bounded numbers, arrays, patterns),
   compiled against this vocabulary: first compile (a cache miss) and second (a hit), in ms.

Usage: ``python -m bench.structured_outputs [--threads N] [--repeats N]`` (prints markdown tables).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from services.engine import engine_core
from services.engine.core.sampling_params import SamplingParams, StructuredOutput
from services.engine.llm import LLM, greedy
from services.engine.tiny_checkpoint import write_tiny_checkpoint

BATCH = 32
OUTPUT_TOKENS = 64


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    props: dict[str, Any] = {}
    for i in range(rng.randint(1, 4)):
        kind = rng.choice(["enum", "int", "number", "bool", "array", "pattern"] + (["object"] if depth == 0 else []))
        if kind == "enum":
            props[f"f{i}"] = {"enum": ["red", "green", "blue"]}
        elif kind == "int":
            lo = rng.randint(-50, 50)
            props[f"f{i}"] = {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 100)}
        elif kind == "number":
            props[f"f{i}"] = {"type": "number", "minimum": 0, "maximum": 10}
        elif kind == "bool":
            props[f"f{i}"] = {"type": "boolean"}
        elif kind == "array":
            props[f"f{i}"] = {"type": "array", "items": {"type": "integer"}, "maxItems": 3}
        elif kind == "pattern":
            props[f"f{i}"] = {"type": "string", "pattern": "^[a-z]{1,5}$"}
        else:
            props[f"f{i}"] = random_schema(rng, depth + 1)
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def timed_masks() -> list[float]:
    """Wrap the engine's mask function; returns the list its durations are appended to."""
    spent: list[float] = []
    original = engine_core.apply_grammar_masks

    def wrapper(logits: torch.Tensor, matchers: Any) -> torch.Tensor:
        start = time.perf_counter()
        out = original(logits, matchers)
        spent.append(time.perf_counter() - start)
        return out

    engine_core.apply_grammar_masks = wrapper  # type: ignore[assignment]
    return spent


def run(llm: LLM, params: list[SamplingParams], spent: list[float]) -> tuple[float, int, float]:
    prompts = [[(i * 37 + j) % 8000 + 3 for j in range(64)] for i in range(BATCH)]
    spent.clear()
    start = time.perf_counter()
    out = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    return wall, sum(len(c.token_ids) for c in out), sum(spent)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_tiny_checkpoint(Path(tmp) / "tiny", arch="qwen3", hidden_size=256, num_layers=4, num_heads=8,
                                     num_kv_heads=4, intermediate_size=768, vocab_size=8192)
        llm = LLM(path, kv_capacity_tokens=BATCH * 192, max_concurrency=BATCH, max_pending_requests=BATCH)
        spent = timed_masks()
        rng = random.Random(26)
        schema = json.dumps(random_schema(rng))
        constraint = StructuredOutput(kind="json_schema", spec=schema, strict=True)
        plain = [greedy(OUTPUT_TOKENS, ignore_eos=True)] * BATCH
        half = plain[: BATCH // 2] + [SamplingParams(temperature=1.0, seed=i, max_tokens=OUTPUT_TOKENS,
                                                     structured=constraint) for i in range(BATCH // 2)]
        run(llm, plain, spent)  # warm-up (kernels, first grammar compile)
        run(llm, half, spent)
        rows: dict[str, list[tuple[float, int, float]]] = {"none": [], "half": []}
        for _ in range(args.repeats):  # interleaved, so load from other processes hits both alike
            rows["none"].append(run(llm, plain, spent))
            rows["half"].append(run(llm, half, spent))
        compile_rows = []
        fresh = LLM(path, kv_capacity_tokens=1024)
        for i in range(20):
            c = StructuredOutput(kind="json_schema", spec=json.dumps(random_schema(rng)), strict=True)
            t0 = time.perf_counter()
            fresh.core.grammars.compile(c)
            t1 = time.perf_counter()
            fresh.core.grammars.compile(c)
            t2 = time.perf_counter()
            compile_rows.append(((t1 - t0) * 1000, (t2 - t1) * 1000))
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, torch {torch.__version__} "
          f"({torch.get_num_threads()} threads); batch {BATCH}, {OUTPUT_TOKENS} output tokens, vocab 8192")
    print("| rows constrained | output tok/s (median) | mask fill + apply s | mask share of wall |")
    print("|---|---|---|---|")
    for name, label in (("none", "0 / 32"), ("half", "16 / 32 (JSON schema)")):
        results = rows[name]
        tps = statistics.median(n / w for w, n, _ in results)
        mask = statistics.median(m for _, _, m in results)
        share = statistics.median(m / w for w, _, m in results)
        print(f"| {label} | {tps:.0f} | {mask:.3f} | {share * 100:.1f} % |")
    first = [a for a, _ in compile_rows]
    again = [b for _, b in compile_rows]
    print()
    print("| grammar compile (20 schemas) | median ms | max ms |")
    print("|---|---|---|")
    print(f"| first (miss) | {statistics.median(first):.1f} | {max(first):.1f} |")
    print(f"| again (cache hit) | {statistics.median(again):.3f} | {max(again):.3f} |")


if __name__ == "__main__":
    main()
