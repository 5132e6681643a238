"""The engine: requests in, token outputs out, one ``step()`` at a time.

A short coordinator over small parts: the request builder checks what comes in and makes the
sequences (n > 1 forks included), the scheduler picks the batch, the model runner computes it,
the sampler picks tokens, the output processor turns them into text deltas and applies the stop
conditions, and the KV hand-off keeps the disaggregation states (pinned / pulling) and the
tokens a prefill worker sampled. No I/O; the services wrap it with gRPC, the offline ``LLM``
with a loop.

Request lifecycle: ``add_request`` (validated; nothing allocated on failure) -> waiting ->
running (prefill chunks, then one token per step) -> finished (stop, length) or aborted; blocks
are freed the moment a sequence finishes. Disaggregated: ``add_request(pin_blocks=True)`` ->
pinned after its first token -> ``release_pinned``; ``add_prefilled_request`` -> waiting for
room -> pulling (``take_pull_plans``) -> ``commit_pull`` or ``recompute_pull`` -> running.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable

import torch

from common.sampling_params import SamplingParams
from kernels import reference
from services.engine.block_pool import BlockPool, HostBlockPool
from services.engine.config import EngineConfig, ModelConfig
from services.engine.grammar import Grammars
from services.engine.kv_handoff import KVHandoff, PullPlan
from services.engine.model.gemm_choice import GemmTable
from services.engine.model.int8_linear import Int8Ops
from services.engine.model.llama import LlamaModel
from services.engine.model.loader import load_config, load_model
from services.engine.model.simulated import SimulatedModel
from services.engine.model.source import resolve_model_dir
from services.engine.model_runner import (
    ModelRunner,
    attention_backend,
    kv_bytes_per_block,
    sampling_kernels,
)
from services.engine.output_processor import OutputProcessor, RequestState
from services.engine.outputs import RequestOutput
from services.engine.prompt_logprobs import record_prompt_logprobs
from services.engine.request_builder import RequestBuilder
from services.engine.sampler import Sampler, SampleResult
from services.engine.scheduler import ScheduledBatch, Scheduler
from services.engine.sequence import FinishReason, Sequence, SequenceStatus
from services.engine.simulation_profile import SimulationProfile
from services.engine.stats import EngineStats
from services.engine.tokenizer import Tokenizer

__all__ = ["LLMEngine", "PullPlan"]

log = logging.getLogger(__name__)


class LLMEngine:
    """Continuous-batching inference over a paged KV cache."""

    def __init__(
        self,
        config: EngineConfig,
        simulation: SimulationProfile | None = None,
        tokenizer: Tokenizer | None = None,
    ):
        """``simulation``: a simulated engine (``SimulatedModel``: the profile's step times,
        deterministic tokens, its KV pool unless ``num_blocks`` is set); the weights are not
        loaded, only the tokenizer and the model's config. ``tokenizer``: one already loaded
        for this model (the simulated workers of one process share one: 16 MB each)."""
        torch.set_num_threads(config.num_threads)
        self.config = config
        self.model_dir = resolve_model_dir(config.model, config.cache_path)
        dtype = getattr(torch, config.dtype)
        cache, sched = config.cache, config.scheduler
        self.model: LlamaModel | SimulatedModel
        if simulation is None:
            backend = attention_backend(config)  # on CPU, the compiled kernels (or reference)
            small_batch = getattr(backend, "linear_bf16", None)
            self.model = load_model(
                self.model_dir,
                dtype,
                config.device,
                config.cpu_matmul,
                small_batch,
                config.cache_path / "kernels",  # the measured GEMM paths, beside the kernels
                config.quantization,
                backend if isinstance(backend, Int8Ops) else None,  # None: the reference
            )
            per_block = kv_bytes_per_block(self.model, cache.block_size, dtype)
            num_blocks = cache.num_blocks or max(1, cache.kv_cache_memory_bytes // per_block)
        else:
            backend = "reference"  # never used: the simulated model computes no attention
            self.model = SimulatedModel(load_config(self.model_dir), simulation)
            num_blocks = cache.num_blocks or simulation.num_blocks(cache.block_size)
        mcfg = self.model.config
        self.tokenizer = tokenizer or Tokenizer(
            config.tokenizer_dir(self.model_dir), mcfg.eos_token_ids
        )
        self.pool = BlockPool(num_blocks, cache.block_size, cache.enable_prefix_caching)
        # A sequence alone must always fit in the pool, or preemption could never make room.
        self.max_model_len = min(
            mcfg.max_position,
            config.max_model_len or mcfg.max_position,
            num_blocks * cache.block_size,
        )
        budget = sched.max_num_batched_tokens
        if not sched.enable_chunked_prefill:  # then a whole prompt must fit in one step
            budget = max(budget, self.max_model_len)
        host_pool = HostBlockPool(cache.num_swap_blocks) if cache.num_swap_blocks else None
        self.scheduler = Scheduler(sched, self.pool, host_pool, budget)
        self.runner = ModelRunner(
            self.model,
            num_blocks,
            cache.block_size,
            dtype,
            config.device,
            cache.num_swap_blocks,
            cache.shared_memory_path,
            attention=backend,
        )
        self.grammars = Grammars(
            self.tokenizer.path,
            self.tokenizer.vocab(),
            mcfg.vocab_size,
            sorted(self.tokenizer.eos_token_ids),
        )
        kernels = sampling_kernels(config)  # on the host, for every device
        ops = kernels if kernels is not None else reference
        self.sampler = Sampler(
            config.seed, self.grammars, ops.argmax_rows, ops.race_rows, ops.filter_floors
        )
        self.sampler.eos_token_ids = frozenset(self.tokenizer.eos_token_ids)  # min_tokens
        self.outputs = OutputProcessor(self.tokenizer, self.max_model_len)
        vocab = mcfg.vocab_size
        self.builder = RequestBuilder(
            self.tokenizer, vocab, self.max_model_len, self.outputs, self.pool, self.scheduler
        )
        self.handoff = KVHandoff(self.scheduler, self.runner, self.outputs, self._weak_check_stop())
        self._requests: dict[str, RequestState] = {}

    # ----- requests -------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        pin_blocks: bool = False,
        cache_salt: str | None = None,
    ) -> list[Sequence]:
        """Queue a request; raises ValueError naming the bad field (nothing is allocated).

        ``pin_blocks`` (prefill workers): stop after the first token and keep the prompt's KV
        blocks until ``release_pinned``; the output carries their ids in ``kv_block_ids``.
        ``cache_salt``: its prefix-cache hits are only blocks computed under the same salt.

        Returns the request's sequences: the live list (n > 1 forks join it), whose timestamps
        a caller may read once the request is over (tracing does).
        """
        params = params or SamplingParams()
        if pin_blocks and params.n != 1:
            raise ValueError("n must be 1 for a prefill-only request")
        request = self._new_request(request_id, prompt, params, cache_salt)
        seq = self.builder.first_sequence(request)
        seq.pin_blocks = pin_blocks
        self._requests[request_id] = request
        self.scheduler.add(seq)
        return request.seqs

    def add_prefilled_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        first_token: int | None,
        params: SamplingParams,
        first_logprobs: dict[int, float] | None = None,
        cache_salt: str | None = None,
    ) -> RequestOutput | None:
        """Queue a request whose prompt was computed elsewhere; its KV is pulled once the
        scheduler admits it (``take_pull_plans``). Returns the final output at once when the
        first token alone ends the request.

        The first token, sampled by the prefill worker, counts as already streamed (see
        ``KVHandoff.expect`` for n > 1). ``first_token`` None (the KV is streamed, the prefill
        still runs): it comes with ``commit_pull``. ``cache_salt``: the prefill worker's, so
        that the pulled blocks are cached (and the cached prefix found) under the same hashes.
        """
        if first_token is not None:
            self.builder.check_token(first_token)
        request = self._new_request(request_id, prompt_token_ids, params, cache_salt)
        self.builder.first_sequence(request)
        if self.handoff.expect(request, first_token, first_logprobs):
            return self.outputs.output(request)  # the first token alone ended it
        self._requests[request_id] = request
        return None

    def abort_request(self, request_id: str, keep_pinned: bool = False) -> RequestOutput | None:
        """Stop a request now and free its blocks; returns its final output (or None).

        ``keep_pinned``: a prefill-only request's blocks stay pinned (a transfer may read them)
        until ``release_pinned``, which its pin's owner calls once no transfer does."""
        request = self._requests.pop(request_id, None)
        if not keep_pinned:
            self.handoff.release(request_id)  # pinned blocks no lease will cover
        if request is None:
            return None
        for seq in request.seqs:
            if keep_pinned and seq.pin_blocks and seq.status == SequenceStatus.RUNNING:
                self.handoff.pin(seq)
                seq.finish_reason = FinishReason.ABORT
                self.sampler.forget(seq)
            else:
                self._finish(seq, FinishReason.ABORT)
        output = self.outputs.output(request)
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

    def _new_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
    ) -> RequestState:
        """A pinned request's id stays in use until its release: its lease names it."""
        if request_id in self._requests or self.handoff.is_pinned(request_id):
            raise ValueError(f"request_id {request_id!r} is already in use")
        if params.structured is not None:  # refused here when it does not compile (cached)
            self.grammars.compile(params.structured)
        return self.builder.build(request_id, prompt, params, cache_salt)

    # ----- the step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration; return a delta for every request that advanced."""
        return self.run(self.schedule())

    def schedule(self) -> ScheduledBatch:
        """The next iteration's batch, for ``run``. What it admitted for a pull or as a
        prefill-only request can be taken (``take_pull_plans``, ``take_prefill_admissions``)
        before it runs: a worker starts those transfers while the model computes."""
        batch = self.scheduler.schedule()
        self.handoff.on_schedule(batch)
        return batch

    def run(self, batch: ScheduledBatch) -> list[RequestOutput]:
        """Compute ``batch``, the last ``schedule``'s (no other engine call in between), and
        return a delta for every request that advanced."""
        if batch.is_empty:
            return []
        self.sampler.prepare(_to_sample(batch))  # grammar masks, while the model runs
        logits, seqs = self.runner.execute(batch)
        record_prompt_logprobs(self.runner.prompt_hidden, self.model.compute_logits)
        self.scheduler.on_step_done(batch)
        rows = list(range(len(seqs)))
        for row, seq in enumerate(list(seqs)):
            if seq.num_forks_pending:  # n > 1: the forks sample from their parent's logits
                children = self.builder.fork(self._requests[seq.request_id], seq)
                seqs += children
                rows += [row] * len(children)
        if not seqs:
            return []
        if len(rows) > len(logits):  # forks share their parent's row (a copy of the logits)
            logits = logits[rows]
        return self._process(seqs, self.sampler(logits, seqs))

    def _process(self, seqs: list[Sequence], sampled: SampleResult) -> list[RequestOutput]:
        """Append each sequence's token (sampled, or forced: the prefill worker's), apply the
        stops, pin the prefill-only ones; one delta per request, finished ones dropped."""
        now = time.monotonic()
        touched: dict[str, RequestState] = {}
        pinned: dict[str, list[int]] = {}
        for row, (seq, token, logprobs) in enumerate(
            zip(seqs, sampled.token_ids, sampled.logprobs)
        ):
            request = touched[seq.request_id] = self._requests[seq.request_id]
            if seq.first_token_time is None:
                seq.first_token_time = now
            if seq.forced_token is not None:
                self.handoff.append_forced(request, seq)
            elif row in sampled.dead_ends:  # no token follows its grammar: none is appended
                log.warning(
                    "request %s: its grammar allows no token after %d output tokens; ended",
                    seq.request_id,
                    seq.num_output_tokens,
                )
                self._end(seq, FinishReason.GRAMMAR_DEAD_END)
            else:
                seq.append_token(token, logprobs)
                self._check_stop(request, seq)
            if seq.pin_blocks:  # kept after its first token, whatever it was
                pinned[seq.request_id] = self.handoff.pin(seq)
                self.sampler.forget(seq)
        outputs = [self.outputs.output(r, pinned.get(rid)) for rid, r in touched.items()]
        for out in outputs:
            if out.finished:
                del self._requests[out.request_id]
        return outputs

    def _weak_check_stop(self) -> Callable[[RequestState, Sequence], None]:
        """``_check_stop`` for the hand-off, which the engine owns: held strongly, the method
        would make the two a reference cycle, which only the cyclic collector frees (a dropped
        engine kept its KV pool and weights until it ran)."""
        method = weakref.WeakMethod(self._check_stop)

        def check_stop(request: RequestState, seq: Sequence) -> None:
            bound = method()
            if bound is not None:  # else the engine is gone, and so are its requests
                bound(request, seq)

        return check_stop

    def _check_stop(self, request: RequestState, seq: Sequence) -> None:
        """Apply the stop conditions to ``seq``'s newest token, finishing it if one holds."""
        stopped = self.outputs.process_token(request, seq)
        if stopped is None:
            return
        reason, seq.stop_reason = stopped
        self._end(seq, reason)

    def _end(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.pin_blocks:  # done, but its blocks stay pinned (maybe read): the owner frees them
            seq.finish_reason = reason
        else:
            self._finish(seq, reason)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        self.scheduler.finish(seq, reason)
        self.sampler.forget(seq)

    # ----- disaggregation ---------------------------------------------------------------------
    def release_pinned(self, request_id: str) -> bool:
        """Prefill side: the request's lease is over: free its blocks (pinned) or abort it (a
        streamed prefill still computing); False if it holds none (any more)."""
        if self.handoff.release(request_id):
            return True
        request = self._requests.get(request_id)
        if request is None or not request.seqs[0].pin_blocks:
            return False
        self.abort_request(request_id)
        return True

    def take_prefill_admissions(self) -> list[tuple[str, list[int]]]:
        """Prefill side: (request id, the prompt's blocks) of the prefill-only requests
        admitted since the last call; their blocks are fixed from then on (streamed KV)."""
        return self.handoff.take_prefill_admissions()

    def take_pull_plans(self) -> list[PullPlan]:
        """Decode side: the requests admitted for a pull since the last call, with their plans."""
        return self.handoff.take_pull_plans()

    def commit_pull(
        self,
        plan: PullPlan,
        blocks: torch.Tensor,
        first_token: int | None = None,
        first_logprobs: dict[int, float] | None = None,
        cache_salt: str | None = None,
    ) -> RequestOutput | None:
        """Decode side: the pulled (and verified) blocks, and the first token when it came with
        them (streamed KV); the request joins the batch. Returns the final output at once when
        that first token alone ends the request (nothing runs here then)."""
        request = self._requests[plan.request_id]
        if first_token is not None:
            self.builder.check_token(first_token)
        if not self.handoff.commit(request, plan, blocks, first_token, first_logprobs):
            return None
        del self._requests[plan.request_id]
        return self.outputs.output(request)

    def recompute_pull(self, request_id: str) -> None:
        """Decode side: the pull failed or will not happen: compute the prompt here instead."""
        self.handoff.recompute(self._requests[request_id])

    # ----- state (read-only: what the services report and hand to the KV transports) --------
    @property
    def model_config(self) -> ModelConfig:
        return self.model.config

    @property
    def gemm_table(self) -> GemmTable | None:
        """The GEMM path per linear shape and row count (CPU), and how it was chosen."""
        return getattr(self.model, "gemm_table", None)  # a simulated model has none

    @property
    def num_blocks(self) -> int:
        """KV blocks in the pool (the device cache's first dimension)."""
        return self.pool.num_blocks

    @property
    def kv_cache(self) -> torch.Tensor:
        """The device KV cache, ``[num_blocks, ...]``: prefill workers lend blocks of it."""
        return self.runner.kv_cache

    def cached_block_hashes(self) -> list[int]:
        """Hashes of the prefix-cached blocks (a copy), for prefix-aware routing."""
        return self.pool.cached_block_hashes

    def has_work(self) -> bool:
        """Whether a step could do anything (PULLING sequences wait for their KV, PINNED ones
        for their release: neither needs a step)."""
        return self.scheduler.has_unfinished

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    def running_request_ids(self) -> set[str]:
        return {seq.request_id for seq in self.scheduler.running}

    def stats(self) -> EngineStats:
        pool, sched = self.pool, self.scheduler
        return EngineStats(
            num_running=len(sched.running),
            num_waiting=sched.num_waiting,
            num_pulling=sched.num_kv_pending,
            num_pinned=self.handoff.num_pinned,
            kv_blocks_total=pool.num_blocks,
            kv_blocks_used=pool.num_used_blocks,
            kv_blocks_cached=pool.num_evictable_blocks,
            kv_blocks_free=pool.num_empty_blocks,
            num_prefix_blocks=pool.num_cached_blocks,
            prefix_cache_queries=pool.num_prefix_query_tokens,
            prefix_cache_hits=pool.num_prefix_hit_tokens,
            num_preemptions=sched.num_preemptions,
        )


def _to_sample(batch: ScheduledBatch) -> list[Sequence]:
    """The sequences ``batch`` completes: those sampled after it (the model runner's rule)."""
    return [
        s for s, n in zip(batch.seqs, batch.num_tokens) if s.num_computed_tokens + n == s.num_tokens
    ]
