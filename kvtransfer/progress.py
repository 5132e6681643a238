"""Wakes streamed pulls when a prompt's blocks may have become ready, instead of their polling.

A streamed pull that finds none of its blocks computed waits for the prefill to progress. It
used to look again every 2 ms: on a prefill worker that computes on one core, each look took
the core (and the GIL) from the engine's step, in the same process, while the step ran. Now the
blocks' owner announces every change that can make blocks ready (a step done, a final answer,
a pin ended) and the waiting pulls look again then, and only then (or at a re-check bound).

A wait is against a *mark* read before looking at the blocks: an announcement between the look
and the wait moves the mark, so the wait returns at once and nothing is missed.

Thread-safe: announced from any thread, waited on from any event loop.
"""

from __future__ import annotations

import asyncio
import threading


class ProgressSignal:
    """A counter of announcements and the futures of the pulls waiting for the next one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    def mark(self) -> int:
        """The announcements so far: what a later :meth:`wait` waits to see pass."""
        with self._lock:
            return self._count

    def announce(self) -> None:
        """Something changed: every pull waiting looks again."""
        with self._lock:
            self._count += 1
            waiters, self._waiters = self._waiters, []
        for loop, future in waiters:
            try:
                loop.call_soon_threadsafe(_wake, future)
            except RuntimeError:
                pass  # that loop is closed: nobody waits there any more

    async def wait(self, mark: int, timeout: float) -> bool:
        """Until an announcement after ``mark`` (True) or ``timeout`` seconds (False)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        waiter = (loop, future)
        with self._lock:
            if self._count != mark:
                return True
            self._waiters.append(waiter)
        try:
            await asyncio.wait_for(future, timeout)
            return True
        except asyncio.TimeoutError:
            return False
        finally:
            with self._lock:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)

    @property
    def num_waiting(self) -> int:
        with self._lock:
            return len(self._waiters)


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
