"""Scheduler: token budget, chunked prefill mixed with decodes, lanes, admission errors, preemption,
stop conditions, abort in every state, prefix-cache hits on admission."""

from __future__ import annotations

import pytest

from services.engine.core.request import Request, RequestStatus
from services.engine.core.sampling_params import SamplingParams
from services.engine.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from services.engine.errors import (
    ContextLengthExceededError,
    DuplicateRequestError,
    InvalidParameterError,
    QueueFullError,
)

EOS = 2
TOKEN = 5  # what the fake model always samples unless told otherwise


def config(**overrides: object) -> SchedulerConfig:
    values: dict[str, object] = dict(
        max_num_batched_tokens=8, max_concurrency=4, max_pending_requests=8, max_context=64,
        block_size=4, num_blocks=33, enable_prefix_caching=True,
    )
    values.update(overrides)
    return SchedulerConfig(**values)  # type: ignore[arg-type]


def request(
    rid: str, prompt_len: int = 3, max_tokens: int = 4, first_token: int = 100, **params: object
) -> Request:
    """A request whose prompt is ``first_token, first_token + 1, ...``; EOS is token ``EOS``."""
    prompt = list(range(first_token, first_token + prompt_len))
    sampling = SamplingParams(max_tokens=max_tokens, **params)  # type: ignore[arg-type]
    return Request(rid, prompt, sampling, arrival_s=0.0, eos_token_ids=[EOS])


def step(sched: Scheduler, now: float = 1.0, tokens: dict[str, int] | None = None) -> SchedulerOutput:
    """One engine step with a fake model: every seq that needs logits samples TOKEN (or ``tokens[id]``)."""
    out = sched.schedule(now=now)
    assert out.num_scheduled_tokens <= sched.config.max_num_batched_tokens
    sampled = {s.request_id: (tokens or {}).get(s.request_id, TOKEN) for s in out.scheduled if s.needs_logits}
    sched.update_from_output(out, sampled, now=now)
    return out


def plan(out: SchedulerOutput) -> dict[str, tuple[int, int, bool]]:
    """request id -> (start_pos, num_tokens, needs_logits)."""
    return {s.request_id: (s.start_pos, s.num_tokens, s.needs_logits) for s in out.scheduled}


def run_to_completion(sched: Scheduler, max_steps: int = 1000) -> int:
    for n in range(max_steps):
        if not sched.has_unfinished_requests():
            return n
        step(sched)
    raise AssertionError("requests did not finish")


def test_a_long_prompt_is_prefilled_in_chunks_interleaved_with_a_running_decode() -> None:
    sched = Scheduler(config(max_num_batched_tokens=8))
    a = request("a", prompt_len=3, max_tokens=10)
    sched.add_request(a)
    assert plan(step(sched)) == {"a": (0, 3, True)}
    sched.add_request(request("b", prompt_len=20, first_token=500))
    # Budget 8 per step: a's decode takes 1, b's chunk the other 7; 20 = 7 + 7 + 6.
    assert plan(step(sched)) == {"a": (3, 1, True), "b": (0, 8 - 1, False)}
    assert plan(step(sched)) == {"a": (4, 1, True), "b": (7, 8 - 1, False)}
    out = step(sched)
    assert plan(out) == {"a": (5, 1, True), "b": (14, 20 - 14, True)}
    assert (out.num_decode_tokens, out.num_prefill_tokens) == (1, 6)
    b = sched.get_request("b")
    assert b is not None and b.output_token_ids == [TOKEN]
    assert plan(step(sched)) == {"a": (6, 1, True), "b": (20, 1, True)}


