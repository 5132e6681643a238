"""The engine's side of prefill/decode disaggregation, as sequence states (no I/O).

Prefill worker: a request added with ``pin_blocks`` gets blocks for its whole prompt when the
scheduler admits it (``take_prefill_admissions`` names them: streamed KV may be read from then
on), computes its prompt and samples its first token; then ``pin`` takes it out of the batch
with its blocks kept (PINNED) and the output names those blocks; ``release`` frees them when the
decode worker is done pulling (or the lease ran out).

Decode worker: ``expect`` queues a sequence whose prompt KV comes from a prefill worker, with
the first token that worker sampled (the "forced" token: streamed already, appended here
without sampling); the scheduler admits it like any other (its one budget rule: ``max_num_seqs``
and free blocks) and reserves blocks for that KV (PULLING); each admission becomes a
``PullPlan`` (``take_pull_plans``); ``commit`` writes the pulled blocks (through the model
runner) and the sequence runs, or ``recompute`` sends it back to compute its prompt here.

The sequence's status is the state: WAITING with ``kv_from_remote`` (queued for a pull),
PULLING, PINNED. Only pinned sequences are also kept by request id (see ``KVHandoff.pinned``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.engine.model_runner import ModelRunner
from services.engine.output_processor import OutputProcessor, RequestState
from services.engine.scheduler import ScheduledBatch, Scheduler
from services.engine.sequence import Sequence, SequenceStatus

CheckStop = Callable[[RequestState, Sequence], None]


@dataclass
class PullPlan:
    """Blocks a decode worker must fill from the prefill worker before the request can run."""

    request_id: str
    block_indices: list[int]  # positions in the request's block table (and the KVHandle's)
    dest_block_ids: list[int]  # this pool's blocks, in the same order
    num_cached_tokens: int  # prompt tokens this pool already held (prefix cache)


class KVHandoff:
    """Pinned sequences (prefill side) and sequences waiting for pulled KV (decode side)."""

    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        outputs: OutputProcessor,
        check_stop: CheckStop,
    ):
        """``check_stop`` is the engine's: it applies the stop conditions to a sequence's
        newest token and finishes the sequence (a forced token may end the request)."""
        self.scheduler = scheduler
        self.runner = runner
        self.outputs = outputs
        self.check_stop = check_stop
        self.block_size = scheduler.pool.block_size
        # By request id, because a release comes by request id (a lease ended) and nothing else
        # holds a PINNED sequence: the scheduler let go of it at ``pin`` and the engine of its
        # request, whose output was final. In here <=> status PINNED (``pin``/``release``).
        self.pinned: dict[str, Sequence] = {}
        self._pull_plans: list[PullPlan] = []
        self._prefill_admissions: list[tuple[str, list[int]]] = []

    def on_schedule(self, batch: ScheduledBatch) -> None:
        """Note what the step admitted: pulls (decode side) and prefill-only requests."""
        self._pull_plans += [self._plan(seq) for seq in batch.pulls]
        self._prefill_admissions += [(s.request_id, list(s.block_table)) for s in batch.prefills]

    @property
    def num_pinned(self) -> int:
        return len(self.pinned)

    # ----- prefill side -----------------------------------------------------------------------
    def take_prefill_admissions(self) -> list[tuple[str, list[int]]]:
        """(request id, the prompt's blocks) of the prefill-only requests admitted since the
        last call; their blocks are fixed from then on (streamed KV)."""
        admitted, self._prefill_admissions = self._prefill_admissions, []
        return admitted

    def pin(self, seq: Sequence) -> list[int]:
        """Keep ``seq``'s blocks after its first token; returns those holding the prompt's KV
        (the sampled token's KV was never computed)."""
        self.scheduler.pin(seq)
        self.pinned[seq.request_id] = seq
        return seq.block_table[: -(-seq.num_prompt_tokens // self.block_size)]

    def is_pinned(self, request_id: str) -> bool:
        return request_id in self.pinned

    def release(self, request_id: str) -> bool:
        """Free a pinned request's blocks; False if it holds none (any more)."""
        seq = self.pinned.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.pool.free(seq)
        seq.status = SequenceStatus.FINISHED
        return True

    # ----- decode side ------------------------------------------------------------------------
    def expect(
        self,
        request: RequestState,
        first_token: int | None,
        first_logprobs: dict[int, float] | None,
    ) -> bool:
        """Queue the request's sequence for admission with its prompt's KV to be pulled; True
        when its first token alone ended it instead (nothing queued, nothing to pull).

        This is the one place that decides how much of the prompt's KV is pulled: all of it
        (``num_remote_kv_tokens``; the scheduler reserves exactly that, the plan pulls the
        blocks holding it and ``commit`` marks it computed), whether the first token comes
        now or with the last pull. With n > 1 the last prompt token is computed here instead,
        so the other sequences can draw their own first token from its logits, while sequence
        0 keeps the one it was given.
        """
        seq = request.seqs[0]
        seq.num_remote_kv_tokens = seq.num_prompt_tokens - (1 if request.params.n > 1 else 0)
        if request.params.n > 1:
            seq.forced_token, seq.forced_logprobs = first_token, first_logprobs
        elif first_token is not None:
            self.append_forced(request, seq, first_token, first_logprobs)
        if seq.is_finished:
            return True
        seq.kv_from_remote = True
        self.scheduler.add(seq)
        return False

    def take_pull_plans(self) -> list[PullPlan]:
        """The requests admitted for a pull since the last call, with their plans."""
        plans, self._pull_plans = self._pull_plans, []
        return plans

    def _plan(self, seq: Sequence) -> PullPlan:
        """The blocks reserved for ``seq``'s KV that its own prefix cache did not have, which
        must come from the prefill worker."""
        first = seq.num_computed_tokens // self.block_size
        indices = list(range(first, len(seq.block_table)))
        dest = [seq.block_table[i] for i in indices]
        return PullPlan(seq.request_id, indices, dest, seq.num_computed_tokens)

    def commit(
        self,
        request: RequestState,
        plan: PullPlan,
        blocks: torch.Tensor,
        first_token: int | None,
        first_logprobs: dict[int, float] | None,
    ) -> bool:
        """Write the pulled (and verified) blocks; the request joins the batch. True when the
        first token, if it came with the blocks (streamed KV), ended the request instead (the
        scheduler freed the reservation; nothing is written). KeyError when not PULLING."""
        seq = request.seqs[0]
        if seq.status != SequenceStatus.PULLING:
            raise KeyError(plan.request_id)
        if first_token is not None:
            if request.params.n > 1:  # the last prompt token is computed here, for the forks
                seq.forced_token, seq.forced_logprobs = first_token, first_logprobs
            else:  # as if the router had sent it: computing goes on from the first token
                self.append_forced(request, seq, first_token, first_logprobs)
                if seq.is_finished:
                    return True
        self.runner.write_blocks(plan.dest_block_ids, blocks)
        self.scheduler.commit_pull(seq)
        return False

    def recompute(self, request: RequestState) -> None:
        """The pull failed (or will not happen): compute the prompt here instead (also before
        admission). KeyError when the request does not wait for pulled KV (any more)."""
        seq = request.seqs[0]
        if not seq.kv_from_remote or seq.is_finished:
            raise KeyError(request.request_id)
        self.scheduler.recompute_pull(seq)

    def append_forced(
        self,
        request: RequestState,
        seq: Sequence,
        token: int | None = None,
        logprobs: dict[int, float] | None = None,
    ) -> None:
        """Append a token sampled by the prefill worker (``seq``'s forced token when ``token``
        is None); it was streamed already, so only text held back is still to come."""
        if token is None:
            token, logprobs = seq.forced_token, seq.forced_logprobs
            seq.forced_token = seq.forced_logprobs = None
        assert token is not None
        seq.append_token(token, logprobs)
        self.check_stop(request, seq)
        self.outputs.mark_emitted(request, seq)
