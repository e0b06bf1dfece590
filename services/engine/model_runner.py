"""ModelRunner: turns one scheduled step into logits.

The scheduler decides *what* runs (which sequences, how many of their tokens, which blocks they own);
the runner only executes it: flatten the step's new tokens, build the attention metadata, run the model
(which writes K/V into the cache), and project the last row of each sequence that needs sampling to
logits. It never allocates blocks or decides admission.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from services.engine.attention import KVCache, SeqSpan, build_attention_metadata
from services.engine.model import CausalLM
from services.engine.model_config import ModelConfig


class StepSeq(Protocol):
    """What the runner reads of each scheduled sequence (RunnerSeq, or the scheduler's own type)."""

    @property
    def token_ids(self) -> Sequence[int]: ...  # new tokens this step: a prompt chunk or the last sample
    @property
    def start_pos(self) -> int: ...  # tokens already in the KV cache
    @property
    def block_table(self) -> Sequence[int]: ...  # covers positions 0 .. start_pos + len(token_ids) - 1
    @property
    def needs_logits(self) -> bool: ...  # this chunk ends at the last known token: sample from it
    @property
    def num_draft_tokens(self) -> int: ...  # trailing draft tokens: logits for the last 1 + this many rows


@dataclass(frozen=True, kw_only=True)
class RunnerSeq:
    """One sequence's share of a step (see StepSeq for the meaning of each field)."""

    token_ids: Sequence[int]
    start_pos: int
    block_table: Sequence[int]
    needs_logits: bool
    num_draft_tokens: int = 0


class ModelRunner:
    """Executes steps of ``model`` against ``kv_cache``; owns neither the blocks nor the schedule."""

    def __init__(
        self,
        model: CausalLM,
        config: ModelConfig,
        kv_cache: KVCache,
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> None:
        if block_size != kv_cache.block_size:
            raise ValueError(f"block_size {block_size} differs from the KV cache's {kv_cache.block_size}")
        self.model = model
        self.config = config
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = torch.device(device)

    def run(self, seqs: Sequence[StepSeq]) -> torch.Tensor:
        """Compute one step; return float32 logits ``[number of seqs with needs_logits, vocab_size]`` in
        the order of ``seqs``. Each sequence's K/V for ``token_ids`` is written into its blocks.

        A sequence with ``num_draft_tokens = k > 0`` (speculative verification) contributes ``1 + k``
        rows, its last ``1 + k`` positions in order, instead of one."""
        return self.run_with_hidden(seqs)[0]

    def run_with_hidden(self, seqs: Sequence[StepSeq]) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`run`, plus the final-normed hidden states ``[T, hidden_size]`` of every token of the
        step (``seqs``' ``token_ids`` concatenated in order): what an MTP drafter reads."""
        if not seqs:
            empty = torch.empty((0, self.config.vocab_size), dtype=torch.float32, device=self.device)
            return empty, torch.empty((0, self.config.hidden_size), dtype=self.model.dtype, device=self.device)
        input_ids: list[int] = []
        logit_rows: list[int] = []
        spans: list[SeqSpan] = []
        for seq in seqs:
            input_ids.extend(seq.token_ids)
            spans.append(SeqSpan(seq.start_pos, len(seq.token_ids), seq.block_table))
            if seq.needs_logits:
                if seq.num_draft_tokens:
                    logit_rows.extend(range(len(input_ids) - 1 - seq.num_draft_tokens, len(input_ids)))
                else:
                    logit_rows.append(len(input_ids) - 1)
        with torch.inference_mode():
            meta, positions = build_attention_metadata(spans, self.block_size, self.device)
            ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
            hidden = self.model(ids, positions, meta, self.kv_cache)
            if not logit_rows:
                return torch.empty((0, self.config.vocab_size), dtype=torch.float32, device=self.device), hidden
            rows = torch.tensor(logit_rows, dtype=torch.long, device=self.device)
            return self.model.compute_logits(hidden[rows]), hidden
