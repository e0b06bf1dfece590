"""EngineCore end to end against transformers: continuous batching must not change a single token.

Every scenario below runs the real step loop (scheduler → runner → sampler → detokenizer) and compares
each request's greedy tokens with transformers decoding the same prompt alone.
"""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest

from services.engine.config import EngineConfig
from services.engine.engine_core import EngineCore
from services.engine.errors import ContextLengthExceededError, QueueFullError
from services.engine.llm import greedy
from services.engine.tiny_checkpoint import write_tiny_checkpoint
from tests.unit.engine.fake_clock import FakeClock
from tests.unit.engine.model_helpers import hf_greedy, hf_model

NUM_NEW = 12


def run_staggered(core: EngineCore, prompts: list[list[int]], arrivals: list[int], max_tokens: int = NUM_NEW,
                  ) -> dict[str, list[int]]:
    """Add prompt i at step arrivals[i]; step until all finish; return each request's output tokens."""
    clock = FakeClock()
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    for step in itertools.count():
        for i, at in enumerate(arrivals):
            if at == step:
                core.add_request(f"r{i}", prompts[i], greedy(max_tokens, ignore_eos=True), clock())
        if step > max(arrivals) and not core.has_unfinished_requests():
            return out
        for o in core.step(clock):
            out[o.request_id].extend(o.token_ids)
    raise AssertionError("unreachable")


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp(request.param) / "ckpt", arch=request.param)


@pytest.fixture(scope="module")
def reference(checkpoint: Path):  # type: ignore[no-untyped-def]
    hf = hf_model(checkpoint)
    cache: dict[tuple[int, ...], list[int]] = {}

    def greedy_tokens(prompt: list[int]) -> list[int]:
        key = tuple(prompt)
        if key not in cache:
            cache[key] = hf_greedy(hf, prompt, NUM_NEW)
        return cache[key]

    return greedy_tokens


def prompts_with_shared_prefix(seed: int, n: int, prefix_len: int = 24) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 500) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 20))] for _ in range(n)]


def test_staggered_arrivals_with_chunked_prefill_match_transformers(checkpoint: Path, reference) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(5, 40))] for _ in range(5)]
    # A 16-token budget per step: 40-token prompts are prefilled in chunks while others decode.
    core = EngineCore(EngineConfig(model_path=checkpoint, kv_capacity_tokens=1024, block_size=4,
                                   max_num_batched_tokens=16, max_concurrency=4, max_pending_requests=8))
    got = run_staggered(core, prompts, arrivals=[0, 0, 2, 5, 9])
    for i, prompt in enumerate(prompts):
        assert got[f"r{i}"] == reference(prompt), f"request {i} diverged"


def test_prefix_cache_hits_do_not_change_tokens(checkpoint: Path, reference) -> None:  # type: ignore[no-untyped-def]
    prompts = prompts_with_shared_prefix(seed=2, n=4)
    core = EngineCore(EngineConfig(model_path=checkpoint, kv_capacity_tokens=1024, block_size=4,
                                   max_concurrency=4))
    # The later arrivals find the shared 24-token prefix (6 full blocks) cached.
    got = run_staggered(core, prompts, arrivals=[0, 3, 6, 9])
    stats = core.scheduler.stats()
    assert stats.num_prompt_tokens_hit >= 3 * 24
    for i, prompt in enumerate(prompts):
        assert got[f"r{i}"] == reference(prompt)


def test_forced_preemption_recomputes_to_the_same_tokens(checkpoint: Path, reference) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(20)] for _ in range(4)]
    # 4 requests x (20 + 12) tokens = 128 tokens of KV needed; only 64 fit (16 blocks of 4).
    core = EngineCore(EngineConfig(model_path=checkpoint, kv_capacity_tokens=64, block_size=4,
                                   max_concurrency=4, enable_prefix_caching=False))
    got = run_staggered(core, prompts, arrivals=[0, 0, 0, 0])
    assert core.scheduler.stats().num_preemptions_total > 0
    for i, prompt in enumerate(prompts):
        assert got[f"r{i}"] == reference(prompt)
    assert core.scheduler.stats().num_kv_blocks_used == 0


def test_abort_frees_blocks_and_typed_admission_errors(tiny_model: Path) -> None:
    clock = FakeClock()
    core = EngineCore(EngineConfig(model_path=tiny_model, kv_capacity_tokens=256, block_size=4,
                                   max_concurrency=1, max_pending_requests=1, max_context=128))
    core.add_request("a", list(range(3, 30)), greedy(50), clock(), source="gw")
    core.step(clock)
    assert core.scheduler.stats().num_kv_blocks_used > 0
    core.add_request("b", list(range(3, 10)), greedy(5), clock(), source="gw")
    with pytest.raises(QueueFullError):
        core.add_request("c", list(range(3, 10)), greedy(5), clock(), source="gw")
    with pytest.raises(ContextLengthExceededError):
        core.add_request("d", list(range(3, 100)), greedy(100), clock(), source="gw")
    # refusals are not admissions: the gateway un-books them, so the engine must not count them (issue #29)
    assert core.admitted_by_source["gw"] == 2 and core.admitted_total == 2
    aborted = core.abort("a", clock())
    assert aborted is not None and aborted.finish_reason == "abort"
    core.abort("b", clock())
    assert core.scheduler.stats().num_kv_blocks_used == 0
    assert not core.has_unfinished_requests()


def test_stop_strings_are_cut_from_the_text(tiny_model: Path) -> None:
    clock = FakeClock()
    core = EngineCore(EngineConfig(model_path=tiny_model, kv_capacity_tokens=512))
    core.add_request("free", list(range(3, 12)), greedy(24, ignore_eos=True), clock())
    text = ""
    while core.has_unfinished_requests():
        text += "".join(o.text for o in core.step(clock))
    assert len(text) > 4
    stop = text[2:4]
    core.add_request("stopped", list(range(3, 12)), greedy(24, ignore_eos=True, stop=(stop,)), clock())
    outs = []
    while core.has_unfinished_requests():
        outs += core.step(clock)
    assert "".join(o.text for o in outs) == text[: text.index(stop)]
    assert outs[-1].finish_reason == "stop"


def test_the_start_line_says_what_fp8_kv_costs_on_the_cpu(tiny_model: Path) -> None:
    # issue #30: fp8 KV on the CPU was ~25x slower than the default without a word
    config = dict(model_path=tiny_model, kv_capacity_tokens=256, block_size=4, max_concurrency=1, max_context=64)
    plain = EngineCore(EngineConfig(**config)).describe()  # type: ignore[arg-type]
    assert "NOTE fp8" not in plain
    line = EngineCore(EngineConfig(**config, kv_dtype="fp8")).describe()  # type: ignore[arg-type]
    assert "NOTE fp8 KV on the CPU holds 4x the tokens of float32" in line
    assert "bench/kv_dtype.py" in line and "--kv-dtype auto" in line
