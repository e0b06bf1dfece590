"""GPU benchmark (issue 11, part 4): kernel correctness on the GPU, then engine throughput; one run, <= 8 min.

1. **Correctness** of every Triton kernel (services/engine/kernels) against its torch oracle at realistic
   sizes (Qwen3-0.6B's: 16 query / 8 KV heads, head_dim 128, hidden 1024, intermediate 3072, block 16):
   RMSNorm (plain, per-head on a qkv view, fused with the residual add), RoPE, SiLU-and-mul, the KV write
   (bf16 bytes exact, fp8 bytes exact on arbitrary values: the GPU rounds to nearest-even like torch), and
   TritonPagedAttention vs TorchPagedAttention over prefill / prefix-cached chunk / speculative-verify /
   mixed / decode steps with shuffled block tables, bf16 and fp8 caches. Plus decode-attention kernel
   times (Triton vs the torch path) at 64 sequences.
2. **Throughput** of our engine (EngineCore, the loop LLM.generate runs) on a random-weight
   Qwen3-0.6B-shaped checkpoint (28 layers, vocab 151936, tied embeddings, bf16) written first:
   the standard workload (256 requests, input and output lengths uniform in 100..1024, EOS ignored,
   seeded, all submitted at once), solo decode (1 request) and C=8 (8 concurrent requests), each with the
   torch attention backend and with TritonPagedAttention. Throughput = output tokens / wall seconds of
   the run (prefill included), after a warm-up that compiles the kernels.
3. A markdown table to ``--out`` (and stdout). Exit status 1 if any correctness check failed.

Without CUDA it stops with an error, unless ``--cpu-smoke``: the same code at toy sizes on CPU (kernels
under TRITON_INTERPRET=1, a tiny model, 8 requests, torch backend only), to check the script itself.
A global deadline (``--budget-s``, default 420 s) skips what would not fit and says so in the table;
nothing is estimated or filled in.

4. The quantized GEMMs and the fused-MoE kernel against bf16 (issue #27; bench/gpu_quant.py): correctness and
   time at the Qwen3-0.6B and a 7B-class layer shape. ``--only-quant`` runs just these (about 3 minutes,
   not yet measured on a GPU), ``--skip-quant`` leaves them out.

Usage: ``python -m bench.gpu_bench --out results.md [--cpu-smoke] [--budget-s 420] [--only-quant]`` (or
bench/gpu_bench.sh).
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

FIRST_ID = 3  # ids 0-2 are the tiny tokenizer's special tokens


@dataclass(frozen=True)
class Sizes:
    """Everything that differs between the GPU run and the CPU smoke run."""

    device: str
    dtype: torch.dtype  # activations for the kernel checks
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    block_size: int
    num_tokens: int  # rows for the elementwise checks
    # attention scenarios: name -> [(cached positions before the step, new tokens this step)]
    scenarios: dict[str, list[tuple[int, int]]]
    tiles: dict[str, int]  # TritonPagedAttention tile sizes
    # model
    num_layers: int
    vocab_size: int
    model_dtype: str
    # workload
    num_requests: int
    min_len: int
    max_len: int
    solo_output_tokens: int
    solo_prompt_tokens: int
    max_num_batched_tokens: int
    atol: dict[str, float] = field(default_factory=dict)


def _gpu_sizes(num_requests: int) -> Sizes:
    rng = random.Random(1)
    decode64 = [(rng.randint(1, 4095), 1) for _ in range(64)]
    return Sizes(
        device="cuda", dtype=torch.bfloat16, num_q_heads=16, num_kv_heads=8, head_dim=128, hidden_size=1024,
        intermediate_size=3072, block_size=16, num_tokens=2048,
        scenarios={
            "prefill 4 seqs (1000, 700, 333, 1)": [(0, 1000), (0, 700), (0, 333), (0, 1)],
            "prefix-cached chunk (512 cached + 300)": [(512, 300), (0, 64)],
            "spec verify (8 x 5 rows, ~1k ctx)": [(rng.randint(500, 1500), 5) for _ in range(8)],
            "mixed (chunk + 6 decodes)": [(100, 200)] + [(rng.randint(1, 3000), 1) for _ in range(6)],
            "decode 64 seqs (ctx 1..4096)": decode64,
        },
        tiles={"decode_block_n": 32, "extend_block_m": 64, "extend_block_n": 64},
        num_layers=28, vocab_size=151936, model_dtype="bfloat16",
        num_requests=num_requests, min_len=100, max_len=1024, solo_output_tokens=512, solo_prompt_tokens=128,
        max_num_batched_tokens=8192,
        atol={"elementwise": 1.6e-2, "attention": 2e-2},
    )


def _smoke_sizes() -> Sizes:
    return Sizes(
        device="cpu", dtype=torch.float32, num_q_heads=6, num_kv_heads=2, head_dim=24, hidden_size=48,
        intermediate_size=40, block_size=3, num_tokens=5,
        scenarios={
            "prefill 2 seqs (17, 5)": [(0, 17), (0, 5)],
            "prefix-cached chunk (4 cached + 3)": [(4, 3)],
            "decode 3 seqs": [(18, 1), (6, 1), (1, 1)],
        },
        tiles={"decode_block_n": 16, "extend_block_m": 16, "extend_block_n": 16},
        num_layers=2, vocab_size=512, model_dtype="float32",
        num_requests=8, min_len=10, max_len=40, solo_output_tokens=16, solo_prompt_tokens=8,
        max_num_batched_tokens=256,
        atol={"elementwise": 1e-5, "attention": 1e-5},
    )


class Deadline:
    def __init__(self, budget_s: float) -> None:
        self.end = time.monotonic() + budget_s

    def left_s(self) -> float:
        return self.end - time.monotonic()


@dataclass
class Report:
    header: list[str] = field(default_factory=list)
    checks: list[tuple[str, str, str, str, bool]] = field(default_factory=list)  # kernel, case, diff, tol, ok
    timings: list[tuple[str, str, str]] = field(default_factory=list)  # case, torch ms, triton ms
    runs: list[tuple[str, str, str, str, str, str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    quant: str = ""  # bench/gpu_quant.py's tables (issue #27), when that phase ran

    @property
    def all_ok(self) -> bool:
        return all(ok for *_, ok in self.checks)

    def markdown(self) -> str:
        lines = ["# GPU benchmark (bench/gpu_bench.py)", "", *[f"- {h}" for h in self.header], ""]
        lines += ["## Kernel correctness vs the torch oracle", "",
                  "| kernel | case | max abs diff | tolerance | ok |", "|---|---|---|---|---|"]
        lines += [f"| {k} | {c} | {d} | {t} | {'yes' if ok else '**NO**'} |" for k, c, d, t, ok in self.checks]
        if self.timings:
            lines += ["", "## Attention kernel time (one layer, CUDA events, median of 20)", "",
                      "| case | torch path ms | Triton ms |", "|---|---|---|"]
            lines += [f"| {c} | {a} | {b} |" for c, a, b in self.timings]
        lines += ["", "## Engine throughput", "",
                  "| run | attention backend | requests | concurrency | output tokens | wall s | output tok/s |",
                  "|---|---|---|---|---|---|---|"]
        lines += ["| " + " | ".join(row) + " |" for row in self.runs]
        if self.quant:
            lines += ["", self.quant]
        if self.notes:
            lines += ["", "Notes:", *[f"- {n}" for n in self.notes]]
        return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------- correctness


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


def _check(report: Report, kernel: str, case: str, diff: float, tol: float) -> None:
    report.checks.append((kernel, case, f"{diff:.3g}", f"{tol:.3g}", diff <= tol))


def check_elementwise(sizes: Sizes, report: Report) -> None:
    from services.engine.kernels import reference
    from services.engine.kernels.activation import silu_and_mul
    from services.engine.kernels.rms_norm import fused_add_rms_norm, rms_norm
    from services.engine.kernels.rope import rope_

    dev, dt, t = sizes.device, sizes.dtype, sizes.num_tokens
    gen = torch.Generator(device=dev).manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=dev).to(dt)

    tol = sizes.atol["elementwise"]
    hq, hk, d = sizes.num_q_heads, sizes.num_kv_heads, sizes.head_dim
    x, w = randn(t, sizes.hidden_size), 1 + 0.1 * randn(sizes.hidden_size)
    # Relative tolerance folded in: compare |diff| / max(1, |ref|).
    def rel(got: torch.Tensor, want: torch.Tensor) -> float:
        return ((got.float() - want.float()).abs() / want.float().abs().clamp(min=1.0)).max().item()

    _check(report, "rms_norm", f"[{t}, {sizes.hidden_size}] {dt}", rel(rms_norm(x, w, 1e-6),
           reference.rms_norm(x, w, 1e-6)), tol)
    qkv = randn(t, (hq + 2 * hk) * d)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
    wd = 1 + 0.1 * randn(d)
    _check(report, "rms_norm", f"per head on a qkv view [{t}, {hq}, {d}]",
           rel(rms_norm(q, wd, 1e-6), reference.rms_norm(q, wd, 1e-6)), tol)
    residual = randn(t, sizes.hidden_size)
    want_out, want_sum = reference.fused_add_rms_norm(x, residual.clone(), w, 1e-6)
    out, new_residual = fused_add_rms_norm(x, residual, w, 1e-6)
    _check(report, "fused_add_rms_norm", "normed output", rel(out, want_out), tol)
    _check(report, "fused_add_rms_norm", "residual sum (in place)", rel(new_residual, want_sum), tol)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, d, 2, device=dev).float() / d))
    cos, sin = reference.rope_cos_sin_cache(inv_freq, 40960)
    positions = torch.randint(0, 40960, (t,), generator=gen, device=dev)
    want_q, want_k = reference.rope(q, positions, cos, sin), reference.rope(k, positions, cos, sin)
    rope_(q, k, positions, cos, sin)
    _check(report, "rope", f"q [{t}, {hq}, {d}], theta 1e6, positions < 40960", rel(q, want_q), tol)
    _check(report, "rope", f"k [{t}, {hk}, {d}]", rel(k, want_k), tol)
    gate_up = randn(t, 2 * sizes.intermediate_size)
    _check(report, "silu_and_mul", f"[{t}, {2 * sizes.intermediate_size}]",
           rel(silu_and_mul(gate_up), reference.silu_and_mul(gate_up)), tol)


def _cache(sizes: Sizes, kv_cache_dtype: str, num_blocks: int) -> Any:
    from services.engine.model.kv_cache import KVCache, KVCacheSpec

    spec = KVCacheSpec(num_layers=1, num_kv_heads=sizes.num_kv_heads, head_dim=sizes.head_dim,
                       block_size=sizes.block_size, dtype=sizes.dtype, kv_cache_dtype=kv_cache_dtype)  # type: ignore[arg-type]
    return KVCache(spec, num_blocks, sizes.device, fp8_scale=0.5 if kv_cache_dtype == "fp8" else 1.0)


def check_kv_write(sizes: Sizes, report: Report) -> None:
    from services.engine.kernels.kv_write import write_kv

    gen = torch.Generator(device=sizes.device).manual_seed(1)
    t, hk, d = sizes.num_tokens, sizes.num_kv_heads, sizes.head_dim
    num_blocks = -(-t // sizes.block_size) * 2
    slots = torch.randperm(num_blocks * sizes.block_size, generator=gen, device=sizes.device)[:t]
    for kv_dtype in ("auto", "fp8"):
        k = torch.randn(t, hk, d, generator=gen, device=sizes.device).to(sizes.dtype) * 4
        v = torch.randn(t, hk, d, generator=gen, device=sizes.device).to(sizes.dtype) * 4
        if kv_dtype == "fp8" and sizes.device == "cpu":
            # The interpreter's fp8 cast mis-rounds (see tests/unit/engine/test_triton_kernels.py): on CPU
            # feed values already on the e4m3 grid (x 0.5, the scale); on a GPU arbitrary values.
            k = (k.float() / 0.5).to(torch.float8_e4m3fn).float().mul(0.5).to(sizes.dtype)
            v = (v.float() / 0.5).to(torch.float8_e4m3fn).float().mul(0.5).to(sizes.dtype)
        want, got = _cache(sizes, kv_dtype, num_blocks), _cache(sizes, kv_dtype, num_blocks)
        want.write(0, k, v, slots)
        write_kv(k, v, got.key_caches[0], got.value_caches[0], slots, got.k_scales[:1], got.v_scales[:1])
        mismatched = sum(
            int((a.view(torch.uint8) != b.view(torch.uint8)).sum().item())
            for a, b in ((got.key_caches[0], want.key_caches[0]), (got.value_caches[0], want.value_caches[0]))
        )
        report.checks.append(("write_kv", f"{t} tokens, {kv_dtype} cache: bytes differing", str(mismatched), "0",
                              mismatched == 0))


def _scenario_tables(
    steps: list[tuple[int, int]], block_size: int, gen: torch.Generator
) -> tuple[list[list[int]], int]:
    """Block tables for ``steps`` drawn from one shuffled pool (no sequence contiguous), and the pool size."""
    needs = [-(-(before + new) // block_size) for before, new in steps]
    num_blocks = sum(needs) + 1
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, at = [], 0
    for n in needs:
        tables.append(perm[at : at + n])
        at += n
    return tables, num_blocks


def check_attention(sizes: Sizes, report: Report) -> None:
    from services.engine.model.attention import SeqSpan, TorchPagedAttention, build_attention_metadata
    from services.engine.model.triton_attention import TritonPagedAttention

    gen = torch.Generator().manual_seed(2)
    torch_backend, triton_backend = TorchPagedAttention(), TritonPagedAttention(**sizes.tiles)
    hq, hk, d, dev, dt = sizes.num_q_heads, sizes.num_kv_heads, sizes.head_dim, sizes.device, sizes.dtype

    def rand(*shape: int) -> torch.Tensor:
        out = torch.randn(shape, generator=gen).to(dt)
        return out.to(dev)

    for kv_dtype in ("auto", "fp8"):
        for name, steps in sizes.scenarios.items():
            tables, num_blocks = _scenario_tables(steps, sizes.block_size, gen)
            want_cache, got_cache = _cache(sizes, kv_dtype, num_blocks), _cache(sizes, kv_dtype, num_blocks)
            prior = [SeqSpan(0, before, tables[i]) for i, (before, _) in enumerate(steps) if before > 0]
            if prior:  # the cached prefix, written by torch into both caches
                meta, _ = build_attention_metadata(prior, sizes.block_size, dev)
                kp, vp = rand(meta.num_tokens, hk, d), rand(meta.num_tokens, hk, d)
                if kv_dtype == "fp8" and dev == "cpu":
                    kp, vp = (x.float().div(0.5).to(torch.float8_e4m3fn).float().mul(0.5).to(dt) for x in (kp, vp))
                for cache in (want_cache, got_cache):
                    cache.write(0, kp, vp, meta.slot_mapping)
            spans = [SeqSpan(before, new, tables[i]) for i, (before, new) in enumerate(steps)]
            meta, _ = build_attention_metadata(spans, sizes.block_size, dev)
            q, k, v = rand(meta.num_tokens, hq, d), rand(meta.num_tokens, hk, d), rand(meta.num_tokens, hk, d)
            if kv_dtype == "fp8" and dev == "cpu":
                k, v = (x.float().div(0.5).to(torch.float8_e4m3fn).float().mul(0.5).to(dt) for x in (k, v))
            want = torch_backend.forward(0, q, k, v, meta, want_cache)
            got = triton_backend.forward(0, q, k, v, meta, got_cache)
            _check(report, "attention", f"{name}, {kv_dtype} cache", _max_diff(got, want), sizes.atol["attention"])
            same_cache = all(
                torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8))
                for a, b in ((got_cache.key_caches, want_cache.key_caches),
                             (got_cache.value_caches, want_cache.value_caches))
            )
            report.checks.append(("attention", f"{name}, {kv_dtype} cache: K/V cache bytes equal", str(same_cache),
                                  "True", same_cache))


def time_decode_attention(sizes: Sizes, report: Report) -> None:
    """Decode attention at 64 sequences (one layer: write + attention), torch path vs Triton."""
    from services.engine.model.attention import SeqSpan, TorchPagedAttention, build_attention_metadata
    from services.engine.model.triton_attention import TritonPagedAttention

    gen = torch.Generator().manual_seed(3)
    hq, hk, d, dt = sizes.num_q_heads, sizes.num_kv_heads, sizes.head_dim, sizes.dtype
    for context in (512, 2048, 8192):
        steps = [(context - 1, 1)] * 64
        tables, num_blocks = _scenario_tables(steps, sizes.block_size, gen)
        cache = _cache(sizes, "auto", num_blocks)
        meta, _ = build_attention_metadata([SeqSpan(s, n, tables[i]) for i, (s, n) in enumerate(steps)],
                                           sizes.block_size, sizes.device)
        q = torch.randn(64, hq, d, generator=gen).to(dt).to(sizes.device)
        k = torch.randn(64, hk, d, generator=gen).to(dt).to(sizes.device)
        row = []
        for backend in (TorchPagedAttention(), TritonPagedAttention(**sizes.tiles)):
            def call(backend: Any = backend) -> None:
                backend.forward(0, q, k, k, meta, cache)
            for _ in range(3):
                call()
            times = []
            for _ in range(20):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                call()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            row.append(f"{sorted(times)[len(times) // 2]:.3f}")
        report.timings.append((f"64 seqs x {context} ctx, bf16", row[0], row[1]))


# -------------------------------------------------------------------------------------------- throughput


def write_checkpoint(sizes: Sizes, root: Path) -> Path:
    from services.engine.tiny_checkpoint import write_tiny_checkpoint

    # mtp_layers=1: a random MTP module, drawn after the model's own weights (which it leaves unchanged),
    # so the spec-decoding runs can time --spec mtp (its drafts are essentially never accepted).
    if sizes.device == "cpu":
        return write_tiny_checkpoint(root / "tiny", "qwen3", dtype=sizes.model_dtype, seed=0, mtp_layers=1)
    return write_tiny_checkpoint(
        root / "qwen3-0.6b-shaped", "qwen3", hidden_size=1024, num_layers=28, num_heads=16, num_kv_heads=8,
        head_dim=128, intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True,
        dtype="bfloat16", seed=0, max_position_embeddings=40960, mtp_layers=1,
    )


def standard_workload(sizes: Sizes, seed: int) -> list[tuple[list[int], int]]:
    """(prompt token ids, output tokens) per request: lengths uniform in min_len..max_len, seeded."""
    rng = random.Random(seed)
    out = []
    for _ in range(sizes.num_requests):
        prompt_len, output_len = rng.randint(sizes.min_len, sizes.max_len), rng.randint(sizes.min_len, sizes.max_len)
        out.append(([rng.randrange(FIRST_ID, sizes.vocab_size) for _ in range(prompt_len)], output_len))
    return out


def serve(core: Any, requests: list[tuple[list[int], int]], concurrency: int, deadline: Deadline,
          tag: str, tokens: dict[str, list[int]] | None = None) -> tuple[int, float, bool]:
    """Run ``requests`` through ``core`` with at most ``concurrency`` in flight (LLM.generate's loop, with
    a deadline). Returns (output tokens, wall seconds, finished all); ``tokens`` collects each request's
    output ids by index (``"0"``, ``"1"`` …) when given."""
    from services.engine.core.sampling_params import SamplingParams

    pending = list(reversed(requests))
    active: set[str] = set()
    produced, index = 0, 0
    start = time.monotonic()
    while pending or core.has_unfinished_requests():
        if deadline.left_s() <= 0:
            for rid in sorted(active):
                core.abort(rid, time.monotonic())
            return produced, time.monotonic() - start, False
        while pending and len(active) < concurrency:
            prompt, output_len = pending.pop()
            params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
            rid = f"{tag}-{index}"
            if tokens is not None:
                tokens[rid] = []
            core.add_request(rid, prompt, params, time.monotonic())
            active.add(rid)
            index += 1
        for out in core.step(time.monotonic):
            produced += len(out.token_ids)
            if tokens is not None:
                tokens[out.request_id].extend(out.token_ids)
            if out.finished:
                active.discard(out.request_id)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return produced, time.monotonic() - start, True


def run_throughput(sizes: Sizes, report: Report, deadline: Deadline, seed: int, workdir: Path,
                   backends: list[str]) -> Path:
    """The throughput rows; returns the checkpoint it wrote (the spec-decoding runs reuse it)."""
    from services.engine.config import EngineConfig
    from services.engine.engine_core import EngineCore
    from services.engine.model.attention import TorchPagedAttention

    t0 = time.monotonic()
    path = write_checkpoint(sizes, workdir)
    report.notes.append(f"checkpoint written in {time.monotonic() - t0:.1f} s: {path.name}")
    concurrency = sizes.num_requests
    capacity = concurrency * 2 * sizes.max_len
    t0 = time.monotonic()
    core = EngineCore(EngineConfig(
        model_path=path, device=sizes.device, dtype=sizes.model_dtype, max_concurrency=concurrency,
        max_pending_requests=concurrency, max_context=2 * sizes.max_len, kv_capacity_tokens=capacity,
        max_num_batched_tokens=sizes.max_num_batched_tokens,
    ))
    params_m = sum(p.numel() for p in core.model.parameters()) / 1e6
    report.notes.append(f"engine loaded in {time.monotonic() - t0:.1f} s: {params_m:.1f}M params, "
                        f"KV capacity {core.kv_capacity_tokens} tokens, step budget {sizes.max_num_batched_tokens}")
    rng = random.Random(seed + 1)
    solo_prompt = [rng.randrange(FIRST_ID, sizes.vocab_size) for _ in range(sizes.solo_prompt_tokens)]
    workload = standard_workload(sizes, seed)
    runs: list[tuple[str, list[tuple[list[int], int]], int]] = [
        ("solo decode", [(solo_prompt, sizes.solo_output_tokens)], 1),
        ("batched C=8", [(list(p), sizes.solo_output_tokens) for p, _ in workload[:8]], 8),
        (f"standard workload ({sizes.num_requests} req, in/out U[{sizes.min_len},{sizes.max_len}])", workload,
         concurrency),
    ]

    graphs = core.runner.graphs  # captured at start (CUDA + triton), else None
    report.notes.append(f"CUDA graphs: {core.cuda_graphs}")

    def use(name: str) -> None:
        """"torch" and "triton" decode eagerly; "triton+graphs" replays the captured decode graphs."""
        core.runner.graphs = graphs if name == "triton+graphs" else None
        if name == "torch":
            core.model.attention = TorchPagedAttention()
            return
        from services.engine.model.triton_attention import TritonPagedAttention

        core.model.attention = TritonPagedAttention(**sizes.tiles)

    if "triton+graphs" in backends and graphs is None:
        backends = [b for b in backends if b != "triton+graphs"]
    for name in backends:
        use(name)
        serve(core, [(solo_prompt[:16], 8)] * 2, 2, deadline, f"warmup-{name}")  # compiles kernels
    solo_tokens: dict[str, list[int]] = {}
    for label, requests, conc in runs:
        for name in backends:
            expected = sum(n for _, n in requests)
            row = (label, name, str(len(requests)), str(conc))
            if deadline.left_s() < 20:
                report.runs.append((*row, "-", "-", "not run: time budget"))
                continue
            if name == "triton" and sizes.device == "cpu" and label != "solo decode":
                report.runs.append((*row, "-", "-", "not run: interpreted Triton in --cpu-smoke"))
                continue
            use(name)
            tokens: dict[str, list[int]] = {}
            produced, wall, finished = serve(core, requests, conc, deadline, name, tokens)
            if label == "solo decode":
                solo_tokens[name] = next(iter(tokens.values()))
            rate = f"{produced / wall:.1f}" + ("" if finished else " (partial: deadline hit)")
            report.runs.append((*row, f"{produced}/{expected}", f"{wall:.2f}", rate))
    for first, second in (("torch", "triton"), ("triton", "triton+graphs")):
        if first in solo_tokens and second in solo_tokens:
            a, b = solo_tokens[first], solo_tokens[second]
            same = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            report.notes.append(
                f"solo decode, greedy: {first} and {second} agree on the first {same} of {len(a)} tokens "
                "(information, not a check: in bf16 a near-tie argmax may flip on random weights, and the "
                "graphs use a fixed split count per batch-size bucket)"
            )
    return path


def run_spec_decode(sizes: Sizes, report: Report, deadline: Deadline, seed: int, path: Path) -> None:
    """C=8 on repetitive prompts (a random phrase of up to 48 tokens said 4 times, then a random tail), greedy,
    with speculation off, ``ngram`` and ``mtp`` (K=4): output tok/s and the engine's own acceptance
    counters. Random weights: the figures time the mechanism; ngram finds what the random model repeats,
    the random MTP module's drafts are essentially never accepted. A trained model's rates differ."""
    from services.engine.config import EngineConfig
    from services.engine.engine_core import EngineCore
    from services.engine.spec.spec_decode import SpecConfig

    rng = random.Random(seed + 2)
    phrase_len = min(48, sizes.max_len // 5)  # 4 phrases and a tail stay under max_len
    prompts = []
    for _ in range(8):
        phrase = [rng.randrange(FIRST_ID, sizes.vocab_size) for _ in range(phrase_len)]
        prompts.append(phrase * 4 + [rng.randrange(FIRST_ID, sizes.vocab_size) for _ in range(phrase_len // 3)])
    requests = [(p, sizes.solo_output_tokens) for p in prompts]
    for method in ("none", "ngram", "mtp"):
        row = (f"spec {method}, K=4" if method != "none" else "spec off", "auto", "8", "8")
        if deadline.left_s() < 40:
            report.runs.append((*row, "-", "-", "not run: time budget"))
            continue
        spec = SpecConfig(method=method, num_draft_tokens=4) if method != "none" else SpecConfig()
        core = EngineCore(EngineConfig(
            model_path=path, device=sizes.device, dtype=sizes.model_dtype, max_concurrency=8,
            max_pending_requests=8, max_context=2 * sizes.max_len, kv_capacity_tokens=16 * 2 * sizes.max_len,
            max_num_batched_tokens=sizes.max_num_batched_tokens, spec=spec,
        ))
        serve(core, [(prompts[0][:16], 8)] * 2, 2, deadline, f"warmup-spec-{method}")
        produced, wall, finished = serve(core, requests, 8, deadline, f"spec-{method}")
        rate = f"{produced / wall:.1f}" + ("" if finished else " (partial: deadline hit)")
        if core.spec_counters is not None:
            stats = core.spec_counters.snapshot()
            per_pos = ", ".join(f"{n / stats.num_drafts:.0%}" if stats.num_drafts else "-"
                                for n in stats.num_accepted_tokens_per_pos)
            report.notes.append(
                f"spec {method}: {stats.num_drafts} drafts, {stats.num_draft_tokens} draft tokens, "
                f"{stats.num_accepted_tokens} accepted ({stats.acceptance_rate:.1%}; per position {per_pos})")
        report.runs.append((*row, f"{produced}/{sum(n for _, n in requests)}", f"{wall:.2f}", rate))
        del core
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------- main


def _quant_phase(smoke: bool, report: Report, deadline: Deadline, share: float) -> None:
    """bench/gpu_quant.py's cells, in ``share`` of the time left (the throughput runs need the rest)."""
    from bench import gpu_quant

    end = time.monotonic() + deadline.left_s() * share
    report.quant, ok = gpu_quant.run(smoke, lambda: end - time.monotonic())
    report.checks.append(("quantized GEMMs / fused MoE", "every cell (see its table)", "-", "2e-2 rel.", ok))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results/gpu_bench.md"))
    parser.add_argument("--cpu-smoke", action="store_true", help="toy sizes on CPU (kernels interpreted)")
    parser.add_argument("--budget-s", type=float, default=420.0, help="deadline for the whole run")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--skip-quant", action="store_true", help="skip the quantized GEMM / fused-MoE cells")
    parser.add_argument("--only-quant", action="store_true",
                        help="only the quantized GEMM / fused-MoE cells (bench/gpu_quant.py, issue #27)")
    args = parser.parse_args(argv)
    deadline = Deadline(args.budget_s)

    if args.cpu_smoke:
        # Before triton is imported: @triton.jit reads it at decoration time.
        os.environ["TRITON_INTERPRET"] = "1"
        sizes = _smoke_sizes()
        backends = ["torch", "triton"]  # triton interpreted: slow, but it runs the engine's GPU code path
    else:
        if not torch.cuda.is_available():
            print("gpu_bench: CUDA is not available (torch.cuda.is_available() is False); this benchmark "
                  "does not fall back to CPU. Use --cpu-smoke to check the script on CPU.", file=sys.stderr)
            return 2
        from services.engine.kernels.backend import select_backend

        if select_backend("cuda", env={}) != "triton":
            print("gpu_bench: triton is not importable on this CUDA machine", file=sys.stderr)
            return 2
        sizes = _gpu_sizes(args.num_requests)
        # The GPU path first: if the deadline cuts the standard workload short, its figure is the one kept.
        backends = ["triton+graphs", "triton", "torch"]

    import triton

    report = Report()
    device_name = torch.cuda.get_device_name(0) if sizes.device == "cuda" else platform.processor() or "cpu"
    report.header += [
        f"mode: {'CPU smoke (toy sizes, kernels under TRITON_INTERPRET=1)' if args.cpu_smoke else 'GPU'}",
        f"device: {device_name}; torch {torch.__version__} (CUDA {torch.version.cuda}); triton {triton.__version__}; "
        f"python {platform.python_version()}",
        f"date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
    ]
    phases: list[tuple[str, Callable[[], None]]] = [
        ("elementwise kernels", lambda: check_elementwise(sizes, report)),
        ("kv write", lambda: check_kv_write(sizes, report)),
        ("attention", lambda: check_attention(sizes, report)),
    ]
    if sizes.device == "cuda":
        phases.append(("attention timing", lambda: time_decode_attention(sizes, report)))
    if args.only_quant:
        phases, args.skip_throughput = [], True
    if not args.skip_quant:
        phases.append(("quantized GEMMs", lambda: _quant_phase(args.cpu_smoke, report, deadline,
                                                                    1.0 if args.only_quant else 0.5)))
    for name, phase in phases:
        t0 = time.monotonic()
        phase()
        report.notes.append(f"{name}: {time.monotonic() - t0:.1f} s")
        print(f"gpu_bench: {name} done ({time.monotonic() - t0:.1f} s)", file=sys.stderr, flush=True)
    if not args.skip_throughput:
        with tempfile.TemporaryDirectory(prefix="gpu_bench_") as tmp:
            path = run_throughput(sizes, report, deadline, args.seed, Path(tmp), backends)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # the throughput engine's KV cache is garbage by now
            run_spec_decode(sizes, report, deadline, args.seed, path)
    text = report.markdown()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    if not report.all_ok:
        print("gpu_bench: some correctness checks FAILED (see the table)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
