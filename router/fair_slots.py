"""Slots shared fairly among clients, with a bounded wait: the router's concurrency slots and
its tokenizer threads are each one `FairSlots`.

A request asks for some slots. It gets them at once when they are free and nobody waits;
otherwise it waits in its client's line. Whenever slots free up, the client that holds the
fewest slots per unit of weight goes next (its oldest request, once enough slots are free), so a
client over its share gets more only while nobody else waits. No client ever holds more than its
cap, ``share`` x weight of the slots: a client that took every slot while alone would keep
newcomers waiting until its requests end, as slots cannot be taken back.

The lines together hold at most ``max_waiting`` requests; when full, a newcomer whose client
waits with fewer requests than the longest line takes the place of that line's newest request
(refused: ``queue_full``). A request waits at most its timeout (``queue_timeout``); with a
timeout of 0 it is refused at once when it cannot run (``full``, or ``client_share`` when its
client is at its cap). Waiting holds nothing: a request refused or cancelled while waiting took
no slot.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from dataclasses import dataclass, field

from router.clients import Client


class Refused(Exception):
    """No slots for this request; ``reason`` is one of full, client_share, queue_full,
    queue_timeout."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass
class _Waiter:
    client: Client
    slots: int
    seq: int
    granted: asyncio.Future[None] = field(default_factory=lambda: _new_future())


def _new_future() -> asyncio.Future[None]:
    return asyncio.get_running_loop().create_future()


class FairSlots:
    """The one owner of a pool of slots: every grant and release goes through it."""

    def __init__(self, capacity: int, max_waiting: int, share: float = 1.0):
        self.capacity = capacity
        self.max_waiting = max_waiting
        self.share = share
        self.in_use = 0
        self._held: dict[str, int] = {}
        self._lines: dict[str, deque[_Waiter]] = {}
        self._weights: dict[str, float] = {}
        self._seq = itertools.count()

    @property
    def num_waiting(self) -> int:
        return sum(len(line) for line in self._lines.values())

    @property
    def waiting_slots(self) -> int:
        return sum(w.slots for line in self._lines.values() for w in line)

    def held(self, client: Client) -> int:
        return self._held.get(client.id, 0)

    def cap(self, client: Client) -> int:
        """The most slots ``client`` may hold at once."""
        return min(self.capacity, max(1, int(self.capacity * self.share * client.weight)))

    async def acquire(self, client: Client, slots: int, timeout: float) -> None:
        """Take ``slots`` for ``client`` (give them back with `release`) or raise `Refused`."""
        if slots > self.cap(client):
            raise ValueError(f"{slots} slots asked by a client whose cap is {self.cap(client)}")
        waiter = _Waiter(client, slots, next(self._seq))
        self._enqueue(waiter)
        self._dispatch()
        if not waiter.granted.done() and timeout <= 0:
            self._remove(waiter)
            router_full = self.in_use + slots > self.capacity
            raise Refused("full" if router_full else "client_share")
        try:
            await asyncio.wait({waiter.granted}, timeout=timeout)
        except BaseException:  # cancelled while waiting: give back what may have been granted
            self._abandon(waiter)
            raise
        if not waiter.granted.done():
            self._remove(waiter)
            raise Refused("queue_timeout")
        waiter.granted.result()  # raises Refused("queue_full") when displaced

    def release(self, client: Client, slots: int) -> None:
        self.in_use -= slots
        left = self._held[client.id] - slots
        if left:
            self._held[client.id] = left
        else:
            del self._held[client.id]
        self._dispatch()

    def _enqueue(self, waiter: _Waiter) -> None:
        if self.num_waiting >= self.max_waiting:
            longest = max(self._lines.values(), key=len)
            if len(longest) <= len(self._lines.get(waiter.client.id, ())):
                raise Refused("queue_full")
            displaced = longest.pop()
            displaced.granted.set_exception(Refused("queue_full"))
            self._prune(displaced.client)
        self._lines.setdefault(waiter.client.id, deque()).append(waiter)
        self._weights[waiter.client.id] = waiter.client.weight

    def _dispatch(self) -> None:
        """Grant the heads of the lines, the client with the fewest slots per weight first."""
        while True:
            lines = [line for line in self._lines.values() if self._under_cap(line[0])]
            if not lines:
                return
            line = min(lines, key=self._priority)
            head = line[0]
            if self.in_use + head.slots > self.capacity:
                return  # its slots are kept for it: nobody overtakes the neediest client
            line.popleft()
            self._prune(head.client)
            self.in_use += head.slots
            self._held[head.client.id] = self.held(head.client) + head.slots
            head.granted.set_result(None)

    def _under_cap(self, waiter: _Waiter) -> bool:
        return self.held(waiter.client) + waiter.slots <= self.cap(waiter.client)

    def _priority(self, line: deque[_Waiter]) -> tuple[float, int]:
        head = line[0]
        return self.held(head.client) / head.client.weight, head.seq

    def _remove(self, waiter: _Waiter) -> None:
        line = self._lines.get(waiter.client.id)
        if line is not None and waiter in line:
            line.remove(waiter)
            self._prune(waiter.client)
            self._dispatch()  # a big request that blocked the others may have left

    def _abandon(self, waiter: _Waiter) -> None:
        if not waiter.granted.done():
            self._remove(waiter)
        elif waiter.granted.exception() is None:
            self.release(waiter.client, waiter.slots)

    def _prune(self, client: Client) -> None:
        if not self._lines.get(client.id):
            self._lines.pop(client.id, None)
