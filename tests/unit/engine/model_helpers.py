"""Shared helpers for the model / runner tests: build a runner over a tiny checkpoint, run greedy decodes
through it one token per step, and compute the transformers reference."""

from __future__ import annotations

from pathlib import Path

import torch

from services.engine.model.kv_cache import KVCache, KVCacheSpec
from services.engine.model.loader import load_model
from services.engine.model.model import CausalLM
from services.engine.model.model_config import ModelConfig
from services.engine.model.model_runner import ModelRunner, RunnerSeq

BLOCK_SIZE = 4
NUM_BLOCKS = 64
PROMPT = [5, 17, 300, 42, 99, 7, 8, 200, 201, 11]


def make_runner(
    model: CausalLM,
    config: ModelConfig,
    *,
    kv_cache_dtype: str = "auto",
    num_blocks: int = NUM_BLOCKS,
    block_size: int = BLOCK_SIZE,
) -> ModelRunner:
    spec = KVCacheSpec(
        num_layers=config.num_hidden_layers,
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        block_size=block_size,
        dtype=model.dtype,
        kv_cache_dtype=kv_cache_dtype,
    )  # type: ignore[arg-type]
    return ModelRunner(model, config, KVCache(spec, num_blocks), block_size)


def load_runner(path: Path, **kwargs: object) -> ModelRunner:
    model, config = load_model(path)
    return make_runner(model, config, **kwargs)  # type: ignore[arg-type]


def reversed_blocks(
    count: int, *, num_blocks: int = NUM_BLOCKS, stride: int = 1, first: int = 0
) -> list[int]:
    """``count`` physical blocks handed out from the top of the pool downwards, every ``stride``-th one,
    so a sequence's positions are never contiguous in the cache."""
    return list(range(num_blocks - 1 - first, -1, -stride))[:count]


def runner_greedy(
    runner: ModelRunner,
    prompt: list[int],
    num_tokens: int,
    block_table: list[int],
    forced: list[int] | None = None,
) -> tuple[list[int], torch.Tensor]:
    """Prefill ``prompt`` then decode one token per step. Returns the argmax tokens and the logits
    ``[num_tokens, vocab]`` they were taken from. With ``forced``, those tokens are fed back instead of the
    argmax (teacher forcing), so two runs can be compared position by position."""
    tokens: list[int] = []
    rows = []
    logits = runner.run(
        [RunnerSeq(token_ids=prompt, start_pos=0, block_table=block_table, needs_logits=True)]
    )
    position = len(prompt)
    for step in range(num_tokens):
        rows.append(logits[0])
        tokens.append(int(logits[0].argmax()))
        fed = tokens[-1] if forced is None else forced[step]
        logits = runner.run(
            [RunnerSeq(token_ids=[fed], start_pos=position, block_table=block_table, needs_logits=True)]
        )
        position += 1
    return tokens, torch.stack(rows)


def hf_model(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()


@torch.no_grad()
def hf_logits(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """transformers' logits ``[len(ids), vocab]`` for one full forward pass."""
    return hf(torch.tensor([ids])).logits[0].float()


@torch.no_grad()
def hf_greedy(hf: torch.nn.Module, prompt: list[int], num_tokens: int) -> list[int]:
    """Greedy decode by full recomputation each step: no KV cache on the reference side at all."""
    ids = list(prompt)
    for _ in range(num_tokens):
        ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]
