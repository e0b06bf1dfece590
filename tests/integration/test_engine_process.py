"""ProcessEngine: the engine core in a child process, behind the same interface as the threaded AsyncEngine."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from services.engine.config import EngineConfig
from services.engine.core.sampling_params import SamplingParams
from services.engine.engine_core import EngineCore
from services.engine.errors import CoreLostError, ModelLoadError, QueueFullError, SpeculativeDecodingError
from services.engine.serve.async_engine import AsyncEngine
from services.engine.serve.process_engine import ProcessEngine
from services.engine.spec.spec_decode import SpecConfig
from tests.conftest import LONG_GENERATION_TOKENS


def config(model: Path, **overrides: object) -> EngineConfig:
    settings: dict[str, object] = dict(model_path=model, model_id="tiny", kv_capacity_tokens=2048,
                                       max_concurrency=2, max_pending_requests=4, torch_threads=1)
    settings.update(overrides)
    return EngineConfig(**settings)  # type: ignore[arg-type]


async def collect(engine: ProcessEngine | AsyncEngine, rid: str, prompt: list[int], max_tokens: int) -> list[int]:
    stream = await engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                  ignore_eos=True))
    tokens: list[int] = []
    async for out in stream:
        tokens += out.token_ids
    return tokens


async def test_the_child_serves_the_same_greedy_tokens_as_the_threaded_engine(tiny_model: Path) -> None:
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]
    async with AsyncEngine(EngineCore(config(tiny_model))) as threaded:
        expected = [await collect(threaded, f"t{i}", p, 12) for i, p in enumerate(prompts)]
    changes: list[int] = []
    async with ProcessEngine(config(tiny_model)) as engine:
        engine.on_change(lambda: changes.append(1))
        assert engine.core.model_id == "tiny" and engine.core.max_context == 2048
        assert "KV capacity 2048 tokens" in engine.description and engine.pid != os.getpid()
        got = await asyncio.gather(*(collect(engine, f"p{i}", p, 12) for i, p in enumerate(prompts)))
        snap = engine.snapshot()
        assert snap.output_tokens_total == 24 and snap.admitted_total == 2 and snap.stats.num_running == 0
    assert got == expected
    assert changes  # listeners heard about state changes from the child


async def test_admission_errors_cross_the_process_boundary_typed(long_model: Path) -> None:
    async with ProcessEngine(config(long_model, max_concurrency=1, max_pending_requests=1,
                                    kv_capacity_tokens=LONG_GENERATION_TOKENS + 64)) as engine:
        params = SamplingParams(max_tokens=LONG_GENERATION_TOKENS, temperature=0.0, ignore_eos=True)
        first = await engine.add_request("a", [5, 6, 7], params)
        outputs = aiter(first)
        await anext(outputs)  # "a" runs: it holds the only lane
        await engine.add_request("b", [5, 6, 7], params)  # waits in the queue of 1
        with pytest.raises(QueueFullError) as err:
            await engine.add_request("c", [5, 6, 7], params)
        assert err.value.max_pending_requests == 1 and err.value.retry_after_s > 0
        await outputs.aclose()  # the client went away: the child aborts "a" and frees its blocks
        for _ in range(200):
            if engine.snapshot().stats.num_running == 1 and engine.snapshot().stats.num_waiting == 0:
                break
            await asyncio.sleep(0.02)
        assert engine.snapshot().stats.num_waiting == 0  # "b" took the freed lane


async def test_a_core_that_cannot_start_fails_the_start_with_its_own_error(tiny_model: Path, tmp_path: Path) -> None:
    with pytest.raises(SpeculativeDecodingError, match="mtp"):
        async with ProcessEngine(config(tiny_model, spec=SpecConfig(method="mtp", num_draft_tokens=2))):
            pass
    with pytest.raises(ModelLoadError, match="cannot load model"):
        async with ProcessEngine(config(tmp_path / "nowhere")):
            pass


async def test_a_dead_child_ends_every_open_stream_and_marks_the_engine_failed(tiny_model: Path) -> None:
    async with ProcessEngine(config(tiny_model)) as engine:
        stream = await engine.add_request("long", [5, 6, 7], SamplingParams(max_tokens=1500, temperature=0.0,
                                                                            ignore_eos=True))
        outputs = []
        async for out in stream:
            outputs.append(out)
            if len(outputs) == 2:
                assert engine.pid is not None
                os.kill(engine.pid, signal.SIGKILL)
        assert outputs[-1].finish_reason == "abort"
        assert engine.step_error is not None and "exited" in str(engine.step_error)
        with pytest.raises(CoreLostError, match="exited"):
            await engine.add_request("after", [5], SamplingParams(max_tokens=2))
        lost = await asyncio.wait_for(engine.core_lost(), 10)  # what stops the service (engine __main__)
        assert isinstance(lost, CoreLostError) and lost.exit_code == -signal.SIGKILL
        assert "killed by signal 9" in str(lost)


def test_the_cpu_child_starts_with_short_openmp_spins_unless_the_operator_chose(monkeypatch: pytest.MonkeyPatch,
                                                                                tmp_path: Path) -> None:
    from services.engine.serve.process_engine import CPU_SPINCOUNT, _child_environment

    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    with _child_environment(config(tmp_path)):
        assert os.environ["GOMP_SPINCOUNT"] == CPU_SPINCOUNT
    assert "GOMP_SPINCOUNT" not in os.environ  # only the child's start sees it
    with _child_environment(config(tmp_path, device="cuda")):
        assert "GOMP_SPINCOUNT" not in os.environ
    monkeypatch.setenv("GOMP_SPINCOUNT", "7")
    with _child_environment(config(tmp_path)):
        assert os.environ["GOMP_SPINCOUNT"] == "7"


async def test_a_stream_interval_merges_outputs_without_changing_the_tokens(tiny_model: Path) -> None:
    prompt = [5, 6, 7, 8, 9]

    async def outputs(engine: ProcessEngine | AsyncEngine) -> list[tuple[int, ...]]:
        stream = await engine.add_request("r", prompt, SamplingParams(max_tokens=2000, temperature=0.0,
                                                                      ignore_eos=True))
        return [out.token_ids async for out in stream]

    # 2,000 tokens: long enough that a reader without an interval is handed many outputs (it merges only
    # what queued up while it was busy; the tiny model makes a token in ~0.2 ms).
    async with AsyncEngine(EngineCore(config(tiny_model))) as engine:
        each_step = await outputs(engine)
    # An interval far longer than the whole request: everything after the first text waits for the end.
    async with ProcessEngine(config(tiny_model, stream_interval_ms=60_000)) as engine:
        held = await outputs(engine)
    assert [t for out in held for t in out] == [t for out in each_step for t in out]
    assert len(each_step) >= 30 and len(held) <= 3, (len(each_step), len(held))


async def test_embeddings_from_the_child_are_the_threaded_engines_and_its_refusals_come_back_typed(
        tiny_model: Path) -> None:
    from services.engine.errors import ContextLengthExceededError

    inputs = [[5, 6, 7, 8, 9], [11, 12, 13]]
    async with AsyncEngine(EngineCore(config(tiny_model, max_context=64))) as threaded:
        expected = await threaded.embed("t", inputs)
    async with ProcessEngine(config(tiny_model, max_context=64)) as engine:
        got = await engine.embed("p", inputs)
        with pytest.raises(ContextLengthExceededError):
            await engine.embed("q", [[1] * 65])
        assert engine.snapshot().stats.num_kv_blocks_used == 0  # the borrowed blocks came back
    assert [len(v) for v in got] == [64 * 4, 64 * 4]  # hidden size 64, float32
    assert got == expected
