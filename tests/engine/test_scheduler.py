"""Scheduler: continuous batching, chunked prefill, preemption (recompute / swap), no model.

A small simulator plays the model runner: it performs the batch's block swaps and copies on a
model of the KV contents (block -> slot -> token), "computes" the scheduled tokens by writing
them into their blocks, calls ``on_step_done``, samples a fake token for every sequence whose
tokens are all computed, and finishes sequences at their target length. After every step it checks
that each running sequence's computed positions still hold its own tokens, so lost swaps, missed
copies or two sequences writing into one block show up as mismatches.
"""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.sampling_params import SamplingParams
from services.engine.block_pool import BlockPool, HostBlockPool
from services.engine.config import SchedulerConfig
from services.engine.scheduler import ScheduledBatch, Scheduler, is_decoding
from services.engine.sequence import FinishReason, Sequence, SequenceStatus

_ids = itertools.count()


def make_seq(prompt: list[int]) -> Sequence:
    return Sequence(next(_ids), f"req-{len(prompt)}", list(prompt), SamplingParams())


class Sim:
    """Drives a Scheduler like the engine does, with a fake model and strict checks."""

    def __init__(
        self,
        sched: Scheduler,
        targets: dict[int, int] | None = None,
        check_seq_cap: bool = True,
        fork_at_first_token: set[int] | None = None,
    ):
        self.sched = sched
        self.pool = sched.pool
        self.bs = sched.pool.block_size
        self.targets: dict[int, int] = dict(targets or {})  # seq_id -> output length
        self.check_seq_cap = check_seq_cap
        self.fork_at_first_token = set(fork_at_first_token or ())
        self.device_kv: dict[int, dict[int, int]] = {}
        self.host_kv: dict[int, dict[int, int]] = {}
        self.finished: list[Sequence] = []
        self.batches: list[ScheduledBatch] = []
        self.all_seqs: list[Sequence] = []
        self.rng = random.Random(0)
        self.steps = 0

    def add(self, seq: Sequence, target: int) -> Sequence:
        self.targets[seq.seq_id] = target
        self.all_seqs.append(seq)
        self.sched.add(seq)
        return seq

    def step(self) -> ScheduledBatch:
        sched, pool = self.sched, self.pool
        running_before = list(sched.running)
        # The streams at the step's start: their next token waits for the whole step.
        streams = [s for s in [*sched.running, *sched.swapped] if is_decoding(s)]
        batch = sched.schedule()
        self.batches.append(batch)
        self.steps += 1
        cfg = sched.config

        # --- the step's shape -----------------------------------------------------------
        assert batch.total_tokens <= sched.token_budget, "token budget exceeded"
        assert all(n >= 1 for n in batch.num_tokens)
        cap = cfg.max_prompt_tokens_beside_decodes
        if cap is not None and cfg.enable_chunked_prefill and streams:
            prompt_tokens = sum(
                n for s, n in zip(batch.seqs, batch.num_tokens) if not (s in streams and n == 1)
            )
            assert prompt_tokens <= cap, "a step beside decodes computed more prompt than the cap"
        assert len(set(map(id, batch.seqs))) == len(batch.seqs), "a sequence scheduled twice"
        if self.check_seq_cap:
            assert len(sched.running) <= cfg.max_num_seqs
        # decode (already running) sequences come before anything admitted in this step
        was_running = [s in running_before for s in batch.seqs]
        assert was_running == sorted(was_running, reverse=True), "a new prefill before a decode"
        # running sequences keep their order (oldest first)
        kept = [s for s in running_before if s in sched.running]
        assert sched.running[: len(kept)] == kept
        if batch.num_preempted:
            # the victims are the newest running sequences; none of them is in the batch
            victims = running_before[len(running_before) - batch.num_preempted :]
            assert not any(v in batch.seqs for v in victims)
            assert not any(v in sched.running for v in victims)
            assert kept == running_before[: len(kept)]
            for v in victims:
                assert v.block_table == []
                assert v.status in (SequenceStatus.WAITING, SequenceStatus.SWAPPED)
                if v.status == SequenceStatus.WAITING:
                    assert v.num_computed_tokens == 0
            recomputed = [v for v in victims if v.status == SequenceStatus.WAITING]
            assert list(sched.waiting)[: len(recomputed)] == recomputed, (
                "recomputed victims go to the front of waiting, oldest first"
            )
            assert not batch.blocks_to_swap_in
        for seq in batch.seqs:
            assert seq.status == SequenceStatus.RUNNING and seq in sched.running

        # --- the runner: swap out, swap in, copy, then compute ------------------------------
        for dev, host in batch.blocks_to_swap_out:
            self.host_kv[host] = dict(self.device_kv.get(dev, {}))
        for host, dev in batch.blocks_to_swap_in:
            self.device_kv[dev] = dict(self.host_kv[host])
        for src, dst in batch.blocks_to_copy:
            self.device_kv[dst] = dict(self.device_kv.get(src, {}))
        for seq, num in zip(batch.seqs, batch.num_tokens):
            start = seq.num_computed_tokens
            assert start + num <= seq.num_tokens
            assert len(seq.block_table) * self.bs >= start + num, "no slot for a scheduled token"
            for pos in range(start, start + num):
                block = seq.block_table[pos // self.bs]
                assert pool.ref_count(block) == 1, f"write into block {block} shared by others"
                self.device_kv.setdefault(block, {})[pos % self.bs] = seq.token_ids[pos]
        sched.on_step_done(batch)
        pool.check_invariants()

        # --- sample and finish ------------------------------------------------------------
        for seq in list(batch.seqs):
            if seq.num_computed_tokens != seq.num_tokens:
                continue
            seq.append_token(self.rng.randrange(5))
            if seq.num_output_tokens >= self.targets[seq.seq_id]:
                free_before = pool.num_free_blocks
                held = len(set(b for b in seq.block_table if pool.ref_count(b) == 1))
                sched.finish(seq, FinishReason.LENGTH)
                assert seq.status == SequenceStatus.FINISHED
                assert seq.finish_reason == FinishReason.LENGTH
                assert seq.block_table == [], "a finished sequence keeps blocks"
                assert pool.num_free_blocks == free_before + held
                self.finished.append(seq)
            elif seq.seq_id in self.fork_at_first_token and seq.num_output_tokens == 1:
                self.fork_at_first_token.discard(seq.seq_id)
                child = seq.fork(next(_ids), 1)
                pool.fork(seq, child)
                self.targets[child.seq_id] = self.targets[seq.seq_id]
                self.all_seqs.append(child)
                sched.add_running(child)

        # --- the KV model agrees with every running sequence ------------------------------
        refs: dict[int, int] = {}
        for seq in sched.running:
            assert seq.num_computed_tokens <= seq.num_tokens
            for pos in range(seq.num_computed_tokens):
                block = seq.block_table[pos // self.bs]
                assert self.device_kv[block][pos % self.bs] == seq.token_ids[pos], (
                    f"seq {seq.seq_id} lost its KV at position {pos} (block {block})"
                )
            for b in seq.block_table:
                refs[b] = refs.get(b, 0) + 1
        for seq in [*sched.waiting, *sched.swapped]:
            assert seq.block_table == []
        for b in range(pool.num_blocks):
            assert pool.ref_count(b) == refs.get(b, 0), "ref count differs from block tables"
        return batch

    def run(self, max_steps: int = 2000) -> None:
        while self.sched.has_unfinished:
            assert self.steps < max_steps, "the scheduler made no progress (livelock)"
            self.step()
        assert all(s.is_finished for s in self.all_seqs)
        for s in self.all_seqs:
            assert s.num_output_tokens == self.targets[s.seq_id]
        assert self.pool.num_free_blocks == self.pool.num_blocks
        self.pool.check_invariants()
        if self.sched.host_pool is not None:
            assert self.sched.host_pool.num_free_blocks == self.sched.host_pool.num_blocks


def new_sched(
    num_blocks: int = 64,
    block_size: int = 4,
    *,
    max_num_seqs: int = 8,
    budget: int = 64,
    chunked: bool = True,
    mode: str = "recompute",
    host_blocks: int = 0,
    prefix_caching: bool = True,
    prompt_cap: int | None = None,
) -> Scheduler:
    cfg = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        enable_chunked_prefill=chunked,
        preemption_mode=mode,
        max_prompt_tokens_beside_decodes=prompt_cap,
    )
    pool = BlockPool(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    host = HostBlockPool(host_blocks) if host_blocks else None
    return Scheduler(cfg, pool, host)


def prompt(n: int, base: int = 1000) -> list[int]:
    return list(range(base, base + n))


# ------------------------------------------------------------------------------------------


def test_decode_before_prefill_and_budget():
    sched = new_sched(budget=16)
    sim = Sim(sched)
    a = sim.add(make_seq(prompt(10, 0)), target=20)
    b1 = sim.step()
    assert b1.seqs == [a] and b1.num_tokens == [10]
    b = sim.add(make_seq(prompt(30, 100)), target=3)
    b2 = sim.step()
    assert b2.seqs == [a, b], "the running sequence's decode comes first"
    assert b2.num_tokens == [1, 15]
    b3 = sim.step()
    assert b3.seqs == [a, b] and b3.num_tokens == [1, 15]
    sim.run()


def test_token_budget_and_max_num_seqs_with_many_requests():
    sched = new_sched(num_blocks=256, budget=24, max_num_seqs=3)
    sim = Sim(sched)
    for i in range(10):
        sim.add(make_seq(prompt(5 + 3 * i, 100 * i)), target=4 + i % 3)
    max_running = 0
    while sched.has_unfinished:
        batch = sim.step()
        assert batch.total_tokens <= 24
        assert len(batch.seqs) <= 3
        max_running = max(max_running, len(sched.running))
        assert sim.steps < 500
    assert max_running == 3, "max_num_seqs is reached but never exceeded"
    sim.run()


def test_waiting_sequences_are_admitted_in_arrival_order():
    sched = new_sched(budget=100, max_num_seqs=2)
    sim = Sim(sched)
    seqs = [sim.add(make_seq(prompt(4, 10 * i)), target=2) for i in range(4)]
    b1 = sim.step()
    assert b1.seqs == seqs[:2]
    assert list(sched.waiting) == seqs[2:]
    sim.run()
    order = [s.seq_id for s in sim.finished]
    assert order == [s.seq_id for s in seqs]


def test_chunked_prefill_splits_a_long_prompt():
    sched = new_sched(budget=8, chunked=True)
    sim = Sim(sched)
    a = sim.add(make_seq(prompt(20)), target=2)
    chunks = []
    while a.num_output_tokens == 0:
        batch = sim.step()
        assert batch.seqs == [a]
        chunks.append(batch.num_tokens[0])
    assert chunks == [8, 8, 4]
    sim.run()


def test_chunked_prefill_fills_the_rest_of_the_budget():
    sched = new_sched(budget=16, chunked=True)
    sim = Sim(sched)
    a = sim.add(make_seq(prompt(6, 0)), target=5)
    b = sim.add(make_seq(prompt(12, 100)), target=5)
    batch = sim.step()
    assert batch.seqs == [a, b] and batch.num_tokens == [6, 10]
    batch = sim.step()
    assert batch.seqs == [a, b] and batch.num_tokens == [1, 2]
    sim.run()


def test_beside_decodes_a_prompt_goes_in_chunks_of_the_cap():
    """A decoding stream waits for each step's prompt part: with the cap, a 30-token prompt
    goes 4 tokens a step beside it, and a waiting one gets what the cap leaves; alone, a prompt
    takes the whole budget."""
    sched = new_sched(budget=16, prompt_cap=4)
    sim = Sim(sched)
    a = sim.add(make_seq(prompt(10, 0)), target=20)
    assert sim.step().num_tokens == [10]  # no decode yet: the whole budget
    b = sim.add(make_seq(prompt(30, 100)), target=3)
    c = sim.add(make_seq(prompt(3, 200)), target=3)
    batch = sim.step()
    assert batch.seqs == [a, b] and batch.num_tokens == [1, 4]
    for _ in range(6):
        batch = sim.step()
        assert batch.seqs == [a, b] and batch.num_tokens == [1, 4]
    batch = sim.step()  # b's last 2 tokens, then c's first 2 within the cap
    assert batch.seqs == [a, b, c] and batch.num_tokens == [1, 2, 2]
    sim.run()


def _pull(tokens: list[int]) -> Sequence:
    """A sequence whose prompt KV a prefill worker computed (as ``KVHandoff`` queues it)."""
    seq = make_seq(tokens)
    seq.kv_from_remote, seq.num_remote_kv_tokens = True, len(tokens)
    return seq


def _decoding(sched: Scheduler) -> Sequence:
    seq = make_seq(prompt(10, 0))
    sched.add(seq)
    sched.on_step_done(sched.schedule())
    seq.append_token(1)
    return seq


def test_a_pull_goes_ahead_of_prompts_that_wait_for_the_steps_tokens():
    """The prompts wait for the step's prompt tokens; the pull behind them computes nothing
    this step, so it is admitted (its stream's second token does not wait for their prompts),
    and the prompts keep their order."""
    sched = new_sched(budget=16, prompt_cap=4)
    a = _decoding(sched)
    p1, p2, pull = make_seq(prompt(30, 100)), make_seq(prompt(8, 200)), _pull(prompt(20, 300))
    for seq in (p1, p2, pull):
        sched.add(seq)
    batch = sched.schedule()
    assert batch.seqs == [a, p1] and batch.num_tokens == [1, 4]
    assert batch.pulls == [pull] and pull.status == SequenceStatus.PULLING
    assert list(sched.waiting) == [p2]


def test_a_pull_waits_behind_a_prompt_the_pool_has_no_blocks_for():
    sched = new_sched(num_blocks=8, block_size=4, budget=64)
    a = _decoding(sched)  # 3 blocks
    big, pull = make_seq(prompt(24, 100)), _pull(prompt(4, 300))  # 6 blocks; 1 block
    sched.add(big)
    sched.add(pull)
    batch = sched.schedule()
    assert batch.seqs == [a] and batch.pulls == []
    assert list(sched.waiting) == [big, pull]


def test_without_chunked_prefill_the_cap_does_not_hold_a_prompt_back():
    sched = new_sched(budget=32, chunked=False, prompt_cap=4)
    sim = Sim(sched)
    a = sim.add(make_seq(prompt(10, 0)), target=20)
    sim.step()
    b = sim.add(make_seq(prompt(12, 100)), target=2)
    batch = sim.step()
    assert batch.seqs == [a, b] and batch.num_tokens == [1, 12]
    sim.run()


def test_without_chunked_prefill_a_prompt_waits_for_a_step_with_room():
    sched = new_sched(budget=16, chunked=False)
    sim = Sim(sched)
    a = sim.add(make_seq(prompt(6, 0)), target=5)
    b = sim.add(make_seq(prompt(12, 100)), target=5)
    c = sim.add(make_seq(prompt(2, 200)), target=5)
    batch = sim.step()
    # b (12) does not fit the 10 tokens left: it waits whole, and c behind it waits too (FCFS)
    assert batch.seqs == [a] and batch.num_tokens == [6]
    assert list(sched.waiting) == [b, c]
    assert b.num_computed_tokens == 0 and b.block_table == []
    batch = sim.step()
    assert batch.seqs == [a, b, c] and batch.num_tokens == [1, 12, 2]
    sim.run()


def test_recompute_preemption_with_a_tiny_pool():
    # 3 sequences of 7 prompt tokens (2 blocks) growing to 17 tokens (5 blocks); 6 blocks total
    sched = new_sched(num_blocks=6, block_size=4, budget=64, prefix_caching=False)
    sim = Sim(sched)
    seqs = [sim.add(make_seq(prompt(7, 100 * i)), target=10) for i in range(3)]
    b1 = sim.step()
    assert b1.seqs == seqs and b1.num_preempted == 0
    assert sched.pool.num_free_blocks == 0
    b2 = sim.step()  # token 8 fits in the second block
    assert b2.num_preempted == 0
    b3 = sim.step()  # token 9 needs a third block for everyone: the newest is preempted
    assert b3.num_preempted >= 1
    victim = seqs[2]
    assert victim not in b3.seqs
    assert sched.waiting[0] is victim
    assert victim.status == SequenceStatus.WAITING
    assert victim.num_computed_tokens == 0 and victim.block_table == []
    assert victim.num_output_tokens == 2  # its tokens so far are kept and recomputed
    assert sched.num_preemptions >= 1
    sim.run()
    assert sum(b.num_preempted for b in sim.batches) == sched.num_preemptions


def test_the_newest_sequence_preempts_itself():
    # a has room left in its last block; b (the newest) needs a new block and none is free
    sched = new_sched(num_blocks=4, block_size=4, budget=64, prefix_caching=False)
    sim = Sim(sched)
    a = sim.add(make_seq(prompt(5, 0)), target=3)
    b = sim.add(make_seq(prompt(8, 50)), target=3)
    sim.step()
    assert sched.pool.num_free_blocks == 0
    batch = sim.step()
    assert batch.num_preempted == 1
    assert batch.seqs == [a] and batch.num_tokens == [1]
    assert sched.running == [a]
    assert list(sched.waiting) == [b]
    assert b.num_computed_tokens == 0 and b.block_table == []
    sim.run()
    assert a.is_finished and b.is_finished


def test_tiny_pool_two_sequences_finish():
    sched = new_sched(num_blocks=4, block_size=2, budget=64, max_num_seqs=4, prefix_caching=False)
    sim = Sim(sched)
    a = sim.add(make_seq(prompt(3, 0)), target=4)
    b = sim.add(make_seq(prompt(3, 50)), target=4)
    sim.run()
    assert a.is_finished and b.is_finished
    assert sched.num_preemptions >= 1


def test_swap_preemption_swaps_out_then_in():
    sched = new_sched(
        num_blocks=6, block_size=4, budget=64, mode="swap", host_blocks=16, prefix_caching=False
    )
    sim = Sim(sched)
    seqs = [sim.add(make_seq(prompt(7, 100 * i)), target=10) for i in range(3)]
    sim.step()
    sim.step()
    table_before = list(seqs[2].block_table)
    b3 = sim.step()
    assert b3.num_preempted >= 1
    victim = seqs[2]
    assert victim.status == SequenceStatus.SWAPPED
    assert victim in sched.swapped and victim not in sched.waiting
    assert victim.num_computed_tokens == 9 - 1  # its KV is kept (on the host)
    assert [d for d, _ in b3.blocks_to_swap_out][: len(table_before)] == table_before
    host_ids = [h for _, h in b3.blocks_to_swap_out[: len(table_before)]]
    assert sched.host_pool is not None
    assert sched.host_pool.num_free_blocks == 16 - len(b3.blocks_to_swap_out)
    # later it comes back with the same host blocks, before any new request
    swap_in_batch = None
    while victim.status == SequenceStatus.SWAPPED:
        swap_in_batch = sim.step()
        assert sim.steps < 200
    assert swap_in_batch is not None
    pairs = swap_in_batch.blocks_to_swap_in[: len(host_ids)]  # the first swapped comes first
    assert [h for h, _ in pairs] == host_ids
    devs = [d for _, d in pairs]
    assert victim.block_table[: len(devs)] == devs
    assert victim in swap_in_batch.seqs
    sim.run()
    assert sum(len(b.blocks_to_swap_out) for b in sim.batches) == sum(
        len(b.blocks_to_swap_in) for b in sim.batches
    )


def test_swapped_sequences_come_back_before_new_ones():
    sched = new_sched(
        num_blocks=6, block_size=4, budget=64, mode="swap", host_blocks=16, prefix_caching=False
    )
    sim = Sim(sched)
    seqs = [sim.add(make_seq(prompt(7, 100 * i)), target=10) for i in range(3)]
    for _ in range(3):
        sim.step()
    assert seqs[2].status == SequenceStatus.SWAPPED
    late = sim.add(make_seq(prompt(3, 900)), target=2)
    while seqs[2].status == SequenceStatus.SWAPPED:
        # the previous step ended with a swapped sequence, so nothing new was admitted
        assert late.status == SequenceStatus.WAITING, "a new request overtook a swapped one"
        sim.step()
        assert sim.steps < 200
    sim.run()


def test_swap_falls_back_to_recompute_without_host_room():
    sched = new_sched(
        num_blocks=6, block_size=4, budget=64, mode="swap", host_blocks=1, prefix_caching=False
    )
    sim = Sim(sched)
    seqs = [sim.add(make_seq(prompt(7, 100 * i)), target=10) for i in range(3)]
    for _ in range(3):
        sim.step()
    assert seqs[2].status == SequenceStatus.WAITING
    assert seqs[2].num_computed_tokens == 0
    assert not any(b.blocks_to_swap_out for b in sim.batches)
    sim.run()


def test_finish_releases_blocks_at_once_and_from_any_queue():
    sched = new_sched(num_blocks=16, block_size=4, budget=8, max_num_seqs=1)
    sim = Sim(sched)
    a = sim.add(make_seq(prompt(10, 0)), target=50)
    b = sim.add(make_seq(prompt(5, 100)), target=50)
    sim.step()
    assert a.block_table and a.status == SequenceStatus.RUNNING
    sched.finish(a, FinishReason.ABORT)
    assert a.block_table == [] and a.finish_reason == FinishReason.ABORT
    assert a not in sched.running
    sched.finish(b, FinishReason.ABORT)  # still waiting
    assert not sched.has_unfinished
    sched.finish(b, FinishReason.STOP)  # a second finish is a no-op
    assert b.finish_reason == FinishReason.ABORT
    assert sched.pool.num_free_blocks == sched.pool.num_blocks
    sched.pool.check_invariants()


def test_finish_a_swapped_sequence_frees_host_blocks():
    sched = new_sched(
        num_blocks=6, block_size=4, budget=64, mode="swap", host_blocks=16, prefix_caching=False
    )
    sim = Sim(sched)
    seqs = [sim.add(make_seq(prompt(7, 100 * i)), target=10) for i in range(3)]
    for _ in range(3):
        sim.step()
    assert seqs[2].status == SequenceStatus.SWAPPED
    assert sched.host_pool is not None and sched.host_pool.num_free_blocks < 16
    sched.finish(seqs[2], FinishReason.ABORT)
    assert sched.host_pool.num_free_blocks == 16
    assert not sched.swapped
    sim.all_seqs.remove(seqs[2])
    sim.run()


def test_prefix_cache_hits_through_the_scheduler():
    sched = new_sched(num_blocks=32, block_size=4, budget=64)
    sim = Sim(sched)
    shared = prompt(12, 0)
    a = sim.add(make_seq(shared + [1]), target=2)
    sim.run()
    b = sim.add(make_seq(shared + [2, 3]), target=2)
    batch = sim.step()
    assert batch.seqs == [b] and batch.num_tokens == [2]  # 12 tokens from the cache
    assert b.num_cached_tokens == 12
    sim.run()
    assert a.is_finished


def test_forked_sequences_copy_on_write():
    sched = new_sched(num_blocks=32, block_size=4, budget=64)
    parent = make_seq(prompt(6, 0))
    sim = Sim(sched, check_seq_cap=False, fork_at_first_token={parent.seq_id})
    sim.add(parent, target=6)
    sim.run()
    assert len(sim.all_seqs) == 2
    assert any(b.blocks_to_copy for b in sim.batches), "the shared partial block was not copied"


@settings(max_examples=60, deadline=None)
@given(
    block_size=st.sampled_from([1, 2, 4]),
    extra_blocks=st.integers(0, 6),
    budget=st.integers(1, 24),
    max_num_seqs=st.integers(1, 4),
    chunked=st.booleans(),
    mode=st.sampled_from(["recompute", "swap"]),
    host_blocks=st.integers(0, 12),
    prefix_caching=st.booleans(),
    requests=st.lists(
        st.tuples(st.lists(st.integers(0, 1), min_size=1, max_size=10), st.integers(1, 6)),
        min_size=1,
        max_size=6,
    ),
    fork_mask=st.lists(st.booleans(), min_size=6, max_size=6),
    prompt_cap=st.one_of(st.none(), st.integers(1, 8)),
)
def test_random_workloads_all_finish(
    block_size,
    extra_blocks,
    budget,
    max_num_seqs,
    chunked,
    mode,
    host_blocks,
    prefix_caching,
    requests,
    fork_mask,
    prompt_cap,
):
    longest = max(len(p) + t for p, t in requests)
    # the pool must hold the longest sequence alone, or nothing could ever finish
    num_blocks = -(-longest // block_size) + extra_blocks
    if not chunked:  # the engine raises the budget to max_model_len in this case
        budget = max(budget, longest)
    sched = new_sched(
        num_blocks,
        block_size,
        max_num_seqs=max_num_seqs,
        budget=budget,
        chunked=chunked,
        mode=mode,
        host_blocks=host_blocks,
        prefix_caching=prefix_caching,
        prompt_cap=prompt_cap,
    )
    seqs = [make_seq(p) for p, _ in requests]
    forks = {s.seq_id for s, f in zip(seqs, fork_mask) if f}
    sim = Sim(sched, check_seq_cap=not forks, fork_at_first_token=forks)
    for seq, (_, target) in zip(seqs, requests):
        sim.add(seq, target)
    sim.run(max_steps=3000)


def test_scheduler_config_validation():
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_batched_tokens=0)
    with pytest.raises(ValueError, match="preemption_mode"):
        SchedulerConfig(preemption_mode="drop")
    with pytest.raises(ValueError, match="max_prompt_tokens_beside_decodes must be >= 1, got 0"):
        SchedulerConfig(max_prompt_tokens_beside_decodes=0)
