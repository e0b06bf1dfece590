"""Block pool: accounting, prefix caching (hits, collisions, LRU reuse and eviction), and a randomized
property test of block accounting driven through the scheduler."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.engine.core.block_pool import NULL_BLOCK_ID, BlockPool, HashFn, hash_block_tokens
from services.engine.core.request import Request
from services.engine.core.sampling_params import SamplingParams
from services.engine.core.scheduler import Scheduler, SchedulerConfig
from services.engine.errors import ContextLengthExceededError, QueueFullError

BS = 4  # block size used by the hand-written tests


def make_request(rid: str, prompt: list[int], max_tokens: int = 4) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens), arrival_s=0.0)


def admit_and_compute(pool: BlockPool, req: Request) -> int:
    """Admit ``req`` with its prefix hits and pretend its whole prompt was computed; return the hit."""
    blocks, num_cached = pool.get_computed_blocks(req.all_token_ids)
    assert pool.allocate_slots(req, req.num_tokens - num_cached, blocks)
    req.num_computed_tokens = req.num_tokens
    pool.cache_full_blocks(req)
    return num_cached


def test_block_zero_is_reserved_and_never_allocated() -> None:
    pool = BlockPool(num_blocks=5, block_size=BS)
    req = make_request("a", list(range(1, 4 * BS + 1)))
    assert pool.num_total_blocks == 5 - 1
    assert pool.allocate_slots(req, 4 * BS)
    assert NULL_BLOCK_ID not in req.block_ids
    assert sorted(req.block_ids) == [1, 2, 3, 4]


def test_allocation_that_does_not_fit_returns_false_and_changes_nothing() -> None:
    pool = BlockPool(num_blocks=3, block_size=BS)  # 2 usable blocks = 8 slots
    req = make_request("a", list(range(1, 10)))
    assert not pool.allocate_slots(req, 9)  # 9 tokens need ceil(9 / 4) = 3 blocks
    assert req.block_ids == []
    assert pool.num_free_blocks == 2
    assert pool.allocate_slots(req, 8)
    assert (pool.num_used_blocks, pool.num_free_blocks, pool.usage) == (2, 0, 2 / 2)


def test_a_second_request_with_the_same_three_block_prefix_gets_three_blocks_of_cached_tokens() -> None:
    pool = BlockPool(num_blocks=16, block_size=BS)
    prefix = list(range(100, 100 + 3 * BS))
    a = make_request("a", [*prefix, 1, 2])
    b = make_request("b", [*prefix, 7, 8, 9])
    assert admit_and_compute(pool, a) == 0
    assert admit_and_compute(pool, b) == 3 * BS
    assert b.block_ids[:3] == a.block_ids[:3]
    for shared in a.block_ids[:3]:
        assert pool.ref_count(shared) == 2
    # Hit rate is in tokens: (0 + 3*4) hits over (14 + 15) prompt tokens queried.
    pool.record_prefix_lookup(a.num_prompt_tokens, 0)
    pool.record_prefix_lookup(b.num_prompt_tokens, 3 * BS)
    assert pool.stats().prefix_hit_rate == (0 + 3 * BS) / ((3 * BS + 2) + (3 * BS + 3))


def test_a_fully_cached_prompt_still_leaves_its_last_token_to_compute() -> None:
    pool = BlockPool(num_blocks=16, block_size=BS)
    prompt = list(range(1, 2 * BS + 1))  # exactly two full blocks
    admit_and_compute(pool, make_request("a", prompt))
    blocks, num_cached = pool.get_computed_blocks(prompt)
    # Both blocks are cached, but taking both would leave no token to produce logits for.
    assert (len(blocks), num_cached) == (1, 1 * BS)


def test_a_block_is_cached_only_once_its_kv_is_computed() -> None:
    pool = BlockPool(num_blocks=16, block_size=BS)
    prefix = list(range(1, 2 * BS + 1))
    a = make_request("a", [*prefix, 99])
    assert pool.allocate_slots(a, a.num_tokens)
    assert pool.get_computed_blocks([*prefix, 5]) == ([], 0)  # allocated, not computed yet
    a.num_computed_tokens = BS + 1  # one full block computed
    pool.cache_full_blocks(a)
    assert pool.get_computed_blocks([*prefix, 5])[1] == 1 * BS


def test_a_hash_collision_is_caught_by_the_token_check_and_not_reused() -> None:
    def constant_hash(parent: bytes | None, token_ids: tuple[int, ...]) -> bytes:
        return b"\x00" * 16

    pool = BlockPool(num_blocks=16, block_size=BS, hash_fn=constant_hash)
    a = make_request("a", [7] * (2 * BS) + [1])
    admit_and_compute(pool, a)
    # Different first block, same digest: the stored tokens differ, so it is a miss.
    assert pool.get_computed_blocks([8] * BS + [1]) == ([], 0)
    # Same tokens in block 1 as in block 0, same digest: the parent check refuses block 0 as block 1,
    # whose KV would belong to positions 0..3, not 4..7.
    blocks, num_cached = pool.get_computed_blocks([7] * (3 * BS) + [2])
    assert [b.block_id for b in blocks] == a.block_ids[:1]
    assert num_cached == 1 * BS


def test_freed_cached_blocks_are_reused_until_evicted_and_evictions_are_counted() -> None:
    pool = BlockPool(num_blocks=5, block_size=BS)  # 4 usable blocks
    prefix = list(range(1, 2 * BS + 1))
    a = make_request("a", [*prefix, 50])  # 9 tokens: 2 full blocks + 1 partial
    admit_and_compute(pool, a)
    pool.free(a)
    assert pool.num_free_blocks == 4
    # a's partial block was not cached, so a new request takes it before touching any cached block.
    b = make_request("b", [*prefix, 60])
    assert admit_and_compute(pool, b) == 2 * BS
    assert pool.num_evictions == 0
    pool.free(b)
    # 4 blocks of unrelated tokens: the 2 uncached free blocks go first, then both cached ones.
    c = make_request("c", list(range(200, 200 + 4 * BS)))
    assert pool.allocate_slots(c, 4 * BS)
    assert pool.num_evictions == 2
    pool.free(c)
    assert pool.get_computed_blocks([*prefix, 70]) == ([], 0)


def test_freed_blocks_leave_a_prompts_early_blocks_for_last() -> None:
    pool = BlockPool(num_blocks=4, block_size=BS)  # 3 usable blocks
    a = make_request("a", list(range(1, 3 * BS + 2)))  # 13 tokens: 3 full blocks (+1 token)
    assert pool.allocate_slots(a, 3 * BS)
    a.num_computed_tokens = 3 * BS
    pool.cache_full_blocks(a)
    pool.free(a)
    # Evict one block: the LRU head is a's LAST block, so a's first two blocks still hit.
    assert pool.allocate_slots(make_request("x", [9]), 1)
    assert pool.num_evictions == 1
    assert pool.get_computed_blocks(a.all_token_ids)[1] == 2 * BS


def test_two_requests_computing_the_same_prefix_at_once_keep_one_cache_entry() -> None:
    pool = BlockPool(num_blocks=16, block_size=BS)
    prompt = list(range(1, 2 * BS + 2))
    a, b = make_request("a", prompt), make_request("b", prompt)
    for r in (a, b):  # both admitted before either computed: no hits
        assert pool.allocate_slots(r, r.num_tokens)
    for r in (a, b):
        r.num_computed_tokens = r.num_tokens
        pool.cache_full_blocks(r)
    assert pool.stats().num_cached_blocks == 2
    blocks, num_cached = pool.get_computed_blocks(prompt)
    assert [blk.block_id for blk in blocks] == a.block_ids[:2]
    assert num_cached == 2 * BS
    pool.free(a)
    pool.free(b)
    assert pool.num_free_blocks == pool.num_total_blocks


# ---- randomized block accounting through the scheduler --------------------------------------------

EOS = 0
# Prompts are a cut of one of these plus a few fresh tokens, so prefixes are shared at every depth.
BASES = [[1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 6, 5, 4, 3, 2, 1, 2, 3], [2] * 12]


def assert_block_accounting(sched: Scheduler) -> None:
    pool = sched.block_pool
    assert pool.num_used_blocks + pool.num_free_blocks == pool.num_total_blocks
    owners: Counter[int] = Counter()
    for r in sched.running:
        assert len(set(r.block_ids)) == len(r.block_ids)
        # Enough blocks for every computed token.
        assert len(r.block_ids) * pool.block_size >= r.num_computed_tokens
        owners.update(r.block_ids)
    for r in sched.waiting:
        assert r.block_ids == [] and r.num_computed_tokens == 0
    assert NULL_BLOCK_ID not in owners
    for block_id in range(pool.num_blocks):
        assert pool.ref_count(block_id) >= 0
        assert pool.ref_count(block_id) == owners[block_id]
    for block_id, n in owners.items():
        if n > 1:
            assert pool.is_cached(block_id), f"block {block_id} shared by {n} requests but not cached"
    assert pool.num_used_blocks == len(owners)
    assert len(sched.running) <= sched.config.max_concurrency


class FakeKV:
    """Records, per physical slot, which prefix's KV was written there, and checks every read.

    A slot's "KV" is the full token prefix ending at that position, so sharing a block whose contents
    came from a different prefix (or position) is caught.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.slots: dict[tuple[int, int], tuple[int, ...]] = {}

    def run(self, req: Request, start: int, n: int, table: tuple[int, ...]) -> None:
        bs = self.block_size
        toks = req.all_token_ids
        for pos in range(start):
            assert self.slots.get((table[pos // bs], pos % bs)) == tuple(toks[: pos + 1]), (req, pos)
        for pos in range(start, start + n):
            self.slots[(table[pos // bs], pos % bs)] = tuple(toks[: pos + 1])


_add = st.tuples(st.just("add"), st.integers(0, 2), st.integers(0, 12), st.integers(0, 4), st.integers(1, 12))
_step = st.tuples(st.just("step"), st.integers(0, 2**16))
ops = st.lists(
    st.one_of(
        _add, _add, _step, _step, _step,
        st.tuples(st.just("abort"), st.integers(0, 50)),
        st.tuples(st.just("finish"), st.integers(0, 50)),
    ),
    min_size=20,
    max_size=90,
)


def weak_hash(parent: bytes | None, token_ids: tuple[int, ...]) -> bytes:
    """Three possible digests: most lookups and registrations collide."""
    return bytes([(sum(token_ids) + (parent[0] if parent else 0)) % 3])


def run_operations(
    cfg: SchedulerConfig, operations: list[tuple[int | str, ...]], hash_fn: HashFn = hash_block_tokens
) -> Scheduler:
    """Apply ``operations`` (add / step / abort / finish), checking block accounting after each, then
    run what is left to completion and check that every block is free again."""
    sched = Scheduler(cfg, hash_fn=hash_fn)
    kv = FakeKV(cfg.block_size)
    ids: list[str] = []

    def step(seed: int) -> None:
        rng = random.Random(seed)
        out = sched.schedule(now=0.0)
        assert out.num_scheduled_tokens == sum(s.num_tokens for s in out.scheduled)
        assert out.num_scheduled_tokens <= cfg.max_num_batched_tokens
        assert_block_accounting(sched)
        sampled = {}
        for s in out.scheduled:
            req = sched.get_request(s.request_id)
            assert req is not None
            kv.run(req, s.start_pos, s.num_tokens, s.block_table)
            if s.needs_logits:
                sampled[s.request_id] = rng.choice([EOS] + [1, 2, 3, 4, 5, 6] * 3)
        sched.update_from_output(out, sampled, now=1.0)

    for op in operations:
        kind = op[0]
        if kind == "add":
            _, base, cut, extra, max_tokens = op
            rid = f"r{len(ids)}"
            prompt = BASES[int(base)][: int(cut)] + [7 + i for i in range(int(extra))] or [9]
            req = Request(rid, prompt, SamplingParams(max_tokens=int(max_tokens)), 0.0, eos_token_ids=[EOS])
            try:
                sched.add_request(req)
                ids.append(rid)
            except (QueueFullError, ContextLengthExceededError):
                pass
        elif kind == "step":
            step(int(op[1]))
        elif ids:
            rid = ids[int(op[1]) % len(ids)]
            if kind == "abort":
                sched.abort_request(rid)
            else:
                sched.finish_request(rid, "stop")
        assert_block_accounting(sched)

    # Everything left runs to completion (no livelock under preemption), then the pool is whole again.
    for i in range(5000):
        if not sched.has_unfinished_requests():
            break
        step(i)
        assert_block_accounting(sched)
    assert not sched.has_unfinished_requests()
    pool = sched.block_pool
    assert pool.num_free_blocks == pool.num_total_blocks
    assert all(pool.ref_count(b) == 0 for b in range(pool.num_blocks))
    return sched


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    operations=ops,
    block_size=st.sampled_from([1, 2, 4]),
    num_blocks=st.integers(3, 16),
    budget=st.integers(1, 16),
    lanes=st.integers(1, 4),
    caching=st.booleans(),
)
def test_random_operations_never_leak_or_double_own_blocks(
    operations: list[tuple[int | str, ...]], block_size: int, num_blocks: int, budget: int, lanes: int,
    caching: bool,
) -> None:
    cfg = SchedulerConfig(
        max_num_batched_tokens=budget, max_concurrency=lanes, max_pending_requests=5, max_context=32,
        block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=caching,
    )
    run_operations(cfg, operations)


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("block_size", [1, 2, 4])
def test_a_long_seeded_run_under_block_pressure_preempts_evicts_and_still_leaks_nothing(
    block_size: int, caching: bool
) -> None:
    # A tight cache (24 slots) and 4 lanes: running requests outgrow it, so preemption must happen.
    cfg = SchedulerConfig(
        max_num_batched_tokens=8, max_concurrency=4, max_pending_requests=6, max_context=20,
        block_size=block_size, num_blocks=24 // block_size + 1, enable_prefix_caching=caching,
    )
    rng = random.Random(1234 + block_size)
    operations: list[tuple[int | str, ...]] = []
    for _ in range(1500):
        r = rng.random()
        if r < 0.3:
            add = ("add", rng.randrange(3), rng.randrange(13), rng.randrange(4), rng.randrange(4, 12))
            operations.append(add)
        elif r < 0.95:
            operations.append(("step", rng.randrange(2**16)))
        else:
            operations.append((rng.choice(["abort", "finish"]), rng.randrange(1000)))
    sched = run_operations(cfg, operations)
    assert sched.num_preemptions > 0
    # The same run with a hash that collides all the time: the fake KV store proves that no collision
    # ever shares a block whose contents belong to another prefix.
    run_operations(cfg, operations, hash_fn=weak_hash)
    if caching:
        assert sched.block_pool.num_evictions > 0
        assert sched.block_pool.num_prompt_tokens_hit > 0
