"""ModelRunner: turns one scheduled step into logits.

The scheduler decides *what* runs (which sequences, how many of their tokens, which blocks they own);
the runner only executes it: flatten the step's new tokens, build the attention metadata, run the model
(which writes K/V into the cache), and project the last row of each sequence that needs sampling to
logits. It never allocates blocks or decides admission.

With :meth:`ModelRunner.enable_decode_graphs` (CUDA, Triton backend), a step in which every sequence
decodes one token runs through CUDA graphs captured per batch-size bucket (kernels/cuda_graphs.py);
prefill chunks, speculative verification and MTP steps (which need the hidden states) run eagerly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from services.engine.model.attention import SeqSpan, build_attention_metadata
from services.engine.model.cuda_graphs import DecodeGraphRunner, DecodeInputs, decode_metadata
from services.engine.model.kv_cache import KVCache
from services.engine.model.model import CausalLM
from services.engine.model.model_config import ModelConfig

log = logging.getLogger(__name__)


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
        self.graphs: DecodeGraphRunner | None = None
        self._graph_max_seq_len = 0

    def enable_decode_graphs(self, max_batch_size: int, max_context: int, *, capture: bool = True) -> None:
        """Send one-token decode steps of up to ``max_batch_size`` sequences, each at most ``max_context``
        long, through :class:`DecodeGraphRunner`; ``capture`` records its graphs now (CUDA only). Without
        a capture the same path runs eagerly (how the CPU tests check it, with the Triton interpreter).

        Needs an attention backend that reads only device tensors and takes a fixed split count
        (TritonPagedAttention): each bucket is captured with the split count its batch size calls for.
        """
        if not hasattr(self.model.attention, "num_splits"):
            raise ValueError(f"{type(self.model.attention).__name__} cannot be captured in a CUDA graph "
                             "(it reads host-side lengths): use the triton backend")
        max_blocks = -(-max_context // self.block_size)
        self._graph_max_seq_len = max_blocks * self.block_size
        self.graphs = DecodeGraphRunner(self._graph_step, max_batch_size=max_batch_size,
                                        max_blocks_per_seq=max_blocks, device=self.device)
        if capture:
            with torch.inference_mode():
                self.graphs.capture()

    def _graph_step(self, inputs: DecodeInputs) -> torch.Tensor:
        """A decode forward over static inputs (capturable): logits ``[B, vocab]``."""
        from services.engine.kernels.decode_attention import default_num_splits

        attention = self.model.attention
        saved = attention.num_splits  # type: ignore[attr-defined]  # graphs are captured only on TritonPagedAttention
        # Fixed for the bucket: a graph replays the launch shape it recorded.
        attention.num_splits = default_num_splits(  # type: ignore[attr-defined]  # as above: Triton backend only
            self._graph_max_seq_len, inputs.num_seqs, self.config.num_key_value_heads)
        try:
            meta = decode_metadata(inputs, self.block_size, self._graph_max_seq_len)
            hidden = self.model(inputs.input_ids, inputs.positions, meta, self.kv_cache)
            return self.model.compute_logits(hidden)
        finally:
            attention.num_splits = saved  # type: ignore[attr-defined]  # as above: Triton backend only

    def run(self, seqs: Sequence[StepSeq]) -> torch.Tensor:
        """Compute one step; return float32 logits ``[number of seqs with needs_logits, vocab_size]`` in
        the order of ``seqs``. Each sequence's K/V for ``token_ids`` is written into its blocks.

        A sequence with ``num_draft_tokens = k > 0`` (speculative verification) contributes ``1 + k``
        rows, its last ``1 + k`` positions in order, instead of one."""
        if self.graphs is not None and seqs and all(
            len(s.token_ids) == 1 and s.needs_logits and not s.num_draft_tokens for s in seqs
        ):
            return self._run_decode(seqs)
        return self.run_with_hidden(seqs)[0]

    def _run_decode(self, seqs: Sequence[StepSeq]) -> torch.Tensor:
        assert self.graphs is not None
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        tables: list[list[int]] = []
        for seq in seqs:
            pos = seq.start_pos
            table = list(seq.block_table[: pos // bs + 1])
            if len(table) <= pos // bs:
                raise ValueError(f"block table of {len(table)} blocks does not cover position {pos}")
            ids.append(seq.token_ids[0])
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            tables.append(table)
        width = max(len(t) for t in tables)
        device, long = self.device, torch.long
        with torch.inference_mode():
            inputs = DecodeInputs(
                input_ids=torch.tensor(ids, dtype=long, device=device),
                positions=torch.tensor(positions, dtype=long, device=device),
                slot_mapping=torch.tensor(slots, dtype=long, device=device),
                seq_lens=torch.tensor([p + 1 for p in positions], dtype=long, device=device),
                block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=long, device=device),
            )
            # A replayed result lives in the graph's output buffer until the next replay: copy it out.
            return self.graphs.run(inputs).clone()

    def run_with_hidden(self, seqs: Sequence[StepSeq]) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`run`, plus the final-normed hidden states ``[T, hidden_size]`` of every token of the
        step (``seqs``' ``token_ids`` concatenated in order): what an MTP drafter reads."""
        if not seqs:
            empty = torch.empty((0, self.config.vocab_size), dtype=torch.float32, device=self.device)
            return empty, torch.empty((0, self.config.hidden_size), dtype=self.model.dtype, device=self.device)
        input_ids: list[int] = []
        logit_rows: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        tables: list[Sequence[int]] = []
        for seq in seqs:
            input_ids.extend(seq.token_ids)
            query_start_loc.append(len(input_ids))
            seq_lens.append(seq.start_pos + len(seq.token_ids))
            tables.append(seq.block_table)
            if seq.needs_logits:
                if seq.num_draft_tokens:
                    logit_rows.extend(range(len(input_ids) - 1 - seq.num_draft_tokens, len(input_ids)))
                else:
                    logit_rows.append(len(input_ids) - 1)
        with torch.inference_mode():
            # the compiled CPU decoder takes the step as lists; other paths get metadata tensors
            done = self.model.compiled_step(self.kv_cache, input_ids, query_start_loc, seq_lens, tables,
                                            self.block_size, logit_rows)
            if done is not None:
                return done
            spans = [SeqSpan(seq.start_pos, len(seq.token_ids), seq.block_table) for seq in seqs]
            meta, positions = build_attention_metadata(spans, self.block_size, self.device)
            ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
            rows = torch.tensor(logit_rows, dtype=torch.long, device=self.device)
            return self.model.forward_logits(ids, positions, meta, self.kv_cache, rows)


def capture_decode_graphs(runner: ModelRunner, *, enabled: bool, device: torch.device, backend: str,
                          max_batch_size: int, max_context: int) -> str:
    """Capture the runner's decode graphs where they apply; what happened, for the startup line."""
    if not enabled:
        return "off (--no-cuda-graphs)"
    if device.type != "cuda" or backend != "triton":
        return f"off ({device.type}, {backend} backend)"
    started = time.monotonic()
    try:
        runner.enable_decode_graphs(max_batch_size, max_context)
    except Exception as exc:  # eager decoding still works: say why and go on
        runner.graphs = None
        log.warning("CUDA graphs off: capture failed: %s", exc)
        return f"off (capture failed: {type(exc).__name__})"
    assert runner.graphs is not None
    sizes = runner.graphs.sizes
    return f"on (decode batch sizes {', '.join(map(str, sizes))}; captured in {time.monotonic() - started:.1f} s)"
