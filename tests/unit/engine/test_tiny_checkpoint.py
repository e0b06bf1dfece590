"""The tiny checkpoint writer: deterministic, exactly sized, and readable by transformers."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from services.engine.model.tokenizer import Tokenizer
from services.engine.tiny_checkpoint import main, write_tiny_checkpoint


def test_the_same_seed_writes_byte_identical_files(tmp_path: Path) -> None:
    a = write_tiny_checkpoint(tmp_path / "a", "qwen2", seed=3)
    b = write_tiny_checkpoint(tmp_path / "b", "qwen2", seed=3)
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_a_different_seed_writes_different_weights(tmp_path: Path) -> None:
    a = write_tiny_checkpoint(tmp_path / "a", "llama", seed=0)
    b = write_tiny_checkpoint(tmp_path / "b", "llama", seed=1)
    assert (a / "model.safetensors").read_bytes() != (b / "model.safetensors").read_bytes()


@pytest.mark.parametrize("vocab_size", [261, 512, 3000])
def test_the_tokenizer_has_exactly_vocab_size_tokens(tmp_path: Path, vocab_size: int) -> None:
    path = write_tiny_checkpoint(tmp_path, "qwen3", vocab_size=vocab_size)
    tokenizer = Tokenizer.from_dir(path)
    assert tokenizer.vocab_size == vocab_size
    for token in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"):
        assert tokenizer.token_to_id(token) is not None, token
    assert json.loads((path / "config.json").read_text())["vocab_size"] == vocab_size


def test_writing_a_checkpoint_takes_well_under_two_seconds(tmp_path: Path) -> None:
    start = time.perf_counter()
    write_tiny_checkpoint(tmp_path, "qwen3")
    assert time.perf_counter() - start < 2.0


def test_sharded_checkpoints_come_with_an_index_covering_every_tensor(tmp_path: Path) -> None:
    path = write_tiny_checkpoint(tmp_path, "llama", num_shards=3)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)}
    assert "lm_head.weight" in index["weight_map"]
    assert not (path / "model.safetensors").exists()


def test_transformers_reads_the_tokenizer_and_renders_the_same_chat_prompt(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    path = write_tiny_checkpoint(tmp_path, "qwen3")
    theirs = AutoTokenizer.from_pretrained(path)
    ours = Tokenizer.from_dir(path)
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "héllo 世界"}]
    rendered = ours.apply_chat_template(messages)
    assert rendered == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.encode(rendered) == theirs.encode(rendered)
    assert theirs.eos_token == "<|im_end|>"


def test_the_cli_writes_a_checkpoint_of_the_requested_shape(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    main([str(tmp_path / "m"), "--arch", "llama", "--hidden-size", "32", "--num-layers", "1"])
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["hidden_size"], config["num_hidden_layers"]) == (32, 1)
    assert capsys.readouterr().out.strip() == str(tmp_path / "m")


def test_an_unknown_arch_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="arch must be one of"):
        write_tiny_checkpoint(tmp_path, "gpt2")
