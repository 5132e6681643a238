"""BlockPool / HostBlockPool: allocation, ref counts, copy-on-write, prefix cache, LRU eviction.

The unit tests pin the documented behaviour; the hypothesis state machine drives random
interleavings of add / compute / decode / fork / free / reset and checks, after every step, the
pool's own invariants plus an independent model of the KV contents (each block slot remembers
which token was written to it), so a block shared by two writers or a wrong prefix hit shows up
as a token mismatch.
"""

from __future__ import annotations

import copy
import itertools

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from common.sampling_params import SamplingParams
from services.engine.block_pool import BlockPool, HostBlockPool, NoFreeBlocksError
from services.engine.hashing import hash_full_blocks
from services.engine.sequence import Sequence

_ids = itertools.count()


def make_seq(tokens: list[int], seq_id: int | None = None) -> Sequence:
    return Sequence(next(_ids) if seq_id is None else seq_id, "req", list(tokens), SamplingParams())


def admit_and_compute(pool: BlockPool, seq: Sequence) -> list[int]:
    """Admit ``seq`` (with its cached prefix) and compute all of its tokens, like one prefill."""
    prefix = pool.find_cached_prefix(seq)
    num_new = seq.num_tokens - len(prefix) * pool.block_size
    assert pool.can_allocate(seq, num_new, prefix)
    pool.allocate(seq, num_new, prefix)
    seq.num_computed_tokens += num_new
    pool.cache_full_blocks(seq)
    return prefix


def decode_one(pool: BlockPool, seq: Sequence, token: int) -> list[tuple[int, int]]:
    """Append one sampled token and compute it (one decode step)."""
    seq.append_token(token)
    copies = pool.append_slots(seq, 1)
    seq.num_computed_tokens += 1
    pool.cache_full_blocks(seq)
    return copies


# ------------------------------------------------------------------------------------------
# unit tests
# ------------------------------------------------------------------------------------------


def test_allocate_free_returns_every_block():
    pool = BlockPool(num_blocks=10, block_size=4, enable_prefix_caching=False)
    seqs = [make_seq(list(range(i * 7, i * 7 + 7))) for i in range(4)]  # 2 blocks each
    for seq in seqs:
        admit_and_compute(pool, seq)
        assert len(seq.block_table) == 2
        pool.check_invariants()
    assert pool.num_free_blocks == 10 - 8
    assert pool.num_used_blocks == 8
    all_ids = [b for s in seqs for b in s.block_table]
    assert len(set(all_ids)) == 8, "two sequences got the same block"
    assert all(pool.ref_count(b) == 1 for b in all_ids)
    for seq in seqs:
        pool.free(seq)
        assert seq.block_table == []
        pool.check_invariants()
    assert pool.num_free_blocks == pool.num_blocks == 10
    assert pool.num_used_blocks == 0
    assert all(pool.ref_count(b) == 0 for b in range(10))


def test_free_list_basics_lifo_and_lowest_first():
    pool = BlockPool(num_blocks=6, block_size=2, enable_prefix_caching=False)
    assert pool.allocate_blocks(3) == [0, 1, 2]  # a fresh pool hands out 0, 1, 2, ...
    a = make_seq([1, 2, 3])  # 2 blocks
    admit_and_compute(pool, a)
    assert a.block_table == [3, 4]
    pool.free(a)  # tail first: 4 then 3 go back; 3 is on top of the stack
    b = make_seq([5])
    admit_and_compute(pool, b)
    assert b.block_table == [3], "the most recently freed block is reused first (O(1) stack)"
    assert pool.num_free_blocks == 2  # 4 and 5
    with pytest.raises(NoFreeBlocksError):
        pool.allocate_blocks(3)
    assert pool.num_free_blocks == 2, "a refused allocate_blocks takes nothing"
    assert pool.allocate_blocks(0) == []
    pool.check_invariants()


