"""The compiled whole-decoder forward (kernels/cpu_kernels.cpp ``Decoder``) against the torch model path.

Both run the same model over their own copy of the same KV cache: a prompt first, then one step that mixes
a decode, a prompt chunk over a cached prefix and a whole new prompt, with blocks handed out in reverse.
Tolerance: logits and hidden states within 2e-5 (the products are the same oneDNN / MKL calls; the norms,
RoPE and attention sum in another order), the K/V written into the cache likewise. The transformers
equivalence tests (test_model_equivalence.py) run through the runner, so through this path too.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from services.engine.kernels import cpu_kernels
from services.engine.model import model as model_module
from services.engine.model.loader import load_model
from services.engine.model.model import CausalLM
from services.engine.model.model_runner import ModelRunner, RunnerSeq
from services.engine.model.sampler import argmax
from services.engine.tiny_checkpoint import write_tiny_checkpoint
from tests.unit.engine.model_helpers import make_runner, reversed_blocks

fused = cpu_kernels.fused_decode()
# Under CI (.ci/run installs g++ and sets LLMGW_CI=1) a kernel that cannot be built fails instead of skipping.
needs_kernel = pytest.mark.skipif(fused is None and os.environ.get("LLMGW_CI") != "1",
                                  reason="no C++ compiler: the compiled kernels could not be built")
ATOL = 2e-5

VARIANTS = {
    "llama": ("llama", {}),
    "qwen2_qkv_bias": ("qwen2", {}),
    "qwen3_qk_norm": ("qwen3", {}),
    "qwen3_wide_head_dim": ("qwen3", {"head_dim": 32}),
    "qwen3_tied": ("qwen3", {"tie_word_embeddings": True}),
    # weights of 64Ki elements and more go to oneDNN, packed: the branch the bench shapes take
    "qwen3_onednn": ("qwen3", {"hidden_size": 256, "intermediate_size": 512, "num_heads": 8, "num_kv_heads": 4,
                               "vocab_size": 1024}),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    arch, kwargs = VARIANTS[request.param]
    return write_tiny_checkpoint(tmp_path_factory.mktemp(request.param), arch, **kwargs)


def _torch_path(model: CausalLM, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model, "_compiled_decoder", lambda: None)


def _steps(runner: ModelRunner) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A prompt, then a mixed step; (logits, hidden) of each."""
    a, b, c = reversed_blocks(4), reversed_blocks(6, first=4), reversed_blocks(2, first=10)
    prompt_a = [5, 17, 300, 42, 99, 7, 8, 200, 201, 11]
    prompt_b = [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    first = runner.run_with_hidden([
        RunnerSeq(token_ids=prompt_a, start_pos=0, block_table=a, needs_logits=True),
        RunnerSeq(token_ids=prompt_b[:5], start_pos=0, block_table=b, needs_logits=False),
    ])
    mixed = runner.run_with_hidden([
        RunnerSeq(token_ids=[33], start_pos=len(prompt_a), block_table=a, needs_logits=True),
        RunnerSeq(token_ids=prompt_b[5:], start_pos=5, block_table=b, needs_logits=True),
        RunnerSeq(token_ids=[60, 61, 62], start_pos=0, block_table=c, needs_logits=True),
    ])
    return [first, mixed]


@needs_kernel
def test_the_compiled_decoder_computes_what_the_torch_path_computes(checkpoint: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    model, config = load_model(checkpoint)
    assert model._compiled_decoder() is not None, "float32 on the CPU runs on the compiled decoder"
    compiled_runner = make_runner(model, config)
    compiled = _steps(compiled_runner)
    torch_runner = make_runner(model, config)
    _torch_path(model, monkeypatch)
    reference = _steps(torch_runner)
    for (logits, hidden), (want_logits, want_hidden) in zip(compiled, reference, strict=True):
        torch.testing.assert_close(logits, want_logits, rtol=0, atol=ATOL)
        torch.testing.assert_close(hidden, want_hidden, rtol=0, atol=ATOL)
    for got, want in zip(compiled_runner.kv_cache.key_caches + compiled_runner.kv_cache.value_caches,
                         torch_runner.kv_cache.key_caches + torch_runner.kv_cache.value_caches, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=ATOL)


@needs_kernel
def test_the_module_forward_runs_the_compiled_decoder_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from services.engine.model.attention import SeqSpan, build_attention_metadata

    model, config = load_model(write_tiny_checkpoint(tmp_path, "qwen3"))
    runner = make_runner(model, config)
    meta, positions = build_attention_metadata([SeqSpan(0, 6, [3, 2])], 4, "cpu")
    ids = torch.tensor([1, 2, 3, 4, 5, 6])
    got = model(ids, positions, meta, runner.kv_cache)
    _torch_path(model, monkeypatch)
    want = model(ids, positions, meta, make_runner(model, config).kv_cache)
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL)


def test_a_handed_in_backend_an_fp8_cache_or_bf16_keep_the_torch_path(tmp_path: Path) -> None:
    from services.engine.model.attention import TorchPagedAttention

    path = write_tiny_checkpoint(tmp_path, "qwen3")
    model, config = load_model(path)
    model.attention = TorchPagedAttention()  # a backend chosen by the caller is honoured
    assert model._compiled_decoder() is None
    model, config = load_model(path)
    runner = make_runner(model, config, kv_cache_dtype="fp8")
    assert model.compiled_step(runner.kv_cache, [1], [0, 1], [1], [[0]], 4, [0]) is None
    model, _ = load_model(path, dtype=torch.bfloat16)
    assert model._compiled_decoder() is None


@needs_kernel
def test_bad_step_addresses_are_refused_not_read(tmp_path: Path) -> None:
    model, config = load_model(write_tiny_checkpoint(tmp_path, "qwen3"))
    cache = make_runner(model, config, num_blocks=4).kv_cache

    def step(ids: list[int], seq_len: int, table: list[int], rows: list[int]) -> object:
        return model.compiled_step(cache, ids, [0, len(ids)], [seq_len], [table], 4, rows)

    with pytest.raises(RuntimeError, match="block table too short"):
        step([1, 2, 3], 7, [1], [2])
    with pytest.raises(RuntimeError, match="outside the cache"):
        step([1, 2, 3], 3, [9], [2])
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        step([1, config.vocab_size], 2, [1], [1])
    with pytest.raises(RuntimeError, match="logit row outside"):
        step([1, 2], 2, [1], [2])
    logits, hidden = step([1, 2], 2, [1], [1])  # and a good one still runs
    assert tuple(logits.shape) == (1, config.vocab_size) and tuple(hidden.shape) == (2, config.hidden_size)


@needs_kernel
def test_new_packed_weights_rebuild_the_compiled_decoder(tmp_path: Path) -> None:
    model, _ = load_model(write_tiny_checkpoint(tmp_path, "qwen3", **VARIANTS["qwen3_onednn"][1]))
    first = model._compiled_decoder()
    assert first is not None and model._compiled_decoder() is first  # built once
    weight = torch.randn(256, 256)
    assert model_module.prepack_linear_weights([weight]) > 0
    assert model._compiled_decoder() is not first  # it holds the packed copies: rebuilt


@needs_kernel
def test_the_compiled_argmax_is_torchs_first_index_of_the_largest() -> None:
    torch.manual_seed(5)
    x = torch.randn(40, 8192)
    x[3, 5] = x[3, 7] = 100.0  # a tie: the first index wins
    x[4] = float("-inf")  # every value -inf: index 0
    x[5, :10] = float("-inf")
    assert torch.equal(argmax(x), x.argmax(dim=-1))
    one = torch.randn(1, 7)
    assert torch.equal(argmax(one), one.argmax(dim=-1))
