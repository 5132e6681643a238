"""One generation stream: its tokens and a few counters.

Lifecycle::

    WAITING -> RUNNING -> FINISHED          (RUNNING -> WAITING on preemption by recompute,
                                             RUNNING -> SWAPPED -> RUNNING by swap)
    prefill worker:  RUNNING -> PINNED -> FINISHED   (first token sampled; the prompt's blocks
                                                      are kept until released or expired)
    decode worker:   WAITING -> PULLING -> RUNNING   (admitted: blocks reserved for the prompt's
                                                      KV, which is pulled from the prefill
                                                      worker; or back to WAITING to recompute)

The scheduler gives a RUNNING sequence tokens from each step's budget until
``num_computed_tokens == num_tokens``; then the step samples its next token. Plain data: no
tensors, no random generators (the sampler keeps those).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from common.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    PINNED = "pinned"  # prefill-only: done computing, blocks kept for a decode worker to pull
    PULLING = "pulling"  # blocks reserved for KV computed elsewhere, not yet in place
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"
    # The request's grammar allows no token of the vocabulary (it needs a byte no token holds):
    # the output cannot go on and still follow it. The router answers with an error.
    GRAMMAR_DEAD_END = "grammar_dead_end"


@dataclass(eq=False)
class Sequence:
    """Token ids (prompt then output) and how many of them are in the KV cache."""

    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: float = 0.0
    index: int = 0  # which of the request's n outputs this is
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prefix-cache hits at the last admission
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of full blocks
    cache_salt: str | None = None  # mixed into the first block's hash: prefix-cache tenant
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    logprobs: list[dict[int, float]] = field(default_factory=list)
    # params.prompt_logprobs set: entry i for prompt token i + 1 (its logprob first, then the top
    # alternatives), filled as the prompt's chunks are computed; a recompute skips what is here.
    prompt_logprobs: list[dict[int, float]] = field(default_factory=list)
    # Beside each entry: the prompt token's rank in the whole vocabulary (1: the most likely).
    prompt_logprob_ranks: list[int] = field(default_factory=list)
    # Disaggregation: a prefill-only sequence is pinned after its first token; a pulled one is
    # admitted for its prompt's KV (``num_remote_kv_tokens``) instead of computing it.
    pin_blocks: bool = False
    kv_from_remote: bool = False
    # Pulled: how many leading prompt tokens' KV comes from the prefill worker (set once, by
    # ``KVHandoff.expect``): the scheduler reserves exactly that and ``commit_pull`` marks
    # exactly that computed.
    num_remote_kv_tokens: int = 0
    # n > 1: the first sequence computes the prompt and is forked into the others once.
    num_forks_pending: int = 0
    # Disaggregated n > 1: the token the prefill worker already sampled for this sequence is
    # taken instead of sampling when the last prompt token is computed here.
    forced_token: int | None = None
    forced_logprobs: dict[int, float] | None = None
    # When things happened (time.monotonic(), like ``arrival``; None: not yet). Plain numbers,
    # set by the scheduler and the engine; the services turn them into trace spans afterwards.
    first_scheduled_time: float | None = None  # the first step that computed any of its tokens
    first_token_time: float | None = None  # the end of the step that sampled its first token
    finished_time: float | None = None  # finished, aborted, or detached with pinned blocks
    num_preemptions: int = 0

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def append_token(self, token_id: int, logprobs: dict[int, float] | None = None) -> None:
        self.token_ids.append(token_id)
        if logprobs is not None:
            self.logprobs.append(logprobs)

    def fork(self, seq_id: int, index: int) -> Sequence:
        """A copy that shares everything computed so far (blocks are shared by the pool)."""
        child = Sequence(
            seq_id=seq_id,
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            params=self.params,
            arrival=self.arrival,
            index=index,
            token_ids=list(self.token_ids),
            num_computed_tokens=self.num_computed_tokens,
            num_cached_tokens=self.num_cached_tokens,
            block_table=list(self.block_table),
            block_hashes=list(self.block_hashes),
            cache_salt=self.cache_salt,
            status=self.status,
            logprobs=list(self.logprobs),
            prompt_logprobs=self.prompt_logprobs,
            prompt_logprob_ranks=self.prompt_logprob_ranks,
            first_scheduled_time=self.first_scheduled_time,
        )
        return child
