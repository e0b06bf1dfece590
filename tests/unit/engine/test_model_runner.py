"""ModelRunner batching: a step mixing prompt chunks and decodes of several sequences gives each
sequence the logits it gets when run alone (atol 1e-5 in float32; measured max |diff| ~1e-6, from the
batched decode path's padded SDPA call versus one call per sequence)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.engine.model.loader import load_model
from services.engine.model.model_runner import ModelRunner, RunnerSeq
from services.engine.tiny_checkpoint import write_tiny_checkpoint
from tests.unit.engine.model_helpers import make_runner

ATOL = 1e-5
PROMPT_A = [5, 17, 300, 42, 99, 7, 8, 200, 201, 11]  # 10 tokens
PROMPT_B = [400, 3, 77, 120, 250, 9, 60]  # 7 tokens
PROMPT_C = [1, 2, 3, 4, 5]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3")


def _alone(
    runner: ModelRunner, prompt: list[int], decoded: list[int], blocks: list[int]
) -> list[torch.Tensor]:
    """Logits after the prompt and after each of ``decoded``, one sequence per step."""
    out = [runner.run([RunnerSeq(token_ids=prompt, start_pos=0, block_table=blocks, needs_logits=True)])[0]]
    for i, token in enumerate(decoded):
        out.append(
            runner.run(
                [
                    RunnerSeq(
                        token_ids=[token], start_pos=len(prompt) + i, block_table=blocks, needs_logits=True
                    )
                ]
            )[0]
        )
    return out


def test_mixed_prefill_chunk_and_decode_step_matches_separate_runs(checkpoint: Path) -> None:
    model, config = load_model(checkpoint)
    batched = make_runner(model, config)
    # Interleaved physical blocks: A owns odd ids from the top, B even ids, C from the bottom.
    blocks_a, blocks_b, blocks_c = [63, 61, 59, 57], [62, 60, 58, 56], [0, 5, 3]

    # Step 1: A's whole prompt; B's first 3 prompt tokens (no logits: the prompt goes on).
    step1 = batched.run(
        [
            RunnerSeq(token_ids=PROMPT_A, start_pos=0, block_table=blocks_a, needs_logits=True),
            RunnerSeq(token_ids=PROMPT_B[:3], start_pos=0, block_table=blocks_b, needs_logits=False),
        ]
    )
    assert step1.shape == (1, config.vocab_size)
    token_a = int(step1[0].argmax())
    # Step 2: A decodes one token while B prefills the rest of its prompt and C its whole prompt.
    step2 = batched.run(
        [
            RunnerSeq(token_ids=PROMPT_B[3:], start_pos=3, block_table=blocks_b, needs_logits=True),
            RunnerSeq(token_ids=[token_a], start_pos=len(PROMPT_A), block_table=blocks_a, needs_logits=True),
            RunnerSeq(token_ids=PROMPT_C, start_pos=0, block_table=blocks_c, needs_logits=True),
        ]
    )
    token_b, token_a2, token_c = (int(row.argmax()) for row in step2)
    # Step 3: all three decode (the batched one-token path).
    step3 = batched.run(
        [
            RunnerSeq(
                token_ids=[token_a2], start_pos=len(PROMPT_A) + 1, block_table=blocks_a, needs_logits=True
            ),
            RunnerSeq(token_ids=[token_b], start_pos=len(PROMPT_B), block_table=blocks_b, needs_logits=True),
            RunnerSeq(token_ids=[token_c], start_pos=len(PROMPT_C), block_table=blocks_c, needs_logits=True),
        ]
    )

    alone_a = _alone(make_runner(model, config), PROMPT_A, [token_a, token_a2], [3, 2, 1, 0])
    alone_b = _alone(make_runner(model, config), PROMPT_B, [token_b], [9, 8])
    alone_c = _alone(make_runner(model, config), PROMPT_C, [token_c], [4, 7])
    torch.testing.assert_close(step1[0], alone_a[0], rtol=0, atol=ATOL)
    torch.testing.assert_close(step2[0], alone_b[0], rtol=0, atol=ATOL)
    torch.testing.assert_close(step2[1], alone_a[1], rtol=0, atol=ATOL)
    torch.testing.assert_close(step2[2], alone_c[0], rtol=0, atol=ATOL)
    torch.testing.assert_close(step3[0], alone_a[2], rtol=0, atol=ATOL)
    torch.testing.assert_close(step3[1], alone_b[1], rtol=0, atol=ATOL)
    torch.testing.assert_close(step3[2], alone_c[1], rtol=0, atol=ATOL)


def test_a_step_with_no_sequence_needing_logits_returns_an_empty_tensor(checkpoint: Path) -> None:
    model, config = load_model(checkpoint)
    runner = make_runner(model, config)
    out = runner.run([RunnerSeq(token_ids=[1, 2, 3], start_pos=0, block_table=[7], needs_logits=False)])
    assert out.shape == (0, config.vocab_size)
    assert runner.run([]).shape == (0, config.vocab_size)


def test_a_step_writes_each_token_into_the_slot_its_block_table_names(checkpoint: Path) -> None:
    model, config = load_model(checkpoint)
    runner = make_runner(model, config)
    # Positions 0..5 with block_size 4: positions 0-3 in block 9, 4-5 in block 2 (slots 8 and 9).
    runner.run([RunnerSeq(token_ids=[1, 2, 3, 4, 5, 6], start_pos=0, block_table=[9, 2], needs_logits=True)])
    keys = runner.kv_cache.key_caches[0]
    written = keys.abs().sum(dim=(2, 3)) > 0  # [num_blocks, block_size]
    expected = torch.zeros_like(written)
    expected[9, :] = True
    expected[2, :2] = True
    assert torch.equal(written, expected)


def test_runner_rejects_a_block_size_that_differs_from_the_cache(checkpoint: Path) -> None:
    model, config = load_model(checkpoint)
    cache = make_runner(model, config, block_size=4).kv_cache
    with pytest.raises(ValueError, match="block_size 8"):
        ModelRunner(model, config, cache, 8)
