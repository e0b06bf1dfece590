"""Mixture-of-experts models against transformers: tiny random Qwen3-MoE, Qwen2-MoE (shared expert) and
Mixtral checkpoints written by transformers' own ``save_pretrained`` (so the on-disk names are the real
ones), served by our engine (paged cache, continuous batching, chunked prefill, prefix cache), greedy output
token for token equal to transformers' full-recompute greedy decode (float32, CPU).

Weights are drawn with ``initializer_range`` 0.2 (transformers' 0.02 gives near-uniform logits whose argmax
is a near-tie) and routers so that several experts are used per step.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from services.engine.errors import ModelLoadError
from services.engine.llm import LLM, greedy
from services.engine.model.loader import load_model
from services.engine.model.model import MoE
from services.engine.model.model_config import ModelConfig
from services.engine.model.quant.linear import fp8_quant_dequant
from services.engine.tiny_checkpoint import build_tokenizer, write_tokenizer_files
from tests.unit import quant_checkpoints as qc
from tests.unit.engine.model_helpers import (
    hf_greedy,
    hf_model,
    make_runner,
    reversed_blocks,
    runner_greedy,
)

VOCAB = 512
COMMON = {"vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
          "num_key_value_heads": 2, "initializer_range": 0.2, "max_position_embeddings": 512}


def _variants() -> dict[str, tuple[str, dict[str, Any]]]:
    return {
        "qwen3_moe": ("Qwen3Moe", {**COMMON, "head_dim": 16, "intermediate_size": 96, "moe_intermediate_size": 32,
                                   "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True,
                                   "mlp_only_layers": [1]}),
        "qwen3_moe_unnormalised": ("Qwen3Moe", {**COMMON, "head_dim": 16, "intermediate_size": 96,
                                                "moe_intermediate_size": 32, "num_experts": 4,
                                                "num_experts_per_tok": 3, "norm_topk_prob": False}),
        "qwen2_moe": ("Qwen2Moe", {**COMMON, "intermediate_size": 96, "moe_intermediate_size": 32,
                                   "shared_expert_intermediate_size": 48, "num_experts": 6,
                                   "num_experts_per_tok": 2, "decoder_sparse_step": 1}),
        "mixtral": ("Mixtral", {**COMMON, "intermediate_size": 32, "num_local_experts": 4,
                                "num_experts_per_tok": 2}),
    }


def _write(path: Path, family: str, kwargs: dict[str, Any]) -> Path:
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, f"{family}Config")(**kwargs, eos_token_id=None, bos_token_id=None)
    model = getattr(transformers, f"{family}ForCausalLM")(config)
    with torch.no_grad():  # norms away from 1 and a spread router, as the dense fixtures do
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    tokenizer = build_tokenizer(VOCAB)
    bos, eos = tokenizer.token_to_id("<|endoftext|>"), tokenizer.token_to_id("<|im_end|>")
    assert bos is not None and eos is not None
    write_tokenizer_files(path, tokenizer, 512, eot_id=bos, im_end_id=eos)
    return path


@pytest.fixture(scope="module", params=list(_variants()))
def variant(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    family, kwargs = _variants()[request.param]
    path = _write(tmp_path_factory.mktemp(request.param), family, kwargs)
    return path, hf_model(path)


def _prompts(seed: int, count: int, prefix: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    return [(prefix or []) + [rng.randrange(10, VOCAB) for _ in range(rng.randrange(5, 20))] for _ in range(count)]


def test_single_request_greedy_equals_transformers(variant: tuple[Path, Any]) -> None:
    path, hf = variant
    prompt = _prompts(1, 1)[0]
    llm = LLM(path, kv_capacity_tokens=512, block_size=4)
    out = llm.generate([prompt], greedy(12, ignore_eos=True))[0]
    expected = hf_greedy(hf, prompt, 12)
    assert list(out.token_ids) == expected
    assert len(set(expected)) > 2


def test_batched_chunked_prefill_and_prefix_hits_equal_transformers(variant: tuple[Path, Any]) -> None:
    path, hf = variant
    shared = _prompts(7, 1)[0] * 2  # a 10-38 token prefix the later requests share (prefix-cache hits)
    prompts = _prompts(2, 3) + _prompts(3, 3, prefix=shared)
    # a 7-token step budget: every prompt is prefilled in chunks, next to other requests' decodes
    llm = LLM(path, kv_capacity_tokens=1024, block_size=4, max_concurrency=4, max_num_batched_tokens=7)
    llm.generate([shared], greedy(1, ignore_eos=True))  # the shared prefix is now cached
    outs = llm.generate(prompts, greedy(8, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        assert list(out.token_ids) == hf_greedy(hf, prompt, 8)
    assert sum(out.num_cached_tokens for out in outs[3:]) >= 3 * (len(shared) // 4) * 4


def _config(tmp_path: Path, **overrides: Any) -> Path:
    _, kwargs = _variants()["qwen3_moe"]
    raw = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **kwargs, **overrides}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path


@pytest.mark.parametrize(("overrides", "fragment"), [
    ({"scoring_func": "sigmoid"}, "router option 'scoring_func'='sigmoid'"),
    ({"topk_method": "noaux_tc", "n_group": 8}, "router option 'topk_method'"),
    ({"routed_scaling_factor": 2.5}, "router option 'routed_scaling_factor'=2.5"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"moe_intermediate_size": None}, "moe_intermediate_size"),
])
def test_an_moe_config_with_an_unknown_router_is_refused_naming_it(tmp_path: Path, overrides: dict[str, Any],
                                                                    fragment: str) -> None:
    with pytest.raises(ModelLoadError) as err:
        ModelConfig.from_dir(_config(tmp_path, **overrides))
    assert fragment in str(err.value)


def _greedy_runs(prompt: list[int], *runs: tuple[Path, str]) -> list[Any]:
    """(greedy tokens, logits, model) of each (checkpoint, quant_dequant mode), every run after the first
    teacher-forced on the first's tokens, so their logits compare step by step (equal argmax at every step:
    equal greedy text)."""
    out: list[Any] = []
    for path, mode in runs:
        model, cfg = load_model(path, quant_dequant=mode)  # type: ignore[arg-type]
        tokens, logits = runner_greedy(make_runner(model, cfg), prompt, 6, reversed_blocks(12),
                                       forced=out[0][0] if out else None)
        out.append((tokens, logits, model))
    return out


def _quantized_weight_elements(twin: Path) -> int:
    """Weights the quantizer replaced (every linear layer's but the router's and lm_head's), counted in the twin."""
    return sum(t.numel() for name, t in load_file(str(twin / "model.safetensors")).items()
               if name.endswith(".weight") and name.rsplit(".", 2)[1] in qc.LINEAR_LEAVES)


# group 16: the shared expert's 48-wide down projection is not a multiple of 32
AWQ_G16 = {"quant_method": "awq", "bits": 4, "group_size": 16, "zero_point": True, "version": "gemm"}


@pytest.mark.parametrize("variant_name", ["qwen2_moe", "mixtral", "qwen3_moe"])
def test_packed_experts_give_the_logits_of_load_in_a_fraction_of_the_memory(tmp_path: Path,
                                                                            variant_name: str) -> None:
    """AWQ experts (routed and shared) and attention: dequantised at load they compute what the dense twin
    holds; kept packed (``per-product``, each routed expert dequantised for its own product only) the logits
    are load's and the greedy tokens too, while the model holds the packed bytes instead of float32."""
    family, kwargs = _variants()[variant_name]
    dense = _write(tmp_path / "dense", family, kwargs)
    qc.quantize_checkpoint(dense, tmp_path / "q", tmp_path / "twin", qc.awq(16), AWQ_G16)
    twin, load, per_product = _greedy_runs(_prompts(4, 1)[0], (tmp_path / "twin", "load"),
                                           (tmp_path / "q", "load"), (tmp_path / "q", "per-product"))
    torch.testing.assert_close(load[1], twin[1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(per_product[1], load[1], atol=1e-4, rtol=1e-4)
    assert per_product[0] == load[0] == twin[0]
    assert len(set(load[0])) > 1

    loaded, packed = load[2], per_product[2]
    moes = [layer.mlp for layer in packed.layers if isinstance(layer.mlp, MoE)]
    assert moes and all(m.gate_up_parts is not None and m.down_parts is not None
                        and m.gate_up_weight.numel() == m.down_weight.numel() == 0 for m in moes)
    if variant_name == "qwen2_moe":
        assert all(m.shared_gate_up_parts is not None and m.shared_down_parts is not None
                   and m.shared_gate_up_weight is not None and m.shared_gate_up_weight.numel() == 0 for m in moes)
    # every quantized weight: 32 bits in float32 against 4 bits + an fp16 scale and a 4-bit zero per 16 weights
    num_weights = _quantized_weight_elements(tmp_path / "twin")
    packed_bits = 4 + 16 / 16 + 4 / 16
    assert loaded.weight_bytes() - packed.weight_bytes() == num_weights * (32 - packed_bits) / 8
    print(f"\nFIGURES moe-per-product {variant_name}: weights load {loaded.weight_bytes()} B, "
          f"per-product {packed.weight_bytes()} B ({num_weights} quantized weights)")


FP8 = {"num_bits": 8, "type": "float"}
INT4_G16 = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 16}
# name -> (quantizer, quantization_config, family): every format the dense per-product path takes, on the experts
MOE_FORMATS: dict[str, tuple[qc.Quantizer, dict[str, object], str]] = {
    "ct-fp8-tensor": (qc.fp8_tensor, qc.ct_config("float-quantized", {**FP8, "strategy": "tensor"}), "mixtral"),
    "ct-fp8-channel": (qc.fp8_channel, qc.ct_config("float-quantized", {**FP8, "strategy": "channel"}), "qwen3_moe"),
    "ct-fp8-block": (qc.fp8_block(128, "weight_scale"), qc.ct_config(
        "float-quantized", {**FP8, "strategy": "block", "block_structure": [128, 128]}), "qwen2_moe"),
    "ct-nvfp4": (qc.nvfp4("ct"), qc.ct_config("nvfp4-pack-quantized", {
        "num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}), "qwen2_moe"),
    "modelopt-nvfp4": (qc.nvfp4("modelopt"), {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                                              "exclude_modules": ["lm_head"]}, "mixtral"),
    "gptq-sym": (qc.gptq(16, sym=True), {"quant_method": "gptq", "bits": 4, "group_size": 16, "desc_act": False,
                                         "sym": True}, "qwen3_moe"),
    "gptq-desc-act": (qc.gptq(16, sym=True, desc_act=True), {"quant_method": "gptq", "bits": 4, "group_size": 16,
                                                             "desc_act": True, "sym": True}, "qwen2_moe"),
    "ct-w4a16-group-asym": (qc.ct_pack(4, 16, sym=False), qc.ct_config(
        "pack-quantized", {**INT4_G16, "symmetric": False}), "mixtral"),
    "ct-w4a16-actorder-group": (qc.ct_pack(4, 16, sym=True, actorder=True), qc.ct_config(
        "pack-quantized", {**INT4_G16, "actorder": "group"}), "qwen2_moe"),
    "ct-w8a16-channel-asym": (qc.ct_pack(8, 0, sym=False), qc.ct_config("pack-quantized", {
        "num_bits": 8, "type": "int", "strategy": "channel", "symmetric": False}), "qwen3_moe"),
}


@pytest.mark.parametrize("format_name", list(MOE_FORMATS))
def test_every_packed_expert_format_gives_the_logits_of_load(tmp_path: Path, format_name: str) -> None:
    """Each format the dense per-product path takes, on the experts of one MoE family (the three families
    spread over the table): per-product logits equal load's (1e-4), which equal the dense twin's; the greedy
    tokens are equal; the per-product model holds fewer weight bytes, none of them dense expert weights."""
    quantizer, config, variant_name = MOE_FORMATS[format_name]
    family, kwargs = _variants()[variant_name]
    dense = _write(tmp_path / "dense", family, kwargs)
    qc.quantize_checkpoint(dense, tmp_path / "q", tmp_path / "twin", quantizer, config)
    twin, load, per_product = _greedy_runs(_prompts(6, 1)[0], (tmp_path / "twin", "load"),
                                           (tmp_path / "q", "load"), (tmp_path / "q", "per-product"))
    torch.testing.assert_close(load[1], twin[1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(per_product[1], load[1], atol=1e-4, rtol=1e-4)
    assert per_product[0] == load[0] == twin[0]

    loaded, packed = load[2], per_product[2]
    moes = [layer.mlp for layer in packed.layers if isinstance(layer.mlp, MoE)]
    assert moes and all(m.gate_up_parts is not None and m.gate_up_weight.numel() == 0 for m in moes)
    # every format stores at most 10 bits a weight here (8-bit codes plus a per-row scale and zero point over 32
    # or more columns: 9 bits; the 4-bit formats about 5), against float32's 32: at least 22 bits a weight saved
    num_weights = _quantized_weight_elements(tmp_path / "twin")
    assert loaded.weight_bytes() - packed.weight_bytes() >= num_weights * (32 - 10) / 8


@pytest.mark.parametrize("variant_name", ["qwen2_moe", "mixtral"])
def test_w8a8_fp8_experts_round_every_expert_input_through_dynamic_fp8(tmp_path: Path, variant_name: str) -> None:
    """compressed-tensors FP8 channel weights with dynamic per-token FP8 activations (llm-compressor's
    ``FP8_DYNAMIC``) on every linear, the experts and Qwen2-MoE's shared expert included. Each expert product's
    input is rounded through FP8: a layer's output (experts dequantised at load) equals a hand-written loop over
    the routed experts that rounds with ``fp8_quant_dequant`` (itself checked against e4m3 by hand in
    test_quant_formats); with ``per-product`` (experts kept packed, the torch backend) the layer's output and the
    logits are load's; the logits stay close to the dense twin's without equalling them (the rounding happened)."""
    fp8 = {"num_bits": 8, "type": "float"}
    family, kwargs = _variants()[variant_name]
    dense = _write(tmp_path / "dense", family, kwargs)
    config = qc.ct_config("float-quantized", {**fp8, "strategy": "channel"},
                          {**fp8, "strategy": "token", "dynamic": True, "symmetric": True})
    qc.quantize_checkpoint(dense, tmp_path / "q", tmp_path / "twin", qc.fp8_channel, config)

    model, cfg = load_model(tmp_path / "q", quant_dequant="load")
    packed, _ = load_model(tmp_path / "q", quant_dequant="per-product")
    moes = [layer.mlp for layer in model.layers if isinstance(layer.mlp, MoE)]
    packed_moes = [layer.mlp for layer in packed.layers if isinstance(layer.mlp, MoE)]
    assert moes and all(m.act_group == 0 and m.gate_up_experts is None and m.gate_up_parts is None for m in moes)
    assert all(m.act_group == 0 and m.gate_up_parts is not None and m.down_parts is not None for m in packed_moes)
    moe, packed_moe = moes[0], packed_moes[0]
    if variant_name == "qwen2_moe":
        assert moe.shared_act_group == packed_moe.shared_act_group == 0
        assert packed_moe.shared_gate_up_parts is not None and packed_moe.shared_down_parts is not None
    x = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        weights, experts = moe.route(x)
        expected = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for k in range(experts.shape[1]):
                e = int(experts[t, k])
                gate, up = F.linear(fp8_quant_dequant(x[t:t + 1], 0), moe.gate_up_weight[e]).chunk(2, dim=-1)
                y = F.linear(fp8_quant_dequant(F.silu(gate) * up, 0), moe.down_weight[e])
                expected[t] += weights[t, k] * y[0]
        got = moe.shared(x, torch.zeros_like(x)) if moe.shared_gate_up_weight is not None else torch.zeros_like(x)
        torch.testing.assert_close(moe.forward(x) - got, expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(moe.forward_triton(x), moe.forward(x))  # the triton backend takes this path too
        torch.testing.assert_close(packed_moe.forward(x), moe.forward(x), atol=1e-6, rtol=1e-6)

    twin, load, per_product = _greedy_runs(_prompts(5, 1)[0], (tmp_path / "twin", "load"),
                                           (tmp_path / "q", "load"), (tmp_path / "q", "per-product"))
    torch.testing.assert_close(per_product[1], load[1], atol=1e-4, rtol=1e-4)
    assert per_product[0] == load[0]
    ref, logits = twin[1], load[1]
    span = float(ref.max() - ref.min())
    print(f"\nFIGURES w8a8-experts {variant_name}: logits span {span:.2f} mean |diff| "
          f"{float((logits - ref).abs().mean()):.3f} max {float((logits - ref).abs().max()):.3f}")
    assert float((logits - ref).abs().mean()) < 0.05 * span
    assert not torch.allclose(logits, ref, atol=1e-4, rtol=1e-4)
