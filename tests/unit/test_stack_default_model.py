"""What ``make up`` / ``llmgw up`` serves when no model is named (issue #9): the trained demo model shipped in
``models/demo-qwen3``; in a checkout without its files (a sparse or LFS-less clone), a tiny random-weight
checkpoint written once into the data dir, with a warning that says so."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import pytest

from services.cli import stack

SHIPPED = Path(__file__).resolve().parents[2] / "models" / "demo-qwen3"


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    stack.add_arguments(parser)
    return parser.parse_args(argv)


def test_with_no_model_named_the_stack_serves_the_shipped_demo_model(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LLMGW_MODEL", raising=False)
    assert parse().model is None  # so run() asks default_model
    assert stack.default_model(tmp_path) == SHIPPED
    assert json.loads((SHIPPED / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    assert list(tmp_path.iterdir()) == []  # nothing written to the data dir


def test_a_model_named_by_flag_or_environment_replaces_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMGW_MODEL", "/srv/models/from-env")
    assert parse().model == "/srv/models/from-env"
    assert parse("--model", "/srv/models/from-flag").model == "/srv/models/from-flag"


@pytest.mark.parametrize("present", [(), ("config.json",)], ids=["folder empty", "weights missing"])
def test_without_the_demo_model_files_the_stack_writes_a_tiny_checkpoint_once_and_warns(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        present: tuple[str, ...]) -> None:
    demo = tmp_path / "repo" / "models" / "demo-qwen3"
    demo.mkdir(parents=True)
    for name in present:
        (demo / name).write_text("{}")
    monkeypatch.setattr(stack, "DEMO_MODEL", demo)
    data = tmp_path / "data"
    with caplog.at_level(logging.WARNING, logger="llmgw.up"):
        model = stack.default_model(data)
    assert model == data / "models" / "tiny-qwen3"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {f.name for f in model.iterdir()}
    assert json.loads((model / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    assert [r.message for r in caplog.records if "no trained demo model" in r.message]
    written_ns = (model / "model.safetensors").stat().st_mtime_ns
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="llmgw.up"):
        assert stack.default_model(data) == model  # the second start reuses it
    assert (model / "model.safetensors").stat().st_mtime_ns == written_ns
    assert not caplog.records
