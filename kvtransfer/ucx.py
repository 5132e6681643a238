"""The ``ucx`` transport: UCX tag messages through ``ucxx`` (``pip install 'pdserve[ucx]'``).

UCX picks the path between the two processes: cuda_ipc or RDMA for GPU memory, tcp for host
memory; payloads are sent from and received into the tensors themselves (zero copy in Python;
CUDA tensors go as ``__cuda_array_interface__``). Works on CPU-only machines with the
``ucxx-cu12`` wheel (no CUDA driver needed), but there it is the slowest transport: with
endpoint error handling on (needed to notice a dead peer) UCX 1.21 selects only ``tcp/lo``
between two local processes, with "rendezvous fragmented copy-in copy-out" for large
messages (``UCX_PROTO_INFO=y``); ``UCX_RNDV_SCHEME=put_zcopy`` roughly doubles its loopback
throughput. Prefer ``tcp`` for host-memory KV caches (see ``default_transport``).

Address: ``ucx://HOST:PORT``. The listener binds every interface on PORT: ucxx 0.52's Python
API takes no address for it (the C++ builder gained one in rapidsai/ucxx#703, not yet exposed),
so the cluster token is what keeps strangers out; see docs/reliability.md. Per connection (a
UCX endpoint), messages are framed with :mod:`kvtransfer.framing`, each control frame sent as
a u64 length then the bytes; a request goes as two frames, its header and token first, so the
server checks the token before it takes the rest (at most ``MAX_CONNECTIONS`` endpoints, each
closed when idle for ``IDLE_SECONDS``):

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
import time
from typing import Any

import numpy as np
import torch

from kvtransfer import framing
from kvtransfer.base import (
    BlockSource,
    KVLayout,
    KVTransferClient,
    KVTransferServer,
    TransferError,
    bytes_per_row,
)
from kvtransfer.connection_pool import ConnectionPool
from kvtransfer.faults import KVFaults
from kvtransfer.metrics import TransferMetrics
from kvtransfer.streaming import ready_pull
from kvtransfer.tcp import expect_reply_size

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


class UcxKVServer(KVTransferServer):
    """Serves pinned KV blocks over UCX; see the module docstring for the protocol."""

    transport = "ucx"

    def __init__(
        self,
        source: BlockSource,
        layout: KVLayout,
        token: str | None = None,
        metrics: TransferMetrics | None = None,
        ucx_options: dict[str, str] | None = None,
        faults: KVFaults | None = None,
    ):
        super().__init__(source, layout, token, metrics, faults)
        self._ucxx = _require_ucxx(ucx_options)
        self._listener: Any = None
        self._endpoints: set[Any] = set()

    async def start(self, host: str = "127.0.0.1", advertise_host: str | None = None) -> str:
        self._listener = self._ucxx.create_listener(self._serve_endpoint, 0)
        public = advertise_host or host
        shown = f"[{public}]" if ":" in public else public
        return f"ucx://{shown}:{self._listener.port}"

    async def stop(self) -> None:
        for ep in list(self._endpoints):
            _abort(ep)
        for _ in range(100):  # let the handlers see their endpoints close (<= ~1 s)
            if not self._endpoints:
                break
            await asyncio.sleep(0.01)
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    async def _serve_endpoint(self, ep: Any) -> None:
        if len(self._endpoints) >= framing.MAX_CONNECTIONS:
            _abort(ep)
            return
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
                blocks = await asyncio.to_thread(self.read_blocks, *args[:2])
        except framing.ProtocolError as exc:
            self._record_failure("protocol")
            await _send_frame(ep, framing.error_reply("protocol", str(exc)))
            return False
        except TransferError as exc:
            await _send_frame(ep, framing.error_reply(exc.reason, exc.detail))
            return exc.reason not in ("refused", "protocol")
        fault = self.draw_fault()
        if fault == "corrupt":
            assert self.faults is not None
            blocks = self.faults.corrupted(blocks)
        num_bytes = blocks.numel() * blocks.element_size()
        await _send_frame(ep, framing.encode_reply(framing.STATUS_OK, message, num_bytes))
        if fault == "drop":  # the endpoint is closed with no payload: the client fails at once
            return False
        if num_bytes:  # a streamed part may have nothing ready yet
            await ep.send(_payload(blocks))
        self.record_sent(num_bytes, time.perf_counter() - start)
        return True


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
        token: str | None = None,
        device: str = "cpu",
        metrics: TransferMetrics | None = None,
        ucx_options: dict[str, str] | None = None,
        max_idle_per_server: int = 4,
    ):
        super().__init__(token, device, metrics)
        self._ucxx = _require_ucxx(ucx_options)
        self.connections: ConnectionPool[Any] = ConnectionPool(
            self._connect, _abort, lambda ep: not ep.closed, max_idle_per_server
        )

    async def _pull_into(
        self,
        address: str,
        request_id: str,
        block_ids: list[int],
        out: torch.Tensor,
        timeout: float,
        streamed: bool = False,
    ) -> tuple[int, str]:
        host, port, _ = framing.parse_address(address, "ucx")
        op = framing.OP_PULL_READY if streamed else framing.OP_PULL
        frame = framing.encode_request(
            framing.Request(op, self.token or "", request_id, block_ids, bytes_per_row(out))
        )

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
                    rest.cancel()
                    raise
                if reply[0] == framing.STATUS_OK:
                    await rest
                else:
                    rest.cancel()
                    await asyncio.gather(rest, return_exceptions=True)
                return reply
            except _UCXError as exc:
                raise ConnectionResetError(f"UCX request failed: {exc}") from exc

        ep, payload_len, message = await self.connections.request((host, port), exchange, timeout)
        try:
            num = expect_reply_size(payload_len, out, streamed)
            self._mark_transferring(request_id)
            if num:
                await ep.recv(_payload(out[:num]))
        except _UCXError as exc:
            _abort(ep)
            raise ConnectionResetError(f"UCX receive failed: {exc}") from exc
        except BaseException:
            _abort(ep)
            raise
        self.connections.release((host, port), ep)
        return num, message

    async def _connect(self, key: tuple[str, int], timeout: float) -> Any:
        try:
            return await self._ucxx.create_endpoint(key[0], key[1], connect_timeout=timeout)
        except _UCXError as exc:
            raise ConnectionRefusedError(f"UCX connect to {key} failed: {exc}") from exc

    async def close(self) -> None:
        self.connections.close_all()
