"""The ``tcp`` transport: framed requests and raw payload bytes over plain sockets (asyncio).

No dependency beyond the standard library. Address: ``tcp://HOST:PORT``.

Server, per connection: read a request frame -> check token (refused: reply and close) ->
check size and pins (unknown request / size mismatch: reply, keep the connection) -> reply OK
with the total byte count -> send the bytes:

- zero copy, when the source lends its rows (:class:`~kvtransfer.base.BlockRowSource`, host
  memory): each row straight from the KV cache; the kernel's copy is the only one;
- otherwise gathered (``read_blocks``) in pieces of ``chunk_bytes``, each sent from a
  memoryview while the next is gathered in one of the server's own copy threads
  (:meth:`~kvtransfer.base.KVTransferServer.run_blocking`).

A failure after the OK reply closes the connection, which the client sees as
``connection_lost``. Every send has a deadline (``send_timeout``, the lease by default, for each
piece of ``SEND_PIECE_BYTES``): a reader that stops reading is cut off, its read ends and the
blocks it held can be freed. A malformed frame gets a ``protocol`` reply and closes that
connection only. A connection counts against the listener's small pre-auth budget (per peer
address, ``PREAUTH_SECONDS`` to present the token) until its first token checks out, then
against ``MAX_CONNECTIONS`` (:mod:`kvtransfer.framing`).
Injected faults (``faults=``, testing only): ``drop`` closes the connection after the OK reply,
``corrupt`` sends a copy of the payload with one byte flipped.

Client, per pull: take an idle connection to the address (or connect; ``ConnectionPool``) ->
send the request -> read the reply -> receive exactly the announced bytes straight into the
preallocated output tensor (``sock_recv_into`` on its memoryview). The connection goes back to
the pool only after a complete pull; on any error or timeout it is closed, so a later pull never
reads stale bytes.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import torch

from kvtransfer import framing
from kvtransfer.base import (
    KVTransferClient,
    KVTransferServer,
    PullRequest,
    TransferError,
    tensor_bytes,
)
from kvtransfer.connection_pool import ConnectionPool
from kvtransfer.streaming import ready_pull

# Below this many bytes the gather runs on the event loop; above, in the server's copy threads.
INLINE_GATHER_BYTES = 1 << 20
# Large pulls are gathered and sent in pieces of this size, so gathering overlaps sending.
DEFAULT_CHUNK_BYTES = 8 << 20
# A send waits at most ``send_timeout`` (the lease) for each piece of this size: a reader that
# takes no piece for that long has stalled.
SEND_PIECE_BYTES = 8 << 20


class TcpKVServer(KVTransferServer):
    """Serves pinned KV blocks over TCP; see the module docstring for the protocol."""

    transport = "tcp"

    def __init__(
        self,
        *args: Any,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        zero_copy: bool = True,
        **kwargs: Any,
    ) -> None:
        """:class:`KVTransferServer`'s arguments; ``chunk_bytes``: the pieces a gathered pull is
        sent in (0: one piece); ``zero_copy``: send the rows a source lends straight from it."""
        super().__init__(*args, **kwargs)
        self.chunk_bytes = chunk_bytes
        self.zero_copy = zero_copy
        self._listener = framing.SocketListener(self._serve_connection)

    async def start(self, host: str = "127.0.0.1", advertise_host: str | None = None) -> str:
        port = self._listener.start(host)
        return framing.format_address("tcp", advertise_host or host, port)

    async def stop(self) -> None:
        await self._listener.stop()
        self.shutdown_threads()

    async def _serve_connection(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                request = await framing.read_request(loop, conn, self._checker(conn))
            except framing.ProtocolError as exc:
                self._record_failure("protocol")
                await self._send(loop, conn, framing.error_reply("protocol", str(exc)))
                return
            except TransferError as exc:  # refused: the rest of the frame is never read
                await self._send(loop, conn, framing.error_reply(exc.reason, exc.detail))
                return
            except (ConnectionError, EOFError, asyncio.TimeoutError):
                return
            if not await self._serve_request(loop, conn, request):
                return

    def _checker(self, conn: socket.socket) -> Callable[[str], None]:
        """The token check of ``conn``'s requests: a valid token moves the connection out of
        the listener's pre-auth budget (see :mod:`kvtransfer.framing`)."""

        def check(token: str) -> None:
            self.check_token(token)
            self._listener.authenticated(conn)

        return check

    async def _serve_request(
        self, loop: asyncio.AbstractEventLoop, conn: socket.socket, request: framing.Request
    ) -> bool:
        """Answer one request; False when the connection must be closed. The blocks are held
        (a lease expiry or a release waits) until the last byte is handed to the socket."""
        start = time.perf_counter()
        with ExitStack() as held:
            try:
                request, message = await self._admit(request, held)
                ids = (request.request_id, request.block_ids)
                rows = self.lent_rows(*ids) if self.zero_copy else None
                chunks = self._chunks(request.block_ids)
                first = None if rows is not None else await self._gather(request, chunks[0])
            except TransferError as exc:
                await self._send(loop, conn, framing.error_reply(exc.reason, exc.detail))
                return exc.reason not in ("refused", "protocol")
            fault = self.draw_fault()
            if fault == "corrupt":  # a flipped copy: the KV cache itself stays intact
                assert self.faults is not None
                if rows is not None:
                    rows = [self.faults.corrupted(torch.cat(rows))]
                elif first is not None:
                    first = self.faults.corrupted(first)
            num_bytes = len(request.block_ids) * self.layout.bytes_per_block
            try:
                reply = framing.encode_reply(framing.STATUS_OK, message, num_bytes)
                await self._send(loop, conn, reply)
                if fault == "drop":  # close with no payload: the client fails now
                    return False
                if rows is not None:  # straight from the KV cache: the kernel's copy only
                    for i, row in enumerate(rows):
                        await self._send(loop, conn, tensor_bytes(row))
                        if i == 0:
                            await self.pause_mid_transfer()
                else:
                    assert first is not None
                    await self._stream(loop, conn, request, first, chunks[1:])
            except TimeoutError as exc:  # the reader stopped reading: its blocks may go
                self._record_failure("timeout")
                raise ConnectionResetError(f"reader stalled for {self.send_timeout}s") from exc
            except (ConnectionError, OSError) as exc:
                self._record_failure("connection_lost")
                raise ConnectionResetError(f"client went away mid-transfer: {exc!r}") from exc
            except TransferError as exc:  # e.g. the lease ran out mid-way: counted already
                raise ConnectionResetError(f"aborted mid-transfer: {exc}") from exc
        self.record_sent(num_bytes, time.perf_counter() - start)
        return True

    async def _admit(
        self, request: framing.Request, held: ExitStack
    ) -> tuple[framing.Request, str]:
        """Validate a pull and hold its blocks until ``held`` closes: an op this transport
        serves, a streamed pull cut to its ready blocks (:func:`ready_pull`), the client's
        block size, the pins. (The plain pull to answer, the reply's message); TransferError,
        counted, otherwise. The shm transport admits its pulls the same way."""
        if request.op not in (framing.OP_PULL, framing.OP_PULL_READY):
            self._record_failure("protocol")
            raise TransferError("protocol", f"op {request.op} is not served by {self.transport}")
        request, message = await ready_pull(self, request)
        held.enter_context(
            self.holding(request.request_id, request.block_ids, request.bytes_per_block)
        )
        return request, message

    def _chunks(self, block_ids: list[int]) -> list[list[int]]:
        """Block ids in pieces of about ``chunk_bytes`` (one piece when chunking is off)."""
        per_chunk = max(1, self.chunk_bytes // self.layout.bytes_per_block)
        if not self.chunk_bytes or len(block_ids) <= per_chunk:
            return [block_ids]
        return [block_ids[i : i + per_chunk] for i in range(0, len(block_ids), per_chunk)]

    async def _stream(
        self,
        loop: asyncio.AbstractEventLoop,
        conn: socket.socket,
        request: framing.Request,
        current: torch.Tensor,
        rest: list[list[int]],
    ) -> None:
        """Send ``current`` while the next chunk is gathered in a thread, and so on."""
        await self.pause_mid_transfer()
        for ids in rest:
            gathering = asyncio.ensure_future(self._gather(request, ids))
            try:
                await self._send(loop, conn, tensor_bytes(current))
            except BaseException:
                gathering.cancel()
                raise
            current = await gathering
        await self._send(loop, conn, tensor_bytes(current))

    async def _send(
        self, loop: asyncio.AbstractEventLoop, conn: socket.socket, data: bytes | memoryview
    ) -> None:
        """Hand ``data`` to the socket, each piece of ``SEND_PIECE_BYTES`` within
        ``send_timeout`` (TimeoutError: the reader stalled; the caller closes the connection,
        which ends the read and lets the pin go)."""
        view = memoryview(data).cast("B")
        for start in range(0, max(len(view), 1), SEND_PIECE_BYTES):
            piece = view[start : start + SEND_PIECE_BYTES]
            await asyncio.wait_for(loop.sock_sendall(conn, piece), self.send_timeout)

    async def _gather(self, request: framing.Request, block_ids: list[int]) -> torch.Tensor:
        """Blocks of ``request`` in host memory (in a copy thread unless small)."""
        if len(block_ids) * self.layout.bytes_per_block <= INLINE_GATHER_BYTES:
            return self._read_to_host(request.request_id, block_ids)
        return await self.run_blocking(self._read_to_host, request.request_id, block_ids)

    def _read_to_host(self, request_id: str, block_ids: list[int]) -> torch.Tensor:
        return self.read_blocks(request_id, block_ids).cpu()


class TcpKVClient(KVTransferClient):
    """Pulls KV blocks over TCP, keeping idle connections per server for reuse."""

    transport = "tcp"

    def __init__(self, *args: Any, max_idle_per_server: int = 4, **kwargs: Any) -> None:
        """:class:`KVTransferClient`'s arguments; ``max_idle_per_server``: idle connections
        kept for reuse per server."""
        super().__init__(*args, **kwargs)
        self.connections: ConnectionPool[socket.socket] = ConnectionPool(
            _connect, socket.socket.close, max_idle_per_server=max_idle_per_server
        )

    async def _pull_into(self, pull: PullRequest) -> tuple[int, str]:
        host, port, _ = framing.parse_address(pull.address, "tcp")
        frame = framing.encode_pull(pull, self.token)
        sock, payload_len, message = await self._request((host, port), frame, pull.timeout)
        try:
            num = pull.announced_blocks(payload_len)
            self._mark_transferring(pull.request_id)
            await self._receive(sock, pull.out[:num])
        except BaseException:
            sock.close()
            raise
        self.connections.release((host, port), sock)
        return num, message

    async def _request(
        self, key: tuple[str, int], frame: bytes, timeout: float
    ) -> tuple[socket.socket, int, str]:
        """Send ``frame`` on a pooled connection, read an OK reply: (connection, payload
        length, message)."""

        async def exchange(sock: socket.socket) -> tuple[int, str, int]:
            loop = asyncio.get_running_loop()
            try:
                await loop.sock_sendall(sock, frame)
                return await framing.read_reply(loop, sock)
            except OSError as exc:  # a pooled socket the server closed meanwhile
                raise ConnectionResetError(str(exc)) from exc

        return await self.connections.request(key, exchange, timeout)

    async def _receive(self, sock: socket.socket, out: torch.Tensor) -> None:
        loop = asyncio.get_running_loop()
        host = out
        if out.device.type != "cpu":
            host = torch.empty(out.shape, dtype=out.dtype, pin_memory=torch.cuda.is_available())
        await framing.recv_into(loop, sock, tensor_bytes(host))
        if host is not out:
            out.copy_(host)

    async def close(self) -> None:
        self.connections.close_all()
        self.shutdown_threads()


async def _connect(key: tuple[str, int], timeout: float) -> socket.socket:
    family = socket.AF_INET6 if ":" in key[0] else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        framing.tune_socket(sock)
        await asyncio.get_running_loop().sock_connect(sock, key)
    except BaseException:
        sock.close()
        raise
    return sock
