"""ModelConfig parsing: family detection, defaults, both RoPE layouts, and errors that name the key."""

from __future__ import annotations

from typing import Any

import pytest

from services.engine.errors import ModelLoadError, UnsupportedArchitectureError
from services.engine.model.model_config import ModelConfig, RopeScaling


def _config(arch: str = "Qwen3ForCausalLM", **overrides: Any) -> dict[str, Any]:
    base = {
        "architectures": [arch],
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
    }
    return {**base, **overrides}


def test_families_and_their_attention_details_follow_the_architecture() -> None:
    llama = ModelConfig.from_dict(_config("LlamaForCausalLM", attention_bias=True))
    qwen2 = ModelConfig.from_dict(_config("Qwen2ForCausalLM", attention_bias=False))
    qwen3 = ModelConfig.from_dict(_config("Qwen3ForCausalLM"))
    assert (llama.architecture, llama.attention_bias, llama.o_proj_bias, llama.qk_norm) == (
        "llama",
        True,
        True,
        False,
    )
    # Qwen2 always has q/k/v bias and never an o_proj bias, whatever attention_bias says.
    assert (qwen2.architecture, qwen2.attention_bias, qwen2.o_proj_bias, qwen2.qk_norm) == (
        "qwen2",
        True,
        False,
        False,
    )
    assert (qwen3.architecture, qwen3.attention_bias, qwen3.qk_norm) == ("qwen3", False, True)


def test_optional_keys_take_transformers_defaults() -> None:
    config = ModelConfig.from_dict(_config())
    assert config.num_key_value_heads == 4  # = num_attention_heads
    assert config.head_dim == 16  # = 64 / 4
    assert config.rope_theta == 10000.0 and config.rope_scaling is None
    assert config.torch_dtype == "float32" and config.tie_word_embeddings is False
    assert config.eos_token_ids == () and config.bos_token_id is None


def test_explicit_head_dim_and_an_eos_list_are_kept() -> None:
    config = ModelConfig.from_dict(
        _config(head_dim=32, eos_token_id=[7, 9], bos_token_id=1, torch_dtype="bfloat16")
    )
    assert config.head_dim == 32
    assert config.eos_token_ids == (7, 9)
    assert config.torch_dtype == "bfloat16"


def test_rope_scaling_reads_both_the_v4_and_the_v5_layouts() -> None:
    v4 = ModelConfig.from_dict(_config(rope_theta=5e5, rope_scaling={"type": "linear", "factor": 4.0}))
    v5 = ModelConfig.from_dict(
        _config(dtype="float16", rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 5e5})
    )
    assert v4.rope_theta == v5.rope_theta == 5e5
    assert v4.rope_scaling == v5.rope_scaling == RopeScaling(rope_type="linear", factor=4.0)
    assert v5.torch_dtype == "float16"


def test_llama3_rope_defaults_its_original_length_to_max_position_embeddings() -> None:
    config = ModelConfig.from_dict(
        _config(
            max_position_embeddings=8192,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
            },
        )
    )
    assert config.rope_scaling == RopeScaling(
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    )


def test_an_unknown_rope_type_is_an_error_naming_it() -> None:
    with pytest.raises(ModelLoadError, match="unsupported rope type 'yarn'"):
        ModelConfig.from_dict(_config(rope_scaling={"rope_type": "yarn", "factor": 4.0}))


@pytest.mark.parametrize(
    "key", ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"]
)
def test_a_missing_required_key_is_named(key: str) -> None:
    config = _config()
    del config[key]
    with pytest.raises(ModelLoadError, match=f"missing required key '{key}'"):
        ModelConfig.from_dict(config)


def test_an_unsupported_architecture_names_itself_and_the_supported_ones() -> None:
    with pytest.raises(UnsupportedArchitectureError, match=r"'GPT2LMHeadModel'.*LlamaForCausalLM"):
        ModelConfig.from_dict(_config("GPT2LMHeadModel"))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"num_key_value_heads": 3}, "not a multiple"),
        ({"torch_dtype": "float64"}, "torch_dtype 'float64'"),
    ],
)
def test_features_we_do_not_implement_stop_loading(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ModelLoadError, match=message):
        ModelConfig.from_dict(_config(**overrides))
