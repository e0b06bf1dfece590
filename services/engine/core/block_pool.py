"""The paged KV cache's block manager, with prefix caching over full blocks.

The KV cache is ``num_blocks`` physical blocks of ``block_size`` token slots each. Token ``t`` of a
request lives in slot ``block_ids[t // block_size] * block_size + t % block_size``.

**Block 0 is reserved** as the null block: it is never handed to a request, so a model runner may point
padded block-table entries and padded slot-mapping entries at it (its contents are garbage by contract).
The pool therefore manages ``num_blocks - 1`` usable blocks; every count below (``num_total_blocks``,
free, used, usage) is over the usable ones.

**Ownership.** A block's ``ref_cnt`` is the number of requests whose block table holds it. Only full
blocks that are in the prefix cache can have ``ref_cnt > 1`` (a prefix-cache hit shares them); every
other block belongs to exactly one request. The pool is the only writer of ``Request.block_ids``.

**Prefix caching** (vLLM v1's design, docs/design/prefix_caching). Once a request's block is *full and
computed* it is registered under a chained digest ``hash(parent_digest, token_ids_of_block)``, so a digest
names a whole prefix, not one block. A lookup walks a new prompt block by block and stops at the first
miss. The digest is a 128-bit blake2b, and every hit is still verified: the cached block stores its own
token ids and the id of the cache entry of its parent, and both must match, so a hash collision (or a
deliberately broken hash in a test) yields a miss, never wrong KV. Entry ids are a per-pool counter, so a
parent that was evicted and later re-registered with the same tokens gets a new id and its stale
children stop matching.

Blocks are registered only after their KV is computed (:meth:`BlockPool.cache_full_blocks`, called after
the step), never at allocation: a lookup in the same step must not share KV that is not written yet.

**Free list.** Blocks with ``ref_cnt == 0`` sit in one LRU queue. Freed blocks that are cached go to the
tail, the request's last block first, so a prompt's early blocks (the most shareable) are evicted last.
Freed blocks that are not cached go to the head: reusing them loses nothing, whereas taking a cached
block evicts a prefix someone might hit. Allocation pops the head; if that block is cached its digest is
dropped from the cache and the eviction is counted. A cached free block that is hit is taken out of
the queue wherever it is.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from services.engine.core.request import Request

NULL_BLOCK_ID = 0

BlockHash = bytes
# (parent digest or None for a prompt's first block, the block's token ids) -> digest
HashFn = Callable[[BlockHash | None, tuple[int, ...]], BlockHash]

# Parent digest of a prompt's first block; a fixed value keeps digests stable across processes.
_ROOT_DIGEST = bytes(16)


def hash_block_tokens(parent: BlockHash | None, token_ids: tuple[int, ...]) -> BlockHash:
    """Chained digest of one full block: blake2b-128 over the parent digest and the token ids as int64.

    The parent digest is fixed-size and every block has ``block_size`` tokens, so the byte string is
    unambiguous without separators.
    """
    h = hashlib.blake2b(parent if parent is not None else _ROOT_DIGEST, digest_size=16)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


@dataclass(slots=True, eq=False)
class KVBlock:
    """One physical block. Mutable; owned by the pool (callers only pass these back to it)."""

    block_id: int
    ref_cnt: int = 0
    # Set while the block is registered in the prefix cache; all four together, or all None.
    block_hash: BlockHash | None = None
    token_ids: tuple[int, ...] | None = None
    entry_id: int | None = None
    parent_entry_id: int | None = None

    @property
    def is_cached(self) -> bool:
        return self.block_hash is not None


@dataclass(frozen=True, slots=True)
class BlockPoolStats:
    """A snapshot of the pool's counters. Token counts are prompt tokens at first admission."""

    num_total_blocks: int
    num_free_blocks: int
    num_used_blocks: int
    num_cached_blocks: int
    usage: float
    num_evictions: int
    num_prompt_tokens_queried: int
    num_prompt_tokens_hit: int

    @property
    def prefix_hit_rate(self) -> float:
        return prefix_hit_rate(self.num_prompt_tokens_hit, self.num_prompt_tokens_queried)


def prefix_hit_rate(num_prompt_tokens_hit: int, num_prompt_tokens_queried: int) -> float:
    """Prefix-cache hits / queried, in prompt tokens; 0.0 before any query."""
    q = num_prompt_tokens_queried
    return num_prompt_tokens_hit / q if q else 0.0


