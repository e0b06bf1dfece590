"""The shipped demo model (``models/demo-qwen3``, trained by ``tools/train_demo_model.py``, issue #9).

The same checkpoint must mean the same thing to transformers and to us: transformers' tokenizer encodes and
its ``Qwen3ForCausalLM`` (eager attention, float32) decodes greedily to exactly the tokens our engine serves
through ``LLM.generate`` (paged cache, continuous batching of all prompts at once). The chat template both
sides render is the ChatML that the training data used.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from services.engine.llm import LLM, greedy
from services.engine.model.tokenizer import Tokenizer
from tests.unit.engine.model_helpers import hf_greedy, hf_model

DEMO_MODEL = Path(__file__).resolve().parents[3] / "models" / "demo-qwen3"
NUM_NEW_TOKENS = 16
PROMPTS = (
    "Return the",
    "This module provides",
    "If the file does not exist,",
    "<|im_start|>user\nWhat does os.path.join do?<|im_end|>\n<|im_start|>assistant\n",
)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is json?"}]
RENDERED = (
    "<|im_start|>system\nBe brief.<|im_end|>\n"
    "<|im_start|>user\nWhat is json?<|im_end|>\n"
    "<|im_start|>assistant\n"
)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """A 4M-parameter model gains nothing from a second thread and, on a busy machine, loses a lot: measured
    on 2 shared cores (load average 5), 64 greedy engine steps took 6.9 s with 2 threads, 0.04 s with 1."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def engine_outputs() -> list[tuple[list[int], list[int]]]:
    """(prompt ids, 16 greedy ids) per prompt, from our engine. ``ignore_eos``: the comparison needs all 16
    tokens even where the model would have ended its answer."""
    llm = LLM(DEMO_MODEL, kv_capacity_tokens=1024, block_size=4)
    results = llm.generate(list(PROMPTS), greedy(NUM_NEW_TOKENS, ignore_eos=True))
    prompt_ids = [llm.tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    return [(ids, list(r.token_ids)) for ids, r in zip(prompt_ids, results, strict=True)]


def test_demo_model_is_a_small_tied_float32_qwen3() -> None:
    config = json.loads((DEMO_MODEL / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert config["tie_word_embeddings"] is True
    assert config["torch_dtype"] == "float32"
    total_bytes = sum(f.stat().st_size for f in DEMO_MODEL.iterdir())
    assert total_bytes < 30 * 1000 * 1000


def test_transformers_tokenizer_encodes_the_prompts_to_our_ids(engine_outputs: list[Any]) -> None:
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(DEMO_MODEL)
    for prompt, (ids, _) in zip(PROMPTS, engine_outputs, strict=True):
        assert hf_tok.encode(prompt, add_special_tokens=False) == ids


def test_transformers_greedy_tokens_match_our_engine(engine_outputs: list[Any]) -> None:
    hf = hf_model(DEMO_MODEL)
    for ids, ours in engine_outputs:
        assert len(ours) == NUM_NEW_TOKENS
        assert hf_greedy(hf, ids, NUM_NEW_TOKENS) == ours


def test_chat_template_renders_chatml_for_us_and_for_transformers() -> None:
    from transformers import AutoTokenizer

    ours = Tokenizer.from_dir(DEMO_MODEL).apply_chat_template(MESSAGES, add_generation_prompt=True)
    theirs = AutoTokenizer.from_pretrained(DEMO_MODEL).apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True
    )
    assert ours == RENDERED
    assert theirs == RENDERED


def test_chat_answers_end_with_stop_before_max_tokens() -> None:
    """The chat exchanges in the training data end with ``<|im_end|>``, which generation_config.json lists as
    a stop token: a chat reply finishes with "stop", not by running into ``max_tokens``."""
    llm = LLM(DEMO_MODEL, kv_capacity_tokens=1024)
    assert set(llm.tokenizer.stop_token_ids) == {
        llm.tokenizer.token_to_id("<|im_end|>"),
        llm.tokenizer.token_to_id("<|endoftext|>"),
    }
    questions = ("What does os.path.join do?", "hi")
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    results = llm.generate(prompts, greedy(64))
    assert [r.finish_reason for r in results] == ["stop", "stop"]
    assert all(0 < len(r.token_ids) < 64 for r in results)