def test_prefix_cache_hit_after_free():
    bs = 4
    pool = BlockPool(num_blocks=16, block_size=bs)
    prompt = list(range(100, 110))  # 2 full blocks + 2 tokens
    a = make_seq(prompt)
    assert admit_and_compute(pool, a) == []
    assert pool.num_prefix_hit_tokens == 0
    assert pool.num_prefix_query_tokens == 10
    full_blocks = a.block_table[:2]
    assert pool.num_cached_blocks == 2
    assert a.block_hashes == hash_full_blocks(prompt, bs)
    pool.free(a)
    pool.check_invariants()
    assert pool.num_free_blocks == 16  # cached blocks still count as allocatable
    assert pool.num_cached_blocks == 2

    b = make_seq(prompt + [7, 7, 7])
    assert pool.find_cached_prefix(b) == full_blocks
    # find_cached_prefix does not change state or counters
    assert pool.num_prefix_query_tokens == 10
    prefix = admit_and_compute(pool, b)
    assert prefix == full_blocks
    assert b.block_table[:2] == full_blocks
    assert b.num_cached_tokens == 8
    assert pool.num_prefix_hit_tokens == 8
    assert pool.num_prefix_query_tokens == 10 + 13
    assert pool.prefix_hit_rate == pytest.approx(8 / 23)
    assert all(pool.ref_count(x) == 1 for x in b.block_table)

    # a different second block: only the first block hits
    c = make_seq(prompt[:4] + [0, 0, 0, 0, 1])
    assert pool.find_cached_prefix(c) == full_blocks[:1]
    admit_and_compute(pool, c)
    assert pool.ref_count(full_blocks[0]) == 2  # shared by b and c
    assert pool.ref_count(full_blocks[1]) == 1
    pool.free(b)
    pool.free(c)
    pool.check_invariants()
    assert pool.num_free_blocks == 16


def test_prefix_cache_disabled_never_hits():
    pool = BlockPool(num_blocks=8, block_size=2, enable_prefix_caching=False)
    a = make_seq([1, 2, 3, 4, 5])
    admit_and_compute(pool, a)
    pool.free(a)
    assert pool.num_cached_blocks == 0
    assert pool.find_cached_prefix(make_seq([1, 2, 3, 4, 5])) == []


def test_at_least_one_token_left_to_compute():
    bs = 4
    pool = BlockPool(num_blocks=16, block_size=bs)
    prompt = list(range(12))  # exactly 3 full blocks
    a = make_seq(prompt)
    admit_and_compute(pool, a)
    blocks = list(a.block_table)
    assert len(blocks) == 3
    pool.free(a)
    b = make_seq(prompt)
    hits = pool.find_cached_prefix(b)
    assert hits == blocks[:2], "a prompt of k full blocks may hit only k-1 of them"
    admit_and_compute(pool, b)
    assert b.num_cached_tokens == 8
    # the last block was recomputed into a block of its own (same content, stays private)
    assert b.block_table[:2] == blocks[:2]
    assert b.num_computed_tokens == 12
    pool.check_invariants()
    # a one-token prompt can never hit
    assert pool.find_cached_prefix(make_seq([0])) == []


def test_lru_eviction_is_tail_first():
    bs = 2
    pool = BlockPool(num_blocks=4, block_size=bs)
    prompt = [1, 2, 3, 4, 5, 6, 7]  # 3 full blocks + 1 token -> all 4 blocks
    a = make_seq(prompt)
    admit_and_compute(pool, a)
    b0, b1, b2, b3 = a.block_table
    pool.free(a)
    assert pool.num_cached_blocks == 3
    assert pool.num_free_blocks == 4
    # 2 new blocks: the unhashed partial block first, then the LRU cached block, which must be
    # the END of the freed prefix (b2), not its start.
    other = make_seq([9, 9, 9])
    admit_and_compute(pool, other)
    assert set(other.block_table) == {b3, b2}
    assert pool.num_evictions == 1
    assert pool.find_cached_prefix(make_seq(prompt)) == [b0, b1]
    # one more block: b1 is evicted next, b0 survives
    other2 = make_seq([8])
    admit_and_compute(pool, other2)
    assert other2.block_table == [b1]
    assert pool.num_evictions == 2
    assert pool.find_cached_prefix(make_seq(prompt)) == [b0]
    pool.check_invariants()


def test_prefix_hit_revives_block_from_lru():
    bs = 2
    pool = BlockPool(num_blocks=4, block_size=bs)
    a = make_seq([1, 2, 3, 4, 5])
    admit_and_compute(pool, a)
    pool.free(a)
    b = make_seq([1, 2, 3, 4, 6, 6])
    prefix = pool.find_cached_prefix(b)
    assert len(prefix) == 2
    # 2 revived cached blocks + 1 new one; all 4 are free, so this fits
    assert pool.can_allocate(b, 2, prefix)
    admit_and_compute(pool, b)
    assert pool.num_free_blocks == 1
    # revived blocks are no longer evictable: a 2-block request must not fit now
    c = make_seq([7, 7, 7])
    assert not pool.can_allocate(c, 3, [])
    pool.check_invariants()


