"""An LLMEngine driven from asyncio: one engine, one step loop, many concurrent callers.

The engine is not thread-safe, so it is touched in exactly two ways: ``engine.run(batch)``
computes a step on a dedicated thread (so the event loop stays responsive while the model
computes), and every other engine call, ``schedule()`` included, is made by the loop between two
steps (queued through the named methods below). Each request's outputs go to its
``OutputStream``, which merges the deltas a slow consumer has not read yet into one output:
memory per request is bounded by its answer, never by how far the consumer lags, and the step
loop never waits for a consumer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from common.sampling_params import SamplingParams
from services.engine.kv_handoff import PullPlan
from services.engine.llm_engine import LLMEngine
from services.engine.outputs import RequestOutput
from services.engine.scheduler import ScheduledBatch
from services.engine.sequence import Sequence
from services.engine.stats import EngineStats

log = logging.getLogger(__name__)
T = TypeVar("T")
IDLE_POLL_SECONDS = 0.05  # an idle loop (nothing admissible) looks again this often at most


@dataclass(frozen=True)
class StepTiming:
    """When one engine step computed (``time.monotonic()``, read on the step thread around
    ``engine.run``) and what it held."""

    started: float
    ended: float
    prompt_tokens: int  # tokens of prompt chunks (and of contexts recomputed after preemption)
    decode_sequences: int  # sequences computing the token after their last generated one

    @property
    def kind(self) -> str:
        """``prompt`` (prompt chunks only), ``decode`` (decoding sequences only) or ``mixed``."""
        if self.prompt_tokens and self.decode_sequences:
            return "mixed"
        return "prompt" if self.prompt_tokens else "decode"

    @staticmethod
    def contents(batch: ScheduledBatch) -> tuple[int, int]:
        """(prompt tokens, decoding sequences) of ``batch``, read before it runs. A one-token
        prompt is a prompt: a sequence decodes once it has generated a token."""
        prompt = decodes = 0
        for seq, n in zip(batch.seqs, batch.num_tokens):
            if n == 1 and seq.num_tokens > seq.num_prompt_tokens:
                decodes += 1
            else:
                prompt += n
        return prompt, decodes


class OutputStream:
    """One request's outputs, for one consumer; unread deltas are merged, never queued."""

    def __init__(self) -> None:
        self._pending: RequestOutput | None = None
        self._ready = asyncio.Event()

    def put(self, output: RequestOutput) -> None:
        if self._pending is None:
            self._pending = output
        else:
            self._pending.merge(output)
        self._ready.set()

    async def get(self) -> RequestOutput:
        await self._ready.wait()
        self._ready.clear()
        output, self._pending = self._pending, None
        assert output is not None
        return output


