"""An LLMEngine driven from asyncio: one engine, one step loop, many concurrent callers.

The engine is not thread-safe, so it is touched in exactly two ways: ``engine.step()`` runs on a
dedicated thread (so the event loop stays responsive while the model computes), and every other
engine call is queued with ``call()`` and applied by the loop between two steps. Outputs are
routed to a bounded per-request queue that the caller iterates.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from services.engine.llm_engine import LLMEngine
from services.engine.outputs import RequestOutput
from services.engine.sequence import Sequence

log = logging.getLogger(__name__)
T = TypeVar("T")


class AsyncEngine:
    """Owns the step loop; ``start()`` it once inside the event loop."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._pending: list[tuple[Callable[..., Any], tuple[Any, ...], asyncio.Future[Any]]] = []
        self._streams: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._wake = asyncio.Event()
        self._stepped = asyncio.Condition()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="engine-step")
        self._task: asyncio.Task[None] | None = None
        self.num_steps = 0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="engine-loop")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._executor.shutdown(wait=True)

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the engine between two steps and return its result."""
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._pending.append((fn, args, future))
        self._wake.set()
        return await future

    async def wait_for_step(self, timeout: float) -> None:
        """Wait until the next step ends (or ``timeout`` seconds pass)."""
        async with self._stepped:
            try:
                await asyncio.wait_for(self._stepped.wait(), timeout)
            except asyncio.TimeoutError:
                pass

    def open_stream(self, request_id: str) -> asyncio.Queue[RequestOutput]:
        """Register where ``request_id``'s outputs go (before the request can produce any)."""
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._streams[request_id] = queue
        return queue

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    async def outputs(
        self, request_id: str, queue: asyncio.Queue[RequestOutput]
    ) -> AsyncIterator[RequestOutput]:
        """Yield ``request_id``'s outputs until it finishes; abort it if the caller goes away."""
        finished = False
        try:
            while not finished:
                output = await queue.get()
                finished = output.finished
                yield output
        finally:
            self.close_stream(request_id)
            if not finished:  # cancelled (client gone) or failed: free its blocks now
                await asyncio.shield(self.call(self.engine.abort_request, request_id))

    async def add_request(
        self, request_id: str, prompt: list[int], params: Any, pin_blocks: bool = False
    ) -> tuple[asyncio.Queue[RequestOutput], list[Sequence]]:
        """Open the request's stream and add it (ValueError for bad input, nothing left
        behind); returns the stream for ``outputs`` and the request's sequences, whose
        timestamps may be read once it is over."""
        queue = self.open_stream(request_id)
        try:
            seqs = await self.call(self.engine.add_request, request_id, prompt, params, pin_blocks)
        except ValueError:  # refused: nothing was added
            self.close_stream(request_id)
            raise
        except BaseException:  # cancelled, perhaps after the engine took it: take it back
            self.close_stream(request_id)
            await asyncio.shield(self.call(self.engine.abort_request, request_id))
            raise
        return queue, seqs

    async def generate(
        self, request_id: str, prompt: list[int], params: Any, pin_blocks: bool = False
    ) -> AsyncIterator[RequestOutput]:
        """Add a request and stream its outputs (ValueError for bad input, nothing left behind)."""
        queue, _ = await self.add_request(request_id, prompt, params, pin_blocks)
        async for output in self.outputs(request_id, queue):
            yield output

    # ----- the loop -------------------------------------------------------------------------
    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._apply_pending()
            if not self.engine.scheduler.has_unfinished:
                self._wake.clear()
                if not self._pending:
                    await self._wake.wait()
                continue
            try:
                outputs = await loop.run_in_executor(self._executor, self.engine.step)
            except Exception:  # a bug, not bad input: fail the batch loudly, keep serving
                log.exception("engine step failed; aborting the running requests")
                outputs = self._abort_all()
            self.num_steps += 1
            for output in outputs:
                queue = self._streams.get(output.request_id)
                if queue is not None:
                    queue.put_nowait(output)
            async with self._stepped:
                self._stepped.notify_all()

    def _apply_pending(self) -> None:
        pending, self._pending = self._pending, []
        for fn, args, future in pending:
            if future.cancelled():
                continue
            try:
                future.set_result(fn(*args))
            except Exception as exc:  # delivered to the caller, e.g. ValueError for bad input
                future.set_exception(exc)

    def _abort_all(self) -> list[RequestOutput]:
        running = {s.request_id for s in self.engine.scheduler.running}
        aborted = [self.engine.abort_request(rid) for rid in running]
        return [out for out in aborted if out is not None]
