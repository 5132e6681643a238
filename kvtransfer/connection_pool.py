"""Idle client connections per KV server, for transports that keep connections open (tcp, ucx).

A pull takes an idle connection to its server (or opens one), sends its request and reads the
reply header; a pooled connection the server has closed meanwhile fails at once, so that
exchange is retried once on a fresh connection (never on another idle one: the server closes
every connection idle for ``framing.IDLE_SECONDS``, so after a lull all of them are stale).
After a complete pull the connection goes back; on any error it is closed, so a later pull never
reads stale bytes. The pool is bounded twice: idle connections per server, and servers
remembered (least recently used forgotten first, their connections closed), so prefill workers
that come and go do not pile up dead sockets.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from kvtransfer import framing
from kvtransfer.base import TransferError

C = TypeVar("C")
Key = tuple[str, int]
DEFAULT_MAX_SERVERS = 64


class ConnectionPool(Generic[C]):
    """Idle connections of type ``C`` by server; ``connect`` opens one, ``close`` drops one.

    ``close`` must be safe on a connection already closed; ``is_open`` tells a pooled
    connection that is known dead (it is skipped)."""

    def __init__(
        self,
        connect: Callable[[Key, float], Awaitable[C]],
        close: Callable[[C], None],
        is_open: Callable[[C], bool] = lambda conn: True,
        max_idle_per_server: int = 4,
        max_servers: int = DEFAULT_MAX_SERVERS,
    ):
        self._connect = connect
        self._close = close
        self._is_open = is_open
        self.max_idle_per_server = max_idle_per_server
        self.max_servers = max_servers
        self._idle: OrderedDict[Key, list[C]] = OrderedDict()

    @property
    def num_servers(self) -> int:
        return len(self._idle)

    async def request(
        self,
        key: Key,
        exchange: Callable[[C], Awaitable[tuple[int, str, int]]],
        timeout: float,
    ) -> tuple[C, int, str]:
        """Run ``exchange`` (send a request, read the reply header: status, message, payload
        length) on a connection to ``key``; returns the connection, the payload length and the
        message of an OK reply. A refusal raises TransferError; the connection is then closed."""
        for attempt in range(2):
            conn, reused = await self._acquire(key, timeout, fresh=attempt > 0)
            try:
                status, message, payload_len = await exchange(conn)
            except ConnectionError:
                self._close(conn)
                if reused and attempt == 0:
                    continue  # the server closed it while it was idle
                raise
            except BaseException:
                self._close(conn)
                raise
            if status != framing.STATUS_OK:
                self._close(conn)
                raise TransferError(framing.STATUS_REASONS.get(status, "protocol"), message)
            return conn, payload_len, message
        raise AssertionError("unreachable")

    def release(self, key: Key, conn: C) -> None:
        """Give a connection back after a complete pull."""
        idle = self._idle.setdefault(key, [])
        self._idle.move_to_end(key)
        if len(idle) < self.max_idle_per_server:
            idle.append(conn)
        else:
            self._close(conn)
        while len(self._idle) > self.max_servers:
            _, forgotten = self._idle.popitem(last=False)
            for old in forgotten:
                self._close(old)

    def close_all(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                self._close(conn)
        self._idle.clear()

    async def _acquire(self, key: Key, timeout: float, fresh: bool = False) -> tuple[C, bool]:
        """An idle connection to ``key`` (reused: True), else a new one; ``fresh``: a new one,
        the idle ones closed (they are as old as the one that just failed)."""
        if fresh:
            for conn in self._idle.pop(key, []):
                self._close(conn)
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if self._is_open(conn):
                return conn, True
        if idle is not None:  # nothing idle left for this server
            del self._idle[key]
        return await self._connect(key, timeout), False
