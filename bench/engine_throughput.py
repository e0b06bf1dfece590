"""Engine vs transformers output throughput on random-weight checkpoints (issue #3, performance).

One process, one run: for each shape, write a random-weight Qwen3 checkpoint, then time
* transformers ``generate`` sequentially (batch 1) and with left-padded batches of 8 and 32,
* our engine (``LLM.generate``) with 1, 8 and 32 concurrent requests,
on the same prompts (token id lists, lengths uniform in 64..256, seeded), 128 greedy output tokens each,
EOS ignored, so every configuration produces exactly ``num_prompts * 128`` tokens. Throughput is output
tokens / wall seconds of the whole call (prefill included). A warm-up call precedes each timed one.

Then the prefix-cache experiment: requests that share a 200-token prefix (distinct 32-token suffixes),
one output token each, so the wall time is the prefill time; prefix caching on vs off. The prefix is
warmed by one untimed request first (a system prompt already in the cache), so "on" measures the
steady state a served system prompt sees.

Usage: ``python -m bench.engine_throughput [--shapes tiny,100m] [--num-prompts N] [--quick] [--markdown]``.
The 100M shape's sequential transformers run is slow (~7 s a prompt), so batch-1 runs use
``--num-sequential-prompts`` (default 16 tiny, 4 100m) of the same prompts; the output says so.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import random
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from services.engine.llm import LLM, greedy
from services.engine.tiny_checkpoint import write_tiny_checkpoint

OUTPUT_TOKENS = 128
CONCURRENCIES = (1, 8, 32)
PREFIX_TOKENS = 200
SUFFIX_TOKENS = 32
FIRST_ID = 3  # ids 0-2 are the tiny tokenizer's special tokens
PAD_ID = 0


@dataclass(frozen=True)
class Shape:
    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    num_prompts: int  # prompts for batched / concurrent runs
    num_sequential_prompts: int  # prompts for batch-1 runs (a prefix of the same list)


SHAPES = {
    # 4.7M params (2.1M of them the untied embeddings).
    "tiny": Shape("tiny", 256, 4, 8, 4, 768, 8192, False, 64, 16),
    # 108M params: 8 layers x 9.4M + 32.8M tied embeddings.
    "100m": Shape("100m", 1024, 8, 16, 8, 2048, 32000, True, 32, 4),
}


@dataclass
class Row:
    shape: str
    system: str
    concurrency: int
    num_prompts: int
    seconds: float

    @property
    def tok_per_s(self) -> float:
        return self.num_prompts * OUTPUT_TOKENS / self.seconds


def make_prompts(num: int, vocab_size: int, seed: int, lo: int = 64, hi: int = 256) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(FIRST_ID, vocab_size) for _ in range(rng.randint(lo, hi))] for _ in range(num)]


def timed(fn: Callable[[], object]) -> float:
    gc.collect()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# ------------------------------------------------------------------------------------------ transformers


def hf_generate(model, prompts: Sequence[Sequence[int]], batch_size: int) -> list[list[int]]:  # type: ignore[no-untyped-def]
    outputs: list[list[int]] = []
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i : i + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[PAD_ID] * (width - len(p)) + list(p) for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=OUTPUT_TOKENS,
                min_new_tokens=OUTPUT_TOKENS, pad_token_id=PAD_ID, eos_token_id=None,
            )
        outputs.extend(out[:, width:].tolist())
    return outputs


def bench_transformers(
    shape: Shape, path: Path, prompts: list[list[int]], bar: tqdm
) -> tuple[list[Row], list[list[int]]]:
    """Rows for batch 1, 8, 32, and the batch-1 outputs (the reference the engine's are checked against)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    rows = []
    sequential: list[list[int]] = []
    for batch_size in CONCURRENCIES:
        n = shape.num_sequential_prompts if batch_size == 1 else shape.num_prompts
        subset = prompts[:n]
        hf_generate(model, subset[:batch_size], batch_size)  # warm-up
        outputs: list[list[int]] = []
        seconds = timed(lambda m=model, subset=subset, b=batch_size, o=outputs: o.extend(hf_generate(m, subset, b)))
        if batch_size == 1:
            sequential = outputs
        rows.append(Row(shape.name, "transformers", batch_size, n, seconds))
        bar.update()
    del model
    return rows, sequential


# ------------------------------------------------------------------------------------------------ engine


def engine_kwargs(concurrency: int, **extra: object) -> dict[str, object]:
    return {
        "kv_capacity_tokens": concurrency * (256 + OUTPUT_TOKENS + 32) + 1024,
        "max_concurrency": concurrency,
        "max_pending_requests": 256,
        "max_num_batched_tokens": 512,
        **extra,
    }


def bench_engine(
    shape: Shape, path: Path, prompts: list[list[int]], bar: tqdm
) -> tuple[list[Row], list[list[int]]]:
    """Rows for concurrency 1, 8, 32, and the concurrency-1 outputs."""
    rows = []
    sampling = greedy(OUTPUT_TOKENS, ignore_eos=True)
    sequential: list[list[int]] = []
    for concurrency in CONCURRENCIES:
        n = shape.num_sequential_prompts if concurrency == 1 else shape.num_prompts
        subset = prompts[:n]
        llm = LLM(path, **engine_kwargs(concurrency))  # type: ignore[arg-type]
        llm.generate(subset[:concurrency], sampling)  # warm-up
        outputs: list = []
        seconds = timed(lambda llm=llm, subset=subset, o=outputs: o.extend(llm.generate(subset, sampling)))
        if concurrency == 1:
            sequential = [list(c.token_ids) for c in outputs]
        rows.append(Row(shape.name, "engine", concurrency, n, seconds))
        bar.update()
        del llm
    return rows, sequential


def bench_prefix_cache(shape: Shape, path: Path, num_requests: int, bar: tqdm) -> dict[str, float]:
    """Prefill wall seconds of ``num_requests`` prompts sharing a 200-token prefix, cache on vs off."""
    rng = random.Random(1234)
    prefix = [rng.randrange(FIRST_ID, shape.vocab_size) for _ in range(PREFIX_TOKENS)]
    prompts = [prefix + [rng.randrange(FIRST_ID, shape.vocab_size) for _ in range(SUFFIX_TOKENS)]
               for _ in range(num_requests + 1)]
    sampling = greedy(1, ignore_eos=True)
    result = {}
    for enabled in (False, True):
        llm = LLM(path, **engine_kwargs(num_requests, enable_prefix_caching=enabled))  # type: ignore[arg-type]
        llm.generate(prompts[:1], sampling)  # warm-up, and (when enabled) caches the shared prefix
        completions: list = []
        result["on" if enabled else "off"] = timed(lambda llm=llm: completions.extend(
            llm.generate(prompts[1:], sampling)))
        result[f"cached_tokens_{'on' if enabled else 'off'}"] = sum(c.num_cached_tokens for c in completions)
        bar.update()
        del llm
    return result


# ------------------------------------------------------------------------------------------------ report


def machine_line() -> str:
    model_name = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model_name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem_gib = float("nan")
    return (f"{model_name}, {os.cpu_count()} cores, {mem_gib:.0f} GiB RAM, torch {torch.__version__} "
            f"({torch.get_num_threads()} threads)")


def render(rows: list[Row], prefix: dict[str, dict[str, float]], markdown: bool) -> str:
    lines = []
    if markdown:
        lines += ["| shape | concurrency | prompts (tf / engine) | transformers tok/s | engine tok/s | ratio |",
                  "|---|---|---|---|---|---|"]
    else:
        lines += [f"{'shape':6} {'conc':>4} {'prompts':>8} {'transformers':>13} {'engine':>9} {'ratio':>6}"]
    for shape in dict.fromkeys(r.shape for r in rows):
        tf = {r.concurrency: r for r in rows if r.shape == shape and r.system == "transformers"}
        en = {r.concurrency: r for r in rows if r.shape == shape and r.system == "engine"}
        for c in CONCURRENCIES:
            t, e = tf.get(c), en.get(c)
            t_s = f"{t.tok_per_s:.0f}" if t else "-"
            e_s = f"{e.tok_per_s:.0f}" if e else "-"
            ratio = f"{e.tok_per_s / t.tok_per_s:.2f}x" if t and e else "-"
            n = f"{t.num_prompts if t else '-'}/{e.num_prompts if e else '-'}"
            if markdown:
                lines.append(f"| {shape} | {c} | {n} | {t_s} | {e_s} | {ratio} |")
            else:
                lines.append(f"{shape:6} {c:>4} {n:>8} {t_s:>13} {e_s:>9} {ratio:>6}")
        if 1 in tf:
            vs_seq = ", ".join(f"c={c}: {en[c].tok_per_s / tf[1].tok_per_s:.2f}x" for c in CONCURRENCIES if c in en)
            lines.append(("" if not markdown else "\n") + f"{shape}: engine vs transformers sequential: {vs_seq}"
                         + ("\n" if markdown else ""))
    for shape, p in prefix.items():
        lines.append(
            f"{shape}: prefix cache, {p['num_requests']:.0f} requests x ({PREFIX_TOKENS} shared + {SUFFIX_TOKENS} "
            f"own) tokens, prefill: off {p['off'] * 1000:.0f} ms, on {p['on'] * 1000:.0f} ms "
            f"({p['off'] / p['on']:.2f}x faster; cached tokens {p['cached_tokens_on']:.0f})")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="tiny,100m", help="comma-separated: " + ",".join(SHAPES))
    parser.add_argument("--num-prompts", type=int, help="prompts for batched runs (default per shape)")
    parser.add_argument("--num-sequential-prompts", type=int, help="prompts for batch-1 runs (default per shape)")
    parser.add_argument("--prefix-requests", type=int, default=16, help="requests in the prefix-cache experiment")
    parser.add_argument("--skip-transformers", action="store_true", help="engine only (quick iteration)")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny shape, few prompts")
    parser.add_argument("--markdown", action="store_true", help="print the table as markdown for docs/")
    args = parser.parse_args(argv)

    names = ["tiny"] if args.quick else [s for s in args.shapes.split(",") if s]
    for name in names:
        if name not in SHAPES:
            parser.error(f"unknown shape {name!r}; choose from {', '.join(SHAPES)}")
    rows: list[Row] = []
    prefix: dict[str, dict[str, float]] = {}
    matches: dict[str, int] = {}
    systems = 1 if args.skip_transformers else 2
    with tempfile.TemporaryDirectory() as tmp, tqdm(total=len(names) * (3 * systems + 2), unit="run") as bar:
        for name in names:
            shape = SHAPES[name]
            if args.quick:
                shape = Shape(**{**shape.__dict__, "num_prompts": 32, "num_sequential_prompts": 4})
            if args.num_prompts:
                shape = Shape(**{**shape.__dict__, "num_prompts": args.num_prompts})
            if args.num_sequential_prompts:
                shape = Shape(**{**shape.__dict__, "num_sequential_prompts": args.num_sequential_prompts})
            path = write_tiny_checkpoint(
                Path(tmp) / name, "qwen3", hidden_size=shape.hidden_size, num_layers=shape.num_layers,
                num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads,
                intermediate_size=shape.intermediate_size, vocab_size=shape.vocab_size,
                tie_word_embeddings=shape.tie_word_embeddings,
            )
            prompts = make_prompts(max(shape.num_prompts, shape.num_sequential_prompts), shape.vocab_size, seed=0)
            bar.set_description(f"{name} engine")
            engine_rows, engine_outputs = bench_engine(shape, path, prompts, bar)
            rows += engine_rows
            bar.set_description(f"{name} prefix cache")
            p = bench_prefix_cache(shape, path, args.prefix_requests, bar)
            prefix[name] = {**p, "num_requests": args.prefix_requests}
            if not args.skip_transformers:
                bar.set_description(f"{name} transformers")
                tf_rows, tf_outputs = bench_transformers(shape, path, prompts, bar)
                rows += tf_rows
                matches[name] = sum(a == b for a, b in zip(engine_outputs, tf_outputs, strict=True))
                matches[name + "/total"] = len(tf_outputs)
    print()
    print(f"machine: {machine_line()}")
    print(f"{OUTPUT_TOKENS} greedy output tokens per prompt, prompt lengths uniform in 64..256; batch-1 rows use "
          f"the first N prompts of the same list (prompts column: transformers/engine)")
    print(render(rows, prefix, args.markdown))
    for name in names:
        if name in matches:
            print(f"{name}: greedy outputs identical to transformers' (batch 1): "
                  f"{matches[name]}/{matches[name + '/total']} prompts x {OUTPUT_TOKENS} tokens")


if __name__ == "__main__":
    main()
