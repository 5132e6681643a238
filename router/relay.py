"""A worker's chunk stream read in the background, so that it can start before the chunks that
must precede it are out (streamed KV: the decode worker pulls while the prefill worker still
computes, and its chunks follow the first token the prefill worker answers with)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Generic, TypeVar

T = TypeVar("T")

# Chunks read ahead of the client: enough to hide a step's jitter, few enough that a slow
# client still slows the worker down (the call is not read while the queue is full).
READ_AHEAD = 16


class Relay(Generic[T]):
    """Runs ``stream`` in a task now; ``items`` hands its items (or its error) out in order."""

    def __init__(self, stream: AsyncGenerator[T, None]):
        self.started = False  # the stream produced an item
        self._queue: asyncio.Queue[T | Exception | None] = asyncio.Queue(READ_AHEAD)
        self._task = asyncio.get_running_loop().create_task(self._pump(stream))

    async def _pump(self, stream: AsyncGenerator[T, None]) -> None:
        try:
            async with aclosing(stream):
                async for item in stream:
                    self.started = True
                    await self._queue.put(item)
        except Exception as exc:  # handed to the reader; a cancelled pump has none
            await self._queue.put(exc)
            return
        await self._queue.put(None)

    async def items(self) -> AsyncGenerator[T, None]:
        """The stream's items, then its error if it failed."""
        while (item := await self._queue.get()) is not None:
            if isinstance(item, Exception):
                raise item
            yield item

    async def close(self) -> None:
        """Stop reading: the stream is closed (its call cancelled) before this returns."""
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