def test_the_seq_carries_its_new_tokens_start_position_and_block_table() -> None:
    sched = Scheduler(config(max_num_batched_tokens=4, block_size=4))
    a = request("a", prompt_len=6, max_tokens=3, first_token=10)
    sched.add_request(a)
    (first,) = step(sched).scheduled
    assert (first.token_ids, first.start_pos, first.needs_logits) == ((10, 11, 12, 13), 0, False)
    assert len(first.block_table) == 4 // 4
    (second,) = step(sched).scheduled
    assert (second.token_ids, second.start_pos, second.needs_logits) == ((14, 15), 4, True)
    assert second.block_table[:1] == first.block_table and len(second.block_table) == -(-6 // 4)
    (third,) = step(sched).scheduled
    assert (third.token_ids, third.start_pos) == ((TOKEN,), 6)


def test_long_prefill_token_threshold_caps_each_prefill_chunk() -> None:
    sched = Scheduler(config(max_num_batched_tokens=16, long_prefill_token_threshold=5))
    sched.add_request(request("a", prompt_len=12))
    sched.add_request(request("b", prompt_len=12, first_token=300))
    # Each prompt is cut into chunks of at most 5: both start in the first step (5 + 5 <= 16).
    assert plan(step(sched)) == {"a": (0, 5, False), "b": (0, 5, False)}
    assert plan(step(sched)) == {"a": (5, 5, False), "b": (5, 5, False)}
    assert plan(step(sched)) == {"a": (10, 12 - 10, True), "b": (10, 12 - 10, True)}


def test_lanes_cap_the_number_of_running_requests() -> None:
    sched = Scheduler(config(max_concurrency=2, max_num_batched_tokens=64))
    for rid in ("a", "b", "c"):
        sched.add_request(request(rid, max_tokens=2))
    assert set(plan(step(sched))) == {"a", "b"}
    assert sched.stats().num_running == 2 and sched.stats().num_waiting == 1
    finished = sched.update_from_output(sched.schedule(), {"a": TOKEN, "b": TOKEN}, now=2.0)
    assert [r.finish_reason for r in finished] == ["length", "length"]  # 2 = max_tokens outputs each
    assert set(plan(step(sched))) == {"c"}


def test_a_full_pending_queue_refuses_with_retry_after() -> None:
    sched = Scheduler(config(max_concurrency=4, max_pending_requests=2, queue_full_retry_after_s=2.5,
                             max_num_batched_tokens=64))
    for rid in "abcdef":  # 4 for the free lanes, 2 pending
        sched.add_request(request(rid, first_token=100 + 10 * ord(rid)))
    with pytest.raises(QueueFullError) as exc:
        sched.add_request(request("g"))
    assert (exc.value.num_pending, exc.value.max_pending_requests, exc.value.retry_after_s) == (2, 2, 2.5)
    step(sched)  # a-d admitted: e, f pending, still full
    with pytest.raises(QueueFullError):
        sched.add_request(request("g"))
    assert sched.stats().num_waiting == 2


@pytest.mark.parametrize(("lanes", "pending"), [(2, 2), (8, 64)])
def test_a_burst_at_an_idle_engine_is_accepted_up_to_lanes_plus_pending(lanes: int, pending: int) -> None:
    """Issue #30: the runbook's --max-concurrency 8 --max-pending-requests 64 must accept 72 requests arriving
    together and refuse only the 73rd (with 2 + 2, a burst of 12 was served 3 and refused 9)."""
    sched = Scheduler(config(max_concurrency=lanes, max_pending_requests=pending, num_blocks=1 + 4 * 80,
                             max_num_batched_tokens=4 * 80))
    accepted = refused = 0
    for i in range(lanes + pending + 5):
        try:
            sched.add_request(request(f"r{i}", first_token=1000 + 10 * i))
            accepted += 1
        except QueueFullError:
            refused += 1
    assert (accepted, refused) == (lanes + pending, 5)
    step(sched)
    stats = sched.stats()
    assert (stats.num_running, stats.num_waiting) == (lanes, pending)  # every lane taken by the burst


def test_a_burst_at_a_full_engine_gets_only_the_pending_slots_and_finishing_requests_make_room() -> None:
    sched = Scheduler(config(max_concurrency=2, max_pending_requests=2))
    for rid in ("a", "b"):
        sched.add_request(request(rid, max_tokens=3, first_token=100 + 10 * ord(rid)))
    step(sched)  # both lanes busy
    accepted = []
    for i in range(5):
        try:
            sched.add_request(request(f"n{i}", first_token=2000 + 10 * i))
            accepted.append(f"n{i}")
        except QueueFullError:
            pass
    assert accepted == ["n0", "n1"]  # lanes full: only the pending bound
    run = 0
    while sched.stats().num_running == 2 and run < 20:  # a and b finish: their lanes free up
        step(sched)
        run += 1
    sched.add_request(request("late", first_token=3000))  # a freed lane makes room again


def test_prompt_plus_max_tokens_over_max_context_is_refused_with_its_numbers() -> None:
    sched = Scheduler(config(max_context=16))
    with pytest.raises(ContextLengthExceededError) as exc:
        sched.add_request(request("a", prompt_len=10, max_tokens=7))  # 10 + 7 = 17 > 16
    assert (exc.value.prompt_tokens, exc.value.max_tokens, exc.value.max_context) == (10, 7, 16)
    sched.add_request(request("b", prompt_len=10, max_tokens=6))  # 10 + 6 = 16 fits


def test_a_request_larger_than_the_whole_kv_cache_is_refused() -> None:
    # 2 usable blocks x 4 = 8 slots; the last sampled token needs none, so prompt + max_tokens <= 9.
    sched = Scheduler(config(num_blocks=3, block_size=4, max_context=100))
    with pytest.raises(ContextLengthExceededError) as exc:
        sched.add_request(request("a", prompt_len=8, max_tokens=2))  # 8 + 2 = 10 > 2 * 4 + 1
    assert exc.value.max_context == 2 * 4 + 1
    sched.add_request(request("b", prompt_len=7, max_tokens=2))
    assert run_to_completion(sched) > 0


def test_bad_params_empty_prompts_and_duplicate_ids_are_refused() -> None:
    sched = Scheduler(config())
    with pytest.raises(InvalidParameterError) as exc:
        sched.add_request(request("a", temperature=-1.0))
    assert exc.value.field == "temperature"
    with pytest.raises(InvalidParameterError):
        sched.add_request(Request("e", [], SamplingParams(), 0.0))
    sched.add_request(request("a"))
    with pytest.raises(DuplicateRequestError):
        sched.add_request(request("a"))


@pytest.mark.parametrize("caching", [False, True])
def test_when_blocks_run_out_the_newest_request_is_preempted_and_later_recomputed(caching: bool) -> None:
    # 4 usable blocks of 2 slots. Three 2-token prompts take one block each in step 1.
    sched = Scheduler(config(block_size=2, num_blocks=5, max_num_batched_tokens=16,
                             enable_prefix_caching=caching))
    for rid in ("a", "b", "c"):
        sched.add_request(request(rid, prompt_len=2, max_tokens=3, first_token=10 * ord(rid)))
    step(sched)
    assert sched.block_pool.num_free_blocks == 4 - 3
    # Step 2: each needs a 2nd block for position 2. a takes the last free one; b finds none, so the
    # newest running request, c, is preempted and its block goes to b.
    out = step(sched)
    assert out.preempted_ids == ("c",)
    assert set(plan(out)) == {"a", "b"}
    c = sched.get_request("c")
    assert c is not None
    assert (c.status, c.num_computed_tokens, c.block_ids) == (RequestStatus.PREEMPTED, 0, [])
    assert c.num_preemptions == 1
    assert sched.waiting[0] is c and sched.stats().num_preemptions_total == 1
    assert c.output_token_ids == [TOKEN]  # its sampled token survives preemption
    # c's freed block was the only free one, so b's allocation took it: with caching on, that is an
    # eviction of c's cached first block, and c has no prefix hit left.
    assert sched.block_pool.num_evictions == (1 if caching else 0)
    # a and b finish (3 outputs each), then c is recomputed from 0: prompt + its one output = 3 tokens.
    step(sched)
    recompute = step(sched)
    assert plan(recompute)["c"] == (0, 2 + 1, True)
    run_to_completion(sched)
    assert c.is_finished and c.finish_reason == "length"
    assert c.output_token_ids == [TOKEN] * 3
    assert sched.block_pool.num_free_blocks == 4


def test_the_oldest_request_is_never_the_one_preempted() -> None:
    # 2 usable blocks of 2: a (oldest) needs both eventually; b is newest and must yield to it.
    sched = Scheduler(config(block_size=2, num_blocks=3, max_num_batched_tokens=16))
    sched.add_request(request("a", prompt_len=1, max_tokens=4))
    sched.add_request(request("b", prompt_len=1, max_tokens=4, first_token=900))
    step(sched)
    step(sched)  # positions 0-1 fill each request's one block
    out = step(sched)  # a needs a 2nd block: b (newest) is preempted
    assert out.preempted_ids == ("b",)
    assert run_to_completion(sched) > 0
    assert sched.stats().num_preemptions_total >= 1


def test_the_newest_request_preempts_itself_when_it_is_the_one_short_of_blocks() -> None:
    # 2 usable blocks of 2: a's 1-token prompt leaves room in its block; b's 2-token prompt fills its own.
    sched = Scheduler(config(block_size=2, num_blocks=3, max_num_batched_tokens=16))
    sched.add_request(request("a", prompt_len=1, max_tokens=3))
    sched.add_request(request("b", prompt_len=2, max_tokens=3, first_token=900))
    step(sched)
    out = step(sched)  # a writes position 1 in place; b needs a block for position 2 and none is free
    assert out.preempted_ids == ("b",)
    assert plan(out) == {"a": (1, 1, True)}
    assert run_to_completion(sched) > 0


def test_a_step_that_preempts_admits_nobody() -> None:
    sched = Scheduler(config(block_size=2, num_blocks=3, max_num_batched_tokens=16))
    sched.add_request(request("a", prompt_len=2, max_tokens=3))
    sched.add_request(request("b", prompt_len=2, max_tokens=3, first_token=900))
    step(sched)
    sched.add_request(request("c", prompt_len=1, max_tokens=1, first_token=700))
    out = step(sched)
    assert out.preempted_ids == ("b",) and out.num_admitted == 0


def test_eos_finishes_with_stop_unless_ignored_and_stop_token_ids_always_stop() -> None:
    sched = Scheduler(config(max_num_batched_tokens=64))
    sched.add_request(request("eos", max_tokens=5))
    sched.add_request(request("ignore", max_tokens=2, ignore_eos=True))
    sched.add_request(request("stopid", max_tokens=5, ignore_eos=True, stop_token_ids=[7]))
    step(sched, tokens={"eos": EOS, "ignore": EOS, "stopid": 7})
    assert sched.get_request("eos") is None and sched.get_request("stopid") is None
    ignore = sched.get_request("ignore")
    assert ignore is not None and ignore.output_token_ids == [EOS]
    out = sched.schedule()
    (finished,) = sched.update_from_output(out, {"ignore": EOS}, now=3.0)
    assert (finished.finish_reason, finished.finished_s) == ("length", 3.0)
    assert finished.output_token_ids == [EOS, EOS]  # 2 = max_tokens


def test_stop_strings_are_finished_by_the_caller_through_finish_request() -> None:
    sched = Scheduler(config())
    sched.add_request(request("a", max_tokens=10))
    step(sched)
    used = sched.block_pool.num_used_blocks
    assert used == 1
    finished = sched.finish_request("a", "stop", now=4.0)
    assert finished is not None and (finished.finish_reason, finished.finished_s) == ("stop", 4.0)
    assert sched.block_pool.num_used_blocks == used - 1
    assert sched.finish_request("a", "stop") is None


def test_abort_frees_blocks_in_every_state_and_is_idempotent() -> None:
    sched = Scheduler(config(block_size=2, num_blocks=5, max_num_batched_tokens=16, max_concurrency=3))
    for rid in ("run", "pre", "victim"):
        sched.add_request(request(rid, prompt_len=2, max_tokens=3, first_token=10 * len(rid)))
    sched.add_request(request("wait", prompt_len=2, max_tokens=3, first_token=500))  # no lane left
    step(sched)
    step(sched)  # "victim" (newest running) is preempted
    victim = sched.get_request("victim")
    assert victim is not None and victim.status is RequestStatus.PREEMPTED
    total = sched.block_pool.num_total_blocks
    for rid, state in (("wait", RequestStatus.WAITING), ("victim", RequestStatus.PREEMPTED),
                       ("run", RequestStatus.RUNNING)):
        req = sched.get_request(rid)
        assert req is not None and req.status is state
        aborted = sched.abort_request(rid, now=9.0)
        assert aborted is req and req.finish_reason == "abort" and req.block_ids == []
        assert sched.abort_request(rid) is None
    pre = sched.get_request("pre")
    assert pre is not None
    assert sched.block_pool.num_free_blocks == total - len(pre.block_ids)
    sched.abort_request("pre")
    assert sched.block_pool.num_free_blocks == total and not sched.has_unfinished_requests()


def test_a_request_aborted_between_schedule_and_update_is_skipped() -> None:
    sched = Scheduler(config())
    sched.add_request(request("a"))
    out = sched.schedule()
    sched.abort_request("a")
    assert sched.update_from_output(out, {"a": TOKEN}, now=1.0) == []
    assert sched.block_pool.num_free_blocks == sched.block_pool.num_total_blocks


def test_a_second_request_with_the_same_prefix_starts_after_the_cached_blocks() -> None:
    sched = Scheduler(config(block_size=4, max_num_batched_tokens=64))
    shared = list(range(100, 100 + 3 * 4))
    sched.add_request(Request("a", [*shared, 1], SamplingParams(max_tokens=2), 0.0))
    step(sched)
    sched.add_request(Request("b", [*shared, 7, 8], SamplingParams(max_tokens=2), 0.0))
    assert plan(step(sched))["b"] == (3 * 4, 2, True)
    b = sched.get_request("b")
    assert b is not None and b.num_cached_prompt_tokens == 3 * 4
    stats = sched.stats()
    # Hit rate in tokens: a hit 0 of its 13, b hit 12 of its 14.
    assert (stats.num_prompt_tokens_queried, stats.num_prompt_tokens_hit) == (13 + 14, 0 + 12)
    assert stats.prefix_hit_rate == 12 / 27


def test_prefix_caching_off_never_hits() -> None:
    sched = Scheduler(config(enable_prefix_caching=False, max_num_batched_tokens=64))
    shared = list(range(100, 112))
    sched.add_request(Request("a", [*shared, 1], SamplingParams(max_tokens=2), 0.0))
    step(sched)
    sched.add_request(Request("b", [*shared, 7], SamplingParams(max_tokens=2), 0.0))
    assert plan(step(sched))["b"] == (0, 13, True)


def test_stats_tell_prefilling_from_decoding_and_count_blocks() -> None:
    sched = Scheduler(config(max_num_batched_tokens=8, block_size=4))
    sched.add_request(request("a", prompt_len=3, max_tokens=5))
    step(sched)
    sched.add_request(request("b", prompt_len=12, first_token=300))
    step(sched)  # a decodes, b has 7 of 12 prompt tokens
    s = sched.stats()
    assert (s.num_running, s.num_waiting, s.num_decoding, s.num_prefilling) == (2, 0, 1, 1)
    # a: positions 0..3 computed -> ceil(4 / 4) = 1 block; b: 7 of 12 -> ceil(7 / 4) = 2 blocks.
    assert s.num_kv_blocks_used == 1 + 2 and s.num_kv_blocks_total == 33 - 1
    assert s.kv_usage == 3 / 32


def test_timings_are_the_callers_now() -> None:
    sched = Scheduler(config(max_num_batched_tokens=2))
    sched.add_request(request("a", prompt_len=3, max_tokens=1))
    step(sched, now=10.0)
    a = sched.get_request("a")
    assert a is not None and (a.first_scheduled_s, a.first_token_s) == (10.0, None)
    (done,) = sched.update_from_output(sched.schedule(now=11.0), {"a": TOKEN}, now=11.5)
    assert (done.first_scheduled_s, done.first_token_s, done.finished_s) == (10.0, 11.5, 11.5)
    assert done.take_new_output_tokens() == 1 and done.take_new_output_tokens() == 0


def test_config_names_the_bad_key() -> None:
    with pytest.raises(ValueError, match="max_concurrency"):
        config(max_concurrency=0)
    with pytest.raises(ValueError, match="num_blocks"):
        config(num_blocks=1)
