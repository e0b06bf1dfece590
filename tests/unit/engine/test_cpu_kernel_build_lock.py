"""A build killed mid-way leaves torch's ``lock`` file; the next engine start must not wait on it forever."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from services.engine.kernels import cpu_kernels


@pytest.fixture
def build_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    return tmp_path


def test_a_stale_lock_of_a_killed_build_is_removed_under_the_build_flock(build_root: Path) -> None:
    stale = build_root / "ninfer_cpu_kernels_test" / "lock"
    stale.parent.mkdir()
    stale.write_text("")  # what torch's FileBaton leaves when its builder is SIGKILLed
    with cpu_kernels._sole_builder("ninfer_cpu_kernels_test"):
        assert not stale.exists()


def _hold(name: str, ready: Any) -> None:  # a multiprocessing Event
    with cpu_kernels._sole_builder(name):
        (Path(os.environ["TORCH_EXTENSIONS_DIR"]) / name / "lock").write_text("")  # a live build's lock
        ready.set()
        time.sleep(60)


def test_a_live_builders_lock_is_left_alone_until_it_dies(build_root: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    ready = ctx.Event()
    builder = ctx.Process(target=_hold, args=("ninfer_cpu_kernels_live", ready))
    builder.start()
    try:
        assert ready.wait(30)
        lock = build_root / "ninfer_cpu_kernels_live" / "lock"
        assert lock.exists()
        os.kill(builder.pid, signal.SIGKILL)  # killed mid-build: its flock goes with it, its lock file stays
        builder.join(10)
        assert lock.exists()
        with cpu_kernels._sole_builder("ninfer_cpu_kernels_live"):  # must not hang
            assert not lock.exists()
    finally:
        if builder.is_alive():
            builder.kill()
