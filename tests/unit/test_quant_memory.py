"""Memory honesty at start: the KV cache is sized from the context actually served (a --max-context above
the model's limit is clamped, and the cache with it), and the start line reports the weights' bytes."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from services.engine.config import EngineConfig
from services.engine.engine_core import EngineCore
from services.engine.model.kv_cache import KVCacheSpec, allocate_kv_cache
from services.engine.tiny_checkpoint import write_tiny_checkpoint
from tests.unit import quant_checkpoints as qc


def test_a_max_context_above_the_model_limit_sizes_the_cache_from_the_limit() -> None:
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=16, block_size=16, dtype=torch.float32,
                       kv_cache_dtype="auto")
    sized = allocate_kv_cache(spec, torch.device("cpu"), free_bytes=64 * 2**30, capacity_tokens=None,
                              memory_fraction=0.9, max_concurrency=2, max_context=4_000_000, model_max_context=4096)
    # every lane at full (clamped) context twice over, plus the null block: 2 * 2 * 4096 + 16 tokens
    assert sized.kv_capacity_tokens == 2 * 2 * 4096
    assert sized.max_context == 4096
    assert sized.kv_cache.nbytes == (2 * 2 * 4096 + 16) * spec.bytes_per_token


def test_the_start_line_reports_weight_bytes_and_the_dequantisation_mode(tmp_path: Path) -> None:
    dense = write_tiny_checkpoint(tmp_path / "dense", "qwen3", hidden_size=128, intermediate_size=256,
                                  max_position_embeddings=512)
    config = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}
    qc.quantize_checkpoint(dense, tmp_path / "awq", tmp_path / "twin", qc.awq(32), config)
    lines = {}
    for mode in ("load", "per-product"):
        core = EngineCore(EngineConfig(model_path=tmp_path / "awq", quant_dequant=mode, max_context=10**6,  # type: ignore[arg-type]
                                       max_concurrency=2, block_size=16))
        lines[mode] = core.describe()
        assert core.max_context == 512
        assert core.kv_capacity_tokens <= 2 * 2 * 512
        assert f"(awq, dequantised {mode})" in lines[mode]
    load_mib, packed_mib = (float(re.search(r"weights ([0-9.]+) MiB", lines[m]).group(1))  # type: ignore[union-attr]
                            for m in ("load", "per-product"))
    # int4 codes + fp16 scales + int4 zeros in place of fp32 weights (embedding and lm_head stay dense)
    assert packed_mib < 0.6 * load_mib


def test_the_quant_dequant_flag_reaches_the_engine_config_and_refuses_other_values(tmp_path: Path) -> None:
    import argparse

    import pytest

    from services.engine.__main__ import add_arguments, build_config

    model = write_tiny_checkpoint(tmp_path / "m", "qwen3")

    def cli(*flags: str) -> argparse.Namespace:
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        return parser.parse_args([str(model), "--data-dir", str(tmp_path), *flags])

    assert build_config(cli())[0].quant_dequant == "load"  # the in-tile kernels only when asked (not GPU-run yet)
    assert build_config(cli("--quant-dequant", "auto"))[0].quant_dequant == "auto"
    assert build_config(cli("--quant-dequant", "load"))[0].quant_dequant == "load"
    assert build_config(cli("--quant-dequant", "per-product"))[0].quant_dequant == "per-product"
    with pytest.raises(SystemExit):
        cli("--quant-dequant", "lazy")


def test_auto_dequantises_in_the_tile_on_the_triton_backend_and_at_load_on_torch() -> None:
    from services.engine.model.loader import resolve_quant_dequant

    assert resolve_quant_dequant("auto", "triton") == "per-product"
    assert resolve_quant_dequant("auto", "torch") == "load"
    assert resolve_quant_dequant("load", "triton") == "load"
    assert resolve_quant_dequant("per-product", "torch") == "per-product"
