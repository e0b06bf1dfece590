"""A quantization_config we do not implement stops loading with a ModelLoadError naming the key and value
(rather than loading packed tensors as if they were dense, or ignoring what the checkpoint asks for)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from services.engine.errors import ModelLoadError
from services.engine.model.loader import load_model
from services.engine.model.model_config import ModelConfig
from services.engine.tiny_checkpoint import write_tiny_checkpoint
from tests.unit import quant_checkpoints as qc

FP8 = {"num_bits": 8, "type": "float"}


def _with_quant(tmp_path: Path, quantization_config: Any) -> Path:
    path = write_tiny_checkpoint(tmp_path / "m", "qwen3")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(config))
    return path


def _ct(**group: Any) -> dict[str, Any]:
    config = qc.ct_config("float-quantized", {**FP8, "strategy": "channel"})
    config["config_groups"]["group_0"].update(group)
    return config


REFUSED: dict[str, tuple[Any, str]] = {
    "unknown method": ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes'"),
    "no method": ({"bits": 4}, "quant_method None"),
    "ct pack-quantized 2 bit": (qc.ct_config("pack-quantized", {"num_bits": 2, "type": "int", "strategy": "group",
                                                                "group_size": 128}), "type/num_bits 'int/2'"),
    "ct pack-quantized tensor strategy": (qc.ct_config("pack-quantized", {"num_bits": 4, "type": "int",
                                                                          "strategy": "tensor"}), "strategy 'tensor'"),
    "ct pack-quantized with activations": (qc.ct_config(
        "pack-quantized", {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128},
        {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}), "null for pack-quantized"),
    "ct pack-quantized dynamic actorder": (qc.ct_config("pack-quantized", {
        "num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "actorder": "dynamic"}),
        "actorder 'dynamic'"),
    "ct fp8 actorder group": (_ct(weights={**FP8, "strategy": "channel", "actorder": "group"}),
                              "actorder 'group'"),
    "ct bitmask sparse format": (qc.ct_config("sparse-bitmask", {**FP8, "strategy": "channel"}),
                                 "format 'sparse-bitmask'"),
    "ct static activations": (_ct(input_activations={**FP8, "strategy": "tensor", "dynamic": False}),
                              "input_activations.dynamic False"),
    "ct int8 activations": (_ct(input_activations={"num_bits": 8, "type": "int", "strategy": "token",
                                                   "dynamic": True}), "type/num_bits 'int/8'"),
    "ct output activations": (_ct(output_activations={**FP8, "strategy": "token", "dynamic": True}),
                              "output_activations"),
    "ct kv cache scheme": ({**_ct(), "kv_cache_scheme": {**FP8, "strategy": "tensor"}}, "kv_cache_scheme"),
    "ct group fp8 weights": (_ct(weights={**FP8, "strategy": "group", "group_size": 128}), "strategy 'group'"),
    "ct nvfp4 group 32": (qc.ct_config("nvfp4-pack-quantized", {"num_bits": 4, "type": "float",
                                                                "strategy": "tensor_group", "group_size": 32}),
                          "float/4/tensor_group/32"),
    "fp8 without blocks": ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "weight_block_size None"),
    "fp8 static activations": ({"quant_method": "fp8", "activation_scheme": "static",
                                "weight_block_size": [128, 128]}, "activation_scheme 'static'"),
    "modelopt int4 awq": ({"quant_method": "modelopt", "quant_algo": "W4A8_AWQ"}, "quant_algo 'W4A8_AWQ'"),
    "modelopt fp8 kv cache": ({"quant_method": "modelopt", "quant_algo": "NVFP4", "kv_cache_quant_algo": "FP8"},
                              "kv_cache_quant_algo 'FP8'"),
    "awq gemv": ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"}, "version 'gemv'"),
    "awq 8 bit": ({"quant_method": "awq", "bits": 8, "group_size": 32}, "bits 8"),
    "gptq 3 bit": ({"quant_method": "gptq", "bits": 3, "group_size": 32}, "bits 3"),
    "gptq marlin format": ({"quant_method": "gptq", "bits": 4, "group_size": 32, "checkpoint_format": "marlin"},
                           "checkpoint_format 'marlin'"),
    "not an object": ("fp8", "quantization_config must be an object"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_an_unsupported_quantization_config_is_refused_naming_it(tmp_path: Path, case: str) -> None:
    config, fragment = REFUSED[case]
    path = _with_quant(tmp_path, config)
    with pytest.raises(ModelLoadError, match="quantization_config") as err:
        ModelConfig.from_dir(path)
    assert fragment in str(err.value)


def test_a_quantized_config_over_dense_tensors_names_the_missing_tensor(tmp_path: Path) -> None:
    path = _with_quant(tmp_path, {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm"})
    with pytest.raises(ModelLoadError, match=r"missing tensor 'model\.layers\.0\.self_attn\.q_proj\.qweight'"):
        load_model(path)


def test_a_quantized_tensor_of_the_wrong_shape_is_named(tmp_path: Path) -> None:
    dense = write_tiny_checkpoint(tmp_path / "dense", "qwen3", hidden_size=64, intermediate_size=128)
    config = {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm"}
    qc.quantize_checkpoint(dense, tmp_path / "q", tmp_path / "twin", qc.awq(32), config)
    # the same files read with a different group size: scales has 2 groups per row, the config implies 4
    (tmp_path / "q" / "config.json").write_text(
        (tmp_path / "q" / "config.json").read_text().replace('"group_size": 32', '"group_size": 16'))
    with pytest.raises(ModelLoadError, match=r"'model\.layers\.0\.self_attn\.q_proj\.qzeros' has shape"):
        load_model(tmp_path / "q")


def test_an_unknown_dequantisation_mode_is_refused(tmp_path: Path) -> None:
    path = write_tiny_checkpoint(tmp_path / "m", "qwen3")
    with pytest.raises(ModelLoadError, match="quant_dequant 'lazy'"):
        load_model(path, quant_dequant="lazy")  # type: ignore[arg-type]
