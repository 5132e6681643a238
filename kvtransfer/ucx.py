"""The ``ucx`` transport: UCX tag messages through ``ucxx`` (``pip install 'pdserve[ucx]'``).

UCX picks the path between the two processes: cuda_ipc or RDMA for GPU memory, tcp for host
memory; payloads are sent from and received into the tensors themselves (zero copy in Python;
CUDA tensors go as ``__cuda_array_interface__``). Works on CPU-only machines with the
``ucxx-cu12`` wheel (no CUDA driver needed), but there it is the slowest transport: with
endpoint error handling on (needed to notice a dead peer) UCX 1.21 selects only ``tcp/lo``
between two local processes, with "rendezvous fragmented copy-in copy-out" for large
messages (``UCX_PROTO_INFO=y``); ``UCX_RNDV_SCHEME=put_zcopy`` roughly doubles its loopback
throughput. Prefer ``tcp`` for host-memory KV caches (see ``default_transport``).

Address: ``ucx://HOST:PORT``, where PORT is a TCP rendezvous socket bound to the worker's own
HOST (ucxx 0.52's listener takes no address and would bind every interface, so none is used).
A client connects there and sends a hello: the cluster token (checked before anything else is
read or any UCX endpoint exists), its UCX worker address and a fresh random tag pair; the server
answers with its own worker address and both sides open an endpoint to the other's worker. The
TCP socket then closes; each connection's messages carry its own tags (``force_tag``), so
endpoints sharing a UCX worker never see each other's frames. On a connection, messages are
framed with :mod:`kvtransfer.framing`, each control frame sent as a u64 length then the bytes;
a request goes as two frames, its header and token first, so the server checks the token
before it takes the rest. Connection limits are the rendezvous socket's, which lives as long as
its connection (:mod:`kvtransfer.framing`): until the hello's token checks out it is in the
small pre-auth budget (per peer address, ``PREAUTH_SECONDS``; no UCX endpoint exists yet), then
one of at most ``MAX_CONNECTIONS``, each closed when idle for ``IDLE_SECONDS``:

    client: request head + rest  ──▶  server: reply frame (OK + byte count, or the error)
                                server: payload (one tag message, the contiguous tensor)
    client: receives the payload straight into its preallocated output tensor

Errors: refused / protocol close the endpoint; unknown request / size mismatch keep it. The
client pools idle endpoints per server, aborts any endpoint involved in a failure or timeout,
and retries once on a fresh endpoint when a pooled one turns out to be dead. Injected faults
(``faults=``, testing only): ``drop`` closes the endpoint after the OK reply, ``corrupt`` sends
a copy of the payload with one byte flipped.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import secrets
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvtransfer import framing
from kvtransfer.base import KVTransferClient, KVTransferServer, PullRequest, TransferError
from kvtransfer.connection_pool import ConnectionPool
from kvtransfer.streaming import ready_pull

logger = logging.getLogger(__name__)

_ucxx: Any = None
_UCXError: type[Exception] = RuntimeError
_IMPORT_ERROR: str | None = None
try:
    _ucxx = importlib.import_module("ucxx")
    _UCXError = importlib.import_module("ucxx.exceptions").UCXError
except ImportError as exc:  # also raised by ucxx itself when its native libraries are missing
    _IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

MAX_HEAD_BYTES = framing.REQUEST_HEADER.size + framing.MAX_TOKEN_LEN
MAX_FRAME_BYTES = framing.MAX_ID_LEN + 8 * framing.MAX_BLOCKS
ABORT_PERIOD_NS = 10**9  # at most 1 s to tear down a broken endpoint
# The rendezvous hello: magic, version, token length, UCX worker address length; then the
# token, the address and the connection's two tags (client -> server, server -> client).
HELLO = struct.Struct("<4sBHI")
HELLO_MAGIC, HELLO_VERSION = b"PDUX", 1
TAGS = struct.Struct("<QQ")
MAX_WORKER_ADDRESS = 1 << 16
HANDSHAKE_SECONDS = 5.0
LOST_GRACE_SECONDS = 0.25


def ucx_import_error() -> str | None:
    """Why ``ucxx`` cannot be used here, or None when it can."""
    return _IMPORT_ERROR


def _require_ucxx(options: dict[str, str] | None) -> Any:
    """The ucxx module, initialized with ``options`` (UCX_* names without the prefix)."""
    if _ucxx is None:
        raise ImportError(
            f"the ucx KV transport needs ucxx: pip install 'pdserve[ucx]' ({_IMPORT_ERROR})"
        )
    if options:
        try:
            _ucxx.init(options=options)
        except RuntimeError:  # already initialized in this process: first options win
            logger.warning("UCX already initialized; ignoring options %s", options)
    return _ucxx


def _payload(tensor: torch.Tensor) -> Any:
    """What ucxx sends from / receives into: a uint8 numpy view, or the CUDA tensor itself."""
    flat = tensor.reshape(-1).view(torch.uint8)
    return flat if flat.is_cuda else flat.numpy()


async def _send_frame(ep: Any, frame: bytes) -> None:
    await ep.send(np.array([len(frame)], dtype="<u8"))
    await ep.send(np.frombuffer(frame, dtype=np.uint8))


async def _recv_frame(ep: Any, limit: int = MAX_FRAME_BYTES) -> bytes:
    size = np.empty(1, dtype="<u8")
    await ep.recv(size)
    if int(size[0]) > limit:
        raise framing.ProtocolError(f"frame of {int(size[0])} bytes is too large")
    body = bytearray(int(size[0]))
    if body:
        await ep.recv(body)
    return bytes(body)


def _abort(ep: Any) -> None:
    try:
        ep.abort(period=ABORT_PERIOD_NS)
    except Exception:  # already closed by the peer
        pass


@dataclass(eq=False)  # hashed by identity: the server keeps a set of them
class TaggedEndpoint:
    """One connection: a UCX endpoint to the peer's worker, this connection's tags, and the
    rendezvous socket, held open while the connection lives. An endpoint made from a worker
    address never learns that the peer dropped this one connection, so every send and receive
    also fails at once when the peer closes that socket."""

    ep: Any
    send_tag: int
    recv_tag: int
    sock: socket.socket

    def __post_init__(self) -> None:
        self.lost = asyncio.Event()
        self._watch = asyncio.get_running_loop().create_task(self._watch_peer())

    async def send(self, buffer: Any) -> None:
        await self._unless_lost(self.ep.send(buffer, tag=self.send_tag, force_tag=True))

    async def recv(self, buffer: Any) -> None:
        await self._unless_lost(self.ep.recv(buffer, tag=self.recv_tag, force_tag=True))

    @property
    def closed(self) -> bool:
        return bool(self.ep.closed) or self.lost.is_set()

    def abort(self, period: int = ABORT_PERIOD_NS) -> None:
        self._watch.cancel()
        self.sock.close()
        self.ep.abort(period=period)

    async def _watch_peer(self) -> None:
        try:  # the peer never writes here: any return is its close
            await asyncio.get_running_loop().sock_recv(self.sock, 1)
        except OSError:
            pass
        finally:
            self.lost.set()

    async def _unless_lost(self, operation: Any) -> None:
        work = asyncio.ensure_future(operation)
        try:
            await self._until_done_or_lost(work)
        except BaseException:  # lost, or cancelled: the operation is given up
            _give_up(work)
            raise
        work.result()

    async def _until_done_or_lost(self, work: asyncio.Future[Any]) -> None:
        """Return when ``work`` is done; ConnectionResetError when the peer closed first."""
        lost = asyncio.ensure_future(self.lost.wait())
        try:
            await asyncio.wait({work, lost}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            lost.cancel()
        if not work.done():
            # The close can overtake the peer's last UCX message, which takes another path:
            # what it sent before closing gets a moment to arrive.
            await asyncio.wait({work}, timeout=LOST_GRACE_SECONDS)
        if not work.done():
            raise ConnectionResetError("the peer closed the connection")


def _give_up(work: asyncio.Future[Any]) -> None:
    """Cancel ``work`` and take its outcome whenever it comes: an operation already failed, or
    one that fails when its endpoint is aborted (UCXXCanceledError), is otherwise logged as
    "Task exception was never retrieved"."""
    work.cancel()
    work.add_done_callback(_take_outcome)


def _take_outcome(work: asyncio.Future[Any]) -> None:
    if not work.cancelled():
        work.exception()


def _hello(token: str, address: bytes, tags: tuple[int, int]) -> bytes:
    raw = token.encode()
    head = HELLO.pack(HELLO_MAGIC, HELLO_VERSION, len(raw), len(address))
    return head + raw + address + TAGS.pack(*tags)


async def _open_endpoint(ucxx: Any, address: bytes) -> Any:
    """An endpoint to the UCX worker whose address is ``address``."""
    worker_address = ucxx.get_ucx_address_from_buffer(address)
    return await ucxx.create_endpoint_from_worker_address(worker_address)


class UcxKVServer(KVTransferServer):
    """Serves pinned KV blocks over UCX; see the module docstring for the protocol."""

    transport = "ucx"

    def __init__(
        self, *args: Any, ucx_options: dict[str, str] | None = None, **kwargs: Any
    ) -> None:
        """:class:`KVTransferServer`'s arguments; ``ucx_options``: UCX settings (UCX_* names
        without the prefix), for the process: the first endpoint that starts UCX sets them."""
        super().__init__(*args, **kwargs)
        self._ucxx = _require_ucxx(ucx_options)
        self._rendezvous = framing.SocketListener(self._handshake)
        self._endpoints: set[TaggedEndpoint] = set()

    async def start(self, host: str = "127.0.0.1", advertise_host: str | None = None) -> str:
        port = self._rendezvous.start(host)  # bound to this worker's host only
        return framing.format_address("ucx", advertise_host or host, port)

    async def stop(self) -> None:
        for ep in list(self._endpoints):
            _abort(ep)
        await self._rendezvous.stop()  # ends every connection's handler
        self.shutdown_threads()

    async def _handshake(self, sock: socket.socket) -> None:
        """A connection's life on the rendezvous socket: the hello (token first), an endpoint
        per side, then requests until either side closes. The listener caps connections."""
        loop = asyncio.get_running_loop()
        try:
            hello = await asyncio.wait_for(self._read_hello(loop, sock), HANDSHAKE_SECONDS)
        except framing.ProtocolError as exc:
            self._record_failure("protocol")
            await loop.sock_sendall(sock, framing.error_reply("protocol", str(exc)))
            return
        except TransferError as exc:  # refused: address and tags are never read
            await loop.sock_sendall(sock, framing.error_reply(exc.reason, exc.detail))
            return
        address, send_tag, recv_tag = hello
        ep = TaggedEndpoint(await _open_endpoint(self._ucxx, address), send_tag, recv_tag, sock)
        own = bytes(self._ucxx.get_worker_address())
        await loop.sock_sendall(sock, framing.encode_reply(framing.STATUS_OK, "", len(own)) + own)
        await self._serve_endpoint(ep)

    async def _read_hello(
        self, loop: asyncio.AbstractEventLoop, sock: socket.socket
    ) -> tuple[bytes, int, int]:
        """(client's worker address, server->client tag, client->server tag) of a hello."""
        magic, version, token_len, address_len = HELLO.unpack(
            await framing.recv_exactly(loop, sock, HELLO.size)
        )
        if magic != HELLO_MAGIC or version != HELLO_VERSION:
            raise framing.ProtocolError(f"bad hello magic={magic!r} version={version}")
        if token_len > framing.MAX_TOKEN_LEN or address_len > MAX_WORKER_ADDRESS:
            raise framing.ProtocolError("hello too large")
        token = await framing.recv_exactly(loop, sock, token_len)
        self.check_token(token.decode(errors="replace"))
        self._rendezvous.authenticated(sock)  # out of the pre-auth budget (see framing)
        address = await framing.recv_exactly(loop, sock, address_len)
        to_server, to_client = TAGS.unpack(await framing.recv_exactly(loop, sock, TAGS.size))
        return address, to_client, to_server

    async def _serve_endpoint(self, ep: TaggedEndpoint) -> None:
        self._endpoints.add(ep)
        try:
            while await self._serve_one(ep):
                pass
        except (_UCXError, ConnectionError, asyncio.TimeoutError):
            pass  # the client went away, or sent nothing for too long
        except Exception:
            logger.exception("UCX KV transfer handler failed")
        finally:
            self._endpoints.discard(ep)
            _abort(ep)

    async def _serve_one(self, ep: Any) -> bool:
        """Answer one request; False when the endpoint must be closed."""
        start = time.perf_counter()
        try:
            request = await asyncio.wait_for(self._read_request(ep), framing.IDLE_SECONDS)
            if request.op not in (framing.OP_PULL, framing.OP_PULL_READY):
                raise TransferError("protocol", f"op {request.op} is not served by ucx")
            request, message = await ready_pull(self, request)
            args = (request.request_id, request.block_ids, request.bytes_per_block)
            with self.holding(*args):  # a copy is sent, but expiry waits for it all the same
                await self.pause_mid_transfer()
                blocks = await self.run_blocking(self.read_blocks, *args[:2])
        except framing.ProtocolError as exc:
            self._record_failure("protocol")
            await self._within(_send_frame(ep, framing.error_reply("protocol", str(exc))))
            return False
        except TransferError as exc:
            await self._within(_send_frame(ep, framing.error_reply(exc.reason, exc.detail)))
            return exc.reason not in ("refused", "protocol")
        fault = self.draw_fault()
        if fault == "corrupt":
            assert self.faults is not None
            blocks = self.faults.corrupted(blocks)
        num_bytes = blocks.numel() * blocks.element_size()
        await self._within(
            _send_frame(ep, framing.encode_reply(framing.STATUS_OK, message, num_bytes))
        )
        if fault == "drop":  # the endpoint is closed with no payload: the client fails at once
            return False
        if num_bytes:  # a streamed part may have nothing ready yet
            await self._within(ep.send(_payload(blocks)))
        self.record_sent(num_bytes, time.perf_counter() - start)
        return True

    async def _within(self, send: Any) -> None:
        """A send within ``send_timeout``: a peer that takes nothing for that long is cut off
        (TimeoutError: the endpoint is aborted)."""
        await asyncio.wait_for(send, self.send_timeout)

    async def _read_request(self, ep: Any) -> framing.Request:
        """Header and token, checked, then the rest (refused: the rest is never taken)."""
        head = await _recv_frame(ep, MAX_HEAD_BYTES)
        if len(head) < framing.REQUEST_HEADER.size:
            raise framing.ProtocolError(f"request head of {len(head)} bytes")
        header = framing.parse_request_header(head[: framing.REQUEST_HEADER.size])
        token = head[framing.REQUEST_HEADER.size :]
        if len(token) != header.token_len:
            raise framing.ProtocolError("request head does not match its header")
        self.check_token(token.decode(errors="replace"))
        return framing.parse_request_body(header, token + await _recv_frame(ep))


class UcxKVClient(KVTransferClient):
    """Pulls KV blocks over UCX, keeping idle endpoints per server for reuse."""

    transport = "ucx"

    def __init__(
        self,
        *args: Any,
        ucx_options: dict[str, str] | None = None,
        max_idle_per_server: int = 4,
        **kwargs: Any,
    ) -> None:
        """:class:`KVTransferClient`'s arguments; ``ucx_options`` as for the server;
        ``max_idle_per_server``: idle endpoints kept for reuse per server."""
        super().__init__(*args, **kwargs)
        self._ucxx = _require_ucxx(ucx_options)
        self.connections: ConnectionPool[Any] = ConnectionPool(
            self._connect, _abort, lambda ep: not ep.closed, max_idle_per_server
        )

    async def _pull_into(self, pull: PullRequest) -> tuple[int, str]:
        host, port, _ = framing.parse_address(pull.address, "ucx")
        frame = framing.encode_pull(pull, self.token)
        head = framing.request_head_len(frame)

        async def exchange(ep: Any) -> tuple[int, str, int]:
            # A server that refuses the token answers after the head and never takes the rest:
            # its answer counts, not the unfinished send.
            try:
                await _send_frame(ep, frame[:head])
                rest = asyncio.ensure_future(_send_frame(ep, frame[head:]))
                try:
                    reply = framing.parse_reply(await _recv_frame(ep))
                except BaseException:
                    _give_up(rest)
                    raise
                if reply[0] == framing.STATUS_OK:
                    await rest
                else:
                    rest.cancel()
                    await asyncio.gather(rest, return_exceptions=True)
                return reply
            except _UCXError as exc:
                raise ConnectionResetError(f"UCX request failed: {exc}") from exc

        key = (host, port)
        ep, payload_len, message = await self.connections.request(key, exchange, pull.timeout)
        try:
            num = pull.announced_blocks(payload_len)
            self._mark_transferring(pull.request_id)
            if num:
                await ep.recv(_payload(pull.out[:num]))
        except _UCXError as exc:
            _abort(ep)
            raise ConnectionResetError(f"UCX receive failed: {exc}") from exc
        except BaseException:
            _abort(ep)
            raise
        self.connections.release(key, ep)
        return num, message

    async def _connect(self, key: tuple[str, int], timeout: float) -> TaggedEndpoint:
        """Hello on the server's rendezvous socket, then an endpoint to its worker."""
        return await asyncio.wait_for(self._handshake(key), timeout)

    async def _handshake(self, key: tuple[str, int]) -> TaggedEndpoint:
        loop = asyncio.get_running_loop()
        to_server, to_client = secrets.randbits(64), secrets.randbits(64)
        own = bytes(self._ucxx.get_worker_address())
        family = socket.AF_INET6 if ":" in key[0] else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            await loop.sock_connect(sock, key)
            await loop.sock_sendall(sock, _hello(self.token or "", own, (to_server, to_client)))
            status, message, address_len = await framing.read_reply(loop, sock)
            if status != framing.STATUS_OK:
                raise TransferError(framing.STATUS_REASONS.get(status, "protocol"), message)
            if address_len > MAX_WORKER_ADDRESS:
                raise TransferError("protocol", f"worker address of {address_len} bytes")
            address = await framing.recv_exactly(loop, sock, address_len)
            try:
                ep = await _open_endpoint(self._ucxx, address)
            except _UCXError as exc:
                raise ConnectionRefusedError(f"UCX connect to {key} failed: {exc}") from exc
        except BaseException:
            sock.close()
            raise
        return TaggedEndpoint(ep, to_server, to_client, sock)

    async def close(self) -> None:
        self.connections.close_all()
        self.shutdown_threads()
