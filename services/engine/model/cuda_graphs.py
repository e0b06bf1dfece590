"""CUDA graphs for decode steps: batch-size buckets, static input buffers, capture and replay.

A decode step of a small model on a GPU is launch-bound (hundreds of kernel launches for ~1 ms of work),
so the step is captured once per *bucket* of batch sizes and replayed. Buckets are 1, 2, 4, 8, 16, 32, …
up to ``max_batch_size`` (and ``max_batch_size`` itself when it is not a power of two); a batch of ``n``
runs in the smallest bucket ``>= n``, its rows ``n ..`` padded so they do no harm:

* input id 0 at position 0 (any valid token; its output row is dropped),
* slot -1: ``kernels.kv_write`` skips negative slots, so padding never writes the cache,
* seq_len 0: ``kernels.decode_attention`` gives such a row zeros without reading the cache,
* block-table row of zeros.

A graph replays fixed pointers and launch shapes, so everything the step reads lives in buffers
allocated once (``StaticDecodeBuffers``) and refilled in place before each replay, and the attention
backend must not choose launch shapes from host values that vary per step: use
``TritonPagedAttention(num_splits=N)`` with a fixed N (the split length is derived on the device). Steps
that do not fit (a prefill, a batch above the largest bucket, a context wider than the block-table
buffer) run eagerly.

Only the bucketing and padding logic runs on CPU (tests/unit/engine/test_cuda_graphs.py and the padded
decode test in test_triton_kernels.py); capture and replay need a CUDA device.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.engine.model.attention import AttentionMetadata

PAD_SLOT = -1


def capture_batch_sizes(max_batch_size: int) -> tuple[int, ...]:
    """Buckets ``1, 2, 4, …`` below ``max_batch_size``, then ``max_batch_size`` itself (ascending)."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}")
    sizes = []
    size = 1
    while size < max_batch_size:
        sizes.append(size)
        size *= 2
    sizes.append(max_batch_size)
    return tuple(sizes)


