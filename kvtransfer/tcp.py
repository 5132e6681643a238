"""The ``tcp`` transport: framed requests and raw payload bytes over plain sockets (asyncio).

No dependency beyond the standard library. Address: ``tcp://HOST:PORT``.

Server, per connection: read a request frame -> check token (refused: reply and close) ->
check size and pins (unknown request / size mismatch: reply, keep the connection) -> reply OK
with the total byte count -> send the bytes:

- zero copy, when the source lends its rows (:class:`~kvtransfer.base.BlockRowSource`, host
  memory): each row straight from the KV cache; the kernel's copy is the only one;
- otherwise gathered (``read_blocks``) in pieces of ``chunk_bytes``, each sent from a
  memoryview while the next is gathered in a thread.

A failure after the OK reply closes the connection, which the client sees as
``connection_lost``. A malformed frame gets a ``protocol`` reply and closes that connection only.
Injected faults (``faults=``, testing only): ``drop`` closes the connection after the OK reply,
``corrupt`` sends a copy of the payload with one byte flipped.

Client, per pull: take an idle connection to the address (or connect) -> send the request ->
read the reply -> receive exactly the announced bytes straight into the preallocated output
tensor (``sock_recv_into`` on its memoryview). The connection goes back to the pool only after
a complete pull; on any error or timeout it is closed, so a later pull never reads stale bytes.
"""

from __future__ import annotations

import asyncio
import socket
import time

import torch

from kvtransfer import framing
from kvtransfer.base import (
    BlockSource,
    KVLayout,
    KVTransferClient,
    KVTransferServer,
    TransferError,
    bytes_per_row,
    tensor_bytes,
)
from kvtransfer.faults import KVFaults
from kvtransfer.metrics import TransferMetrics

# Below this many bytes the gather runs on the event loop; above, in a worker thread.
INLINE_GATHER_BYTES = 1 << 20
# Large pulls are gathered and sent in pieces of this size, so gathering overlaps sending.
DEFAULT_CHUNK_BYTES = 8 << 20


