"""EngineCore.embed: the blocks it borrows come back, refusals are typed, pooling is what the docstring says."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.engine.config import EngineConfig
from services.engine.core.sampling_params import SamplingParams
from services.engine.engine_core import EngineCore
from services.engine.errors import ContextLengthExceededError, InvalidParameterError, QueueFullError
from services.engine.model.pooler import pool


def test_pool_last_and_mean_are_unit_vectors_of_the_last_row_and_the_average() -> None:
    hidden = torch.tensor([[3.0, 0.0], [0.0, 4.0]])
    assert pool(hidden, "last").tolist() == [0.0, 1.0]
    # mean (1.5, 2) has norm 2.5: (0.6, 0.8)
    assert pool(hidden, "mean").tolist() == pytest.approx([0.6, 0.8])


def test_embed_gives_its_blocks_back_and_refuses_what_does_not_fit(tiny_model: Path) -> None:
    core = EngineCore(EngineConfig(model_path=tiny_model, model_id="tiny", kv_capacity_tokens=64, block_size=16,
                                   max_context=64))
    pool_blocks = core.scheduler.block_pool
    free = pool_blocks.num_free_blocks
    vectors = core.embed("r", [[1, 2, 3], list(range(1, 40))], now=0.0)
    assert [tuple(v.shape) for v in vectors] == [(64,), (64,)]
    assert pool_blocks.num_free_blocks == free  # borrowed for the forward, then freed
    with pytest.raises(ContextLengthExceededError):
        core.embed("r", [[1] * 65], now=0.0)
    with pytest.raises(InvalidParameterError):
        core.embed("r", [[]], now=0.0)
    with pytest.raises(InvalidParameterError):
        core.embed("r", [[core.model_config.vocab_size]], now=0.0)
    # a running request holds blocks: an input that needs more than are free waits for room (429), not a crash
    core.add_request("g", list(range(1, 40)), SamplingParams(max_tokens=8, ignore_eos=True), now=0.0)
    core.step(lambda: 0.0)
    with pytest.raises(QueueFullError):
        core.embed("r", [list(range(1, 64))], now=0.0)


def test_ninfer_serve_pooling_flag_defaults_to_last_and_refuses_an_unknown_kind(tiny_model: Path, tmp_path: Path
                                                                                ) -> None:
    import argparse

    from services.engine.__main__ import add_arguments, build_config

    parser = argparse.ArgumentParser(exit_on_error=False)
    add_arguments(parser)

    def pooling(*flags: str) -> str:
        engine, _, _ = build_config(parser.parse_args([str(tiny_model), "--data-dir", str(tmp_path), *flags]))
        return engine.pooling

    assert pooling() == "last"
    assert pooling("--pooling", "mean") == "mean"
    with pytest.raises((argparse.ArgumentError, SystemExit)):
        parser.parse_args([str(tiny_model), "--pooling", "cls"])
