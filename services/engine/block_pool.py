"""The paged KV block pool: O(1) allocate/free, reference counts, copy-on-write, prefix cache.

Every block is in exactly one of three states:

- free: refcount 0 and no hash (``_free_ids``, a stack);
- used: refcount > 0 (in the block table of one or more sequences, shared after a fork or a
  prefix-cache hit);
- cached: refcount 0 but holding a full block whose chained hash is indexed, kept reusable until
  evicted in LRU order (``_evictable``). A sequence frees its blocks tail-first, so the end of a
  prefix is evicted before its start.

The scheduler asks yes/no questions (``can_allocate``, ``can_append``) and hands over sequences;
it never indexes the pool. The pool never touches tensors: copies it needs (copy-on-write,
swapping) are returned as (src, dst) block id pairs for the model runner to perform.
"""

from __future__ import annotations

from collections import OrderedDict

from services.engine.hashing import hash_full_blocks
from services.engine.sequence import Sequence


class NoFreeBlocksError(RuntimeError):
    """Raised when an allocation was not checked with ``can_*`` first (a scheduler bug)."""


class BlockPool:
    """Owns the ids of ``num_blocks`` KV blocks of ``block_size`` tokens each."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        self._block_hash: list[int | None] = [None] * num_blocks
        self._free_ids = list(range(num_blocks - 1, -1, -1))  # pop() yields 0, 1, 2, ...
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[int, int] = {}  # block hash -> block id
        self.num_prefix_query_tokens = 0
        self.num_prefix_hit_tokens = 0
        self.num_evictions = 0

    # ----- counters -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now (free plus evictable cached ones)."""
        return len(self._free_ids) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks some sequence references."""
        return self.num_blocks - self.num_free_blocks

    @property
    def num_empty_blocks(self) -> int:
        """Blocks holding nothing at all."""
        return len(self._free_ids)

    @property
    def num_evictable_blocks(self) -> int:
        """Blocks no sequence references that keep a reusable prefix until evicted."""
        return len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding an indexed prefix, referenced or not."""
        return len(self._cached)

    @property
    def cached_block_hashes(self) -> list[int]:
        return list(self._cached)

    @property
    def prefix_hit_rate(self) -> float:
        q = self.num_prefix_query_tokens
        return self.num_prefix_hit_tokens / q if q else 0.0

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    # ----- prefix cache ---------------------------------------------------------------------
    def update_hashes(self, seq: Sequence) -> None:
        """Extend ``seq.block_hashes`` to cover every full block of its tokens (salted by its
        request's ``cache_salt``: another tenant's blocks are never its hits)."""
        if len(seq.block_hashes) < seq.num_tokens // self.block_size:
            seq.block_hashes = hash_full_blocks(
                seq.token_ids, self.block_size, seq.block_hashes, seq.cache_salt
            )

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding the longest cached prefix of ``seq`` (no state changes).

        At least one token is always left to compute: the step that computes it yields the
        logits the next token is sampled from. A sequence that wants its prompt's logprobs
        takes no hit past those it already has: cached blocks keep KV, not logits.
        """
        if not self.enable_prefix_caching:
            return []
        self.update_hashes(seq)
        max_blocks = (seq.num_tokens - 1) // self.block_size
        if seq.params.prompt_logprobs is not None:
            max_blocks = min(max_blocks, len(seq.prompt_logprobs) // self.block_size)
        hits: list[int] = []
        for block_hash in seq.block_hashes[:max_blocks]:
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Index the blocks of ``seq`` that are full and computed, so later requests reuse them."""
        if not self.enable_prefix_caching:
            return
        self.update_hashes(seq)
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        for i in range(num_full):
            block_id = seq.block_table[i]
            if self._block_hash[block_id] is not None:
                continue
            block_hash = seq.block_hashes[i]
            if block_hash in self._cached:
                continue  # another block holds the same content; this one stays private
            self._block_hash[block_id] = block_hash
            self._cached[block_hash] = block_id

    # ----- allocation -----------------------------------------------------------------------
    def _num_new_blocks(self, seq: Sequence, num_new_tokens: int, num_held: int) -> int:
        needed = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        return max(0, needed - num_held)

    def can_allocate(self, seq: Sequence, num_new_tokens: int, cached_prefix: list[int]) -> bool:
        """Whether a waiting ``seq`` can take ``cached_prefix`` and room for its next tokens."""
        start = len(cached_prefix) * self.block_size
        needed = -(-(start + num_new_tokens) // self.block_size) - len(cached_prefix)
        revived = sum(1 for b in cached_prefix if self._ref_counts[b] == 0)
        return needed + revived <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int, cached_prefix: list[int]) -> None:
        """Give a waiting ``seq`` its cached prefix and blocks for ``num_new_tokens`` more."""
        assert not seq.block_table, "allocate() is for sequences that hold no blocks"
        for block_id in cached_prefix:
            self._take(block_id)
        seq.block_table = list(cached_prefix)
        seq.num_computed_tokens = len(cached_prefix) * self.block_size
        seq.num_cached_tokens = seq.num_computed_tokens
        self.num_prefix_query_tokens += seq.num_tokens
        self.num_prefix_hit_tokens += seq.num_computed_tokens
        for _ in range(self._num_new_blocks(seq, num_new_tokens, len(seq.block_table))):
            seq.block_table.append(self._pop_free())

    def _needs_copy_on_write(self, seq: Sequence) -> bool:
        """Whether the next token lands in a partly filled block that another sequence shares."""
        offset = seq.num_computed_tokens % self.block_size
        index = seq.num_computed_tokens // self.block_size
        return (
            offset != 0
            and index < len(seq.block_table)
            and self._ref_counts[seq.block_table[index]] > 1
        )

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether a running ``seq`` can get room for ``num_new_tokens`` more tokens."""
        needed = self._num_new_blocks(seq, num_new_tokens, len(seq.block_table))
        return needed + int(self._needs_copy_on_write(seq)) <= self.num_free_blocks

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        """Make room for ``num_new_tokens``; returns the (src, dst) block copies CoW needs."""
        copies: list[tuple[int, int]] = []
        if self._needs_copy_on_write(seq):
            index = seq.num_computed_tokens // self.block_size
            shared = seq.block_table[index]
            private = self._pop_free()
            self._release(shared)
            seq.block_table[index] = private
            copies.append((shared, private))
        for _ in range(self._num_new_blocks(seq, num_new_tokens, len(seq.block_table))):
            seq.block_table.append(self._pop_free())
        return copies

    def allocate_blocks(self, count: int) -> list[int]:
        """``count`` private blocks (for a sequence coming back from host memory)."""
        if count > self.num_free_blocks:
            raise NoFreeBlocksError(f"{count} blocks asked, {self.num_free_blocks} free")
        return [self._pop_free() for _ in range(count)]

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` shares all of ``parent``'s blocks (copy-on-write on the next append)."""
        for block_id in parent.block_table:
            self._ref_counts[block_id] += 1
        child.block_table = list(parent.block_table)

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references, tail first, so a prefix's end is evicted before its start."""
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []

    # ----- internals ------------------------------------------------------------------------
    def _take(self, block_id: int) -> None:
        if self._ref_counts[block_id] == 0:
            del self._evictable[block_id]
        self._ref_counts[block_id] += 1

    def _pop_free(self) -> int:
        if self._free_ids:
            block_id = self._free_ids.pop()
        elif self._evictable:
            block_id, _ = self._evictable.popitem(last=False)
            block_hash = self._block_hash[block_id]
            assert block_hash is not None
            del self._cached[block_hash]
            self._block_hash[block_id] = None
            self.num_evictions += 1
        else:
            raise NoFreeBlocksError("no free KV blocks (check can_allocate/can_append first)")
        self._ref_counts[block_id] = 1
        return block_id

    def _release(self, block_id: int) -> None:
        count = self._ref_counts[block_id] - 1
        assert count >= 0, f"block {block_id} freed more often than taken"
        self._ref_counts[block_id] = count
        if count == 0:
            if self._block_hash[block_id] is None:
                self._free_ids.append(block_id)
            else:
                self._evictable[block_id] = None

    def reset_prefix_cache(self) -> None:
        """Forget every unreferenced cached block (they become plain free blocks)."""
        for block_id in list(self._evictable):
            block_hash = self._block_hash[block_id]
            assert block_hash is not None
            del self._cached[block_hash]
            self._block_hash[block_id] = None
            self._free_ids.append(block_id)
        self._evictable.clear()

    def check_invariants(self) -> None:
        """Assert the accounting: free + used + cached-unreferenced == total, index consistent."""
        free = set(self._free_ids)
        evictable = set(self._evictable)
        used = {b for b, c in enumerate(self._ref_counts) if c > 0}
        assert len(free) == len(self._free_ids), "duplicate id in the free list"
        assert not (free & evictable) and not (free & used) and not (evictable & used)
        assert len(free) + len(evictable) + len(used) == self.num_blocks, "a block is lost"
        assert all(c >= 0 for c in self._ref_counts)
        assert all(self._block_hash[b] is None for b in free), "a free block keeps a hash"
        assert all(self._block_hash[b] is not None for b in evictable)
        for block_hash, block_id in self._cached.items():
            assert self._block_hash[block_id] == block_hash, "cache index out of sync"
        hashed = sum(1 for h in self._block_hash if h is not None)
        assert hashed == len(self._cached), "a hashed block is missing from the index"


class HostBlockPool:
    """Host-memory block ids for swap preemption (a plain free list; no sharing, no hashes)."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free_ids = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_ids)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free_ids):
            raise NoFreeBlocksError("no free host blocks for swapping")
        return [self._free_ids.pop() for _ in range(count)]

    def free(self, block_ids: list[int]) -> None:
        self._free_ids.extend(reversed(block_ids))
