"""Wire format of KV transfer control messages, and async helpers for raw sockets.

A request (client -> server) is a fixed header, then the token, the request id and the block
ids (little-endian int64)::

    magic "PDKV" | version u8 | op u8 | token_len u16 | id_len u16 | num_blocks u32 |
    bytes_per_block u64 | token | request id | block ids

A reply (server -> client) is a fixed header and a UTF-8 message (the error, or op-specific
JSON), followed for the tcp transport by ``payload_len`` raw bytes::

    magic "PDKV" | version u8 | status u8 | msg_len u16 | payload_len u64 | message

Anything malformed raises :class:`ProtocolError`; a server answers it with a ``protocol``
error reply and closes that connection (other connections are unaffected). A server reads the
token before the rest of a request and checks it first, so a peer without it cannot make the
server allocate a request body.

Connection limits (:class:`SocketListener`, every listening transport: tcp, shm, torch's control
and rendezvous connections, ucx's rendezvous socket). A connection is *unauthenticated* from
accept until its first token checks out, then *authenticated*:

- unauthenticated: at most ``MAX_PREAUTH_PER_PEER`` at once from one peer address and
  ``MAX_PREAUTH_CONNECTIONS`` from all peers together; a new connection beyond either budget
  closes the oldest unauthenticated one of that budget (a real client presents its token within
  a round trip of connecting, so it is never the oldest for long, and a flood from one address
  can only push out its own connections); each is closed ``PREAUTH_SECONDS`` after accept if no
  valid token came;
- authenticated (what real clients pool): at most ``MAX_CONNECTIONS``, one more is closed when
  it authenticates; each is closed when it sends no complete request for ``IDLE_SECONDS``.

A peer without the token therefore holds no authenticated slot, and at most
``MAX_PREAUTH_PER_PEER`` connections for at most ``PREAUTH_SECONDS`` each.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtransfer.base import PullRequest, TransferError

logger = logging.getLogger(__name__)

MAGIC = b"PDKV"
VERSION = 1
OP_PULL = 1
OP_CONNECT = 2  # torch transport: set up the pair's process group
OP_DONE = 3  # shm transport: the client has copied the blocks; the server may let them go
OP_PULL_READY = 4  # a streamed pull: the leading blocks computed so far (see KVTransferServer)
OP_STORE = 5  # torch transport: one operation on a pair's rendezvous store (kvtransfer.pair_store)
OPS = (OP_PULL, OP_CONNECT, OP_DONE, OP_PULL_READY, OP_STORE)
REQUEST_HEADER = struct.Struct("!4sBBHHIQ")
REPLY_HEADER = struct.Struct("!4sBBHQ")
MAX_TOKEN_LEN = 4096
MAX_ID_LEN = 1024
MAX_BLOCKS = 1 << 20
MAX_MESSAGE_LEN = 65535  # the reply header's u16 (streamed replies carry checksums)
SOCKET_BUFFER_BYTES = 4 << 20
IDLE_SECONDS = 60.0  # a connection that sends no complete request for this long is closed
MAX_CONNECTIONS = 256  # authenticated connections one server holds at once
PREAUTH_SECONDS = 3.0  # a connection with no valid token this long after accept is closed
MAX_PREAUTH_CONNECTIONS = 128  # unauthenticated connections held at once, all peers together
MAX_PREAUTH_PER_PEER = 32  # unauthenticated connections held at once from one peer address

STATUS_OK = 0
STATUS_REASONS = {
    1: "refused",
    2: "unknown_request",
    3: "size_mismatch",
    4: "protocol",
    5: "internal",
}
REASON_STATUS = {reason: status for status, reason in STATUS_REASONS.items()}


class ProtocolError(TransferError):
    """A frame that does not follow this module's format (reason ``protocol``)."""

    def __init__(self, detail: str):
        super().__init__("protocol", detail)


@dataclass(frozen=True)
class Request:
    """One decoded request frame."""

    op: int
    token: str
    request_id: str
    block_ids: list[int]
    bytes_per_block: int


