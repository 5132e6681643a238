"""Iteration-level (continuous) batching.

One rule schedules both phases: each step, give every sequence tokens from the step's budget
(``max_num_batched_tokens``) until ``num_computed_tokens == num_tokens``. Running sequences go
first (decode before new prefills), oldest first; then swapped sequences come back; then waiting
ones are admitted while the budget, ``max_num_seqs`` and free blocks allow. A prompt larger than
what is left of the budget is split into chunks (chunked prefill) unless that is disabled.

A waiting sequence whose prompt KV comes from a prefill worker (``kv_from_remote``) is admitted
by the same rule, under the same ``max_num_seqs`` and free-block checks, but instead of computing
its prompt it gets blocks reserved for the KV that comes from elsewhere (``num_remote_kv_tokens``,
minus what the prefix cache holds) and becomes PULLING, listed in the batch's ``pulls``;
``commit_pull`` then makes it RUNNING with that KV in place, or ``recompute_pull`` sends it
back to compute its prompt here. PULLING sequences count against ``max_num_seqs``: they are
about to run. ``pin`` takes a prefill worker's finished-computing sequence out of the batch,
keeping its blocks (PINNED).

While sequences decode, a step's prompt tokens (chunks of prompts, recomputed contexts) are
capped at ``max_prompt_tokens_beside_decodes`` when it is set: every decoding stream waits for
the whole step, so a long prompt goes in several short chunks between their tokens.

When a running sequence needs a block and none is free, the newest running sequence is
preempted: its blocks are freed and it is recomputed later (default), or its blocks are copied
to host memory and back (``preemption_mode="swap"``). Finished sequences leave at once.

The scheduler never touches tensors: block copies are returned in the batch for the runner.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from services.engine.block_pool import BlockPool, HostBlockPool
from services.engine.config import SchedulerConfig
from services.engine.sequence import FinishReason, Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """What one step computes: sequences with their token counts, and block copies to do first."""

    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) device
    pulls: list[Sequence] = field(default_factory=list)  # admitted to PULLING this step
    prefills: list[Sequence] = field(default_factory=list)  # prefill-only, admitted this step
    num_preempted: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    def add(self, seq: Sequence, num_tokens: int) -> None:
        self.seqs.append(seq)
        self.num_tokens.append(num_tokens)


@dataclass
class StepBudget:
    """What is left of one step's tokens; of them, ``prompt`` may go to prompt tokens."""

    tokens: int
    prompt: int

    def grant(self, seq: Sequence) -> int:
        """Tokens ``seq`` may compute now: its uncomputed ones, within what is left."""
        wanted = min(seq.num_uncomputed_tokens, self.tokens)
        return wanted if is_decoding(seq) else min(wanted, self.prompt)

    def spend(self, seq: Sequence, num_tokens: int) -> None:
        self.tokens -= num_tokens
        if not is_decoding(seq):
            self.prompt -= num_tokens


def is_decoding(seq: Sequence) -> bool:
    """Whether ``seq`` computes the token after its last generated one (not a prompt chunk, nor
    a context recomputed after preemption)."""
    return seq.num_uncomputed_tokens == 1 and seq.num_tokens > seq.num_prompt_tokens


