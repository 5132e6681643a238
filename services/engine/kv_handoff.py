"""The engine's side of prefill/decode disaggregation, as sequence states (no I/O).

Prefill worker: a request added with ``pin_blocks`` computes its prompt and samples its first
token; then ``pin`` takes it out of the batch with its blocks kept (PINNED) and the output names
those blocks; ``release`` frees them when the decode worker is done pulling (or the lease ran
out).

Decode worker: ``expect`` queues a sequence whose prompt KV comes from a prefill worker; the
scheduler admits it like any other (its one budget rule: ``max_num_seqs`` and free blocks) and
reserves blocks for that KV (PULLING); ``plans`` turns each admission into a ``PullPlan``;
``commit`` writes the pulled blocks (through the model runner) and the sequence runs, or
``recompute`` sends it back to compute its prompt here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.engine.model_runner import ModelRunner
from services.engine.scheduler import ScheduledBatch, Scheduler
from services.engine.sequence import Sequence, SequenceStatus


@dataclass
class PullPlan:
    """Blocks a decode worker must fill from the prefill worker before the request can run."""

    request_id: str
    block_indices: list[int]  # positions in the request's block table (and the KVHandle's)
    dest_block_ids: list[int]  # this pool's blocks, in the same order
    num_cached_tokens: int  # prompt tokens this pool already held (prefix cache)


class KVHandoff:
    """Pinned sequences (prefill side) and sequences waiting for pulled KV (decode side)."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner):
        self.scheduler = scheduler
        self.runner = runner
        self.block_size = scheduler.pool.block_size
        self.pinned: dict[str, Sequence] = {}
        self.pulling: dict[str, Sequence] = {}  # WAITING for room, or PULLING

    # ----- prefill side -----------------------------------------------------------------------
    def pin(self, seq: Sequence) -> list[int]:
        """Keep ``seq``'s blocks after its first token; returns those holding the prompt's KV
        (the sampled token's KV was never computed)."""
        self.scheduler.pin(seq)
        self.pinned[seq.request_id] = seq
        return seq.block_table[: -(-seq.num_prompt_tokens // self.block_size)]

    def release(self, request_id: str) -> bool:
        """Free a pinned request's blocks; False if it holds none (any more)."""
        seq = self.pinned.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.pool.free(seq)
        seq.status = SequenceStatus.FINISHED
        return True

    # ----- decode side ------------------------------------------------------------------------
    def expect(self, seq: Sequence) -> None:
        """Queue ``seq`` for admission with its prompt's KV to be pulled."""
        seq.kv_from_remote = True
        self.pulling[seq.request_id] = seq
        self.scheduler.add(seq)

    def plans(self, batch: ScheduledBatch) -> list[PullPlan]:
        """A plan for every sequence the step admitted to PULLING: the blocks its own prefix
        cache did not have, which must come from the prefill worker."""
        plans = []
        for seq in batch.pulls:
            first = seq.num_computed_tokens // self.block_size
            indices = list(range(first, len(seq.block_table)))
            dest = [seq.block_table[i] for i in indices]
            plans.append(PullPlan(seq.request_id, indices, dest, seq.num_computed_tokens))
        return plans

    def commit(self, plan: PullPlan, blocks: torch.Tensor) -> None:
        """Write the pulled (and verified) blocks; the request joins the batch."""
        seq = self.pulling.pop(plan.request_id)
        self.runner.write_blocks(plan.dest_block_ids, blocks)
        self.scheduler.commit_pull(seq)

    def recompute(self, request_id: str) -> None:
        """The pull failed (or will not happen): compute the prompt here instead."""
        seq = self.pulling.pop(request_id)
        self.scheduler.recompute_pull(seq)

    def forget(self, request_id: str) -> None:
        """The request is gone (aborted): nothing of it is pinned or pulled any more."""
        self.pulling.pop(request_id, None)
        self.release(request_id)