def test_fork_shares_and_copy_on_write():
    bs = 4
    pool = BlockPool(num_blocks=8, block_size=bs)
    parent = make_seq([1, 2, 3, 4, 5, 6])  # block 0 full, block 1 half full
    admit_and_compute(pool, parent)
    child = parent.fork(next(_ids), 1)
    pool.fork(parent, child)
    assert child.block_table == parent.block_table
    assert all(pool.ref_count(b) == 2 for b in parent.block_table)
    pool.check_invariants()
    full, partial = parent.block_table

    copies = decode_one(pool, parent, 42)
    assert len(copies) == 1
    src, dst = copies[0]
    assert src == partial and dst != partial
    assert parent.block_table == [full, dst]
    assert child.block_table == [full, partial]
    assert pool.ref_count(dst) == 1
    assert pool.ref_count(partial) == 1
    assert pool.ref_count(full) == 2

    # the other sequence now owns the old block alone: no copy for it
    assert decode_one(pool, child, 43) == []
    assert child.block_table == [full, partial]
    pool.check_invariants()
    pool.free(parent)
    pool.free(child)
    pool.check_invariants()
    assert pool.num_free_blocks == pool.num_blocks


def test_fork_at_block_boundary_needs_no_copy():
    pool = BlockPool(num_blocks=8, block_size=4)
    parent = make_seq([1, 2, 3, 4, 5, 6, 7, 8])  # exactly 2 full blocks
    admit_and_compute(pool, parent)
    child = parent.fork(next(_ids), 1)
    pool.fork(parent, child)
    assert decode_one(pool, parent, 9) == []
    assert decode_one(pool, child, 9) == []
    assert parent.block_table[:2] == child.block_table[:2]
    assert parent.block_table[2] != child.block_table[2]
    assert all(pool.ref_count(b) == 2 for b in parent.block_table[:2])
    pool.check_invariants()


def test_can_allocate_and_can_append_exact():
    bs = 4
    pool = BlockPool(num_blocks=5, block_size=bs, enable_prefix_caching=False)
    hog = make_seq(list(range(12)))  # 3 blocks
    admit_and_compute(pool, hog)
    assert pool.num_free_blocks == 2
    s = make_seq(list(range(20, 28)))
    assert pool.can_allocate(s, 8, [])  # 2 blocks needed, 2 free
    assert not pool.can_allocate(make_seq(list(range(9))), 9, [])  # 3 needed
    assert pool.can_allocate(make_seq(list(range(9))), 8, [])  # a chunk of 8 fits
    pool.allocate(s, 8, [])
    s.num_computed_tokens = 8
    assert pool.num_free_blocks == 0
    # s is at a block boundary: the next token needs a new block, none is free
    assert not pool.can_append(s, 1)
    # hog has room left in its last block? 12 tokens = 3 full blocks -> also needs one
    assert not pool.can_append(hog, 1)
    with pytest.raises(NoFreeBlocksError):
        pool.append_slots(s, 1)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(make_seq([1]), 1, [])
    pool.free(hog)
    assert pool.can_append(s, 1)
    assert pool.can_append(s, 12)  # 3 more blocks
    assert not pool.can_append(s, 13)  # 4 more blocks


def test_can_append_counts_the_copy_on_write_block():
    bs = 4
    pool = BlockPool(num_blocks=3, block_size=bs, enable_prefix_caching=False)
    parent = make_seq([1, 2, 3, 4, 5])  # 2 blocks, second partly filled
    admit_and_compute(pool, parent)
    child = parent.fork(next(_ids), 1)
    pool.fork(parent, child)
    hog = make_seq([9])
    admit_and_compute(pool, hog)
    assert pool.num_free_blocks == 0
    # one more token fits in the partly filled block's free slots, but that block is shared:
    # the copy needs a block and there is none
    assert not pool.can_append(parent, 1)
    pool.free(hog)
    assert pool.can_append(parent, 1)
    assert not pool.can_append(parent, 4)  # copy + one new block
    assert len(pool.append_slots(parent, 1)) == 1
    pool.check_invariants()


def test_reset_prefix_cache():
    pool = BlockPool(num_blocks=8, block_size=2)
    a = make_seq([1, 2, 3, 4, 5])
    admit_and_compute(pool, a)
    b = make_seq([7, 8, 9, 10, 11])
    admit_and_compute(pool, b)
    pool.free(a)
    assert pool.num_cached_blocks == 4
    pool.reset_prefix_cache()
    pool.check_invariants()
    # a's unreferenced cached blocks are forgotten; b's referenced ones stay indexed
    assert pool.num_cached_blocks == 2
    assert pool.find_cached_prefix(make_seq([1, 2, 3, 4, 5])) == []
    assert pool.find_cached_prefix(make_seq([7, 8, 9, 10, 11])) == b.block_table[:2]
    assert pool.num_free_blocks == 8 - 3
    pool.free(b)
    pool.reset_prefix_cache()
    assert pool.num_cached_blocks == 0
    assert pool.num_free_blocks == 8
    pool.check_invariants()