class AsyncEngine:
    """Owns the step loop; ``start()`` it once inside the event loop."""

    def __init__(self, engine: LLMEngine, step_thread: ThreadPoolExecutor | None = None):
        """``step_thread``: the one-thread pool the engine was built on (see ``build``)."""
        self.engine = engine
        self._pending: list[tuple[Callable[..., Any], tuple[Any, ...], asyncio.Future[Any]]] = []
        self._streams: dict[str, OutputStream] = {}
        self._plans: dict[str, asyncio.Future[PullPlan]] = {}
        self._admissions: dict[str, asyncio.Future[list[int]]] = {}
        self._wake = asyncio.Event()
        self._executor = step_thread or _step_thread()
        self._task: asyncio.Task[None] | None = None
        self._stats = engine.stats()
        self.num_steps = 0
        self.last_step: StepTiming | None = None  # the step just done (None: it failed)
        self._step_listeners: list[Callable[[], None]] = []

    def on_step(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` on the event loop after every step (the prompts it advanced are
        visible then, and ``last_step`` times it): the prefill worker's pins announce it to the
        pulls waiting for blocks, ``--step-log`` writes it down."""
        self._step_listeners.append(listener)

    @classmethod
    def build(cls, make_engine: Callable[[], LLMEngine]) -> AsyncEngine:
        """The engine made by ``make_engine`` on the thread that will run its steps: then that
        thread is the only one with an OpenMP team (``kernels.openmp`` says why it matters)."""
        step_thread = _step_thread()
        try:
            return cls(step_thread.submit(make_engine).result(), step_thread)
        except BaseException:
            step_thread.shutdown(wait=False)
            raise

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="engine-loop")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._executor.shutdown(wait=True)

    def stats(self) -> EngineStats:
        """The engine's state after the last step or command (safe from any thread)."""
        return self._stats

    # ----- requests -----------------------------------------------------------------------------
    async def add_request(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        pin_blocks: bool = False,
        cache_salt: str | None = None,
    ) -> tuple[OutputStream, list[Sequence]]:
        """Add a request (ValueError for bad input or an id in use; nothing left behind);
        returns its stream for ``outputs`` and its sequences, whose timestamps may be read
        once it is over. A prefill-only request (``pin_blocks``) can be awaited
        ``prefill_admitted``. ``cache_salt``: the prefix-cache tenant (LLMEngine.add_request)."""
        stream = self._open(request_id)
        if pin_blocks:
            self._admissions[request_id] = asyncio.get_running_loop().create_future()
        args = (request_id, prompt, params, pin_blocks, cache_salt)
        try:
            seqs = await self._call(self.engine.add_request, *args)
        except BaseException as exc:
            await self._undo_add(request_id, exc)
            raise
        return stream, seqs

    async def compile_grammar(self, params: SamplingParams) -> None:
        """Compile the request's grammar (if any) on a thread of the pool, not the step's: the
        step that adds the request finds it cached (GrammarError, a ValueError: it does not
        compile)."""
        if params.structured is not None:
            await asyncio.to_thread(self.engine.grammars.compile, params.structured)

    async def prefill_admitted(self, request_id: str) -> list[int]:
        """A prefill-only request's blocks (the whole prompt's), once the scheduler admits it."""
        return await asyncio.shield(self._admissions[request_id])

    async def outputs(
        self, request_id: str, stream: OutputStream, abort_on_exit: bool = True
    ) -> AsyncIterator[RequestOutput]:
        """Yield ``request_id``'s outputs until it finishes; abort it if the caller goes away
        (unless ``abort_on_exit`` is False: a caller whose request is leased ends it itself)."""
        finished = False
        try:
            while not finished:
                output = await stream.get()
                finished = output.finished
                yield output
        finally:
            self._streams.pop(request_id, None)
            self._admissions.pop(request_id, None)
            if not finished and abort_on_exit:  # cancelled (client gone) or failed: free now
                await asyncio.shield(self.abort(request_id))

    async def generate(
        self, request_id: str, prompt: list[int], params: SamplingParams, pin_blocks: bool = False
    ) -> AsyncIterator[RequestOutput]:
        """Add a request and stream its outputs (ValueError for bad input, nothing left behind)."""
        stream, _ = await self.add_request(request_id, prompt, params, pin_blocks)
        async for output in self.outputs(request_id, stream):
            yield output

    async def abort(self, request_id: str) -> None:
        """Stop ``request_id`` and free whatever it holds (pinned blocks included)."""
        self._streams.pop(request_id, None)
        plan = self._plans.pop(request_id, None)
        if plan is not None and not plan.done():
            plan.cancel()
        await self._call(self.engine.abort_request, request_id)

    # ----- disaggregation ---------------------------------------------------------------------
    async def release_pinned(self, request_id: str) -> bool:
        """Free a prefill-only request's pinned blocks (its pin's owner calls this once no
        transfer reads them); one still computing (a streamed prefill whose lease ended) is
        aborted and its stream ends at once with the aborted output. False: nothing held."""

        def release() -> bool:
            if request_id not in self.engine.running_request_ids():
                return self.engine.release_pinned(request_id)
            self._put(self.engine.abort_request(request_id))
            return True

        return await self._call(release)

    async def add_prefilled(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        first_token: int | None,
        params: SamplingParams,
        first_logprobs: dict[int, float] | None,
        cache_salt: str | None = None,
    ) -> tuple[RequestOutput | None, list[Sequence], OutputStream]:
        """Queue a request whose prompt KV is pulled (``pull_plan`` says when and which blocks);
        (its final output when the first token ended it, its sequences, its stream)."""
        stream = self._open(request_id)
        self._plans[request_id] = asyncio.get_running_loop().create_future()

        def add() -> tuple[RequestOutput | None, list[Sequence]]:
            args = (request_id, prompt_token_ids, first_token, params, first_logprobs, cache_salt)
            done = self.engine.add_prefilled_request(*args)
            return done, self.engine.sequences(request_id)

        try:
            finished, seqs = await self._call(add)
        except BaseException as exc:
            await self._undo_add(request_id, exc)
            raise
        if finished is not None:
            self._forget(request_id)
        return finished, seqs, stream

    async def pull_plan(self, request_id: str, timeout: float | None = None) -> PullPlan:
        """Wait until the scheduler admits the request (TimeoutError after ``timeout``; ask
        again: the admission is still pending)."""
        future = self._plans[request_id]
        return await asyncio.wait_for(asyncio.shield(future), timeout)

    async def commit_pull(
        self,
        plan: PullPlan,
        blocks: torch.Tensor,
        first_token: int | None = None,
        first_logprobs: dict[int, float] | None = None,
    ) -> float:
        """The pulled blocks go in (with the first token, when it came with them); returns when
        (``time.monotonic()``) the request could run. When that first token ended the request,
        its final output goes to its stream."""
        self._plans.pop(plan.request_id, None)

        def commit() -> float:
            done = self.engine.commit_pull(plan, blocks, first_token, first_logprobs)
            stream = self._streams.get(plan.request_id)
            if done is not None and stream is not None:
                stream.put(done)
            return time.monotonic()

        return await self._call(commit)

    async def recompute_pull(self, request_id: str) -> float:
        """Compute the prompt here instead (also before admission); returns when it was queued."""
        self._plans.pop(request_id, None)
        return await self._call(_stamped(self.engine.recompute_pull), request_id)

    # ----- the loop -------------------------------------------------------------------------
    async def _undo_add(self, request_id: str, exc: BaseException) -> None:
        """An add that raised leaves nothing here; unless it was refused as bad input (it was
        cancelled, perhaps after the engine took it) the engine aborts it too."""
        self._forget(request_id)
        if not isinstance(exc, ValueError):
            await asyncio.shield(self.abort(request_id))

    def _forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._plans.pop(request_id, None)
        self._admissions.pop(request_id, None)

    def _open(self, request_id: str) -> OutputStream:
        if request_id in self._streams:  # refused before anything of the first one is touched
            raise ValueError(f"request_id {request_id!r} is already in use")
        stream = self._streams[request_id] = OutputStream()
        return stream

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the engine between two steps and return its result."""
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._pending.append((fn, args, future))
        self._wake.set()
        return await future

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._apply_pending()
            if not self.engine.has_work():
                self._wake.clear()
                if not self._pending:
                    await self._wake.wait()
                continue
            try:
                batch = self.engine.schedule()
                # Pull plans go out before the batch computes: the pull runs beside this step,
                # and its request can join the next one (one step less of hand-off). So do
                # prefill admissions: their KV handles reach the decode worker while the prompt
                # computes, which is admitted and waiting on a streamed pull when it is done
                # (hand-off 2.6 -> 1.8-1.9 decode steps, TTFT within noise: docs/benchmarks.md).
                admitted = self._deliver_plans()
                self._deliver_admissions()
                self.last_step = None
                outputs = (
                    await loop.run_in_executor(self._executor, self._timed_run, batch)
                    if not batch.is_empty
                    else []
                )
            except Exception:  # a bug, not bad input: fail the batch loudly, keep serving
                log.exception("engine step failed; aborting the running requests")
                outputs, admitted = self._abort_all(), 0
            self.num_steps += 1
            for listener in self._step_listeners:
                listener()
            for output in outputs:
                self._put(output)
            self._stats = self.engine.stats()
            if not self.engine.num_running and not admitted:  # nothing admissible now
                self._wake.clear()
                if not self._pending:
                    await _wait(self._wake, IDLE_POLL_SECONDS)

    def _timed_run(self, batch: ScheduledBatch) -> list[RequestOutput]:
        """``engine.run(batch)`` on the step thread, timed there: the loop's own wake-up is not
        the step's."""
        prompt, decodes = StepTiming.contents(batch)
        started = time.monotonic()
        outputs = self.engine.run(batch)
        self.last_step = StepTiming(started, time.monotonic(), prompt, decodes)
        return outputs

    def _deliver_plans(self) -> int:
        plans = self.engine.take_pull_plans()
        for plan in plans:
            future = self._plans.get(plan.request_id)
            if future is not None and not future.done():
                future.set_result(plan)
        return len(plans)

    def _deliver_admissions(self) -> None:
        for request_id, block_ids in self.engine.take_prefill_admissions():
            admitted = self._admissions.get(request_id)
            if admitted is not None and not admitted.done():
                admitted.set_result(block_ids)

    def _apply_pending(self) -> None:
        pending, self._pending = self._pending, []
        for fn, args, future in pending:
            if future.cancelled():
                continue
            try:
                future.set_result(fn(*args))
            except Exception as exc:  # delivered to the caller, e.g. ValueError for bad input
                future.set_exception(exc)
        if pending:
            self._stats = self.engine.stats()

    def _put(self, output: RequestOutput | None) -> None:
        stream = self._streams.get(output.request_id) if output is not None else None
        if stream is not None:
            assert output is not None
            stream.put(output)

    def _abort_all(self) -> list[RequestOutput]:
        """Abort every running request; a prefill-only one keeps its blocks pinned (a transfer
        may read them): its service ends its pin, whose owner frees them after the last read."""
        running = self.engine.running_request_ids()
        aborted = [self.engine.abort_request(rid, keep_pinned=True) for rid in running]
        return [out for out in aborted if out is not None]


def _step_thread() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(1, thread_name_prefix="engine-step")


def _stamped(fn: Callable[..., object]) -> Callable[..., float]:
    """``fn`` returning the time it ran at: an engine call's moment, not when its caller resumed
    (a step may have started in between)."""

    def run(*args: Any) -> float:
        fn(*args)
        return time.monotonic()

    return run


async def _wait(event: asyncio.Event, timeout: float) -> None:
    try:
        await asyncio.wait_for(event.wait(), timeout)
    except asyncio.TimeoutError:
        pass