class TcpKVServer(KVTransferServer):
    """Serves pinned KV blocks over TCP; see the module docstring for the protocol."""

    transport = "tcp"

    def __init__(
        self,
        source: BlockSource,
        layout: KVLayout,
        token: str | None = None,
        metrics: TransferMetrics | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        zero_copy: bool = True,
        faults: KVFaults | None = None,
    ):
        super().__init__(source, layout, token, metrics, faults)
        self.chunk_bytes = chunk_bytes
        self.zero_copy = zero_copy
        self._listener = framing.SocketListener(self._serve_connection)

    async def start(self, host: str = "127.0.0.1", advertise_host: str | None = None) -> str:
        port = self._listener.start(host)
        return f"tcp://{_format_host(advertise_host or host)}:{port}"

    async def stop(self) -> None:
        await self._listener.stop()

    async def _serve_connection(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                request = await framing.read_request(loop, conn)
            except framing.ProtocolError as exc:
                self._record_failure("protocol")
                await loop.sock_sendall(conn, framing.error_reply("protocol", str(exc)))
                return
            except (ConnectionError, EOFError):
                return
            if not await self._serve_request(loop, conn, request):
                return

    async def _serve_request(
        self, loop: asyncio.AbstractEventLoop, conn: socket.socket, request: framing.Request
    ) -> bool:
        """Answer one request; False when the connection must be closed."""
        start = time.perf_counter()
        chunks = self._chunks(request.block_ids)
        args = (request.request_id, request.block_ids, request.bytes_per_block)
        try:
            if request.op != framing.OP_PULL:
                self._record_failure("protocol")
                raise TransferError("protocol", f"op {request.op} is not served by tcp")
            self.check_token(request.token)
            rows = self.block_rows(*args) if self.zero_copy else None
            first = None if rows is not None else await self._gather(request, chunks[0])
        except TransferError as exc:
            await loop.sock_sendall(conn, framing.error_reply(exc.reason, exc.detail))
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
            await loop.sock_sendall(conn, framing.encode_reply(framing.STATUS_OK, "", num_bytes))
            if fault == "drop":  # close with no payload: the client fails now, not at its timeout
                return False
            if rows is not None:  # straight from the KV cache: the kernel's copy is the only one
                for row in rows:
                    await loop.sock_sendall(conn, tensor_bytes(row))
            else:
                assert first is not None
                await self._stream(loop, conn, request, first, chunks[1:])
        except (ConnectionError, OSError) as exc:
            self._record_failure("connection_lost")
            raise ConnectionResetError(f"client went away mid-transfer: {exc!r}") from exc
        except TransferError as exc:  # e.g. the lease ran out mid-way: counted by read_blocks
            raise ConnectionResetError(f"aborted mid-transfer: {exc}") from exc
        self.record_sent(num_bytes, time.perf_counter() - start)
        return True

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
        for ids in rest:
            gathering = asyncio.ensure_future(self._gather(request, ids))
            try:
                await loop.sock_sendall(conn, tensor_bytes(current))
            except BaseException:
                gathering.cancel()
                raise
            current = await gathering
        await loop.sock_sendall(conn, tensor_bytes(current))

    async def _gather(self, request: framing.Request, block_ids: list[int]) -> torch.Tensor:
        """Blocks of ``request`` in host memory (in a worker thread unless small)."""
        args = (request.request_id, block_ids, request.bytes_per_block)
        if len(block_ids) * self.layout.bytes_per_block <= INLINE_GATHER_BYTES:
            return self.read_blocks(*args).cpu()
        return await asyncio.to_thread(lambda: self.read_blocks(*args).cpu())


class TcpKVClient(KVTransferClient):
    """Pulls KV blocks over TCP, keeping idle connections per server for reuse."""

    transport = "tcp"

    def __init__(
        self,
        token: str | None = None,
        device: str = "cpu",
        metrics: TransferMetrics | None = None,
        max_idle_per_server: int = 4,
    ):
        super().__init__(token, device, metrics)
        self.max_idle_per_server = max_idle_per_server
        self._idle: dict[tuple[str, int], list[socket.socket]] = {}

    async def _pull_into(
        self,
        address: str,
        request_id: str,
        block_ids: list[int],
        out: torch.Tensor,
        timeout: float,
    ) -> None:
        host, port, _ = framing.parse_address(address, "tcp")
        frame = framing.encode_request(
            framing.Request(
                framing.OP_PULL,
                self.token or "",
                request_id,
                block_ids,
                bytes_per_row(out),
            )
        )
        sock, payload_len = await self._request((host, port), frame)
        try:
            expect_reply_size(payload_len, out)
            self._mark_transferring(request_id)
            await self._receive(sock, out)
        except BaseException:
            sock.close()
            raise
        self._release((host, port), sock)

    async def _request(self, key: tuple[str, int], frame: bytes) -> tuple[socket.socket, int]:
        """Send ``frame`` and read an OK reply header: (connection, payload length).

        A pooled connection the server has since closed is retried once on a fresh one.
        """
        loop = asyncio.get_running_loop()
        for attempt in range(2):
            sock, reused = await self._acquire(key)
            try:
                await loop.sock_sendall(sock, frame)
                status, message, payload_len = await framing.read_reply(loop, sock)
            except (ConnectionError, OSError):
                sock.close()
                if reused and attempt == 0:
                    continue
                raise
            except BaseException:
                sock.close()
                raise
            if status != framing.STATUS_OK:
                sock.close()
                raise TransferError(framing.STATUS_REASONS.get(status, "protocol"), message)
            return sock, payload_len
        raise AssertionError("unreachable")

    async def _receive(self, sock: socket.socket, out: torch.Tensor) -> None:
        loop = asyncio.get_running_loop()
        host = out
        if out.device.type != "cpu":
            host = torch.empty(out.shape, dtype=out.dtype, pin_memory=torch.cuda.is_available())
        await framing.recv_into(loop, sock, tensor_bytes(host))
        if host is not out:
            out.copy_(host)

    async def _acquire(self, key: tuple[str, int]) -> tuple[socket.socket, bool]:
        idle = self._idle.get(key)
        if idle:
            return idle.pop(), True
        family = socket.AF_INET6 if ":" in key[0] else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            framing.tune_socket(sock)
            await asyncio.get_running_loop().sock_connect(sock, key)
        except BaseException:
            sock.close()
            raise
        return sock, False

    def _release(self, key: tuple[str, int], sock: socket.socket) -> None:
        idle = self._idle.setdefault(key, [])
        if len(idle) < self.max_idle_per_server:
            idle.append(sock)
        else:
            sock.close()

    async def close(self) -> None:
        for idle in self._idle.values():
            for sock in idle:
                sock.close()
        self._idle.clear()


def expect_reply_size(payload_len: int, out: torch.Tensor) -> None:
    """Raise size_mismatch unless the server announced exactly ``out``'s byte count."""
    expected = out.numel() * out.element_size()
    if payload_len != expected:
        raise TransferError(
            "size_mismatch", f"server announced {payload_len} bytes, expected {expected}"
        )


def _format_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
