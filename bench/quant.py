"""Quantized weights on the CPU: dequantised once at load vs per product, memory and decode tok/s (issue #27).

One random-weight Qwen3 checkpoint (``--shape``: the "100m" shape of bench/engine_throughput.py by default,
hidden 1024, 8 layers, intermediate 2048, vocab 32000 tied; ``--shape tiny`` hidden 256, 4 layers) is
written once dense and then in each format's exact on-disk layout (tests/unit/quant_checkpoints.py, the
quantizers the tests use). For every (format, mode): weight bytes the model holds (``CausalLM.weight_bytes``:
parameters plus packed tensors), the process's resident-set growth while loading (``/proc/self/statm``; noisy,
the allocator keeps freed pages), and greedy decode tok/s at batch 1 (one 32-token prompt, 16 decode steps,
after a warm-up run; ``--quick``: the 100m widths with 1 layer, an 8-token prompt and 4 decode steps),
through the model runner on a paged
KV cache. The GPU side (the Triton GEMMs and the fused-MoE kernel against bf16) is in bench/gpu_bench.py.

``--shape moe``: a random Qwen3-MoE checkpoint written by transformers (hidden 256, 2 layers, 16 experts of
width 256, top 2, vocab 8192 untied; needs the test extras), every expert quantized: per-product keeps the
experts packed and the torch MoE loop dequantises each active expert for its product. ``--formats a,b``
runs only the formats whose names start with those prefixes.

Usage: ``python -m bench.quant [--quick] [--shape 100m|tiny|moe] [--formats ...] [--tokens N] [--prompt N]``;
prints a markdown table.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from services.engine.model.loader import load_model
from services.engine.tiny_checkpoint import write_tiny_checkpoint
from tests.unit import quant_checkpoints as qc
from tests.unit.engine.model_helpers import make_runner, runner_greedy

SHAPES = {"tiny": {"hidden_size": 256, "num_layers": 4, "num_heads": 8, "num_kv_heads": 4,
                   "intermediate_size": 768, "vocab_size": 8192},
          "100m": {"hidden_size": 1024, "num_layers": 8, "num_heads": 16, "num_kv_heads": 8,
                   "intermediate_size": 2048, "vocab_size": 32000, "tie_word_embeddings": True}}
MOE_SHAPE = {"hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4,
             "head_dim": 32, "intermediate_size": 768, "moe_intermediate_size": 256, "num_experts": 16,
             "num_experts_per_tok": 2, "norm_topk_prob": True, "vocab_size": 8192, "max_position_embeddings": 512,
             "tie_word_embeddings": False}
FP8 = {"num_bits": 8, "type": "float"}
FORMATS: dict[str, tuple[qc.Quantizer, dict[str, object]]] = {
    "fp8 per-channel (CT)": (qc.fp8_channel, qc.ct_config("float-quantized", {**FP8, "strategy": "channel"})),
    "fp8 W8A8 dynamic (CT)": (qc.fp8_channel, qc.ct_config("float-quantized", {**FP8, "strategy": "channel"},
                                                           {**FP8, "strategy": "token", "dynamic": True})),
    "fp8 128x128 block": (qc.fp8_block(128, "weight_scale_inv"), {
        "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}),
    "nvfp4 (CT)": (qc.nvfp4("ct"), qc.ct_config("nvfp4-pack-quantized", {
        "num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16})),
    "awq g128": (qc.awq(128), {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"}),
    "gptq g128 sym": (qc.gptq(128, sym=True), {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True}),
    "w4a16 g128 asym (CT pack)": (qc.ct_pack(4, 128, sym=False), qc.ct_config("pack-quantized", {
        "num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": False})),
    "w8a16 channel (CT pack)": (qc.ct_pack(8, 0, sym=True), qc.ct_config("pack-quantized", {
        "num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True})),
}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _measure(path: Path, mode: str, num_tokens: int, prompt_len: int) -> tuple[int, int, float]:
    gc.collect()
    before = _rss_bytes()
    model, config = load_model(path, quant_dequant=mode)  # type: ignore[arg-type]
    grown = _rss_bytes() - before
    runner = make_runner(model, config, num_blocks=64, block_size=16)
    prompt = list(range(5, 5 + prompt_len))
    runner_greedy(runner, prompt, 2, list(range(1, 8)))  # warm-up
    start = time.perf_counter()
    runner_greedy(runner, prompt, num_tokens, list(range(1, 8)))
    tok_s = num_tokens / (time.perf_counter() - start)
    weights = model.weight_bytes()
    del model, runner
    return weights, grown, tok_s


def _write_moe(path: Path, shape: dict[str, Any]) -> Path:
    """A random-weight Qwen3-MoE checkpoint as transformers saves it (names, config keys)."""
    import transformers

    config = transformers.Qwen3MoeConfig(**shape, initializer_range=0.2, eos_token_id=None, bos_token_id=None)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=[*SHAPES, "moe"], default="100m")
    parser.add_argument("--formats", default="", help="comma-separated name prefixes (default: every format)")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    parser.add_argument("--quick", action="store_true",
                        help="the 100m shape's widths with 1 layer, 4 decode tokens after an 8-token prompt")
    args = parser.parse_args()
    shape: dict[str, object] = dict(MOE_SHAPE if args.shape == "moe" else SHAPES[args.shape])
    if args.quick:
        args.tokens, args.prompt = 4, 8
        shape["num_hidden_layers" if args.shape == "moe" else "num_layers"] = 1
    prefixes = tuple(p.strip() for p in args.formats.split(",") if p.strip())
    formats = {name: f for name, f in FORMATS.items() if not prefixes or name.startswith(prefixes)}
    torch.manual_seed(0)
    started = time.monotonic()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f}; shape {args.shape} {shape}; "
          f"batch 1, {args.prompt}-token prompt, {args.tokens} decode tokens\n")
    print("| format | mode | weights MiB | RSS growth at load MiB | decode tok/s |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if args.shape == "moe":
            dense = _write_moe(root / "dense", shape)
        else:
            dense = write_tiny_checkpoint(root / "dense", "qwen3", **shape)  # type: ignore[arg-type]
        w, grown, tok_s = _measure(dense, "load", args.tokens, args.prompt)
        print(f"| dense fp32 | - | {w / 2**20:.1f} | {grown / 2**20:.1f} | {tok_s:.2f} |", flush=True)
        for i, (name, (quantizer, config)) in enumerate(formats.items()):
            out = root / f"q{i}"
            qc.quantize_checkpoint(dense, out, root / f"twin{i}", quantizer, config)
            for mode in ("load", "per-product"):
                w, grown, tok_s = _measure(out, mode, args.tokens, args.prompt)
                print(f"| {name} | {mode} | {w / 2**20:.1f} | {grown / 2**20:.1f} | {tok_s:.2f} |", flush=True)
    print(f"\nwall time {time.monotonic() - started:.0f} s, load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
