"""Requests in: prompt checks, the request's state, its sequences, and the n > 1 forks.

Everything a request must pass before the engine takes it is checked here, so that a refused
request leaves nothing behind (no state, no blocks): the prompt (not empty, token ids in the
vocabulary, shorter than the context), its ``cache_salt`` and a first token that arrives off the
wire. Sequences get their ids here, and the output processor learns of each one as it is made; a
request with n > 1 starts with one sequence, which ``fork`` turns into n once its prompt is
computed (the others share its blocks).
"""

from __future__ import annotations

import itertools
import time

from common.sampling_params import SamplingParams
from services.engine.block_pool import BlockPool
from services.engine.hashing import check_cache_salt
from services.engine.output_processor import OutputProcessor, RequestState
from services.engine.scheduler import Scheduler
from services.engine.sequence import Sequence
from services.engine.tokenizer import Tokenizer


class RequestBuilder:
    """Validates prompts and makes a request's state and sequences (forks included)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        max_model_len: int,
        outputs: OutputProcessor,
        pool: BlockPool,
        scheduler: Scheduler,
    ):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.outputs = outputs
        self.pool = pool
        self.scheduler = scheduler
        self._seq_ids = itertools.count()

    def build(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
    ) -> RequestState:
        """The request's state, with no sequence yet; ValueError naming the bad field."""
        check_cache_salt(cache_salt)
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.check_prompt(token_ids)
        if any(t >= self.vocab_size for t in params.logit_bias):
            raise ValueError(f"logit_bias keys must be token ids in [0, {self.vocab_size})")
        return RequestState(request_id, text, token_ids, params, cache_salt)

    def check_prompt(self, token_ids: list[int]) -> None:
        """Refuse what the step loop could not compute (the error names the limit)."""
        if not token_ids:
            raise ValueError("prompt must not be empty")
        vocab = self.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt is {len(token_ids)} tokens; it must be shorter than the model's "
                f"context (max_model_len={self.max_model_len})"
            )

    def check_token(self, token: int) -> None:
        """A token from the wire: the step loop must never see one outside the vocabulary."""
        vocab = self.vocab_size
        if not 0 <= token < vocab:
            raise ValueError(f"first_token must be an integer in [0, {vocab}), got {token}")

    def first_sequence(self, request: RequestState) -> Sequence:
        """The request's sequence 0 (the one that computes the prompt), registered for output;
        with n > 1 it is forked into the others once the prompt is computed."""
        seq = Sequence(
            next(self._seq_ids),
            request.request_id,
            request.prompt_token_ids,
            request.params,
            arrival=time.monotonic(),
            index=0,
            cache_salt=request.cache_salt,
        )
        seq.num_forks_pending = request.params.n - 1
        self.outputs.register(request, seq)
        return seq

    def fork(self, request: RequestState, parent: Sequence) -> list[Sequence]:
        """n > 1: once the prompt is computed, the other n - 1 sequences share its blocks and
        join the batch; [] when ``parent`` has no forks pending (the common case)."""
        if not parent.num_forks_pending:
            return []
        children = []
        for index in range(1, parent.num_forks_pending + 1):
            child = parent.fork(next(self._seq_ids), index)
            self.pool.fork(parent, child)
            self.scheduler.add_running(child)
            self.outputs.register(request, child)
            children.append(child)
        parent.num_forks_pending = 0
        return children