class BlockPool:
    """Allocates KV blocks to requests and keeps the prefix cache. Pure: no clock, no I/O, no tensors.

    Per-request protocol (the scheduler's):

    1. ``blocks, n = pool.get_computed_blocks(request.all_token_ids)`` on admission (optional);
    2. ``pool.allocate_slots(request, num_new_tokens, blocks)`` — room for the tokens to compute this
       step; ``False`` (nothing changed) when the free blocks do not suffice;
    3. after the step advances ``request.num_computed_tokens``: ``pool.cache_full_blocks(request)``;
       after a speculative step that rejected draft tokens, ``pool.free_unused_blocks(request)`` first;
    4. ``pool.free(request)`` when it finishes, aborts or is preempted.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        hash_fn: HashFn = hash_block_tokens,
    ) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self._hash_fn = hash_fn
        self._blocks = [KVBlock(i) for i in range(num_blocks)]
        # Head = next to allocate. Insertion-ordered dict: O(1) removal of a hit block from the middle.
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self._blocks[1:])
        self._cached: dict[BlockHash, KVBlock] = {}
        self._live_entries: dict[int, KVBlock] = {}
        self._next_entry_id = 1
        self._req_blocks: dict[str, list[KVBlock]] = {}
        # Per request, the cache entry (digest, entry id) that stands for each of its full, computed
        # blocks: its own block's entry, or an identical block's that was cached first. None marks a
        # chain broken by a hash collision: later blocks are then never registered.
        self._req_chain: dict[str, list[tuple[BlockHash, int] | None]] = {}
        self.num_evictions = 0
        self.num_prompt_tokens_queried = 0
        self.num_prompt_tokens_hit = 0

    # ---- counters -----------------------------------------------------------------------------------

    @property
    def num_total_blocks(self) -> int:
        """Usable blocks (the null block excluded)."""
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no owner, cached or not (a cached free block is reusable and evictable)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_total_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks that some request holds, in [0, 1]."""
        return self.num_used_blocks / self.num_total_blocks

    def record_prefix_lookup(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        """Count one admission's prompt lookup (the scheduler calls this once per request)."""
        self.num_prompt_tokens_queried += num_queried_tokens
        self.num_prompt_tokens_hit += num_hit_tokens

    def stats(self) -> BlockPoolStats:
        return BlockPoolStats(
            num_total_blocks=self.num_total_blocks,
            num_free_blocks=self.num_free_blocks,
            num_used_blocks=self.num_used_blocks,
            num_cached_blocks=len(self._cached),
            usage=self.usage,
            num_evictions=self.num_evictions,
            num_prompt_tokens_queried=self.num_prompt_tokens_queried,
            num_prompt_tokens_hit=self.num_prompt_tokens_hit,
        )

    # ---- read-only views for tests and admin pages --------------------------------------------------

    def ref_count(self, block_id: int) -> int:
        return self._blocks[block_id].ref_cnt

    def is_cached(self, block_id: int) -> bool:
        return self._blocks[block_id].is_cached

    def cached_token_ids(self, block_id: int) -> tuple[int, ...] | None:
        """The token ids a block is registered under in the prefix cache, or None if it is not cached."""
        return self._blocks[block_id].token_ids

    def num_blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` token slots."""
        return -(-num_tokens // self.block_size)

    # ---- prefix cache -------------------------------------------------------------------------------

    def get_computed_blocks(self, token_ids: Sequence[int]) -> tuple[list[KVBlock], int]:
        """Longest cached full-block prefix of ``token_ids``: ``(blocks, num_cached_tokens)``.

        Never covers the whole sequence: at least the last token is left to compute, so the step that
        computes it produces logits to sample from. Changes nothing (hits are taken by allocate_slots).
        """
        if not self.enable_caching:
            return [], 0
        bs = self.block_size
        max_blocks = (len(token_ids) - 1) // bs
        hits: list[KVBlock] = []
        parent: BlockHash | None = None
        parent_entry: int | None = None
        for i in range(max_blocks):
            toks = tuple(token_ids[i * bs : (i + 1) * bs])
            digest = self._hash_fn(parent, toks)
            blk = self._cached.get(digest)
            if blk is None or blk.token_ids != toks or blk.parent_entry_id != parent_entry:
                break  # a miss, or a collision caught by the token / parent check
            hits.append(blk)
            parent, parent_entry = digest, blk.entry_id
        return hits, len(hits) * bs

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's full blocks whose KV is computed (``num_computed_tokens // block_size``).

        Call after each step that advanced ``request.num_computed_tokens``. Idempotent.
        """
        if not self.enable_caching:
            return
        rid = request.request_id
        chain = self._req_chain.get(rid)
        if chain is None or (chain and chain[-1] is None):
            return
        blocks = self._req_blocks[rid]
        bs = self.block_size
        num_full = min(request.num_computed_tokens // bs, len(blocks))
        tokens = request.all_token_ids
        for i in range(len(chain), num_full):
            link = chain[-1] if chain else None
            parent, parent_entry = link if link is not None else (None, None)
            toks = tuple(tokens[i * bs : (i + 1) * bs])
            digest = self._hash_fn(parent, toks)
            existing = self._cached.get(digest)
            if existing is not None and self._is_stale(existing):
                self._uncache(existing)
                existing = None
            if existing is None:
                blk = blocks[i]
                blk.block_hash, blk.token_ids = digest, toks
                blk.entry_id, blk.parent_entry_id = self._next_entry_id, parent_entry
                self._next_entry_id += 1
                self._cached[digest] = blk
                self._live_entries[blk.entry_id] = blk
                chain.append((digest, blk.entry_id))
            elif existing.token_ids == toks and existing.parent_entry_id == parent_entry:
                # The same prefix was computed by another request first (both prefilled it at once);
                # keep that entry, ours stays an ordinary private block.
                assert existing.entry_id is not None
                chain.append((digest, existing.entry_id))
            else:
                chain.append(None)  # collision: this prefix cannot be named by its digest
                return

    def _is_stale(self, blk: KVBlock) -> bool:
        # Its parent entry was evicted; no lookup can reach it any more, so it only blocks the digest.
        return blk.parent_entry_id is not None and blk.parent_entry_id not in self._live_entries

    def _uncache(self, blk: KVBlock) -> None:
        assert blk.block_hash is not None and blk.entry_id is not None
        if self._cached.get(blk.block_hash) is blk:
            del self._cached[blk.block_hash]
        self._live_entries.pop(blk.entry_id, None)
        blk.block_hash = blk.token_ids = None
        blk.entry_id = blk.parent_entry_id = None

    # ---- allocation ---------------------------------------------------------------------------------

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: Sequence[KVBlock] = ()
    ) -> bool:
        """Make room for ``num_new_tokens`` more tokens after ``request.num_computed_tokens``.

        ``computed_blocks`` (from :meth:`get_computed_blocks`) may be given only on the request's first
        allocation; they are taken (shared) and count as computed tokens ahead of the new ones, i.e. the
        slots needed are ``num_computed_tokens + len(computed_blocks) * block_size + num_new_tokens``.
        Returns False, changing nothing, when the free blocks do not suffice.
        """
        rid = request.request_id
        blocks = self._req_blocks.get(rid)
        is_first = blocks is None
        if not is_first and computed_blocks:
            raise ValueError(f"computed_blocks given for {rid!r}, which already holds blocks")
        held = blocks if blocks is not None else []
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        num_needed = self.num_blocks_needed(num_computed + num_new_tokens)
        num_new_blocks = num_needed - len(held) - len(computed_blocks)
        # Hit blocks that sit in the free queue leave it when taken, so they do not count as free.
        num_free_hits = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > len(self._free) - num_free_hits:
            return False
        if is_first:
            self._req_blocks[rid] = held
            self._req_chain[rid] = []
            request.block_ids = []
        for blk in computed_blocks:
            if blk.ref_cnt == 0:
                del self._free[blk.block_id]
            blk.ref_cnt += 1
            held.append(blk)
            request.block_ids.append(blk.block_id)
            assert blk.block_hash is not None and blk.entry_id is not None
            self._req_chain[rid].append((blk.block_hash, blk.entry_id))
        for _ in range(num_new_blocks):
            blk = self._pop_free()
            blk.ref_cnt = 1
            held.append(blk)
            request.block_ids.append(blk.block_id)
        return True

    def _pop_free(self) -> KVBlock:
        _, blk = self._free.popitem(last=False)
        if blk.is_cached:
            self._uncache(blk)
            self.num_evictions += 1
        return blk

    def free_unused_blocks(self, request: Request) -> int:
        """Release the request's blocks past the ones its ``num_computed_tokens`` need; return how many.

        Speculative decoding allocates slots for ``K`` draft tokens ahead; when some are rejected, the
        step rolls ``num_computed_tokens`` back to the accepted point and the blocks that held only
        rejected positions come back here. Such blocks were never registered in the prefix cache
        (:meth:`cache_full_blocks` only registers blocks below ``num_computed_tokens``), and the stale
        K/V left in the kept block's tail sits past ``num_computed_tokens``, where the next step
        overwrites it before any attention reads it. Afterwards the request holds exactly
        ``num_blocks_needed(num_computed_tokens)`` blocks, as after a plain decode step.
        """
        blocks = self._req_blocks.get(request.request_id)
        if blocks is None:
            return 0
        keep = self.num_blocks_needed(request.num_computed_tokens)
        num_released = 0
        while len(blocks) > keep:
            blk = blocks.pop()
            request.block_ids.pop()
            assert blk.ref_cnt == 1 and not blk.is_cached, f"block {blk.block_id} past the computed tokens is shared"
            blk.ref_cnt = 0
            self._free[blk.block_id] = blk
            self._free.move_to_end(blk.block_id, last=False)  # uncached: reused first, evicts nothing
            num_released += 1
        return num_released

    def free(self, request: Request) -> None:
        """Release every block the request holds (finish, abort or preemption). Idempotent."""
        blocks = self._req_blocks.pop(request.request_id, None)
        self._req_chain.pop(request.request_id, None)
        request.block_ids = []
        if blocks is None:
            return
        # Last block first: with tail-append, a prompt's later blocks are evicted before its earlier,
        # more shareable ones.
        for blk in reversed(blocks):
            blk.ref_cnt -= 1
            assert blk.ref_cnt >= 0, f"block {blk.block_id} freed more often than taken"
            if blk.ref_cnt == 0:
                self._free[blk.block_id] = blk
                if not blk.is_cached:
                    self._free.move_to_end(blk.block_id, last=False)
