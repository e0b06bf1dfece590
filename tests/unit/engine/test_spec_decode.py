"""Speculative decoding must be lossless: the same tokens (greedy), the same distribution (sampled).

The engine-level tests drive the real step loop with and without speculation over the same requests
(staggered arrivals, different lengths, prefix caching on, block size 4 so rollbacks cross block
boundaries) and compare every request's tokens, text and finish reason. Three drafters cover the three
regimes: the target itself as its draft model (every draft accepted: long runs, bonus tokens), an
unrelated smaller random model (nearly every draft rejected: rollback every step), and n-gram lookup
(a mix).
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.common.runtime import ConfigError
from services.engine.__main__ import add_arguments, build_config
from services.engine.config import EngineConfig
from services.engine.core.block_pool import BlockPool
from services.engine.core.request import Request
from services.engine.core.sampling_params import SamplingParams
from services.engine.core.scheduler import Scheduler, SchedulerConfig
from services.engine.engine_core import EngineCore
from services.engine.errors import ModelLoadError, SpeculativeDecodingError
from services.engine.llm import greedy
from services.engine.outputs import RequestOutput
from services.engine.serve.frontend import output_chunk
from services.engine.serve.usage_ledger import UsageLedger
from services.engine.serve.views import RequestStats, metrics_text, usage_body
from services.engine.spec.rejection_sampler import verify_greedy, verify_random
from services.engine.spec.spec_decode import SpecConfig, SpecDecodeCounters, propose_ngram
from services.engine.tiny_checkpoint import write_tiny_checkpoint
from tests.unit.engine.fake_clock import FakeClock

BLOCK_SIZE = 4
SHARED = [5, 17, 300, 42, 99, 7, 8, 200, 201, 11, 12, 13]  # three blocks shared by some prompts
PROMPTS = [
    [*SHARED, 40, 41],
    [9, 10, 11, 12, 9, 10, 11],
    [*SHARED, 77, 78, 79, 80, 81],
    list(range(3, 40)),
    [100, 101, 102, 100, 101],
    SHARED,
]
ARRIVALS = [0, 0, 1, 3, 3, 6]
MAX_TOKENS = [24, 30, 17, 26, 31, 20]


def make_core(target: Path, spec: SpecConfig | None = None, **kwargs: object) -> EngineCore:
    config = EngineConfig(model_path=target, kv_capacity_tokens=2048, block_size=BLOCK_SIZE, max_concurrency=4,
                          spec=spec or SpecConfig(), **kwargs)  # type: ignore[arg-type]
    return EngineCore(config)


def check_block_invariants(core: EngineCore) -> None:
    """After every step: each running request holds exactly the blocks its computed tokens need, and
    the pool's used count is the number of distinct blocks the running requests hold."""
    pool = core.scheduler.block_pool
    held: set[int] = set()
    for req in core.scheduler.running:
        assert len(req.block_ids) == pool.num_blocks_needed(req.num_computed_tokens), req
        held.update(req.block_ids)
    assert pool.num_used_blocks == len(held)


def run(core: EngineCore, prompts: list[list[int]], params: list[SamplingParams], arrivals: list[int],
        ) -> dict[str, list[RequestOutput]]:
    clock = FakeClock()
    out: dict[str, list[RequestOutput]] = {f"r{i}": [] for i in range(len(prompts))}
    for step in itertools.count():
        for i, at in enumerate(arrivals):
            if at == step:
                core.add_request(f"r{i}", prompts[i], params[i], clock())
        if step > max(arrivals) and not core.has_unfinished_requests():
            return out
        for o in core.step(clock):
            out[o.request_id].append(o)
        check_block_invariants(core)
    raise AssertionError("unreachable")


def summary(outputs: list[RequestOutput]) -> tuple[list[int], str, str | None, int]:
    tokens = [t for o in outputs for t in o.token_ids]
    final = outputs[-1]
    assert final.finished
    return tokens, "".join(o.text for o in outputs), final.finish_reason, final.num_output_tokens


def greedy_params(**kwargs: object) -> list[SamplingParams]:
    return [greedy(n, ignore_eos=True, **kwargs) for n in MAX_TOKENS]  # type: ignore[arg-type]


