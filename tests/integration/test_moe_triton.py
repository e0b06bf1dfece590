"""MoE models on the triton backend (CPU, TRITON_INTERPRET=1): the routed experts run in the fused-MoE kernel,
dense or, with ``--quant-dequant per-product``, packed and dequantised in the tile; the logits and greedy
tokens equal the torch backend's on the same checkpoint (experts dequantised at load, or kept packed and
dequantised per expert product by the torch MoE loop). Checkpoints are tiny
random Qwen2-MoE (shared expert) and Mixtral written by transformers (tests/integration/test_moe_equivalence.py),
quantized into AWQ and compressed-tensors FP8 by tests/unit/quant_checkpoints.py. Tolerance 1e-3: float32,
summation order only. Run this file in its own process (triton under the interpreter).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.triton_interpret import import_interpreted

import_interpreted("services.engine.kernels.fused_moe", "services.engine.model.triton_attention")

from services.engine.model.loader import load_model  # noqa: E402
from services.engine.model.model import MoE  # noqa: E402
from tests.integration.test_moe_equivalence import _prompts, _variants, _write  # noqa: E402
from tests.unit import quant_checkpoints as qc  # noqa: E402
from tests.unit.engine.model_helpers import make_runner, reversed_blocks, runner_greedy  # noqa: E402

FP8 = {"num_bits": 8, "type": "float"}
QUANT = {
    "awq": (qc.awq(16), {"quant_method": "awq", "bits": 4, "group_size": 16, "zero_point": True, "version": "gemm"}),
    "fp8-channel": (qc.fp8_channel, qc.ct_config("float-quantized", {**FP8, "strategy": "channel"})),
}


@pytest.fixture(autouse=True)
def _interpreting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _run(path: Path, prompt: list[int], forced: list[int] | None, **load: object
         ) -> tuple[list[int], torch.Tensor, torch.nn.Module]:
    model, cfg = load_model(path, **load)  # type: ignore[arg-type]
    tokens, logits = runner_greedy(make_runner(model, cfg), prompt, 5, reversed_blocks(12), forced=forced)
    return tokens, logits, model


@pytest.mark.parametrize("variant_name", ["qwen2_moe", "mixtral"])
@pytest.mark.parametrize("quant", [None, *QUANT])
def test_the_fused_moe_kernel_serves_what_the_torch_moe_does(tmp_path: Path, variant_name: str,
                                                              quant: str | None) -> None:
    family, kwargs = _variants()[variant_name]
    path = _write(tmp_path / "dense", family, kwargs)
    if quant is not None:
        quantizer, config = QUANT[quant]
        qc.quantize_checkpoint(path, tmp_path / "q", tmp_path / "twin", quantizer, config)
        path = tmp_path / "q"
    prompt = _prompts(4, 1)[0]
    ref_tokens, ref_logits, _ = _run(path, prompt, None)
    tokens, logits, model = _run(path, prompt, ref_tokens, backend="triton", quant_dequant="per-product")
    sparse = [layer.mlp for layer in model.layers if isinstance(layer.mlp, MoE)]  # type: ignore[attr-defined]
    assert sparse
    for moe in sparse:
        if quant is None:
            assert moe.gate_up_experts is None
        else:  # the experts stayed packed: the dense weights are gone
            assert moe.gate_up_experts.kind == ("int" if quant == "awq" else "fp8")
            assert moe.down_experts is not None and moe.gate_up_weight.numel() == 0
    torch.testing.assert_close(logits, ref_logits, atol=1e-3, rtol=1e-3)
    assert tokens == ref_tokens


def test_packed_experts_give_the_same_logits_on_both_backends(tmp_path: Path) -> None:
    """AWQ experts kept packed on both backends: the torch MoE loop dequantises each active expert for its
    product (``MoE.gate_up_parts``), the fused-MoE kernel in the tile (``MoE.gate_up_experts``); same logits
    (1e-3) and greedy tokens."""
    family, kwargs = _variants()["mixtral"]
    dense = _write(tmp_path / "dense", family, kwargs)
    quantizer, config = QUANT["awq"]
    qc.quantize_checkpoint(dense, tmp_path / "q", tmp_path / "twin", quantizer, config)
    prompt = _prompts(4, 1)[0]
    ref_tokens, ref_logits, torch_model = _run(tmp_path / "q", prompt, None, quant_dequant="per-product")
    tokens, logits, triton_model = _run(tmp_path / "q", prompt, ref_tokens, backend="triton",
                                        quant_dequant="per-product")
    for torch_layer, triton_layer in zip(torch_model.layers, triton_model.layers, strict=True):  # type: ignore[attr-defined]
        assert torch_layer.mlp.gate_up_parts is not None and torch_layer.mlp.gate_up_experts is None
        assert triton_layer.mlp.gate_up_experts is not None and triton_layer.mlp.gate_up_parts is None
    torch.testing.assert_close(logits, ref_logits, atol=1e-3, rtol=1e-3)
    assert tokens == ref_tokens
