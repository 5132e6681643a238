"""Ending a run early: Ctrl-C, or a server that refuses the requests themselves.

Lifecycle of a run's ``Stop``: *running* -> *stopping* (the first SIGINT, or the first 4xx answer
that is the client's fault) -> the run sends nothing more, cancels the requests in flight and
returns what completed, marked with ``reason``; the caller prints and saves that partial result.
A second SIGINT while stopping exits at once (status 130), saving nothing.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager

# 4xx answers that describe the load, not a mistake in the requests: counted, not fatal.
LOAD_STATUSES = (408, 429)


class Stop:
    """A flag the run loop watches, with the reason it was raised (empty while running)."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.reason = ""

    @property
    def is_set(self) -> bool:
        return self.event.is_set() or bool(self.reason)

    def set(self, reason: str) -> None:
        """Stop the run (the first reason given is kept)."""
        if not self.reason:
            self.reason = reason
        self.event.set()

    async def wait(self) -> None:
        await self.event.wait()


def is_client_error(status: int) -> bool:
    """A 4xx that every further request would get too (bad model, key, body)."""
    return 400 <= status < 500 and status not in LOAD_STATUSES


@contextmanager
def sigint_stops(stop: Stop) -> Iterator[None]:
    """While inside: the first SIGINT sets ``stop`` (on the running loop), a second one exits
    the process at once. A plain ``signal.signal`` handler, not the loop's, so that the second
    Ctrl-C also works while results are being written (synchronous code, no loop turning)."""
    loop = asyncio.get_running_loop()

    def on_sigint(signum: int, frame: object) -> None:
        if stop.is_set:
            print("\ninterrupted again: exiting without saving", file=sys.stderr, flush=True)
            os._exit(130)
        # Stopping before saying so: a second SIGINT can run this handler again as soon as
        # the print below has been read (Python runs handlers between any two bytecodes).
        stop.reason = stop.reason or "interrupted (SIGINT)"  # seen at once by sync code
        loop.call_soon_threadsafe(stop.set, "interrupted (SIGINT)")
        print(
            "\ninterrupted: stopping (in-flight requests cancelled); Ctrl-C again to quit at once",
            file=sys.stderr,
            flush=True,
        )

    try:
        previous = signal.signal(signal.SIGINT, on_sigint)
    except ValueError:  # not the main thread: Ctrl-C keeps its default meaning
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
