"""fp8 vs default KV cache on the CPU: what fp8 buys (tokens per byte) and what it costs (tok/s), issue #30.

The CPU engine runs decode attention, and the whole decode step, in compiled kernels over a float32 cache
(services/engine/kernels/cpu_kernels.cpp); an fp8 cache is dequantised in torch instead, a gather per
layer per step. This measures both on the same random-weight checkpoint and prompts, in one run:
output tok/s at concurrency 1 and 8 (128 greedy tokens each, EOS ignored, prefill included, a warm-up
call first) and the KV bytes per token position. The engine's start line quotes the ratio (docs/benchmarks.md).

Usage: ``python -m bench.kv_dtype [--shape tiny|100m] [--markdown]``.
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
from pathlib import Path

from bench.engine_throughput import OUTPUT_TOKENS, SHAPES, engine_kwargs, make_prompts, timed
from services.engine.llm import LLM, greedy
from services.engine.tiny_checkpoint import write_tiny_checkpoint

CONCURRENCIES = (1, 8)


def run(shape_name: str) -> list[tuple[int, str, float, int]]:
    """(concurrency, kv dtype, output tok/s, KV bytes per token) rows."""
    shape = SHAPES[shape_name]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = write_tiny_checkpoint(
            Path(tmp) / "ckpt", arch="qwen3", hidden_size=shape.hidden_size, num_layers=shape.num_layers,
            num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads, intermediate_size=shape.intermediate_size,
            vocab_size=shape.vocab_size, tie_word_embeddings=shape.tie_word_embeddings)
        sampling = greedy(OUTPUT_TOKENS, ignore_eos=True)
        for concurrency in CONCURRENCIES:
            prompts = make_prompts(concurrency * 2, shape.vocab_size, seed=7)
            for kv_dtype in ("auto", "fp8"):
                llm = LLM(path, kv_dtype=kv_dtype, **engine_kwargs(concurrency))  # type: ignore[arg-type]
                llm.generate(prompts[:concurrency], sampling)  # warm-up (and the kernels' first build)
                seconds = timed(lambda llm=llm, p=prompts: llm.generate(p, sampling))
                per_token = llm.core.kv_cache.spec.bytes_per_token
                rows.append((concurrency, kv_dtype, len(prompts) * OUTPUT_TOKENS / seconds, per_token))
                del llm
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    rows = run(args.shape)
    base = {c: tps for c, d, tps, _ in rows if d == "auto"}
    print(f"shape {args.shape}; {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
          f"{OUTPUT_TOKENS} output tokens per request")
    sep = "|" if args.markdown else " "
    print(sep.join(["concurrency", "kv dtype", "tok/s", "vs auto", "KV bytes/token"]))
    if args.markdown:
        print("|".join(["---"] * 5))
    for c, d, tps, per_token in rows:
        print(sep.join([str(c), d, f"{tps:.0f}", f"{tps / base[c]:.2f}x", str(per_token)]))


if __name__ == "__main__":
    main()