class Scheduler:
    """Decides, each step, which sequences compute how many tokens."""

    def __init__(
        self,
        config: SchedulerConfig,
        pool: BlockPool,
        host_pool: HostBlockPool | None = None,
        max_num_batched_tokens: int | None = None,
    ):
        self.config = config
        self.pool = pool
        self.host_pool = host_pool
        self.token_budget = max_num_batched_tokens or config.max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        self.pulling: list[Sequence] = []  # blocks reserved, KV on its way
        self._host_tables: dict[int, list[int]] = {}  # seq_id -> host block ids
        self.num_preemptions = 0
        self.num_swapped_out = 0

    @property
    def has_unfinished(self) -> bool:
        """Whether a step could have something to do (PULLING sequences wait for their KV)."""
        return bool(self.waiting or self.running or self.swapped)

    @property
    def num_waiting(self) -> int:
        """Sequences not running yet: queued, swapped out, or waiting for their pulled KV."""
        return len(self.waiting) + len(self.swapped) + len(self.pulling)

    @property
    def num_kv_pending(self) -> int:
        """Sequences whose prompt KV comes from elsewhere and is not in place yet: PULLING, or
        WAITING to be admitted for it. Counted from the statuses (the one record of that state)
        rather than tracked beside them; the waiting queue is short next to a step's work."""
        return len(self.pulling) + sum(seq.kv_from_remote for seq in self.waiting)

    @property
    def num_admitted(self) -> int:
        """What ``max_num_seqs`` bounds: running sequences and those about to run."""
        return len(self.running) + len(self.pulling)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    # ----- the step -------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = StepBudget(self.token_budget, self.token_budget)
        cap = self.config.max_prompt_tokens_beside_decodes
        chunked = self.config.enable_chunked_prefill  # else a prompt must go whole: no cap
        streams = (*self.running, *self.swapped)  # swapped ones come back to decode
        if cap is not None and chunked and any(is_decoding(seq) for seq in streams):
            budget.prompt = min(cap, self.token_budget)
        self._schedule_running(batch, budget)
        if batch.num_preempted == 0:
            self._schedule_swapped(batch, budget)
            if not self.swapped:
                self._schedule_waiting(batch, budget)
        if batch.seqs:
            now = time.monotonic()
            for seq in batch.seqs:  # a None check per sequence and step: the queue-time mark
                if seq.first_scheduled_time is None:
                    seq.first_scheduled_time = now
        return batch

    def _schedule_running(self, batch: ScheduledBatch, budget: StepBudget) -> None:
        i = 0
        while i < len(self.running) and budget.tokens > 0:
            seq = self.running[i]
            num_new = budget.grant(seq)
            if num_new == 0:  # a prompt's next chunk, and the step's prompt tokens are spent
                i += 1
                continue
            while not self.pool.can_append(seq, num_new):
                victim = self._victim(i)  # the newest; never one already scheduled
                if victim is None:  # all prefill-only, their blocks promised: seq waits a step
                    i += 1
                    break
                self._preempt(victim, batch)
                if victim is seq:
                    break
            else:
                batch.blocks_to_copy += self.pool.append_slots(seq, num_new)
                batch.add(seq, num_new)
                budget.spend(seq, num_new)
                i += 1

    def _schedule_swapped(self, batch: ScheduledBatch, budget: StepBudget) -> None:
        assert self.host_pool is not None or not self.swapped
        while self.swapped and budget.tokens > 0 and self.num_admitted < self.config.max_num_seqs:
            seq = self.swapped[0]
            host_ids = self._host_tables[seq.seq_id]
            num_new = budget.grant(seq)
            if num_new == 0:
                break
            num_after = seq.num_computed_tokens + num_new
            needed = max(len(host_ids), -(-num_after // self.pool.block_size))
            if needed > self.pool.num_free_blocks:
                break
            self.swapped.popleft()
            device_ids = self.pool.allocate_blocks(len(host_ids))
            seq.block_table = device_ids
            batch.blocks_to_swap_in += list(zip(host_ids, device_ids))
            assert self.host_pool is not None
            self.host_pool.free(self._host_tables.pop(seq.seq_id))
            batch.blocks_to_copy += self.pool.append_slots(seq, num_new)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.add(seq, num_new)
            budget.spend(seq, num_new)

    def _schedule_waiting(self, batch: ScheduledBatch, budget: StepBudget) -> None:
        """Admit waiting sequences in arrival order while blocks and ``max_num_seqs`` allow. A
        pull computes nothing this step: one queued behind a prompt that waits only for the
        step's tokens goes ahead of it (its first token is already out; its stream should not
        wait for the prompts before it), and the prompts keep their order among themselves."""
        i, prompts_wait = 0, False
        while i < len(self.waiting) and self.num_admitted < self.config.max_num_seqs:
            seq = self.waiting[i]
            if seq.kv_from_remote:
                if not self._admit_pull(seq, i, batch):
                    return
                continue
            if prompts_wait:
                i += 1
                continue
            admitted = self._admit_prompt(seq, i, batch, budget)
            if admitted is None:  # no blocks for it: nothing behind it goes first
                return
            prompts_wait = not admitted

    def _admit_pull(self, seq: Sequence, index: int, batch: ScheduledBatch) -> bool:
        """Reserve room for exactly the KV that comes from elsewhere; False: no blocks for it."""
        prefix = self.pool.find_cached_prefix(seq)
        num_reserved = seq.num_remote_kv_tokens - len(prefix) * self.pool.block_size
        if not self.pool.can_allocate(seq, num_reserved, prefix):
            return False
        del self.waiting[index]
        self.pool.allocate(seq, num_reserved, prefix)
        seq.status = SequenceStatus.PULLING
        self.pulling.append(seq)
        batch.pulls.append(seq)
        return True

    def _admit_prompt(
        self, seq: Sequence, index: int, batch: ScheduledBatch, budget: StepBudget
    ) -> bool | None:
        """Schedule the prompt at ``index`` (a chunk of it, chunked prefill) into ``batch``:
        True; False when the step has no tokens left for it; None when the pool has no blocks."""
        room = min(budget.tokens, budget.prompt)
        if room <= 0:
            return False
        prefix = self.pool.find_cached_prefix(seq)
        num_new = seq.num_tokens - len(prefix) * self.pool.block_size
        # A prefill-only sequence gets blocks for its whole prompt at once: the KV it hands
        # over may be pulled while later chunks compute, so its blocks never change.
        reserved = num_new if seq.pin_blocks else None
        if num_new > room:
            if not self.config.enable_chunked_prefill:
                return False
            num_new = room
        if not self.pool.can_allocate(seq, reserved or num_new, prefix):
            return None
        del self.waiting[index]
        self.pool.allocate(seq, reserved or num_new, prefix)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        batch.add(seq, num_new)
        if seq.pin_blocks:
            batch.prefills.append(seq)
        budget.tokens -= num_new  # an admitted sequence computes context, never a decode
        budget.prompt -= num_new
        return True

    def _victim(self, first: int) -> Sequence | None:
        """The newest running sequence after position ``first`` that may be preempted (taken
        out of ``running``); prefill-only ones never are."""
        for j in range(len(self.running) - 1, first - 1, -1):
            if not self.running[j].pin_blocks:
                return self.running.pop(j)
        return None

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        batch.num_preempted += 1
        self.num_preemptions += 1
        seq.num_preemptions += 1
        host = self.host_pool
        if (
            self.config.preemption_mode == "swap"
            and host is not None
            and host.num_free_blocks >= len(seq.block_table)
            and all(self.pool.ref_count(b) == 1 for b in seq.block_table)
        ):
            host_ids = host.allocate(len(seq.block_table))
            batch.blocks_to_swap_out += list(zip(seq.block_table, host_ids))
            self._host_tables[seq.seq_id] = host_ids
            self.num_swapped_out += 1
            self.pool.free(seq)
            seq.status = SequenceStatus.SWAPPED
            self.swapped.append(seq)
            return
        # Recompute: drop the KV; the prompt and the tokens so far are computed again later
        # (mostly prefix-cache hits when the blocks were not evicted meanwhile).
        self.pool.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    # ----- after the step -------------------------------------------------------------------
    def on_step_done(self, batch: ScheduledBatch) -> None:
        """Advance the counters of what was computed and index newly full blocks."""
        for seq, num in zip(batch.seqs, batch.num_tokens):
            seq.num_computed_tokens += num
            self.pool.cache_full_blocks(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence forked from a running one (n > 1) joins the batch."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def pin(self, seq: Sequence) -> None:
        """Take a running sequence out of the batch, keeping its blocks (PINNED)."""
        self.running.remove(seq)
        seq.status = SequenceStatus.PINNED
        seq.finished_time = time.monotonic()

    def commit_pull(self, seq: Sequence) -> None:
        """``seq``'s pulled KV is in its reserved blocks: it runs from the first token whose KV
        did not come with it (the first sampled token, or with n > 1 the last prompt token)."""
        self.pulling.remove(seq)
        seq.kv_from_remote = False
        seq.num_computed_tokens = seq.num_remote_kv_tokens
        self.pool.cache_full_blocks(seq)
        self.add_running(seq)

    def recompute_pull(self, seq: Sequence) -> None:
        """``seq`` computes its prompt here after all (its pull failed, or will not happen):
        its reservation, if it has one, is freed and it waits at the front of the queue."""
        if seq.status == SequenceStatus.PULLING:
            self.pulling.remove(seq)
            self.pool.free(seq)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)
        seq.kv_from_remote = False

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Retire ``seq`` at once and free its blocks (device and host)."""
        if seq.is_finished:
            return
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.PULLING:
            self.pulling.remove(seq)
        elif seq.status == SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        elif seq.status == SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
            assert self.host_pool is not None
            self.host_pool.free(self._host_tables.pop(seq.seq_id))
        self.pool.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.finished_time = time.monotonic()

    def sequences_of(self, request_id: str) -> list[Sequence]:
        everything = [*self.running, *self.waiting, *self.swapped, *self.pulling]
        return [s for s in everything if s.request_id == request_id]
