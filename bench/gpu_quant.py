"""GPU cells of issue #27: the quantized Triton GEMMs and the fused-MoE kernel against bf16, correctness and time.

1. **Linear layers** at the Qwen3-0.6B shapes (hidden 1024: qkv 4096x1024, o 1024x2048, gate_up 6144x1024,
   down 1024x3072) and a 7B-class one (Llama-2-7B: qkv 12288x4096, o 4096x4096, gate_up 22016x4096, down
   4096x11008), M = 1 (decode), 16 and 512 (prefill) tokens. Formats: GPTQ INT4 g128, AWQ INT4 g128,
   compressed-tensors W4A16 g128 asym (pack-quantized), NVFP4 (ModelOpt), FP8 per-channel weight-only, FP8
   per-channel W8A8 (per-token activations), FP8 128x128 blocks W8A8 (per-token-group activations). The stored
   tensors are random in each format's exact layout (values do not matter for time); the layer is the engine's
   KernelWeight (what the triton backend runs with ``--quant-dequant per-product``). Per cell: max |diff| of the
   kernel against the torch reference (formats.dequantize to bf16, the input rounded through fp8 for W8A8,
   F.linear), relative to max |reference| (tolerance 2e-2: bf16 rounding of the tile), the median of 20
   CUDA-event times of bf16 F.linear on the dequantised weight, the Triton kernel, and the weight bytes.
2. **Fused MoE** at a Qwen3-30B-A3B layer (128 experts, top 8, hidden 2048, expert width 768), M = 1, 16, 256:
   the torch MoE (a product pair per used expert) vs the fused kernel, dense bf16 and FP8 / INT4 experts.

``--cpu-smoke``: toy sizes on CPU under TRITON_INTERPRET=1 (the same code, to check the script). Called from
bench/gpu_bench.py (phase "quantized GEMMs"; ``--only-quant`` runs just this), or alone:
``python -m bench.gpu_quant [--cpu-smoke]`` prints the markdown tables.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F

GPU_LINEAR_SHAPES = {
    "Qwen3-0.6B": {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)},
    "7B (Llama-2-7B)": {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008)},
}
SMOKE_LINEAR_SHAPES = {"toy": {"a": (40, 256), "b": (64, 128)}}
GPU_MS, SMOKE_MS = (1, 16, 512), (1, 5)
GPU_MOE = {"num_experts": 128, "top_k": 8, "hidden": 2048, "inter": 768, "tokens": (1, 16, 256)}
SMOKE_MOE = {"num_experts": 4, "top_k": 2, "hidden": 256, "inter": 128, "tokens": (1, 7)}
TOLERANCE = 2e-2


def _rand_int32(*shape: int, device: str, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(-2**31, 2**31 - 1, shape, dtype=torch.int64, generator=gen).to(torch.int32).to(device)


Make = Callable[[int, int, str, torch.Generator], tuple[Any, dict[str, torch.Tensor], int | None]]


def _layouts() -> dict[str, Make]:
    """format name → make(n, k, device, gen) → (WeightScheme, stored tensors, activation group)."""
    from services.engine.model.quant.scheme import WeightFormat, WeightScheme

    def scales(*shape: int, gen: torch.Generator, device: str) -> torch.Tensor:
        return (torch.rand(shape, generator=gen) * 0.01 + 0.001).half().to(device)

    def gptq(n: int, k: int, device: str, gen: torch.Generator) -> tuple[Any, dict[str, torch.Tensor], None]:
        s = WeightScheme(format=WeightFormat.GPTQ, bits=4, group_size=128, zero_point_offset=1)
        return s, {"qweight": _rand_int32(k // 8, n, device=device, gen=gen),
                   "qzeros": _rand_int32(k // 128, n // 8, device=device, gen=gen),
                   "scales": scales(k // 128, n, gen=gen, device=device),
                   "g_idx": (torch.arange(k, dtype=torch.int32) // 128).to(device)}, None

    def awq(n: int, k: int, device: str, gen: torch.Generator) -> tuple[Any, dict[str, torch.Tensor], None]:
        s = WeightScheme(format=WeightFormat.AWQ, bits=4, group_size=128, symmetric=False)
        return s, {"qweight": _rand_int32(k, n // 8, device=device, gen=gen),
                   "qzeros": _rand_int32(k // 128, n // 8, device=device, gen=gen),
                   "scales": scales(k // 128, n, gen=gen, device=device)}, None

    def ct_pack(n: int, k: int, device: str, gen: torch.Generator) -> tuple[Any, dict[str, torch.Tensor], None]:
        s = WeightScheme(format=WeightFormat.INT_CT, bits=4, group_size=128, symmetric=False)
        return s, {"weight_packed": _rand_int32(n, k // 8, device=device, gen=gen),
                   "weight_scale": scales(n, k // 128, gen=gen, device=device),
                   "weight_zero_point": _rand_int32(-(-n // 8), k // 128, device=device, gen=gen),
                   "weight_shape": torch.tensor([n, k]).to(device)}, None

    def nvfp4(n: int, k: int, device: str, gen: torch.Generator) -> tuple[Any, dict[str, torch.Tensor], None]:
        s = WeightScheme(format=WeightFormat.NVFP4_MODELOPT, bits=4, group_size=16)
        packed = torch.randint(0, 256, (n, k // 2), dtype=torch.int32, generator=gen).to(torch.uint8)
        local = (torch.rand(n, k // 16, generator=gen) * 2 + 0.5).to(torch.float8_e4m3fn)
        return s, {"weight": packed.to(device), "weight_scale": local.to(device),
                   "weight_scale_2": torch.tensor(0.002).to(device)}, None

    def fp8(act: int | None, block: bool) -> Callable[[int, int, str, torch.Generator], tuple[Any, Any, int | None]]:
        def make(n: int, k: int, device: str, gen: torch.Generator) -> tuple[Any, dict[str, torch.Tensor], int | None]:
            w = (torch.randn(n, k, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn).to(device)
            if block:
                s = WeightScheme(format=WeightFormat.FP8_BLOCK, block=(128, 128), scale_name="weight_scale_inv",
                                 act_dynamic_fp8=act)
                return s, {"weight": w, "weight_scale_inv": (torch.rand(-(-n // 128), k // 128, generator=gen)
                                                             * 1e-4).to(device)}, act
            s = WeightScheme(format=WeightFormat.FP8, act_dynamic_fp8=act)
            return s, {"weight": w, "weight_scale": (torch.rand(n, 1, generator=gen) * 1e-4).to(device)}, act
        return make

    return {"gptq int4 g128": gptq, "awq int4 g128": awq, "w4a16 g128 asym (CT pack)": ct_pack,
            "nvfp4 (ModelOpt)": nvfp4, "fp8 channel weight-only": fp8(None, False),
            "fp8 channel W8A8 token": fp8(0, False), "fp8 block W8A8 group 128": fp8(128, True)}


def _median_ms(fn: Callable[[], Any], device: str, reps: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def run_linear(device: str, dtype: torch.dtype, shapes: dict[str, dict[str, tuple[int, int]]],
               ms: tuple[int, ...], reps: int, left_s: Callable[[], float]) -> tuple[list[str], bool]:
    from services.engine.model.quant.kernel_weight import build_kernel_weight
    from services.engine.model.quant.linear import PackedPart, fp8_quant_dequant

    rows = ["| model | layer (N x K) | format | M | bf16 ms | Triton ms | Triton / bf16 | weight MiB (bf16) "
            "| rel. diff | ok |", "|---|---|---|---|---|---|---|---|---|---|"]
    all_ok = True
    gen = torch.Generator().manual_seed(0)
    for model, layers in shapes.items():
        for layer, (n, k) in layers.items():
            for name, make in _layouts().items():
                if left_s() < 30:
                    rows.append(f"| {model} | {layer} | {name} | - | skipped: deadline | | | | | |")
                    continue
                scheme, tensors, act = make(n, k, device, gen)
                part = PackedPart(scheme=scheme, prefix=layer, tensors=tensors, shape=(n, k))
                dense = part.dequantize().to(dtype)
                kernel = build_kernel_weight((part,), act, device)
                for m in ms:
                    x = torch.randn(m, k, generator=gen).to(dtype).to(device)
                    ref = F.linear(x if act is None else fp8_quant_dequant(x, act), dense)
                    out = kernel.matmul(x)
                    diff = (out.float() - ref.float()).abs().max().item() / max(ref.float().abs().max().item(), 1e-6)
                    ok = diff <= TOLERANCE
                    all_ok &= ok
                    t_dense = _median_ms(lambda: F.linear(x, dense), device, reps)
                    t_kernel = _median_ms(lambda: kernel.matmul(x), device, reps)
                    rows.append(f"| {model} | {layer} ({n} x {k}) | {name} | {m} | {t_dense:.4f} | {t_kernel:.4f} | "
                                f"{t_kernel / t_dense:.2f} | {kernel.num_bytes / 2**20:.1f} "
                                f"({dense.numel() * dense.element_size() / 2**20:.1f}) | {diff:.2g} | "
                                f"{'yes' if ok else '**NO**'} |")
    return rows, all_ok


def run_moe(device: str, dtype: torch.dtype, cfg: dict[str, Any], reps: int,
            left_s: Callable[[], float]) -> tuple[list[str], bool]:
    from services.engine.kernels.fused_moe import ExpertWeights
    from services.engine.model.model import MoE
    from services.engine.model.model_config import MoEConfig
    from services.engine.model.quant.kernel_weight import build_expert_weights
    from services.engine.model.quant.linear import PackedPart

    e, top_k, h, i = cfg["num_experts"], cfg["top_k"], cfg["hidden"], cfg["inter"]
    config = SimpleNamespace(hidden_size=h, moe=MoEConfig(naming="qwen", num_experts=e, top_k=top_k,
                                                          intermediate_size=i, norm_topk_prob=True,
                                                          shared_intermediate_size=0, sparse_layers=(True,)))
    gen = torch.Generator().manual_seed(1)
    rows = [f"| experts (E={e}, top {top_k}, H={h}, I={i}) | M | torch MoE ms | fused ms | fused / torch "
            "| rel. diff | ok |", "|---|---|---|---|---|---|---|"]
    all_ok = True
    layouts = _layouts()
    for kind in ("dense bf16", "fp8 channel weight-only", "gptq int4 g128"):
        if left_s() < 30:
            rows.append(f"| {kind} | - | skipped: deadline | | | | |")
            continue
        moe = MoE(config, dtype, device)  # type: ignore[arg-type]
        with torch.no_grad():
            moe.gate_weight.copy_(torch.randn(e, h, generator=gen).to(dtype))
            if kind == "dense bf16":
                moe.gate_up_weight.copy_((torch.randn(e, 2 * i, h, generator=gen) * h**-0.5).to(dtype))
                moe.down_weight.copy_((torch.randn(e, h, i, generator=gen) * i**-0.5).to(dtype))
            else:
                make = layouts[kind]
                stacks: dict[str, list[tuple[PackedPart, ...]]] = {"gate_up": [], "down": []}
                for ex in range(e):
                    for proj, (n, k) in (("gate_up", (2 * i, h)), ("down", (h, i))):
                        scheme, tensors, _ = make(n, k, device, gen)
                        part = PackedPart(scheme=scheme, prefix=f"e{ex}.{proj}", tensors=tensors, shape=(n, k))
                        getattr(moe, f"{proj}_weight")[ex] = part.dequantize().to(dtype)
                        stacks[proj].append((part,))
                moe.gate_up_experts = build_expert_weights(stacks["gate_up"], device)
                moe.down_experts = build_expert_weights(stacks["down"], device)
        assert moe.gate_up_experts is None or isinstance(moe.gate_up_experts, ExpertWeights)
        for m in cfg["tokens"]:
            x = torch.randn(m, h, generator=gen).to(dtype).to(device)
            ref = moe.forward(x)
            out = moe.forward_triton(x)
            diff = (out.float() - ref.float()).abs().max().item() / max(ref.float().abs().max().item(), 1e-6)
            ok = diff <= TOLERANCE
            all_ok &= ok
            t_ref = _median_ms(lambda: moe.forward(x), device, reps)
            t_fused = _median_ms(lambda: moe.forward_triton(x), device, reps)
            rows.append(f"| {kind} | {m} | {t_ref:.3f} | {t_fused:.3f} | {t_fused / t_ref:.2f} | {diff:.2g} | "
                        f"{'yes' if ok else '**NO**'} |")
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows, all_ok


def run(smoke: bool, left_s: Callable[[], float]) -> tuple[str, bool]:
    """Both sections as markdown, and whether every correctness check passed."""
    device, dtype = ("cpu", torch.float32) if smoke else ("cuda", torch.bfloat16)
    reps = 3 if smoke else 20
    linear, ok_linear = run_linear(device, dtype, SMOKE_LINEAR_SHAPES if smoke else GPU_LINEAR_SHAPES,
                                   SMOKE_MS if smoke else GPU_MS, reps, left_s)
    moe, ok_moe = run_moe(device, dtype, SMOKE_MOE if smoke else GPU_MOE, reps, left_s)
    text = "\n".join(["## Quantized GEMMs vs bf16 (CUDA events, median of 20)", "", *linear, "",
                      "## Fused MoE vs the torch MoE", "", *moe, ""])
    return text, ok_linear and ok_moe


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="toy sizes on CPU (kernels interpreted)")
    parser.add_argument("--budget-s", type=float, default=300.0)
    args = parser.parse_args(argv)
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    elif not torch.cuda.is_available():
        print("gpu_quant: CUDA is not available; use --cpu-smoke to check the script on CPU", file=sys.stderr)
        return 2
    end = time.monotonic() + args.budget_s
    text, ok = run(args.cpu_smoke, lambda: end - time.monotonic())
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