def encode_request(request: Request) -> bytes:
    token = request.token.encode()
    request_id = request.request_id.encode()
    ids = np.asarray(request.block_ids, dtype="<i8")
    header = REQUEST_HEADER.pack(
        MAGIC, VERSION, request.op, len(token), len(request_id), len(ids), request.bytes_per_block
    )
    return header + token + request_id + ids.tobytes()


def encode_pull(pull: PullRequest, token: str | None) -> bytes:
    """The request frame of a client's pull: ``OP_PULL_READY`` for a part of a streamed pull,
    else ``OP_PULL``; the block size lets the server refuse a layout that differs from its own.
    Every transport's client sends exactly this (ucx in two messages, see request_head_len)."""
    op = OP_PULL_READY if pull.streamed else OP_PULL
    return encode_request(
        Request(op, token or "", pull.request_id, pull.block_ids, pull.bytes_per_block)
    )


def encode_reply(status: int, message: str = "", payload_len: int = 0) -> bytes:
    body = message.encode()[:MAX_MESSAGE_LEN]
    return REPLY_HEADER.pack(MAGIC, VERSION, status, len(body), payload_len) + body


def error_reply(reason: str, message: str) -> bytes:
    return encode_reply(REASON_STATUS[reason], message)


async def recv_into(loop: asyncio.AbstractEventLoop, sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``; ConnectionError if the peer closes first."""
    while view.nbytes:
        num = await loop.sock_recv_into(sock, view)
        if num == 0:
            raise ConnectionResetError("peer closed the connection")
        view = view[num:]


async def recv_exactly(loop: asyncio.AbstractEventLoop, sock: socket.socket, size: int) -> bytes:
    buf = bytearray(size)
    await recv_into(loop, sock, memoryview(buf))
    return bytes(buf)


@dataclass(frozen=True)
class RequestHeader:
    """The fixed part of a request; ``body_len`` bytes follow it."""

    op: int
    token_len: int
    id_len: int
    num_blocks: int
    bytes_per_block: int

    @property
    def body_len(self) -> int:
        return self.token_len + self.id_len + 8 * self.num_blocks


def parse_request_header(header: bytes) -> RequestHeader:
    """Validate the fixed header (ProtocolError if malformed or oversized)."""
    magic, version, op, token_len, id_len, num_blocks, bytes_per_block = REQUEST_HEADER.unpack(
        header
    )
    if magic != MAGIC or version != VERSION or op not in OPS:
        raise ProtocolError(f"bad header magic={magic!r} version={version} op={op}")
    if token_len > MAX_TOKEN_LEN or id_len > MAX_ID_LEN or num_blocks > MAX_BLOCKS:
        raise ProtocolError(f"oversized frame: token {token_len}, id {id_len}, {num_blocks} ids")
    return RequestHeader(op, token_len, id_len, num_blocks, bytes_per_block)


def parse_request_body(header: RequestHeader, body: bytes) -> Request:
    """Decode token, request id and block ids (ProtocolError if malformed)."""
    if len(body) != header.body_len:
        raise ProtocolError(f"body has {len(body)} bytes, header says {header.body_len}")
    try:
        token = body[: header.token_len].decode()
        request_id = body[header.token_len : header.token_len + header.id_len].decode()
    except UnicodeDecodeError as exc:
        raise ProtocolError("token or request id is not UTF-8") from exc
    offset = header.token_len + header.id_len
    block_ids = np.frombuffer(body, dtype="<i8", offset=offset).tolist()
    if any(i < 0 for i in block_ids):
        raise ProtocolError("negative block id")
    return Request(header.op, token, request_id, block_ids, header.bytes_per_block)


def request_head_len(frame: bytes) -> int:
    """Bytes of a request frame's fixed header and token: what a server reads and checks
    before the rest (message transports send the two parts as two messages)."""
    return REQUEST_HEADER.size + REQUEST_HEADER.unpack_from(frame)[3]


def parse_request(frame: bytes) -> Request:
    """Decode a whole request frame held in memory (message transports)."""
    if len(frame) < REQUEST_HEADER.size:
        raise ProtocolError(f"frame of {len(frame)} bytes is shorter than a header")
    header = parse_request_header(frame[: REQUEST_HEADER.size])
    return parse_request_body(header, frame[REQUEST_HEADER.size :])


def parse_reply(frame: bytes) -> tuple[int, str, int]:
    """``(status, message, payload_len)`` of a whole reply frame held in memory."""
    if len(frame) < REPLY_HEADER.size:
        raise ProtocolError(f"reply of {len(frame)} bytes is shorter than a header")
    magic, version, status, msg_len, payload_len = REPLY_HEADER.unpack_from(frame)
    if magic != MAGIC or version != VERSION:
        raise ProtocolError(f"bad reply header magic={magic!r} version={version}")
    message = frame[REPLY_HEADER.size : REPLY_HEADER.size + msg_len].decode(errors="replace")
    return status, message, payload_len


async def read_request(
    loop: asyncio.AbstractEventLoop,
    sock: socket.socket,
    check_token: Callable[[str], None] | None = None,
    timeout: float | None = IDLE_SECONDS,
) -> Request:
    """Read and validate one request frame (ProtocolError if malformed); ``check_token`` sees
    the token before the rest is read. TimeoutError when no whole frame comes in ``timeout``."""
    return await asyncio.wait_for(_read_request(loop, sock, check_token), timeout)


async def _read_request(
    loop: asyncio.AbstractEventLoop,
    sock: socket.socket,
    check_token: Callable[[str], None] | None,
) -> Request:
    header = parse_request_header(await recv_exactly(loop, sock, REQUEST_HEADER.size))
    token = await recv_exactly(loop, sock, header.token_len)
    if check_token is not None:
        check_token(token.decode(errors="replace"))
    rest = await recv_exactly(loop, sock, header.body_len - header.token_len)
    return parse_request_body(header, token + rest)


async def read_reply(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> tuple[int, str, int]:
    """``(status, message, payload_len)`` of one reply frame."""
    header = await recv_exactly(loop, sock, REPLY_HEADER.size)
    parse_reply(header)  # validates magic and version before trusting msg_len
    msg_len = REPLY_HEADER.unpack(header)[3]
    return parse_reply(header + await recv_exactly(loop, sock, msg_len))


def tune_socket(sock: socket.socket) -> None:
    """Non-blocking, no Nagle delay on small frames, large buffers for the payload."""
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)


def format_address(scheme: str, host: str, port: int) -> str:
    """``scheme://host:port``, an IPv6 host in brackets (what :func:`parse_address` reads)."""
    shown = f"[{host}]" if ":" in host else host
    return f"{scheme}://{shown}:{port}"


def parse_address(address: str, scheme: str) -> tuple[str, int, dict[str, str]]:
    """``scheme://host:port?key=value`` -> (host, port, query)."""
    prefix = f"{scheme}://"
    if not address.startswith(prefix):
        raise ValueError(f"not a {scheme} address: {address!r}")
    rest, _, query = address[len(prefix) :].partition("?")
    host, _, port = rest.rpartition(":")
    params = dict(item.partition("=")[::2] for item in query.split("&") if item)
    return host.strip("[]"), int(port), params


@dataclass
class _Unauthenticated:
    """A connection still in the pre-auth budget: its peer and its deadline."""

    peer: str
    deadline: asyncio.TimerHandle


class SocketListener:
    """Accepts TCP connections on an ephemeral port and runs ``handler`` on each, within the
    module docstring's connection limits; the handler calls :meth:`authenticated` once the
    connection's token checked out.

    Lifecycle: ``start(host)`` -> serving (one task per connection) -> ``stop()`` closes the
    listening socket and cancels the connection tasks (which close their sockets).
    """

    def __init__(
        self,
        handler: Callable[[socket.socket], Awaitable[None]],
        max_connections: int = MAX_CONNECTIONS,
    ):
        self._handler = handler
        self.max_connections = max_connections
        self.max_preauth = MAX_PREAUTH_CONNECTIONS
        self.max_preauth_per_peer = MAX_PREAUTH_PER_PEER
        self.preauth_seconds = PREAUTH_SECONDS
        self._sock: socket.socket | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._conns: dict[socket.socket, asyncio.Task[None]] = {}
        self._preauth: dict[socket.socket, _Unauthenticated] = {}  # oldest first
        self._authenticated: set[socket.socket] = set()
        self.num_refused = 0  # closed for a budget: pushed out unauthenticated, or over the cap
        self.num_expired = 0  # closed unauthenticated at the pre-auth deadline

    @property
    def num_connections(self) -> int:
        """Connections held: unauthenticated and authenticated."""
        return len(self._conns)

    @property
    def num_preauth(self) -> int:
        return len(self._preauth)

    @property
    def num_authenticated(self) -> int:
        return len(self._authenticated)

    def start(self, host: str) -> int:
        """Listen on ``host`` (port 0: the kernel picks) and return the port."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.create_server((host, 0), family=family, backlog=128)
        self._sock.setblocking(False)
        self._spawn(self._accept_loop(self._sock))
        return int(self._sock.getsockname()[1])

    async def stop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        # Shutting the sockets down, not only cancelling: before Python 3.12, wait_for drops a
        # cancel that lands as its read completes, and the handler would serve on (and stop()
        # wait). Shutdown wakes every pending read with EOF; each handler then closes its own.
        for conn in list(self._conns):
            _shutdown(conn)
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def authenticated(self, conn: socket.socket) -> None:
        """``conn`` presented a valid token: it leaves the pre-auth budget for the
        authenticated one (idempotent). ConnectionResetError when that one is full: the
        handler ends and the connection is closed."""
        pending = self._preauth.pop(conn, None)
        if pending is None:
            return
        pending.deadline.cancel()
        if len(self._authenticated) >= self.max_connections:
            self.num_refused += 1
            raise ConnectionResetError(f"{self.max_connections} authenticated connections held")
        self._authenticated.add(conn)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _accept_loop(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, address = await loop.sock_accept(sock)
            except OSError:  # listening socket closed by stop()
                return
            peer = str(address[0])
            self._make_room(peer)
            # Counted at accept: a burst accepted before any handler runs must see the budgets.
            deadline = loop.call_later(self.preauth_seconds, self._expire, conn)
            self._preauth[conn] = _Unauthenticated(peer, deadline)
            tune_socket(conn)
            task = self._spawn(self._serve(conn))
            self._conns[conn] = task
            task.add_done_callback(lambda _, conn=conn: self._forget(conn))  # type: ignore[misc]
            # Let the new handler read a token already sent before the next accept can push
            # its connection out of a budget.
            await asyncio.sleep(0)

    def _make_room(self, peer: str) -> None:
        """Close the oldest unauthenticated connection of a budget a new one from ``peer``
        would exceed: that peer's own first, else all peers'."""
        own = [conn for conn, pending in self._preauth.items() if pending.peer == peer]
        if own and len(own) >= self.max_preauth_per_peer:
            self.num_refused += 1
            self._close_unauthenticated(own[0])
        elif self._preauth and len(self._preauth) >= self.max_preauth:
            self.num_refused += 1
            self._close_unauthenticated(next(iter(self._preauth)))

    def _expire(self, conn: socket.socket) -> None:
        if conn in self._preauth:
            self.num_expired += 1
            self._close_unauthenticated(conn)

    def _close_unauthenticated(self, conn: socket.socket) -> None:
        self._preauth.pop(conn).deadline.cancel()
        _shutdown(conn)  # wakes a pending read; the cancel also covers a task not yet started
        self._conns[conn].cancel()

    async def _serve(self, conn: socket.socket) -> None:
        try:
            await self._handler(conn)
        except (ConnectionError, OSError):
            pass  # the peer went away; nothing to answer
        except asyncio.TimeoutError:
            pass  # idle too long: closed
        except Exception:
            logger.exception("KV transfer connection handler failed")

    def _forget(self, conn: socket.socket) -> None:
        """The connection's task ended (or was cancelled before it started): release its
        place in whichever budget holds it, and close it."""
        pending = self._preauth.pop(conn, None)
        if pending is not None:
            pending.deadline.cancel()
        self._authenticated.discard(conn)
        self._conns.pop(conn, None)
        conn.close()


def _shutdown(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already disconnected