_CHECKPOINTS: dict[tuple[str, str], Path] = {}


def checkpoint(factory: pytest.TempPathFactory, arch: str, kind: str = "target") -> Path:
    """One checkpoint per (arch, kind) for the whole module. "draft": same tokenizer and vocabulary, one
    layer, other random weights, so its drafts are mostly rejected."""
    key = (arch, kind)
    if key not in _CHECKPOINTS:
        extra = {"num_layers": 1, "seed": 7} if kind == "draft" else {}
        _CHECKPOINTS[key] = write_tiny_checkpoint(factory.mktemp(f"{arch}-{kind}") / "ckpt", arch=arch,
                                                  **extra)  # type: ignore[arg-type]
    return _CHECKPOINTS[key]


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def arch(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def target(arch: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return checkpoint(tmp_path_factory, arch)


@pytest.fixture(scope="module")
def small_draft(arch: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return checkpoint(tmp_path_factory, arch, "draft")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """For the tests that do not depend on the architecture."""
    return checkpoint(tmp_path_factory, "qwen3")


@pytest.fixture(scope="module")
def baseline(target: Path) -> dict[str, list[RequestOutput]]:
    return run(make_core(target), PROMPTS, greedy_params(), ARRIVALS)


def spec_configs(target: Path, small_draft: Path) -> dict[str, SpecConfig]:
    return {
        "ngram": SpecConfig(method="ngram", num_draft_tokens=3),
        "self-draft": SpecConfig(method="draft", num_draft_tokens=4, draft_model_path=target),
        "small-draft": SpecConfig(method="draft", num_draft_tokens=2, draft_model_path=small_draft),
        "small-draft-lm-head": SpecConfig(method="draft", num_draft_tokens=5, draft_model_path=small_draft,
                                          lm_head_draft=True),
    }


@pytest.mark.parametrize("method", ["ngram", "self-draft", "small-draft", "small-draft-lm-head"])
def test_greedy_output_is_identical_with_and_without_speculation(
    method: str, target: Path, small_draft: Path, baseline: dict[str, list[RequestOutput]]
) -> None:
    spec = spec_configs(target, small_draft)[method]
    core = make_core(target, spec)
    got = run(core, PROMPTS, greedy_params(), ARRIVALS)
    for rid, outputs in baseline.items():
        assert summary(got[rid]) == summary(outputs), rid
    stats = core.snapshot(0.0).spec
    assert stats is not None and stats.num_drafts > 0
    assert stats.num_accepted_tokens == sum(stats.num_accepted_tokens_per_pos)
    if method == "self-draft":  # the target drafting for itself is always right
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    # Every finished request returned its blocks; the pool holds nothing but cached prefixes.
    pool = core.scheduler.block_pool
    assert pool.num_used_blocks == 0 and pool.num_free_blocks == pool.num_total_blocks


def test_prefix_cache_holds_only_accepted_tokens_and_later_requests_reuse_it(
    target: Path, small_draft: Path, baseline: dict[str, list[RequestOutput]]
) -> None:
    # Mostly rejected drafts: every step rolls back, often across a block boundary (K = 5 > block size).
    core = make_core(target, spec_configs(target, small_draft)["small-draft-lm-head"])
    first = run(core, PROMPTS, greedy_params(), ARRIVALS)
    sequences = [PROMPTS[i] + summary(first[f"r{i}"])[0] for i in range(len(PROMPTS))]
    aligned = {tuple(s[j : j + BLOCK_SIZE]) for s in sequences for j in range(0, len(s) - BLOCK_SIZE + 1, BLOCK_SIZE)}
    pool = core.scheduler.block_pool
    cached = [pool.cached_token_ids(b) for b in range(1, pool.num_blocks)]
    cached_blocks = [c for c in cached if c is not None]
    assert cached_blocks and set(cached_blocks) <= aligned
    # Follow-up turns: earlier prompt + answer as the new prompt hit the blocks written while speculating.
    follow = [s[:-1] for s in sequences[:3]]
    plain = run(make_core(target), follow, greedy_params()[:3], [0, 0, 0])
    again = run(core, follow, greedy_params()[:3], [0, 0, 0])
    assert all(o[-1].num_cached_tokens > len(PROMPTS[i]) for i, o in enumerate(again.values()))
    for rid in plain:
        assert summary(again[rid]) == summary(plain[rid])


def test_stop_strings_stop_tokens_and_max_tokens_cut_an_accepted_run_where_plain_decoding_stops(
    target: Path, baseline: dict[str, list[RequestOutput]]
) -> None:
    # The target as its own draft accepts every draft, so each step appends runs of K + 1 = 5 tokens
    # and every stop below falls inside a run.
    spec = SpecConfig(method="draft", num_draft_tokens=4, draft_model_path=target)
    tokens, text, _, _ = summary(baseline["r3"])
    stop_text = text[len(text) // 2 : len(text) // 2 + 3]
    stop_token = tokens[9]
    cases = [
        greedy(26, ignore_eos=True, stop=(stop_text,)),
        greedy(26, ignore_eos=True, stop_token_ids=(stop_token,)),
        greedy(8, ignore_eos=True),
        greedy(26, stop=(stop_text,), stop_token_ids=(stop_token,)),
    ]
    prompts = [PROMPTS[3]] * len(cases)
    arrivals = list(range(len(cases)))
    plain = run(make_core(target), prompts, cases, arrivals)
    spec_out = run(make_core(target, spec), prompts, cases, arrivals)
    for rid in plain:
        assert summary(spec_out[rid]) == summary(plain[rid])
    assert summary(plain["r0"])[2] == "stop" and stop_text not in summary(plain["r0"])[1]
    assert summary(plain["r1"])[0][-1] == stop_token and summary(plain["r2"])[3] == 8


def test_sampled_requests_run_with_speculation_and_report_drafts_in_the_final_chunk(
    target: Path, small_draft: Path
) -> None:
    params = [SamplingParams(max_tokens=20, temperature=0.8, top_k=50, top_p=0.95, seed=i, ignore_eos=True)
              for i in range(3)]
    for spec in (SpecConfig(method="ngram"), SpecConfig(method="draft", num_draft_tokens=3,
                                                        draft_model_path=small_draft)):
        core = make_core(target, spec)
        out = run(core, PROMPTS[:3], params, [0, 0, 1])
        for outputs in out.values():
            tokens, _, reason, n = summary(outputs)
            assert reason == "length" and n == len(tokens) == 20
        final = out["r0"][-1]
        chunk = output_chunk(core.tokenizer, "r0", 9, final, "w")
        assert chunk.timings is not None
        assert (chunk.timings.draft_n, chunk.timings.draft_n_accepted) == (
            final.num_draft_tokens, final.num_accepted_draft_tokens)
        stats = core.snapshot(0.0).spec
        assert stats is not None
        assert sum(o[-1].num_draft_tokens for o in out.values()) == stats.num_draft_tokens > 0


# ---- verification (pure) -----------------------------------------------------------------------------


def test_greedy_verification_keeps_the_drafts_that_match_the_argmax_then_the_argmax() -> None:
    logits = torch.full((4, 6), -1.0)
    for row, best in enumerate([2, 5, 1, 0]):
        logits[row, best] = 3.0
    assert verify_greedy(logits, [2, 5, 1]) == [2, 5, 1, 0]  # all accepted + bonus
    assert verify_greedy(logits, [2, 4, 1]) == [2, 5]  # second rejected, replaced by the argmax
    assert verify_greedy(logits, [3, 5, 1]) == [2]
    assert verify_greedy(logits[:1], []) == [2]


def _empirical(counts: collections.Counter[int], vocab: int) -> torch.Tensor:
    total = sum(counts.values())
    return torch.tensor([counts[i] / total for i in range(vocab)])


@pytest.mark.parametrize("drafter", ["model", "point-mass"])
def test_rejection_sampling_emits_tokens_distributed_as_the_target(drafter: str) -> None:
    """Each emitted token follows the target's distribution, whatever the drafts: first position over
    all trials, second position over the trials where the first draft was accepted (Leviathan et al.)."""
    gen = torch.Generator().manual_seed(1234)
    vocab, trials = 5, 20_000
    p = torch.tensor([[0.40, 0.30, 0.15, 0.10, 0.05],
                      [0.05, 0.05, 0.50, 0.20, 0.20],
                      [0.20, 0.20, 0.20, 0.20, 0.20]])
    q = torch.tensor([[0.10, 0.10, 0.60, 0.10, 0.10],
                      [0.30, 0.30, 0.10, 0.20, 0.10]])
    first: collections.Counter[int] = collections.Counter()
    second: collections.Counter[int] = collections.Counter()
    accepted_first = 0
    for _ in range(trials):
        if drafter == "model":
            drafts = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(2)]
            out = verify_random(p, drafts, q, gen)
        else:
            drafts = [0, 3]  # an n-gram drafter's fixed guess
            out = verify_random(p, drafts, None, gen)
        first[out[0]] += 1
        if len(out) > 1:
            accepted_first += 1
            second[out[1]] += 1
    # 4 standard errors of a proportion near 0.5 with n trials: 4 * sqrt(0.25 / n).
    assert torch.allclose(_empirical(first, vocab), p[0], atol=4 * (0.25 / trials) ** 0.5)
    assert torch.allclose(_empirical(second, vocab), p[1], atol=4 * (0.25 / accepted_first) ** 0.5)
    # Acceptance probability of the first draft: sum_x min(p, q) for a model drafter, p(x) for a guess.
    expected = float(torch.minimum(p[0], q[0]).sum()) if drafter == "model" else float(p[0, 0])
    assert abs(accepted_first / trials - expected) < 4 * (0.25 / trials) ** 0.5


def test_a_draft_the_target_gives_probability_one_is_always_accepted() -> None:
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    assert verify_random(p, [1], None, torch.Generator().manual_seed(0)) == [1, 2]


# ---- n-gram proposals (pure) -------------------------------------------------------------------------


def test_ngram_proposals_follow_the_latest_occurrence_of_the_longest_matching_suffix() -> None:
    # Suffix [1, 2, 3] occurs at 0 (followed by 4, 5) and at 6 (followed by 9, 9); the latest wins.
    assert propose_ngram([1, 2, 3, 4, 5, 0, 1, 2, 3, 9, 9, 7, 1, 2, 3], 2) == [9, 9]
    # No 3- or 2-gram match: the 1-gram [8] after the 7.
    assert propose_ngram([8, 7, 6, 5, 8], 3, max_n=3) == [7, 6, 5]
    assert propose_ngram([1, 2, 3], 4) == []
    # A match one period back runs into the end of the sequence: the period is repeated.
    assert propose_ngram([4, 4], 3) == [4, 4, 4]
    assert propose_ngram([1, 2, 3, 1, 2, 3, 1, 2], 5) == [3, 1, 2, 3, 1]
    # 256 and 1 share bytes at a misaligned offset in the int64 encoding; only aligned hits count.
    assert propose_ngram([256, 0, 7, 1], 1, max_n=1) == []


# ---- scheduling and rollback (pure) ------------------------------------------------------------------


def test_drafts_take_budget_and_blocks_and_rejected_ones_are_rolled_back() -> None:
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=4, max_concurrency=2, max_pending_requests=4,
                                      max_context=64, block_size=4, num_blocks=16))
    req = Request("a", [1, 2, 3, 4, 5, 6], greedy(10, ignore_eos=True), arrival_s=0.0)
    sched.add_request(req)
    sched.update_from_output(sched.schedule(), {}, now=1.0)  # budget 4: the prompt's first chunk
    sched.update_from_output(sched.schedule(), {"a": 7}, now=1.0)  # the rest, and the first token
    assert (req.num_tokens, req.num_computed_tokens, len(req.block_ids)) == (7, 6, 2)
    req.spec_token_ids = [8, 9, 10, 11, 12]
    out = sched.schedule()
    (seq,) = out.scheduled
    # Budget 4: the last token and 3 of the 5 drafts; positions 6..9 need a third block.
    assert seq.token_ids == (7, 8, 9, 10) and seq.num_draft_tokens == 3 and out.num_draft_tokens == 3
    assert len(req.block_ids) == 3 and req.spec_token_ids == []
    free_before = sched.block_pool.num_free_blocks
    sched.update_from_output(out, {}, now=2.0, accepted={"a": [8, 42]})  # draft 8 accepted, 9 rejected
    assert req.output_token_ids == [7, 8, 42]
    assert req.num_computed_tokens == 8  # tokens 0..7 (7 and the accepted 8); 42 has no K/V yet
    assert len(req.block_ids) == 2 and sched.block_pool.num_free_blocks == free_before + 1


def test_drafts_never_preempt_anyone_they_are_dropped_when_blocks_run_out() -> None:
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=16, max_concurrency=2, max_pending_requests=4,
                                      max_context=64, block_size=4, num_blocks=4))  # 3 usable blocks
    a = Request("a", [1, 2, 3], greedy(10, ignore_eos=True), arrival_s=0.0)
    b = Request("b", [4, 5, 6], greedy(10, ignore_eos=True), arrival_s=0.0)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    sched.update_from_output(out, {"a": 9, "b": 9}, now=1.0)
    a.spec_token_ids = [1, 2, 3, 4, 5]  # would need 2 more blocks; only 1 is free
    out = sched.schedule()
    assert [s.num_draft_tokens for s in out.scheduled] == [0, 0] and out.preempted_ids == ()


