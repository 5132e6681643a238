"""The engine: requests in, token outputs out, one ``step()`` at a time.

A short coordinator over small parts: the scheduler picks the batch, the model runner computes
it, the sampler picks tokens, the detokenizer and stop checker turn them into text. No I/O; the
services wrap it with gRPC, the offline ``LLM`` with a loop.

Request lifecycle: ``add_request`` (validated; nothing allocated on failure) -> waiting ->
running (prefill chunks, then one token per step) -> finished (stop, length) or aborted; blocks
are freed the moment a sequence finishes.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from services.engine.block_pool import BlockPool, HostBlockPool
from services.engine.config import EngineConfig
from services.engine.detokenizer import IncrementalDetokenizer
from services.engine.model.loader import load_model, resolve_model_dir
from services.engine.model_runner import ModelRunner, kv_bytes_per_block
from services.engine.outputs import CompletionOutput, RequestOutput
from services.engine.sampler import Sampler
from services.engine.sampling_params import SamplingParams
from services.engine.scheduler import Scheduler
from services.engine.sequence import FinishReason, Sequence, SequenceStatus
from services.engine.stop_checker import check_stop_token, find_stop_string, num_held_back
from services.engine.tokenizer import Tokenizer


@dataclass
class _SeqText:
    """Text bookkeeping of one sequence (what is decoded, what was already handed out)."""

    detokenizer: IncrementalDetokenizer
    text: str = ""
    num_emitted_chars: int = 0
    num_emitted_tokens: int = 0


@dataclass
class PullPlan:
    """Blocks a decode worker must fill from the prefill worker before the request can run."""

    request_id: str
    block_indices: list[int]  # positions in the request's block table (and the KVHandle's)
    dest_block_ids: list[int]  # this pool's blocks, in the same order
    num_cached_tokens: int  # prompt tokens this pool already held (prefix cache)


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)
    texts: dict[int, _SeqText] = field(default_factory=dict)
    pin_blocks: bool = False  # prefill-only: keep the prompt's blocks after the first token

    @property
    def finished(self) -> bool:
        return len(self.seqs) == self.params.n and all(s.is_finished for s in self.seqs)


class LLMEngine:
    """Continuous-batching inference over a paged KV cache."""

    def __init__(self, config: EngineConfig, cache_dir: Path | None = None):
        torch.set_num_threads(config.num_threads)
        self.config = config
        cache_dir = cache_dir or Path.home() / ".cache" / "pdserve"
        self.model_dir = resolve_model_dir(config.model, cache_dir)
        self.model = load_model(self.model_dir, config.torch_dtype, config.device)
        mcfg = self.model.config
        self.tokenizer = Tokenizer(self.model_dir, mcfg.eos_token_ids)
        cache = config.cache
        num_blocks = cache.num_blocks or max(
            1,
            cache.kv_cache_memory_bytes
            // kv_bytes_per_block(self.model, cache.block_size, config.torch_dtype),
        )
        self.pool = BlockPool(num_blocks, cache.block_size, cache.enable_prefix_caching)
        # A sequence alone must always fit in the pool, or preemption could never make room.
        self.max_model_len = min(
            mcfg.max_position,
            config.max_model_len or mcfg.max_position,
            num_blocks * cache.block_size,
        )
        sched = config.scheduler
        budget = sched.max_num_batched_tokens
        if not sched.enable_chunked_prefill:  # then a whole prompt must fit in one step
            budget = max(budget, self.max_model_len)
        host_pool = HostBlockPool(cache.num_swap_blocks) if cache.num_swap_blocks else None
        self.scheduler = Scheduler(sched, self.pool, host_pool, budget)
        self.runner = ModelRunner(
            self.model,
            num_blocks,
            cache.block_size,
            config.torch_dtype,
            config.device,
            cache.num_swap_blocks,
            cache.shared_memory_path,
        )
        self.sampler = Sampler(config.seed)
        self._requests: dict[str, _Request] = {}
        self._seq_ids = itertools.count()
        self._pinned: dict[str, Sequence] = {}  # prefill-only requests holding their blocks
        self._pulling: dict[str, Sequence] = {}  # decode side: blocks reserved, KV in flight

    # ----- requests -------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        pin_blocks: bool = False,
    ) -> list[Sequence]:
        """Queue a request; raises ValueError naming the bad field (nothing is allocated).

        ``pin_blocks`` (prefill workers): stop after the first token and keep the prompt's KV
        blocks until ``release_pinned``; the output carries their ids in ``kv_block_ids``.

        Returns the request's sequences: the live list (n > 1 forks join it), whose timestamps
        a caller may read once the request is over (tracing does).
        """
        params = params or SamplingParams()
        if pin_blocks and params.n != 1:
            raise ValueError("n must be 1 for a prefill-only request")
        request = self._new_request(request_id, prompt, params)
        request.pin_blocks = pin_blocks
        seq = self._new_sequence(request, index=0)
        seq.num_forks_pending = params.n - 1
        self._requests[request_id] = request
        self.scheduler.add(seq)
        return request.seqs

    def _new_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams
    ) -> _Request:
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._validate_prompt(token_ids)
        return _Request(request_id, text, token_ids, params)

    def _validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("prompt must not be empty")
        vocab = self.model.config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt is {len(token_ids)} tokens; it must be shorter than the model's "
                f"context (max_model_len={self.max_model_len})"
            )

    def _new_sequence(self, request: _Request, index: int) -> Sequence:
        seq = Sequence(
            next(self._seq_ids),
            request.request_id,
            request.prompt_token_ids,
            request.params,
            arrival=time.monotonic(),
            index=index,
        )
        if request.params.seed is not None:
            seq.generator = torch.Generator().manual_seed(request.params.seed + index)
        self._register(request, seq)
        return seq

    def _register(self, request: _Request, seq: Sequence) -> None:
        request.seqs.append(seq)
        detok = IncrementalDetokenizer(
            self.tokenizer, request.prompt_token_ids, request.params.skip_special_tokens
        )
        for token in seq.output_token_ids:  # a fork inherits its parent's tokens so far
            detok.add(token)
        request.texts[seq.seq_id] = _SeqText(detok, detok.text)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; returns its final output (or None)."""
        request = self._requests.pop(request_id, None)
        if request is None:
            # A prefill-only request whose last step pinned its blocks just before its caller
            # went away: no lease will ever cover them, so they go now.
            self.release_pinned(request_id)
            return None
        pulling = self._pulling.pop(request_id, None)
        if pulling is not None:  # reserved for a pull, not yet in the scheduler
            self.pool.free(pulling)
            pulling.status = SequenceStatus.FINISHED
        for seq in request.seqs:
            self.scheduler.finish(seq, FinishReason.ABORT)
        output = self._output(request)
        output.finished = True
        return output

    def sequences(self, request_id: str) -> list[Sequence]:
        """The live list of a request's sequences (see ``add_request``); [] when unknown."""
        request = self._requests.get(request_id)
        return request.seqs if request is not None else []

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    # ----- the step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration; return an output for every request that advanced."""
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return []
        logits, seqs = self.runner.execute(batch)
        self.scheduler.on_step_done(batch)
        rows = list(range(len(seqs)))
        for row, seq in enumerate(list(seqs)):
            for child in self._fork(seq):
                seqs.append(child)
                rows.append(row)
        if not seqs:
            return []
        sampled = self.sampler(logits[rows], seqs)
        now = time.monotonic()
        touched: dict[str, _Request] = {}
        for seq, token, logprobs in zip(seqs, sampled.token_ids, sampled.logprobs):
            request = self._requests[seq.request_id]
            if seq.first_token_time is None:
                seq.first_token_time = now
            if seq.forced_token is not None:
                self._append_forced(request, seq)
            else:
                seq.append_token(token, logprobs)
                self._process_token(request, seq)
            if request.pin_blocks and not seq.is_finished:
                self.scheduler.detach(seq)
                self._pinned[request.request_id] = seq
            touched[request.request_id] = request
        outputs = [self._output(r) for r in touched.values()]
        for out in outputs:
            if out.finished:
                del self._requests[out.request_id]
        return outputs

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """n > 1: once the prompt is computed, the other n - 1 sequences share its blocks."""
        if not parent.num_forks_pending:
            return []
        request = self._requests[parent.request_id]
        children = []
        for index in range(1, parent.num_forks_pending + 1):
            child = parent.fork(next(self._seq_ids), index)
            self.pool.fork(parent, child)
            self.scheduler.add_running(child)
            self._register(request, child)
            children.append(child)
        parent.num_forks_pending = 0
        return children

    def _process_token(self, request: _Request, seq: Sequence) -> None:
        state = request.texts[seq.seq_id]
        delta = state.detokenizer.add(seq.token_ids[-1])
        stopped = check_stop_token(seq, self.tokenizer.eos_token_ids, self.max_model_len)
        state.text += delta
        if request.params.stop and delta:
            match = find_stop_string(state.text, len(delta), request.params.stop)
            if match is not None:
                index, stop = match
                state.text = state.text[:index]
                self.scheduler.finish(seq, FinishReason.STOP)
                seq.stop_reason = stop
                return
        if stopped is not None:
            reason, stop_token = stopped
            self.scheduler.finish(seq, reason)
            seq.stop_reason = stop_token

    # ----- disaggregation: prefill side ---------------------------------------------------
    def release_pinned(self, request_id: str) -> bool:
        """Free a prefill-only request's pinned blocks; False if it holds none (any more)."""
        seq = self._pinned.pop(request_id, None)
        if seq is None:
            return False
        self.pool.free(seq)
        return True

    @property
    def num_pinned_requests(self) -> int:
        return len(self._pinned)

    @property
    def num_pulling_requests(self) -> int:
        """Decode side: requests waiting for room to pull their KV, or pulling it."""
        return len(self._pulling)

    # ----- disaggregation: decode side ----------------------------------------------------
    def add_prefilled_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        first_token: int,
        params: SamplingParams,
        first_logprobs: dict[int, float] | None = None,
    ) -> RequestOutput | None:
        """Register a request whose prompt was computed elsewhere; ``reserve_pull`` comes next.

        Returns the final output at once when the first token alone ends the request.

        The first token, sampled by the prefill worker, counts as already streamed. With n > 1
        the last prompt token is computed here, so the other sequences can draw their own first
        token from its logits, while sequence 0 keeps the one it was given.
        """
        vocab = self.model.config.vocab_size
        if not 0 <= first_token < vocab:  # it comes off the wire: the step loop must not see it
            raise ValueError(f"first_token must be an integer in [0, {vocab}), got {first_token}")
        request = self._new_request(request_id, prompt_token_ids, params)
        seq = self._new_sequence(request, index=0)
        if params.n > 1:
            seq.forced_token, seq.forced_logprobs = first_token, first_logprobs
            seq.num_forks_pending = params.n - 1
        else:
            self._append_forced(request, seq, first_token, first_logprobs)
        if seq.is_finished:  # the first token alone ended it; nothing to pull
            return self._output(request)
        self._requests[request_id] = request
        self._pulling[request_id] = seq
        return None

    def reserve_pull(self, request_id: str) -> PullPlan | None:
        """Reserve blocks for the prompt's KV (None: no room yet, try again after a step).

        Blocks this pool already holds in its prefix cache are taken as they are; the plan
        lists only the others, which must be filled by ``commit_pull``.
        """
        seq = self._pulling[request_id]
        num_kv_tokens = seq.num_tokens - 1  # the last token is computed here, in the batch
        prefix = self.pool.find_cached_prefix(seq)
        num_new = num_kv_tokens - len(prefix) * self.pool.block_size
        if not seq.block_table:
            if not self.pool.can_allocate(seq, num_new, prefix):
                return None
            self.pool.allocate(seq, num_new, prefix)
        first = len(prefix)
        indices = list(range(first, len(seq.block_table)))
        return PullPlan(
            request_id, indices, [seq.block_table[i] for i in indices], seq.num_computed_tokens
        )

    def commit_pull(self, plan: PullPlan, blocks: torch.Tensor) -> None:
        """Write pulled (and verified) blocks into the cache; the request joins the batch."""
        seq = self._pulling.pop(plan.request_id)
        if plan.dest_block_ids:
            dest = torch.tensor(plan.dest_block_ids, device=self.runner.kv_cache.device)
            self.runner.kv_cache[dest] = blocks.to(self.runner.kv_cache)
        seq.num_computed_tokens = seq.num_tokens - 1
        self.pool.cache_full_blocks(seq)
        self.scheduler.add_running(seq)

    def recompute_pull(self, request_id: str) -> None:
        """The pull failed: drop the reserved blocks and compute the prompt here instead."""
        seq = self._pulling.pop(request_id)
        self.pool.free(seq)
        seq.num_computed_tokens = 0
        self.scheduler.add(seq)

    def _append_forced(
        self,
        request: _Request,
        seq: Sequence,
        token: int | None = None,
        logprobs: dict[int, float] | None = None,
    ) -> None:
        """Append a token sampled by the prefill worker; it was streamed already."""
        if token is None:
            token, logprobs = seq.forced_token, seq.forced_logprobs
            seq.forced_token = seq.forced_logprobs = None
        assert token is not None
        seq.append_token(token, logprobs)
        self._process_token(request, seq)
        state = request.texts[seq.seq_id]
        state.num_emitted_chars, state.num_emitted_tokens = len(state.text), seq.num_output_tokens

    def _output(self, request: _Request) -> RequestOutput:
        outputs = []
        for seq in request.seqs:
            state = request.texts[seq.seq_id]
            visible = len(state.text)
            if not seq.is_finished:
                visible -= num_held_back(state.text, request.params.stop)
            tokens = seq.output_token_ids
            outputs.append(
                CompletionOutput(
                    index=seq.index,
                    text=state.text,
                    token_ids=tokens,
                    finish_reason=seq.finish_reason.value if seq.finish_reason else None,
                    stop_reason=seq.stop_reason,
                    logprobs=seq.logprobs if request.params.logprobs is not None else None,
                    text_delta=state.text[state.num_emitted_chars : visible],
                    token_ids_delta=tokens[state.num_emitted_tokens :],
                )
            )
            state.num_emitted_chars = max(state.num_emitted_chars, visible)
            state.num_emitted_tokens = len(tokens)
        outputs.sort(key=lambda o: o.index)
        pinned = self._pinned.get(request.request_id)
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=outputs,
            finished=request.finished or pinned is not None,
            num_cached_tokens=request.seqs[0].num_cached_tokens,
            kv_block_ids=self._prompt_blocks(pinned) if pinned is not None else None,
        )

    def _prompt_blocks(self, seq: Sequence) -> list[int]:
        """The blocks holding the prompt's KV (the sampled token's KV was never computed)."""
        return seq.block_table[: -(-seq.num_prompt_tokens // self.pool.block_size)]
