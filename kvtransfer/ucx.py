"""The ``ucx`` transport: UCX tag messages through ``ucxx`` (``pip install 'pdserve[ucx]'``).

UCX picks the path between the two processes: cuda_ipc or RDMA for GPU memory, tcp for host
memory; payloads are sent from and received into the tensors themselves (zero copy in Python;
CUDA tensors go as ``__cuda_array_interface__``). Works on CPU-only machines with the
``ucxx-cu12`` wheel (no CUDA driver needed), but there it is the slowest transport: with
endpoint error handling on (needed to notice a dead peer) UCX 1.21 selects only ``tcp/lo``
between two local processes, with "rendezvous fragmented copy-in copy-out" for large
messages (``UCX_PROTO_INFO=y``); ``UCX_RNDV_SCHEME=put_zcopy`` roughly doubles its loopback
throughput. Prefer ``tcp`` for host-memory KV caches (see ``default_transport``).

Address: ``ucx://HOST:PORT`` (the ucxx listener binds every interface on PORT; the cluster
token is what keeps strangers out). Per connection (a UCX endpoint), messages are framed with
:mod:`kvtransfer.framing`, each control frame sent as a u64 length then the bytes:

    client: request frame  ──▶  server: reply frame (OK + byte count, or the error)
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
from kvtransfer.faults import KVFaults
from kvtransfer.metrics import TransferMetrics
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

MAX_FRAME_BYTES = framing.REQUEST_HEADER.size + framing.MAX_TOKEN_LEN + framing.MAX_ID_LEN
MAX_FRAME_BYTES += 8 * framing.MAX_BLOCKS
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


async def _recv_frame(ep: Any) -> bytes:
    size = np.empty(1, dtype="<u8")
    await ep.recv(size)
    if int(size[0]) > MAX_FRAME_BYTES:
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
        self._endpoints.add(ep)
        try:
            while await self._serve_one(ep):
                pass
        except (_UCXError, ConnectionError):
            pass  # the client went away
        except Exception:
            logger.exception("UCX KV transfer handler failed")
        finally:
            self._endpoints.discard(ep)
            _abort(ep)

    async def _serve_one(self, ep: Any) -> bool:
        """Answer one request; False when the endpoint must be closed."""
        start = time.perf_counter()
        try:
            request = framing.parse_request(await _recv_frame(ep))
            self.check_token(request.token)
            if request.op != framing.OP_PULL:
                raise TransferError("protocol", f"op {request.op} is not served by ucx")
            args = (request.request_id, request.block_ids, request.bytes_per_block)
            blocks = await asyncio.to_thread(self.read_blocks, *args)
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
        await _send_frame(ep, framing.encode_reply(framing.STATUS_OK, "", num_bytes))
        if fault == "drop":  # the endpoint is closed with no payload: the client fails at once
            return False
        await ep.send(_payload(blocks))
        self.record_sent(num_bytes, time.perf_counter() - start)
        return True


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
        self.max_idle_per_server = max_idle_per_server
        self._idle: dict[tuple[str, int], list[Any]] = {}

    async def _pull_into(
        self,
        address: str,
        request_id: str,
        block_ids: list[int],
        out: torch.Tensor,
        timeout: float,
    ) -> None:
        host, port, _ = framing.parse_address(address, "ucx")
        frame = framing.encode_request(
            framing.Request(
                framing.OP_PULL, self.token or "", request_id, block_ids, bytes_per_row(out)
            )
        )
        ep, payload_len = await self._request((host, port), frame, timeout)
        try:
            expect_reply_size(payload_len, out)
            self._mark_transferring(request_id)
            await ep.recv(_payload(out))
        except _UCXError as exc:
            _abort(ep)
            raise ConnectionResetError(f"UCX receive failed: {exc}") from exc
        except BaseException:
            _abort(ep)
            raise
        self._release((host, port), ep)

    async def _request(self, key: tuple[str, int], frame: bytes, timeout: float) -> tuple[Any, int]:
        """Send ``frame``, read an OK reply: (endpoint, payload length); retry a dead pooled one."""
        for attempt in range(2):
            ep, reused = await self._acquire(key, timeout)
            try:
                await _send_frame(ep, frame)
                status, message, payload_len = framing.parse_reply(await _recv_frame(ep))
            except _UCXError as exc:
                _abort(ep)
                if reused and attempt == 0:
                    continue
                raise ConnectionResetError(f"UCX request failed: {exc}") from exc
            except BaseException:
                _abort(ep)
                raise
            if status != framing.STATUS_OK:
                _abort(ep)
                raise TransferError(framing.STATUS_REASONS.get(status, "protocol"), message)
            return ep, payload_len
        raise AssertionError("unreachable")

    async def _acquire(self, key: tuple[str, int], timeout: float) -> tuple[Any, bool]:
        idle = self._idle.get(key)
        while idle:
            ep = idle.pop()
            if not ep.closed:
                return ep, True
        try:
            ep = await self._ucxx.create_endpoint(key[0], key[1], connect_timeout=timeout)
        except _UCXError as exc:
            raise ConnectionRefusedError(f"UCX connect to {key} failed: {exc}") from exc
        return ep, False

    def _release(self, key: tuple[str, int], ep: Any) -> None:
        idle = self._idle.setdefault(key, [])
        if len(idle) < self.max_idle_per_server:
            idle.append(ep)
        else:
            _abort(ep)

    async def close(self) -> None:
        for idle in self._idle.values():
            for ep in idle:
                _abort(ep)
        self._idle.clear()
