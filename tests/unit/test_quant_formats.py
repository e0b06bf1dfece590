"""Quantized checkpoints load from the exact layout each exporter writes, and compute what they decode to.

For every format: a tiny random Qwen3 checkpoint is quantized by tests/unit/quant_checkpoints.py into that
format's files (config.json ``quantization_config``, tensor names, dtypes, packing) and into a float32 twin
holding the decoded weights. Tolerance: weight-only formats dequantise to the twin's weights up to float32
rounding of the scale products (|Δ| <= 1e-6 relative), so their logits agree to 1e-4 absolute and greedy
text is identical. W8A8 also rounds every activation through fp8 e4m3 (3 mantissa bits: relative error up
to 2^-4 per element), so its logits are held to 5 % of the logit range and to differ from weight-only.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.engine.model.loader import load_model
from services.engine.model.quant.linear import fp8_quant_dequant
from services.engine.tiny_checkpoint import write_tiny_checkpoint
from tests.unit import quant_checkpoints as qc
from tests.unit.engine.model_helpers import PROMPT, make_runner, reversed_blocks, runner_greedy

NUM_TOKENS = 8
FP8 = {"num_bits": 8, "type": "float"}

FORMATS: dict[str, tuple[qc.Quantizer, dict[str, object] | None, dict[str, object] | None]] = {
    "ct-fp8-tensor": (qc.fp8_tensor, qc.ct_config("float-quantized", {**FP8, "strategy": "tensor"}), None),
    "ct-fp8-channel": (qc.fp8_channel, qc.ct_config("float-quantized", {**FP8, "strategy": "channel"}), None),
    "ct-fp8-block": (qc.fp8_block(128, "weight_scale"), qc.ct_config(
        "float-quantized", {**FP8, "strategy": "block", "block_structure": [128, 128]}), None),
    "ct-nvfp4": (qc.nvfp4("ct"), qc.ct_config("nvfp4-pack-quantized", {
        "num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}, {
        "num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "dynamic": "local"}), None),
    "modelopt-nvfp4-config-json": (qc.nvfp4("modelopt"), {
        "quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "kv_cache_quant_algo": None,
        "exclude_modules": ["lm_head"], "producer": {"name": "modelopt", "version": "0.29.0"}}, None),
    "modelopt-nvfp4-hf-quant-config": (qc.nvfp4("modelopt"), None, {
        "producer": {"name": "modelopt", "version": "0.29.0"},
        "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                         "exclude_modules": ["lm_head"]}}),
    "awq-gemm": (qc.awq(32), {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
                              "version": "gemm", "modules_to_not_convert": None}, None),
    "gptq-sym": (qc.gptq(32, sym=True), {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False,
                                         "sym": True, "damp_percent": 0.01, "true_sequential": True}, None),
    "gptq-asym": (qc.gptq(32, sym=False), {"quant_method": "gptq", "bits": 4, "group_size": 32,
                                           "desc_act": False, "sym": False}, None),
    "gptq-desc-act": (qc.gptq(32, sym=True, desc_act=True), {"quant_method": "gptq", "bits": 4, "group_size": 32,
                                                             "desc_act": True, "sym": True}, None),
    "ct-w4a16-group-sym": (qc.ct_pack(4, 32, sym=True), qc.ct_config("pack-quantized", {
        "num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": True}), None),
    "ct-w4a16-group-asym": (qc.ct_pack(4, 32, sym=False), qc.ct_config("pack-quantized", {
        "num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": False}), None),
    "ct-w4a16-actorder-group": (qc.ct_pack(4, 32, sym=True, actorder=True), qc.ct_config("pack-quantized", {
        "num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "actorder": "group"}), None),
    "ct-w8a16-channel-asym": (qc.ct_pack(8, 0, sym=False), qc.ct_config("pack-quantized", {
        "num_bits": 8, "type": "int", "strategy": "channel", "symmetric": False}), None),
}


def _checkpoints(tmp_path: Path, name: str, **sizes: int) -> tuple[Path, Path]:
    quantizer, config, hf_quant = FORMATS[name]
    dense = write_tiny_checkpoint(tmp_path / "dense", "qwen3", hidden_size=128, intermediate_size=256,
                                  num_heads=4, num_kv_heads=2, vocab_size=512, **sizes)
    out, twin = tmp_path / "quant", tmp_path / "twin"
    qc.quantize_checkpoint(dense, out, twin, quantizer, config, hf_quant_config=hf_quant)
    return out, twin


def _teacher_forced(path: Path, forced: list[int] | None, **load: object) -> tuple[list[int], torch.Tensor]:
    model, config = load_model(path, **load)  # type: ignore[arg-type]
    runner = make_runner(model, config)
    return runner_greedy(runner, PROMPT, NUM_TOKENS, reversed_blocks(8), forced=forced)


@pytest.mark.parametrize("mode", ["load", "per-product"])
@pytest.mark.parametrize("name", list(FORMATS))
def test_each_format_computes_what_its_weights_decode_to(tmp_path: Path, name: str, mode: str) -> None:
    quant, twin = _checkpoints(tmp_path, name)
    ref_tokens, ref_logits = _teacher_forced(twin, None)
    tokens, logits = _teacher_forced(quant, ref_tokens, quant_dequant=mode)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
    assert tokens == ref_tokens
    assert len(set(ref_tokens)) > 1  # a fixture that repeats one token could hide a broken layer


def test_the_transformers_fp8_block_layout_reads_weight_scale_inv(tmp_path: Path) -> None:
    dense = write_tiny_checkpoint(tmp_path / "dense", "qwen3", hidden_size=128, intermediate_size=384,
                                  num_heads=4, num_kv_heads=2)
    out, twin = tmp_path / "quant", tmp_path / "twin"
    config = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}
    qc.quantize_checkpoint(dense, out, twin, qc.fp8_block(128, "weight_scale_inv"), config)
    ref_tokens, ref_logits = _teacher_forced(twin, None)
    # activation_scheme dynamic: inputs rounded through fp8 per token and 128 columns (DeepSeek-V3's act_quant)
    _, logits = _teacher_forced(out, ref_tokens)
    span = float(ref_logits.max() - ref_logits.min())
    assert float((logits - ref_logits).abs().max()) < 0.05 * span
    assert not torch.allclose(logits, ref_logits, atol=1e-4, rtol=1e-4)  # the activation rounding happened


def test_w8a8_dynamic_per_token_activations_are_rounded_through_fp8(tmp_path: Path) -> None:
    dense = write_tiny_checkpoint(tmp_path / "dense", "qwen3", hidden_size=128, intermediate_size=256)
    config = qc.ct_config("float-quantized", {**FP8, "strategy": "channel"},
                          {**FP8, "strategy": "token", "dynamic": True, "symmetric": True})
    qc.quantize_checkpoint(dense, tmp_path / "w8a8", tmp_path / "twin", qc.fp8_channel, config)
    ref_tokens, ref_logits = _teacher_forced(tmp_path / "twin", None)
    for mode in ("load", "per-product"):
        _, logits = _teacher_forced(tmp_path / "w8a8", ref_tokens, quant_dequant=mode)
        span = float(ref_logits.max() - ref_logits.min())
        assert float((logits - ref_logits).abs().max()) < 0.05 * span
        assert not torch.allclose(logits, ref_logits, atol=1e-4, rtol=1e-4)


def test_fp8_activation_rounding_uses_one_amax_over_448_scale_per_token() -> None:
    x = torch.tensor([[1.0, -2.0, 0.3, 4.0], [0.0, 0.0, 0.0, 0.0], [448.0, 1.0, -1.0, 0.5]])
    out = fp8_quant_dequant(x, 0)
    # row 0: scale 4 / 448; 0.3 / scale = 33.6 → e4m3 rounds to 32 (step 2 in [32, 64)) → 32 * 4 / 448
    assert out[0].tolist() == pytest.approx([1.0, -2.0, 32 * 4 / 448, 4.0])
    assert out[1].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert out[2].tolist() == pytest.approx([448.0, 1.0, -1.0, 0.5])
    grouped = fp8_quant_dequant(x, 2)  # [1, -2] and [0.3, 4] scaled separately: 0.3 / (4/448) again
    assert grouped[0].tolist() == pytest.approx([1.0, -2.0, 32 * 4 / 448, 4.0])


def test_per_product_keeps_the_packed_bytes_and_not_the_dense_weights(tmp_path: Path) -> None:
    quant, _ = _checkpoints(tmp_path, "awq-gemm")
    dense_model, _ = load_model(quant, quant_dequant="load")
    packed_model, _ = load_model(quant, quant_dequant="per-product")

    def linear_bytes(model: torch.nn.Module) -> int:
        return sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                   if n.endswith(("qkv_weight", "o_weight", "gate_up_weight", "down_weight")))

    layers = packed_model.layers
    packed_bytes = sum(part.num_bytes for layer in layers for q in (
        layer.self_attn.qkv_quant, layer.self_attn.o_quant, layer.mlp.gate_up_quant, layer.mlp.down_quant)
        if q is not None and q.parts is not None for part in q.parts)
    assert linear_bytes(packed_model) == 0
    # int4 + one fp16 scale and one int4 zero per 32 weights: 4 + 16/32 + 4/32 bits vs 32 bits per weight
    assert packed_bytes * 32 / (4 + 0.5 + 0.125) == pytest.approx(linear_bytes(dense_model), rel=1e-6)