def test_a_pool_gives_back_only_blocks_past_the_computed_tokens() -> None:
    pool = BlockPool(8, 4)
    req = Request("a", list(range(6)), greedy(4), arrival_s=0.0)
    assert pool.allocate_slots(req, 10)
    assert len(req.block_ids) == 3
    req.num_computed_tokens = 5
    assert pool.free_unused_blocks(req) == 1 and len(req.block_ids) == 2
    assert pool.num_free_blocks == 7 - 2


# ---- counters and telemetry --------------------------------------------------------------------------


def test_counters_count_drafts_draft_tokens_and_acceptance_per_position() -> None:
    counters = SpecDecodeCounters("ngram", 3)
    counters.record(3, 2)
    counters.record(2, 0)
    counters.record(0, 0)  # no drafts: not a draft
    stats = counters.snapshot()
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 5, 2)
    assert stats.num_accepted_tokens_per_pos == (1, 1, 0)
    assert stats.acceptance_rate == 2 / 5 and stats.mean_acceptance_length == 1 + 2 / 2


def test_usage_and_metrics_report_the_speculative_counters(qwen3: Path) -> None:
    target = qwen3
    core = make_core(target, SpecConfig(method="ngram", num_draft_tokens=3))
    run(core, PROMPTS[:2], greedy_params()[:2], [0, 0])
    snap = core.snapshot(0.0)
    spec = snap.spec
    assert spec is not None and spec.num_drafts > 0
    body = usage_body("m", snap, UsageLedger(0.125), "2025-01-01", 1.0, 5.0)["speculative"]
    assert body["enabled"] is True and body["method"] == "ngram" and body["draft_tokens_per_step"] == 3
    assert (body["drafts"], body["draft_tokens"], body["accepted_tokens"]) == (
        spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens)
    assert body["accepted_per_position"] == list(spec.num_accepted_tokens_per_pos)
    text = metrics_text("m", snap, RequestStats(), 1.0, None, BLOCK_SIZE)
    assert f'vllm:spec_decode_num_drafts_total{{model_name="m"}} {spec.num_drafts}' in text
    assert f'vllm:spec_decode_num_draft_tokens_total{{model_name="m"}} {spec.num_draft_tokens}' in text
    assert f'vllm:spec_decode_num_accepted_tokens_total{{model_name="m"}} {spec.num_accepted_tokens}' in text
    for pos, n in enumerate(spec.num_accepted_tokens_per_pos):
        assert f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="{pos}"}} {n}' in text
    plain = make_core(target).snapshot(0.0)
    assert "speculative" not in usage_body("m", plain, UsageLedger(0.125), "2025-01-01", 1.0, 5.0)
    assert "spec_decode" not in metrics_text("m", plain, RequestStats(), 1.0, None, BLOCK_SIZE)


