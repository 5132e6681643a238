"""kvtransfer.progress: a wait sees every announcement after its mark, from any thread, and
ends at its timeout when none comes."""

from __future__ import annotations

import asyncio
import threading
import time

from kvtransfer.progress import ProgressSignal


def test_an_announcement_between_the_mark_and_the_wait_is_not_missed() -> None:
    async def run() -> None:
        signal = ProgressSignal()
        mark = signal.mark()
        signal.announce()  # lands before the wait starts
        started = time.monotonic()
        assert await signal.wait(mark, 5.0)
        assert time.monotonic() - started < 0.05
        assert signal.num_waiting == 0

    asyncio.run(run())


def test_a_wait_ends_at_its_timeout_without_an_announcement_and_leaves_nothing() -> None:
    async def run() -> None:
        signal = ProgressSignal()
        started = time.monotonic()
        assert not await signal.wait(signal.mark(), 0.1)
        assert 0.09 <= time.monotonic() - started < 0.5
        assert signal.num_waiting == 0

    asyncio.run(run())


def test_an_announcement_from_another_thread_wakes_every_waiter() -> None:
    async def run() -> None:
        signal = ProgressSignal()
        mark = signal.mark()
        waits = [asyncio.ensure_future(signal.wait(mark, 5.0)) for _ in range(3)]
        await asyncio.sleep(0.05)
        assert signal.num_waiting == 3 and not any(w.done() for w in waits)
        announcer = threading.Thread(target=signal.announce)
        started = time.monotonic()
        announcer.start()
        assert await asyncio.wait_for(asyncio.gather(*waits), 2.0) == [True, True, True]
        assert time.monotonic() - started < 0.1
        announcer.join()
        assert signal.num_waiting == 0 and signal.mark() == mark + 1

    asyncio.run(run())


def test_a_cancelled_wait_leaves_no_waiter_behind() -> None:
    async def run() -> None:
        signal = ProgressSignal()
        wait = asyncio.ensure_future(signal.wait(signal.mark(), 5.0))
        await asyncio.sleep(0.02)
        assert signal.num_waiting == 1
        wait.cancel()
        await asyncio.gather(wait, return_exceptions=True)
        assert signal.num_waiting == 0

    asyncio.run(run())
