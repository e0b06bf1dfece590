"""Shared fixtures: a real nats-server per test (port chosen by the server), tiny checkpoints."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from services.common.bus import connect, ensure_bus
from services.common.nats_server import EmbeddedNatsServer


def pytest_sessionstart(session: pytest.Session) -> None:
    """Build the engine's compiled CPU kernels once, before any test starts an engine.

    The build (35-80 s, minutes on a loaded 2-core machine) otherwise happens inside the first engine a test
    starts, under that test's start-up wait (240 s for the e2e engines) and its pytest timeout. Here it runs
    before any test clock starts; every engine after it, in-process or a subprocess of the same environment,
    loads the built module.
    """
    from services.engine.kernels import cpu_kernels

    cpu_kernels.fused_decode()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight Qwen3 checkpoint with a real BPE tokenizer and chat template."""
    from services.engine.tiny_checkpoint import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("models") / "tiny-qwen3", arch="qwen3")


# Tokens a generation asks for when it must outlast a timeout, an outage or a check: the tiny model makes
# ~7,000 tokens a second on the bench CPU, so its 4,096-token context lasts about half a second.
LONG_GENERATION_TOKENS = 24_000


@pytest.fixture(scope="session")
def long_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny_model with a 32k-token context, for LONG_GENERATION_TOKENS-long generations."""
    from services.engine.tiny_checkpoint import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("models") / "tiny-qwen3-32k", arch="qwen3",
                                 max_position_embeddings=32_768)


@pytest.fixture
async def nats_server(tmp_path: Path) -> AsyncIterator[EmbeddedNatsServer]:
    async with EmbeddedNatsServer(tmp_path / "nats") as server:
        yield server


@pytest.fixture
async def nc(nats_server: EmbeddedNatsServer) -> AsyncIterator[object]:
    client = await connect(nats_server.url, "test")
    await ensure_bus(client)
    try:
        yield client
    finally:
        with contextlib.suppress(Exception):
            await client.drain()