# ---- configuration -----------------------------------------------------------------------------------


def test_spec_mtp_on_a_checkpoint_without_mtp_weights_fails_at_start_naming_the_alternatives(qwen3: Path) -> None:
    target = qwen3
    with pytest.raises(SpeculativeDecodingError, match=r"has no MTP weights \(mtp\.\* .*\); use --spec ngram "
                                                       r"or --spec draft --draft-model PATH"):
        make_core(target, SpecConfig(method="mtp"))


def test_spec_mtp_on_a_checkpoint_with_a_partial_mtp_module_names_a_missing_tensor(qwen3: Path, tmp_path: Path) -> None:
    target = qwen3
    ckpt = tmp_path / "with-mtp"
    ckpt.mkdir()
    for f in target.iterdir():
        (ckpt / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(ckpt / "model.safetensors"))
    tensors["mtp.fc.weight"] = torch.zeros(4, 4)
    save_file(tensors, str(ckpt / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"missing tensor 'mtp\.pre_fc_norm_embedding\.weight'"):
        make_core(ckpt, SpecConfig(method="mtp"))


@pytest.mark.parametrize("k", [0, 16, -1])
def test_draft_tokens_outside_1_to_15_are_refused(k: int) -> None:
    with pytest.raises(SpeculativeDecodingError, match=r"1\.\.15"):
        SpecConfig(method="ngram", num_draft_tokens=k).validate()


def _cli(target: Path, *flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args([str(target), *flags])


@pytest.mark.parametrize(("flags", "key"), [
    (["--spec", "ngram", "--draft-tokens", "0"], "draft-tokens"),
    (["--spec", "ngram", "--draft-tokens", "16"], "draft-tokens"),
    (["--draft-tokens", "4"], "draft-tokens"),
    (["--lm-head-draft"], "lm-head-draft"),
    (["--spec", "ngram", "--lm-head-draft"], "lm-head-draft"),
    (["--spec", "draft"], "draft-model"),
    (["--spec", "ngram", "--draft-model", "/x"], "draft-model"),
])
def test_bad_speculative_flags_stop_the_start_naming_the_flag(
    qwen3: Path, tmp_path: Path, flags: list[str], key: str
) -> None:
    with pytest.raises(ConfigError) as info:
        build_config(_cli(qwen3, "--data-dir", str(tmp_path), *flags))
    assert info.value.key == key and "speculative decoding" in str(info.value)


def test_speculative_flags_reach_the_engine_config(qwen3: Path, tmp_path: Path) -> None:
    target = qwen3
    engine, _, _ = build_config(_cli(target, "--data-dir", str(tmp_path), "--spec", "draft", "--draft-model",
                                     str(target), "--draft-tokens", "6", "--lm-head-draft"))
    assert engine.spec == SpecConfig(method="draft", num_draft_tokens=6, draft_model_path=target, lm_head_draft=True)
    engine, _, _ = build_config(_cli(target, "--data-dir", str(tmp_path), "--spec", "ngram"))
    assert engine.spec == SpecConfig(method="ngram", num_draft_tokens=4)


def test_a_draft_model_with_another_vocabulary_is_refused(qwen3: Path, tmp_path: Path) -> None:
    target = qwen3
    other = write_tiny_checkpoint(tmp_path / "other", arch="qwen3", num_layers=1, vocab_size=600)
    with pytest.raises(SpeculativeDecodingError, match="vocab_size 600"):
        make_core(target, SpecConfig(method="draft", draft_model_path=other))
    config = json.loads((target / "config.json").read_text())
    assert config["vocab_size"] == 512


def test_lm_head_draft_needs_equal_hidden_sizes(qwen3: Path, tmp_path: Path) -> None:
    target = qwen3
    wide = write_tiny_checkpoint(tmp_path / "wide", arch="qwen3", num_layers=1, hidden_size=32, num_heads=2,
                                 num_kv_heads=1, intermediate_size=64)
    with pytest.raises(SpeculativeDecodingError, match="hidden size"):
        make_core(target, SpecConfig(method="draft", draft_model_path=wide, lm_head_draft=True))
    core = make_core(target, replace(SpecConfig(method="draft", draft_model_path=wide), num_draft_tokens=2))
    assert core.drafter is not None and core.drafter.config.hidden_size == 32