def padded_batch_size(num_seqs: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest bucket in ``sizes`` (ascending) holding ``num_seqs`` rows; None when none does."""
    if num_seqs < 1:
        raise ValueError(f"num_seqs must be at least 1, got {num_seqs}")
    index = bisect.bisect_left(sizes, num_seqs)
    return sizes[index] if index < len(sizes) else None


@dataclass(frozen=True, kw_only=True)
class DecodeInputs:
    """One decode step's device inputs, one row per sequence (each sequence has exactly one new token)."""

    input_ids: torch.Tensor  # [B] long
    positions: torch.Tensor  # [B] long: the new token's position = seq_len - 1
    slot_mapping: torch.Tensor  # [B] long: where its K/V go; PAD_SLOT on padded rows
    seq_lens: torch.Tensor  # [B] long: context length including the new token; 0 on padded rows
    block_tables: torch.Tensor  # [B, max_blocks] long

    @property
    def num_seqs(self) -> int:
        return int(self.input_ids.shape[0])


class StaticDecodeBuffers:
    """Input buffers for ``max_batch_size`` rows, allocated once so captured graphs can read them."""

    def __init__(self, max_batch_size: int, max_blocks_per_seq: int, device: torch.device | str) -> None:
        self.max_batch_size = max_batch_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self._inputs = DecodeInputs(
            input_ids=torch.zeros(max_batch_size, dtype=torch.long, device=device),
            positions=torch.zeros(max_batch_size, dtype=torch.long, device=device),
            slot_mapping=torch.full((max_batch_size,), PAD_SLOT, dtype=torch.long, device=device),
            seq_lens=torch.zeros(max_batch_size, dtype=torch.long, device=device),
            block_tables=torch.zeros(max_batch_size, max_blocks_per_seq, dtype=torch.long, device=device),
        )

    def fits(self, inputs: DecodeInputs) -> bool:
        return inputs.num_seqs <= self.max_batch_size and inputs.block_tables.shape[1] <= self.max_blocks_per_seq

    def fill(self, inputs: DecodeInputs, padded_size: int) -> DecodeInputs:
        """Copy ``inputs`` into rows ``0 .. n-1``, pad rows ``n .. padded_size-1`` (see the module docstring),
        and return the buffers' first ``padded_size`` rows. In place: no allocation, no host sync."""
        n, width = inputs.num_seqs, inputs.block_tables.shape[1]
        if not n <= padded_size <= self.max_batch_size or width > self.max_blocks_per_seq:
            raise ValueError(
                f"{n} rows x {width} blocks do not fit a bucket of {padded_size} "
                f"(buffers hold {self.max_batch_size} x {self.max_blocks_per_seq})"
            )
        buf = self._inputs
        buf.input_ids[:n].copy_(inputs.input_ids)
        buf.positions[:n].copy_(inputs.positions)
        buf.slot_mapping[:n].copy_(inputs.slot_mapping)
        buf.seq_lens[:n].copy_(inputs.seq_lens)
        buf.block_tables[:n, :width].copy_(inputs.block_tables)
        buf.block_tables[:n, width:].zero_()
        buf.input_ids[n:padded_size].zero_()
        buf.positions[n:padded_size].zero_()
        buf.slot_mapping[n:padded_size].fill_(PAD_SLOT)
        buf.seq_lens[n:padded_size].zero_()
        buf.block_tables[n:padded_size].zero_()
        return self.view(padded_size)

    def view(self, size: int) -> DecodeInputs:
        buf = self._inputs
        return DecodeInputs(
            input_ids=buf.input_ids[:size],
            positions=buf.positions[:size],
            slot_mapping=buf.slot_mapping[:size],
            seq_lens=buf.seq_lens[:size],
            block_tables=buf.block_tables[:size],
        )


def decode_metadata(inputs: DecodeInputs, block_size: int, max_seq_len: int) -> AttentionMetadata:
    """AttentionMetadata over ``inputs`` for a backend that reads only device tensors and the row count
    (TritonPagedAttention with a fixed ``num_splits``). The host lists are placeholders of the right
    length (every row one token; ``max_seq_len`` stands in for every row's length): they are never
    read per row on that path, and reading them would not be replayable anyway."""
    num_seqs = inputs.num_seqs
    query_start_loc = torch.arange(num_seqs + 1, dtype=torch.long, device=inputs.input_ids.device)
    return AttentionMetadata(
        slot_mapping=inputs.slot_mapping,
        query_start_loc=query_start_loc,
        seq_lens=inputs.seq_lens,
        block_tables=inputs.block_tables,
        query_start_loc_list=tuple(range(num_seqs + 1)),
        seq_lens_list=(max_seq_len,) * num_seqs,
        block_size=block_size,
        decode=None,
    )


StepFn = Callable[[DecodeInputs], torch.Tensor]


class DecodeGraphRunner:
    """Runs ``step_fn(inputs) -> [B, ...]`` (a decode forward, e.g. hidden states or logits) through CUDA
    graphs captured per bucket; ``run`` returns the first ``n`` rows. Before ``capture`` (or on CPU) every
    call runs ``step_fn`` eagerly on the unpadded inputs.

    ``step_fn`` must be capturable: no host syncs, no allocation whose address it later depends on
    outside the graph's pool, attention with a fixed split count. Owned by the model runner; not
    thread-safe (one engine step at a time, as the engine runs them).
    """

    def __init__(self, step_fn: StepFn, *, max_batch_size: int, max_blocks_per_seq: int,
                 device: torch.device | str) -> None:
        self.step_fn = step_fn
        self.device = torch.device(device)
        self.sizes = capture_batch_sizes(max_batch_size)
        self.buffers = StaticDecodeBuffers(max_batch_size, max_blocks_per_seq, self.device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}

    @property
    def is_captured(self) -> bool:
        return bool(self._graphs)

    def capture(self, *, num_warmup: int = 2) -> None:
        """Capture one graph per bucket, largest first so the smaller ones reuse its memory pool."""
        if self.device.type != "cuda":
            raise RuntimeError(f"CUDA graphs need a CUDA device, not {self.device}")
        pool = None
        for size in reversed(self.sizes):
            inputs = self.buffers.view(size)  # all padding: seq_len 0, slot -1 — touches no cache block
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(num_warmup):  # lets lazy inits (autotuning, cuBLAS handles) happen outside
                    self.step_fn(inputs)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._outputs[size] = self.step_fn(inputs)
            pool = graph.pool()
            self._graphs[size] = graph
        torch.cuda.synchronize(self.device)

    def run(self, inputs: DecodeInputs) -> torch.Tensor:
        """The step's output rows for ``inputs``. A replayed result is a view into the graph's output
        buffer: consume it (sample, copy) before the next ``run``."""
        size = padded_batch_size(inputs.num_seqs, self.sizes)
        if size is None or size not in self._graphs or not self.buffers.fits(inputs):
            return self.step_fn(inputs)
        self.buffers.fill(inputs, size)
        self._graphs[size].replay()
        return self._outputs[size][: inputs.num_seqs]
