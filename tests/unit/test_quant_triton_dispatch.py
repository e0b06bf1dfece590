"""The quantized linear layers dispatch to the Triton GEMMs on the triton backend (``--quant-dequant
per-product``), and compute what the torch reference does, on the CPU under TRITON_INTERPRET=1.

Layer level: for each format, a fused layer of three parts (different scales, N not a multiple of the tile,
M odd) in its checkpoint layout (tests/unit/quant_checkpoints.py): the KernelWeight product equals the torch
path's (QuantizedLinear with the packed parts: dequantise, round the input for W8A8, float32 matmul) to 1e-4
(only the summation order, and for W8A8 where the two scales are applied, differ). Model level: a tiny Qwen3
loaded with backend="triton" has every quantized layer on the kernels and gives the torch backend's logits
and greedy tokens. As in test_quant_triton.py, triton must be imported with TRITON_INTERPRET=1: run this
file in its own process.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.triton_interpret import import_interpreted

import_interpreted("services.engine.kernels.quant_gemm")

from services.engine.kernels.backend import select_backend  # noqa: E402
from services.engine.model.loader import load_model  # noqa: E402
from services.engine.model.model import qlinear  # noqa: E402
from services.engine.model.quant.kernel_weight import build_kernel_weight  # noqa: E402
from services.engine.model.quant.linear import PackedPart, QuantizedLinear  # noqa: E402
from services.engine.model.quant.scheme import WeightFormat, WeightScheme  # noqa: E402
from services.engine.tiny_checkpoint import write_tiny_checkpoint  # noqa: E402
from tests.unit import quant_checkpoints as qc  # noqa: E402
from tests.unit.engine.model_helpers import PROMPT, make_runner, reversed_blocks, runner_greedy  # noqa: E402

M, K = 5, 64
PART_ROWS = (40, 24, 24)  # fused q/k/v-like: 88 outputs, not a multiple of the 64-wide tile

LAYOUTS: dict[str, tuple[qc.Quantizer, WeightScheme, int | None]] = {
    "fp8-tensor": (qc.fp8_tensor, WeightScheme(format=WeightFormat.FP8), None),
    "fp8-channel": (qc.fp8_channel, WeightScheme(format=WeightFormat.FP8), None),
    "fp8-channel-w8a8-token": (qc.fp8_channel, WeightScheme(format=WeightFormat.FP8, act_dynamic_fp8=0), 0),
    "fp8-block": (qc.fp8_block(32, "weight_scale_inv"), WeightScheme(
        format=WeightFormat.FP8_BLOCK, block=(32, 32), scale_name="weight_scale_inv"), None),
    "fp8-block-w8a8-group": (qc.fp8_block(32, "weight_scale_inv"), WeightScheme(
        format=WeightFormat.FP8_BLOCK, block=(32, 32), scale_name="weight_scale_inv", act_dynamic_fp8=32), 32),
    "nvfp4-ct": (qc.nvfp4("ct"), WeightScheme(format=WeightFormat.NVFP4_CT, bits=4, group_size=16), None),
    "nvfp4-modelopt": (qc.nvfp4("modelopt"), WeightScheme(format=WeightFormat.NVFP4_MODELOPT, bits=4,
                                                          group_size=16), None),
    "awq": (qc.awq(32), WeightScheme(format=WeightFormat.AWQ, bits=4, group_size=32, symmetric=False), None),
    "gptq-sym": (qc.gptq(32, sym=True), WeightScheme(format=WeightFormat.GPTQ, bits=4, group_size=32,
                                                     zero_point_offset=1), None),
    "gptq-asym": (qc.gptq(32, sym=False), WeightScheme(format=WeightFormat.GPTQ, bits=4, group_size=32,
                                                       symmetric=False, zero_point_offset=1), None),
    "ct-pack-w4-group-asym": (qc.ct_pack(4, 32, sym=False), WeightScheme(
        format=WeightFormat.INT_CT, bits=4, group_size=32, symmetric=False), None),
    "ct-pack-w8-channel-sym": (qc.ct_pack(8, 0, sym=True), WeightScheme(
        format=WeightFormat.INT_CT, bits=8, group_size=0, symmetric=True), None),
}


@pytest.fixture(autouse=True)
def _interpreting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _parts(name: str, quantizers: list[qc.Quantizer] | None = None) -> tuple[tuple[PackedPart, ...], int | None]:
    quantizer, scheme, act_group = LAYOUTS[name]
    gen = torch.Generator().manual_seed(3)
    parts = []
    for i, rows in enumerate(PART_ROWS):
        w = torch.randn(rows, K, generator=gen) * K**-0.5 * (1 + i)  # parts' scales differ
        stored, _ = (quantizers[i] if quantizers else quantizer)(w)
        parts.append(PackedPart(scheme=scheme, prefix=f"p{i}", tensors=stored, shape=(rows, K)))
    return tuple(parts), act_group


def _x() -> torch.Tensor:
    return torch.randn(M, K, generator=torch.Generator().manual_seed(4))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_kernel_form_of_a_fused_layer_equals_the_torch_path(name: str) -> None:
    parts, act_group = _parts(name)
    reference = qlinear(_x(), torch.empty(0, 0), None, QuantizedLinear(act_group=act_group, parts=parts))
    kernel = build_kernel_weight(parts, act_group, "cpu")
    assert len(kernel.ops) == 1  # the three parts merged into one product
    out = qlinear(_x(), torch.empty(0, 0), None, QuantizedLinear(act_group=act_group, kernel=kernel))
    assert out.shape == (M, sum(PART_ROWS))
    torch.testing.assert_close(out, reference, atol=1e-4, rtol=1e-4)


def test_gptq_act_order_parts_with_different_g_idx_run_as_separate_products() -> None:
    quantizers = [qc.gptq(32, sym=True, desc_act=True, seed=s) for s in range(3)]
    parts, _ = _parts("gptq-sym", quantizers)
    parts = tuple(PackedPart(scheme=WeightScheme(format=WeightFormat.GPTQ, bits=4, group_size=32,
                                                 zero_point_offset=1), prefix=p.prefix, tensors=p.tensors,
                             shape=p.shape) for p in parts)
    reference = qlinear(_x(), torch.empty(0, 0), None, QuantizedLinear(parts=parts))
    kernel = build_kernel_weight(parts, None, "cpu")
    assert len(kernel.ops) == 3
    torch.testing.assert_close(kernel.matmul(_x()), reference, atol=1e-4, rtol=1e-4)


def test_a_width_no_tile_divides_is_refused_by_name() -> None:
    w = torch.randn(16, 40)
    stored, _ = qc.fp8_channel(w)
    part = PackedPart(scheme=WeightScheme(format=WeightFormat.FP8), prefix="model.layers.0.mlp.down_proj",
                      tensors=stored, shape=(16, 40))
    with pytest.raises(ValueError, match="K=40"):
        build_kernel_weight((part,), None, "cpu")


@pytest.mark.parametrize("name", ["gptq-desc-act", "ct-nvfp4", "w8a8-channel"])
def test_a_model_on_the_triton_backend_runs_its_quantized_layers_on_the_kernels(tmp_path: Path, name: str) -> None:
    formats = {
        "gptq-desc-act": (qc.gptq(32, sym=True, desc_act=True), {
            "quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": True}),
        "ct-nvfp4": (qc.nvfp4("ct"), qc.ct_config("nvfp4-pack-quantized", {
            "num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16})),
        "w8a8-channel": (qc.fp8_channel, qc.ct_config(
            "float-quantized", {"num_bits": 8, "type": "float", "strategy": "channel"},
            {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True})),
    }
    quantizer, config = formats[name]
    dense = write_tiny_checkpoint(tmp_path / "dense", "qwen3", hidden_size=64, intermediate_size=128,
                                  num_heads=4, num_kv_heads=2, vocab_size=512, num_layers=2)
    quant = tmp_path / "quant"
    qc.quantize_checkpoint(dense, quant, tmp_path / "twin", quantizer, config)
    backend = select_backend("cpu", "triton", env={"TRITON_INTERPRET": "1"})

    def greedy(model_backend: str) -> tuple[list[int], torch.Tensor, torch.nn.Module]:
        model, cfg = load_model(quant, backend=model_backend, quant_dequant="per-product")  # type: ignore[arg-type]
        tokens, logits = runner_greedy(make_runner(model, cfg), PROMPT, 4, reversed_blocks(8))
        return tokens, logits, model

    ref_tokens, ref_logits, _ = greedy("torch")
    tokens, logits, model = greedy(backend)
    for layer in model.layers:  # type: ignore[attr-defined]
        for q in (layer.self_attn.qkv_quant, layer.self_attn.o_quant, layer.mlp.gate_up_quant, layer.mlp.down_quant):
            assert q is not None and q.kernel is not None and q.parts is None
    torch.testing.assert_close(logits, ref_logits, atol=1e-3, rtol=1e-3)
    assert tokens == ref_tokens