def test_same_content_in_two_blocks_keeps_one_indexed():
    pool = BlockPool(num_blocks=8, block_size=2)
    a = make_seq([1, 2, 3])
    b = make_seq([1, 2, 3])
    # both admitted before either is computed: no hit, two blocks with the same content
    pa, pb = pool.find_cached_prefix(a), pool.find_cached_prefix(b)
    pool.allocate(a, 3, pa)
    pool.allocate(b, 3, pb)
    for s in (a, b):
        s.num_computed_tokens = 3
        pool.cache_full_blocks(s)
    assert pool.num_cached_blocks == 1
    pool.check_invariants()
    pool.free(a)
    pool.free(b)
    pool.check_invariants()
    assert pool.num_free_blocks == 8


def test_host_block_pool():
    host = HostBlockPool(4)
    assert host.num_free_blocks == 4
    ids = host.allocate(3)
    assert ids == [0, 1, 2]
    assert host.num_free_blocks == 1
    with pytest.raises(NoFreeBlocksError):
        host.allocate(2)
    assert host.num_free_blocks == 1
    host.free(ids)
    assert host.num_free_blocks == 4
    assert sorted(host.allocate(4)) == [0, 1, 2, 3]
    assert host.num_free_blocks == 0


# ------------------------------------------------------------------------------------------
# stateful property test
# ------------------------------------------------------------------------------------------

BLOCK_SIZE = 2
NUM_BLOCKS = 12
# Shared prompt stems from a tiny vocabulary, so prefix hits (and duplicate contents) happen.
STEMS = [[0, 1, 0, 1, 1, 0, 0, 1, 1, 1], [1, 1, 0, 0, 1, 0, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0]]
token = st.integers(0, 2)


class BlockPoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS, BLOCK_SIZE)
        self.seqs: list[Sequence] = []
        # simulated KV contents: block id -> slot -> token written there
        self.kv: dict[int, dict[int, int]] = {}
        self.next_id = 0
        self.num_hits = 0
        self.num_copies = 0

    # ----- helpers --------------------------------------------------------------------------
    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def _compute(self, seq: Sequence, num: int) -> None:
        """Write tokens [computed, computed + num) into the KV model, checking exclusivity."""
        start = seq.num_computed_tokens
        assert len(seq.block_table) * BLOCK_SIZE >= start + num, "no room for scheduled tokens"
        for pos in range(start, start + num):
            block = seq.block_table[pos // BLOCK_SIZE]
            assert self.pool.ref_count(block) == 1, (
                f"seq {seq.seq_id} writes position {pos} into block {block} "
                f"shared {self.pool.ref_count(block)} ways"
            )
            self.kv.setdefault(block, {})[pos % BLOCK_SIZE] = seq.token_ids[pos]
        seq.num_computed_tokens += num
        self.pool.cache_full_blocks(seq)

    def _apply_copies(self, copies: list[tuple[int, int]]) -> None:
        for src, dst in copies:
            assert src != dst
            self.kv[dst] = dict(self.kv.get(src, {}))
            self.num_copies += 1

    def _assert_refuses(self, action) -> None:  # type: ignore[no-untyped-def]
        """``action`` on deep copies of pool and sequences must raise NoFreeBlocksError."""
        pool_copy = copy.deepcopy(self.pool)
        with pytest.raises(NoFreeBlocksError):
            action(pool_copy)

    # ----- rules ----------------------------------------------------------------------------
    @rule(
        stem=st.sampled_from(STEMS),
        cut=st.integers(0, 10),
        tail=st.lists(token, max_size=4),
        chunk_frac=st.floats(0.05, 1.0),
    )
    def add(self, stem: list[int], cut: int, tail: list[int], chunk_frac: float) -> None:
        prompt = stem[:cut] + tail
        if not prompt:
            prompt = [2]
        seq = Sequence(self._new_id(), "req", prompt, SamplingParams())
        prefix = self.pool.find_cached_prefix(seq)
        assert len(prefix) * BLOCK_SIZE < seq.num_tokens, "nothing left to compute"
        assert len(set(prefix)) == len(prefix)
        # a hit must hold exactly the tokens of the prompt's prefix
        for i, block in enumerate(prefix):
            for slot in range(BLOCK_SIZE):
                assert self.kv[block][slot] == prompt[i * BLOCK_SIZE + slot], "wrong prefix hit"
        remaining = seq.num_tokens - len(prefix) * BLOCK_SIZE
        chunk = max(1, round(remaining * chunk_frac))
        if not self.pool.can_allocate(seq, chunk, prefix):
            probe = copy.deepcopy(seq)
            self._assert_refuses(lambda p: p.allocate(probe, chunk, prefix))
            return
        free_before = self.pool.num_free_blocks
        self.pool.allocate(seq, chunk, prefix)
        self.num_hits += len(prefix)
        assert seq.num_computed_tokens == seq.num_cached_tokens == len(prefix) * BLOCK_SIZE
        assert seq.block_table[: len(prefix)] == prefix
        assert len(seq.block_table) == -(-(seq.num_computed_tokens + chunk) // BLOCK_SIZE)
        assert self.pool.num_free_blocks <= free_before
        self._compute(seq, chunk)
        self.seqs.append(seq)

    @precondition(lambda self: any(s.num_uncomputed_tokens for s in self.seqs))
    @rule(data=st.data(), num=st.integers(1, 5))
    def compute_chunk(self, data: st.DataObject, num: int) -> None:
        """Continue a chunked prefill."""
        pending = [s for s in self.seqs if s.num_uncomputed_tokens]
        seq = data.draw(st.sampled_from(pending))
        num = min(num, seq.num_uncomputed_tokens)
        self._append(seq, num)

    @precondition(lambda self: any(not s.num_uncomputed_tokens for s in self.seqs))
    @rule(data=st.data(), new_tokens=st.lists(token, min_size=1, max_size=3))
    def decode(self, data: st.DataObject, new_tokens: list[int]) -> None:
        """Append sampled tokens (1 = decode, more = a speculative-style multi-token step)."""
        done = [s for s in self.seqs if not s.num_uncomputed_tokens]
        seq = data.draw(st.sampled_from(done))
        if not self.pool.can_append(seq, len(new_tokens)):
            probe = copy.deepcopy(seq)
            self._assert_refuses(lambda p: p.append_slots(probe, len(new_tokens)))
            return
        for t in new_tokens:
            seq.append_token(t)
        self._append(seq, len(new_tokens), checked=True)

    def _append(self, seq: Sequence, num: int, checked: bool = False) -> None:
        if not checked and not self.pool.can_append(seq, num):
            probe = copy.deepcopy(seq)
            self._assert_refuses(lambda p: p.append_slots(probe, num))
            return
        copies = self.pool.append_slots(seq, num)
        self._apply_copies(copies)
        # the block receiving the next token is private now
        block = seq.block_table[seq.num_computed_tokens // BLOCK_SIZE]
        assert self.pool.ref_count(block) == 1
        self._compute(seq, num)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(self.seqs))
        child = parent.fork(self._new_id(), 1)
        self.pool.fork(parent, child)
        assert child.block_table == parent.block_table
        self.seqs.append(child)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self.seqs))
        self.seqs.remove(seq)
        before = self.pool.num_free_blocks
        self.pool.free(seq)
        assert seq.block_table == []
        assert self.pool.num_free_blocks >= before

    @rule()
    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()

    # ----- invariants -----------------------------------------------------------------------
    @invariant()
    def pool_accounting(self) -> None:
        self.pool.check_invariants()
        expected = [0] * NUM_BLOCKS
        for seq in self.seqs:
            for block in seq.block_table:
                expected[block] += 1
        actual = [self.pool.ref_count(b) for b in range(NUM_BLOCKS)]
        assert actual == expected, "ref counts differ from the live block tables"
        used = sum(1 for c in expected if c)
        assert self.pool.num_free_blocks == NUM_BLOCKS - used

    @invariant()
    def kv_contents_match(self) -> None:
        for seq in self.seqs:
            assert seq.num_computed_tokens <= seq.num_tokens
            assert len(seq.block_table) == -(-seq.num_computed_tokens // BLOCK_SIZE)
            for pos in range(seq.num_computed_tokens):
                block = seq.block_table[pos // BLOCK_SIZE]
                assert self.kv[block][pos % BLOCK_SIZE] == seq.token_ids[pos], (
                    f"seq {seq.seq_id} position {pos}: block {block} was overwritten"
                )

    def teardown(self) -> None:
        for seq in self.seqs:
            self.pool.free(seq)
        self.seqs.clear()
        self.pool.check_invariants()
        assert self.pool.num_free_blocks == NUM_BLOCKS
        assert all(self.pool.ref_count(b) == 0 for b in range(NUM_BLOCKS))


BlockPoolMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestBlockPoolMachine = BlockPoolMachine.TestCase
