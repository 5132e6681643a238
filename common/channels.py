"""gRPC channels by peer address: one per peer, shared by every call to it, closed once the
peer has left the registry and no call uses it (autoscaled pools churn addresses, so an
unpruned cache would grow without bound).

A channel belongs to one incarnation of its peer: a worker restarted at the same address (a
container restarted in place keeps its IP and port) comes back under a new worker id, and the
old process's channel, after failing to connect while the address was down, sits in gRPC's
reconnect backoff and fails every call at once until the backoff ends. So a call that names the
worker id it wants gets a fresh channel when the address now belongs to another id; the old one
is closed at the next prune. The backoff itself is capped at ``MAX_RECONNECT_BACKOFF_MS`` (gRPC's
default grows to 120 s) for a peer that refused connections and still holds its id.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import grpc

MAX_MESSAGE_BYTES = 64 << 20
INITIAL_RECONNECT_BACKOFF_MS = 250
MAX_RECONNECT_BACKOFF_MS = 2000


class ChannelPool:
    """Lazily opened ``grpc.aio`` channels, with a count of the calls using each."""

    def __init__(self) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._peers: dict[str, str] = {}  # address -> the peer id its channel was opened for
        self._retired: list[grpc.aio.Channel] = []  # an earlier incarnation's, closed at prune
        self._busy: Counter[str] = Counter()

    def get(self, address: str, peer: str | None = None) -> grpc.aio.Channel:
        """The channel to ``address``; a new one where ``peer`` (a worker id) is not the peer
        the current one was opened for."""
        channel = self._channels.get(address)
        if channel is not None and peer is not None and self._peers.get(address, peer) != peer:
            self._retired.append(channel)
            channel = None
        if channel is None:
            options = [
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.initial_reconnect_backoff_ms", INITIAL_RECONNECT_BACKOFF_MS),
                ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
                # Its own connections: gRPC otherwise shares them (and their backoff) between
                # channels to one address, and a fresh channel would inherit the old one's.
                ("grpc.use_local_subchannel_pool", 1),
            ]
            channel = grpc.aio.insecure_channel(address, options=options)
            self._channels[address] = channel
            self._peers.pop(address, None)
        if peer is not None:
            self._peers[address] = peer
        return channel

    @contextmanager
    def using(self, address: str, peer: str | None = None) -> Iterator[grpc.aio.Channel]:
        """The channel to ``address`` (see ``get``), kept open (not pruned) while the block
        runs."""
        self._busy[address] += 1
        try:
            yield self.get(address, peer)
        finally:
            self._busy[address] -= 1
            if not self._busy[address]:
                del self._busy[address]

    def __len__(self) -> int:
        return len(self._channels)

    async def prune(self, live: Iterable[str]) -> None:
        """Close the channels of addresses not in ``live`` that no call is using, and those of
        earlier incarnations of a peer."""
        keep = set(live)
        gone = [a for a in self._channels if a not in keep and a not in self._busy]
        for address in gone:
            self._peers.pop(address, None)
        closing = [self._channels.pop(a) for a in gone] + self._retired
        self._retired = []
        await asyncio.gather(*(channel.close() for channel in closing))

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()) + self._retired, {}
        self._retired, self._peers = [], {}
        await asyncio.gather(*(c.close() for c in channels))
