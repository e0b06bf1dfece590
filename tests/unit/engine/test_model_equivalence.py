"""Our decoder against transformers' eager implementation on the same tiny checkpoints (float32, CPU).

Tolerance: logits agree to atol 1e-5 (measured max |diff| 4.8e-7 .. 1.9e-6 across these variants: the
only differences are fused vs separate matmuls and summation order). Greedy decoding runs one token per
step through the paged cache (block_size 4, blocks handed out in reverse so no sequence is contiguous)
and must give exactly transformers' tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from services.engine.model.attention import SeqSpan, build_attention_metadata
from services.engine.model.loader import load_model
from services.engine.model.model_runner import RunnerSeq
from services.engine.tiny_checkpoint import write_tiny_checkpoint
from tests.unit.engine.model_helpers import (
    PROMPT,
    hf_greedy,
    hf_logits,
    hf_model,
    make_runner,
    reversed_blocks,
    runner_greedy,
)

LOGITS_ATOL = 1e-5

VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "qwen3_wide_head_dim": ("qwen3", {"head_dim": 32}),  # head_dim != hidden_size / num_heads
    "qwen3_tied": ("qwen3", {"tie_word_embeddings": True}),
    "llama_sharded": ("llama", {"num_shards": 3}),
    "llama_rope_linear": ("llama", {"rope_scaling": {"type": "linear", "factor": 2.0}}),
    # original_max_position_embeddings=16 puts head_dim 16's wavelengths (6.3 .. ~2e4) in all three
    # llama3 bands: kept, smoothed, divided by factor.
    "llama_rope_llama3": (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            }
        },
    ),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    arch, kwargs = VARIANTS[request.param]
    path = write_tiny_checkpoint(tmp_path_factory.mktemp(request.param), arch, **kwargs)
    return path, hf_model(path)


def test_prefill_logits_match_transformers(variant: tuple[Path, Any]) -> None:
    path, hf = variant
    model, config = load_model(path)
    runner = make_runner(model, config)
    blocks = reversed_blocks(3)  # 10 prompt tokens / block_size 4 = 3 blocks
    expected = hf_logits(hf, PROMPT)

    last = runner.run([RunnerSeq(token_ids=PROMPT, start_pos=0, block_table=blocks, needs_logits=True)])

    assert last.shape == (1, config.vocab_size)
    assert last.dtype == torch.float32
    torch.testing.assert_close(last[0], expected[-1], rtol=0, atol=LOGITS_ATOL)


def test_prefill_logits_match_transformers_at_every_position(variant: tuple[Path, Any]) -> None:
    path, hf = variant
    model, config = load_model(path)
    runner = make_runner(model, config)
    span = SeqSpan(start_pos=0, num_new_tokens=len(PROMPT), block_table=reversed_blocks(3))
    meta, positions = build_attention_metadata([span], runner.block_size, "cpu")

    with torch.inference_mode():
        hidden = model(torch.tensor(PROMPT), positions, meta, runner.kv_cache)
        logits = model.compute_logits(hidden)

    torch.testing.assert_close(logits, hf_logits(hf, PROMPT), rtol=0, atol=LOGITS_ATOL)


def test_greedy_tokens_match_transformers(variant: tuple[Path, Any]) -> None:
    path, hf = variant
    model, config = load_model(path)
    runner = make_runner(model, config)
    num_tokens = 16
    blocks = reversed_blocks(-(-(len(PROMPT) + num_tokens) // 4))  # 26 positions -> 7 blocks

    tokens, _ = runner_greedy(runner, PROMPT, num_tokens, blocks)

    assert tokens == hf_greedy(hf, PROMPT, num_tokens)


def test_chunked_prefill_matches_transformers(variant: tuple[Path, Any]) -> None:
    """A prompt computed in chunks of 3, 4 and 3 tokens (chunk edges not on block edges) ends with the
    same logits as transformers over the whole prompt."""
    path, hf = variant
    model, config = load_model(path)
    runner = make_runner(model, config)
    blocks = reversed_blocks(3, stride=2)
    logits = None
    for start, end in ((0, 3), (3, 7), (7, 10)):
        logits = runner.run(
            [
                RunnerSeq(
                    token_ids=PROMPT[start:end],
                    start_pos=start,
                    block_table=blocks,
                    needs_logits=end == len(PROMPT),
                )
            ]
        )
    assert logits is not None and logits.shape[0] == 1
    torch.testing.assert_close(logits[0], hf_logits(hf, PROMPT)[-1], rtol=0, atol=LOGITS_ATOL)
