"""CUDA-graph decode bucketing and padding (services/engine/model/cuda_graphs.py), on CPU.

Capture and replay need a GPU and are exercised by bench/gpu_bench.py; here: which bucket a batch lands
in, what the padded rows contain (slot -1 so the cache is never written, seq_len 0 so attention reads
nothing), that refilling a bucket overwrites every stale row, and that an uncaptured runner is eager.
"""

from __future__ import annotations

import pytest
import torch

from services.engine.model.cuda_graphs import (
    PAD_SLOT,
    DecodeGraphRunner,
    DecodeInputs,
    StaticDecodeBuffers,
    capture_batch_sizes,
    decode_metadata,
    padded_batch_size,
)


def _inputs(num_seqs: int, width: int, *, first_id: int = 100) -> DecodeInputs:
    return DecodeInputs(
        input_ids=torch.arange(first_id, first_id + num_seqs),
        positions=torch.arange(num_seqs) + 10,
        slot_mapping=torch.arange(num_seqs) * 7 + 3,
        seq_lens=torch.arange(num_seqs) + 11,
        block_tables=torch.arange(num_seqs * width).reshape(num_seqs, width) + 1,
    )


def test_buckets_are_powers_of_two_then_the_maximum() -> None:
    assert capture_batch_sizes(1) == (1,)
    assert capture_batch_sizes(32) == (1, 2, 4, 8, 16, 32)
    assert capture_batch_sizes(48) == (1, 2, 4, 8, 16, 32, 48)


def test_a_batch_runs_in_the_smallest_bucket_that_holds_it() -> None:
    sizes = capture_batch_sizes(48)
    assert [padded_batch_size(n, sizes) for n in (1, 2, 3, 5, 8, 9, 17, 33, 48)] == [1, 2, 4, 8, 8, 16, 32, 48, 48]
    assert padded_batch_size(49, sizes) is None  # too big for any graph: eager
    with pytest.raises(ValueError, match="at least 1"):
        padded_batch_size(0, sizes)


def test_fill_copies_the_real_rows_and_pads_the_rest_harmlessly() -> None:
    buffers = StaticDecodeBuffers(max_batch_size=8, max_blocks_per_seq=4, device="cpu")
    real = _inputs(3, 2)
    padded = buffers.fill(real, 4)
    assert padded.num_seqs == 4
    assert padded.input_ids.tolist() == [100, 101, 102, 0]
    assert padded.positions.tolist() == [10, 11, 12, 0]
    assert padded.slot_mapping.tolist() == [3, 10, 17, PAD_SLOT]
    assert padded.seq_lens.tolist() == [11, 12, 13, 0]
    assert padded.block_tables.tolist() == [[1, 2, 0, 0], [3, 4, 0, 0], [5, 6, 0, 0], [0, 0, 0, 0]]


def test_refilling_a_bucket_with_fewer_rows_leaves_no_stale_row_behind() -> None:
    buffers = StaticDecodeBuffers(max_batch_size=8, max_blocks_per_seq=4, device="cpu")
    first = buffers.fill(_inputs(8, 4), 8)
    first_ptr = first.input_ids.data_ptr()
    second = buffers.fill(_inputs(5, 1, first_id=200), 8)
    assert second.input_ids.data_ptr() == first_ptr  # same storage: what a captured graph reads
    assert second.input_ids.tolist() == [200, 201, 202, 203, 204, 0, 0, 0]
    assert second.slot_mapping.tolist()[5:] == [PAD_SLOT] * 3
    assert second.seq_lens.tolist()[5:] == [0, 0, 0]
    assert second.block_tables[:5, 1:].abs().sum().item() == 0  # old columns 1..3 cleared
    assert second.block_tables[5:].abs().sum().item() == 0


def test_inputs_wider_or_longer_than_the_buffers_are_refused() -> None:
    buffers = StaticDecodeBuffers(max_batch_size=4, max_blocks_per_seq=2, device="cpu")
    assert not buffers.fits(_inputs(2, 3))
    assert not buffers.fits(_inputs(5, 1))
    with pytest.raises(ValueError, match="do not fit"):
        buffers.fill(_inputs(2, 3), 2)


def test_decode_metadata_has_one_token_per_row() -> None:
    meta = decode_metadata(_inputs(3, 2), block_size=16, max_seq_len=64)
    assert meta.num_seqs == 3 and meta.num_tokens == 3
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3]
    assert meta.max_seq_len == 64


def test_an_uncaptured_runner_calls_the_step_eagerly_on_the_unpadded_inputs() -> None:
    seen: list[int] = []

    def step(inputs: DecodeInputs) -> torch.Tensor:
        seen.append(inputs.num_seqs)
        return inputs.input_ids * 2

    runner = DecodeGraphRunner(step, max_batch_size=8, max_blocks_per_seq=4, device="cpu")
    assert not runner.is_captured
    assert runner.run(_inputs(3, 2)).tolist() == [200, 202, 204]
    assert seen == [3]
    with pytest.raises(RuntimeError, match="CUDA device"):
        runner.capture()
