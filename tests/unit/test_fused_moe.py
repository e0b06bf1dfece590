"""The fused-MoE Triton kernel (services/engine/kernels/fused_moe.py) against the torch MoE (MoE.forward in
services/engine/model/model.py: one product pair per expert over its token group), on the CPU under
TRITON_INTERPRET=1 at toy sizes: dense experts and experts stored FP8 (per channel, 32x32 blocks), AWQ,
GPTQ, compressed-tensors pack-quantized and NVFP4, with and without renormalised top-k weights, a Qwen2-MoE
shared expert, token counts that leave experts unused and blocks padded. The quantized cases hold the kernel
to the torch MoE run on the weights the stored tensors decode to (tests/unit/quant_checkpoints.py).
Tolerance 1e-4: float32 throughout, only the summation order differs. Run this file in its own process
(triton under the interpreter).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.triton_interpret import import_interpreted

import_interpreted("services.engine.kernels.fused_moe")
from services.engine.kernels.fused_moe import ExpertWeights, fused_moe, moe_align_block_size  # noqa: E402
from services.engine.model.model import MoE  # noqa: E402
from services.engine.model.model_config import MoEConfig  # noqa: E402
from services.engine.model.quant.kernel_weight import build_expert_weights  # noqa: E402
from services.engine.model.quant.linear import PackedPart  # noqa: E402
from services.engine.model.quant.scheme import WeightFormat, WeightScheme  # noqa: E402
from tests.unit import quant_checkpoints as qc  # noqa: E402

H, INTER, E = 64, 32, 6


@pytest.fixture(autouse=True)
def _interpreting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _moe(top_k: int, norm: bool, shared: int = 0, seed: int = 0) -> MoE:
    config = SimpleNamespace(hidden_size=H, moe=MoEConfig(
        naming="qwen", num_experts=E, top_k=top_k, intermediate_size=INTER, norm_topk_prob=norm,
        shared_intermediate_size=shared, sparse_layers=(True,)))
    moe = MoE(config, torch.float32, "cpu")  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
        moe.gate_weight.mul_(4.0)  # a spread router: several experts per step
    return moe.eval()


def _x(num_tokens: int) -> torch.Tensor:
    return torch.randn(num_tokens, H, generator=torch.Generator().manual_seed(7))


def test_alignment_groups_pairs_by_expert_in_padded_blocks() -> None:
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]])
    sorted_ids, expert_ids = moe_align_block_size(ids, 4, 4)
    pad = 6
    # expert 0: pairs 1, 4; expert 1: pair 3; expert 2: pairs 0, 2, 5; expert 3: none; then the unused tail
    assert sorted_ids.tolist()[:12] == [1, 4, pad, pad, 3, pad, pad, pad, 0, 2, 5, pad]
    assert set(sorted_ids.tolist()[12:]) == {pad}
    assert expert_ids.tolist() == [0, 1, 2] + [-1] * (len(expert_ids) - 3)


@pytest.mark.parametrize(("num_tokens", "top_k", "norm", "shared"), [
    (1, 2, True, 0), (5, 2, True, 0), (37, 3, False, 0), (9, 2, False, 48)])
def test_dense_experts_in_one_kernel_equal_the_torch_moe(num_tokens: int, top_k: int, norm: bool,
                                                          shared: int) -> None:
    moe = _moe(top_k, norm, shared)
    x = _x(num_tokens)
    torch.testing.assert_close(moe.forward_triton(x), moe.forward(x), atol=1e-4, rtol=1e-4)


QUANTIZED: dict[str, tuple[qc.Quantizer, WeightScheme]] = {
    "fp8-channel": (qc.fp8_channel, WeightScheme(format=WeightFormat.FP8)),
    "fp8-block": (qc.fp8_block(32, "weight_scale_inv"), WeightScheme(
        format=WeightFormat.FP8_BLOCK, block=(32, 32), scale_name="weight_scale_inv")),
    "awq": (qc.awq(32), WeightScheme(format=WeightFormat.AWQ, bits=4, group_size=32, symmetric=False)),
    "gptq-asym": (qc.gptq(16, sym=False), WeightScheme(format=WeightFormat.GPTQ, bits=4, group_size=16,
                                                       symmetric=False, zero_point_offset=1)),
    "nvfp4-ct": (qc.nvfp4("ct"), WeightScheme(format=WeightFormat.NVFP4_CT, bits=4, group_size=16)),
    "ct-pack-w4-asym": (qc.ct_pack(4, 16, sym=False), WeightScheme(format=WeightFormat.INT_CT, bits=4, group_size=16,
                                                                  symmetric=False)),
}


@pytest.mark.parametrize("name", list(QUANTIZED))
def test_quantized_experts_dequantised_in_the_tile_equal_the_torch_moe_on_the_decoded_weights(name: str) -> None:
    quantizer, scheme = QUANTIZED[name]
    moe = _moe(2, True)
    gate_up_parts, down_parts = [], []
    with torch.no_grad():
        for e in range(E):
            parts = []
            for half, w in enumerate(moe.gate_up_weight[e].chunk(2)):  # gate rows, then up rows
                stored, decoded = quantizer(w.clone())
                parts.append(PackedPart(scheme=scheme, prefix=f"e{e}.{half}", tensors=stored, shape=(INTER, H)))
                moe.gate_up_weight[e, half * INTER:(half + 1) * INTER] = decoded
            gate_up_parts.append(tuple(parts))
            stored, decoded = quantizer(moe.down_weight[e].clone())
            down_parts.append((PackedPart(scheme=scheme, prefix=f"e{e}.down", tensors=stored, shape=(H, INTER)),))
            moe.down_weight[e] = decoded
    x = _x(11)
    reference = moe.forward(x)
    moe.gate_up_experts = build_expert_weights(gate_up_parts, "cpu")
    moe.down_experts = build_expert_weights(down_parts, "cpu")
    assert isinstance(moe.gate_up_experts, ExpertWeights) and moe.gate_up_experts.kind != "dense"
    torch.testing.assert_close(moe.forward_triton(x), reference, atol=1e-4, rtol=1e-4)


def test_no_tokens_give_an_empty_result() -> None:
    moe = _moe(2, True)
    x = _x(0)
    weights, experts = moe.route(x)
    dense = ExpertWeights(kind="dense", weight=moe.gate_up_weight)
    down = ExpertWeights(kind="dense", weight=moe.down_weight)
    assert fused_moe(x, dense, down, weights, experts).shape == (0, H)
