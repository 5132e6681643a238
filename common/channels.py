"""gRPC channels by peer address: one per peer, shared by every call to it, closed once the
peer has left the registry and no call uses it (autoscaled pools churn addresses, so an
unpruned cache would grow without bound)."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import grpc

MAX_MESSAGE_BYTES = 64 << 20


class ChannelPool:
    """Lazily opened ``grpc.aio`` channels, with a count of the calls using each."""

    def __init__(self) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._busy: Counter[str] = Counter()

    def get(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
            channel = grpc.aio.insecure_channel(address, options=options)
            self._channels[address] = channel
        return channel

    @contextmanager
    def using(self, address: str) -> Iterator[grpc.aio.Channel]:
        """The channel to ``address``, kept open (not pruned) while the block runs."""
        self._busy[address] += 1
        try:
            yield self.get(address)
        finally:
            self._busy[address] -= 1
            if not self._busy[address]:
                del self._busy[address]

    def __len__(self) -> int:
        return len(self._channels)

    async def prune(self, live: Iterable[str]) -> None:
        """Close the channels of addresses not in ``live`` that no call is using."""
        keep = set(live)
        gone = [a for a in self._channels if a not in keep and a not in self._busy]
        await asyncio.gather(*(self._channels.pop(a).close() for a in gone))

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        await asyncio.gather(*(c.close() for c in channels))
