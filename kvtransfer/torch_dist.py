"""The ``torch`` transport: ``torch.distributed`` send/recv in one 2-rank group per pair.

gloo moves CPU tensors, NCCL moves CUDA tensors; the code path is the same. No global
``init_process_group``: a worker talks to many peers, so each (prefill, decode) pair gets its
own group, cached on both sides for the life of the pair's control connection.

Address: ``torch://HOST:CONTROL_PORT``. The control channel uses the tcp transport's framing
(:mod:`kvtransfer.framing`) and listener (its pre-auth and connection limits):

1. CONNECT (once per pair): the client presents the token, its backend and its GPU's UUID (NCCL
   only); the server refuses a client on its own GPU, which NCCL cannot join (it allows one rank
   per GPU in a group), with the reason and the alternatives; else it replies with a fresh
   secret pair id; both build the group, server rank 0, client rank 1, on the
   pair's rendezvous store: an in-process store on the server that the client reaches only
   through OP_STORE requests on this same listener, with the token and the pair id
   (:mod:`kvtransfer.pair_store`; no torch ``TCPStore`` listens, so nothing unauthenticated
   does). gloo's own pair connection listens on the address the client reached the server at.
2. PULL (per transfer): request id + block ids -> the server validates and replies OK with the
   byte count -> server ``send`` / client ``recv`` of the contiguous tensor (as bytes) straight
   into the client's preallocated output.

Blocking collectives (group joins, send, recv) run with the pull's timeout in threads of the
endpoint's own ``collective`` pool, so the event loop never blocks, and a collective stalled on
its peer until that timeout delays neither the endpoint's gathers (its copy threads) nor
anything else in the process; after any failure or timeout both sides drop the pair (its group
may be mid-message), and the next pull builds a new one.

Injected faults (``faults=``, testing only): ``drop`` closes the control connection before the
reply (after an OK the client would sit in gloo's ``recv`` until its timeout), ``corrupt``
sends a copy of the payload with one byte flipped.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from kvtransfer import framing, pair_store
from kvtransfer.base import KVTransferClient, KVTransferServer, PullRequest, TransferError
from kvtransfer.streaming import ready_pull

TAG = 0  # one message at a time per pair, so a single tag suffices
# Threads of an endpoint's collective pool (started on demand): a pair runs one collective at a
# time, so with one per connection a listener admits, no pair waits for a thread behind another
# pair's stalled send or recv.
COLLECTIVE_THREADS = framing.MAX_CONNECTIONS
# A c10d backend object (ProcessGroupGloo / ProcessGroupNCCL); torch's stubs lack send/recv.
Group = Any


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def gpu_uuid(device: torch.device) -> str | None:
    """The UUID of ``device``'s GPU (the same in every process), None for the CPU."""
    if device.type != "cuda":
        return None
    return str(torch.cuda.get_device_properties(device).uuid)


def same_gpu_refusal(uuid: str) -> str:
    return (
        f"prefill and decode share one GPU ({uuid}), and NCCL joins one process per GPU: put "
        "them on different GPUs, or use another transport (--kv-transport tcp or ucx)"
    )


def make_pair_group(store: dist.Store, rank: int, backend: str, host: str, timeout: float) -> Group:
    """A 2-rank group for one pair on its own store (blocks until the peer joins or
    ``timeout``)."""
    prefixed = dist.PrefixStore("pdserve-kv", store)
    limit = datetime.timedelta(seconds=timeout)
    if backend == "nccl":
        nccl_options = dist.ProcessGroupNCCL.Options()
        nccl_options._timeout = limit
        return dist.ProcessGroupNCCL(prefixed, rank, 2, nccl_options)
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    options._timeout = limit
    return dist.ProcessGroupGloo(prefixed, rank, 2, options)


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view: gloo and NCCL then move any dtype, bfloat16 included."""
    return tensor.reshape(-1).view(torch.uint8)


def _send(group: Group, tensor: torch.Tensor, timeout: float) -> None:
    group.send([_as_bytes(tensor)], 1, TAG).wait(datetime.timedelta(seconds=timeout))
    if tensor.is_cuda:
        torch.cuda.current_stream(tensor.device).synchronize()


def _recv(group: Group, out: torch.Tensor, timeout: float) -> None:
    group.recv([_as_bytes(out)], 0, TAG).wait(datetime.timedelta(seconds=timeout))
    if out.is_cuda:
        torch.cuda.current_stream(out.device).synchronize()


class TorchKVServer(KVTransferServer):
    """Serves pinned KV blocks through torch.distributed; see the module docstring."""

    transport = "torch"

    def __init__(
        self, *args: Any, device: str = "cpu", group_timeout: float = 30.0, **kwargs: Any
    ) -> None:
        """:class:`KVTransferServer`'s arguments; ``device``: where the KV cache lives (CUDA:
        NCCL, else gloo); ``group_timeout``: the longest a pair's setup or a send may take."""
        super().__init__(*args, **kwargs)
        self.backend = backend_for(torch.device(device))
        self.gpu = gpu_uuid(torch.device(device))
        self.group_timeout = group_timeout
        self._listener = framing.SocketListener(self._serve_connection)
        self._stores: dict[str, dist.Store] = {}  # pair id -> its rendezvous store
        self._collectives = self.thread_pool(COLLECTIVE_THREADS, "collective")

    async def start(self, host: str = "127.0.0.1", advertise_host: str | None = None) -> str:
        port = self._listener.start(host)
        return framing.format_address("torch", advertise_host or host, port)

    async def stop(self) -> None:
        await self._listener.stop()
        self._stores.clear()
        self.shutdown_threads()

    async def _serve_connection(self, conn: socket.socket) -> None:
        """One pair (CONNECT first, then PULLs; the pair's group and store die with the
        connection), or the decode side's operations on its pair's store."""
        pairs: list[str] = []
        try:
            await self._serve_requests(conn, pairs)
        finally:
            for pair_id in pairs:
                self._stores.pop(pair_id, None)

    def _checker(self, conn: socket.socket) -> Callable[[str], None]:
        """The token check: a valid token moves ``conn`` out of the pre-auth budget."""

        def check(token: str) -> None:
            self.check_token(token)
            self._listener.authenticated(conn)

        return check

    async def _serve_requests(self, conn: socket.socket, pairs: list[str]) -> None:
        loop = asyncio.get_running_loop()
        group: Group | None = None
        while True:
            try:
                # Idle pairs are kept: only a connection with no group times out when idle.
                idle = framing.IDLE_SECONDS if group is None else None
                request = await framing.read_request(loop, conn, self._checker(conn), idle)
                if request.op == framing.OP_STORE:
                    await self._serve_store(loop, conn, request)
                elif request.op == framing.OP_CONNECT:
                    group = await self._connect(loop, conn, request, pairs)
                elif group is None:
                    self._record_failure("protocol")
                    raise TransferError("protocol", "PULL before CONNECT")
                elif request.op not in (framing.OP_PULL, framing.OP_PULL_READY):
                    self._record_failure("protocol")
                    raise TransferError("protocol", f"op {request.op} is not served by torch")
                else:
                    await self._serve_pull(loop, conn, group, request)
            except framing.ProtocolError as exc:
                self._record_failure("protocol")
                await self._reply(loop, conn, framing.error_reply("protocol", str(exc)))
                return
            except TransferError as exc:
                await self._reply(loop, conn, framing.error_reply(exc.reason, exc.detail))
                if exc.reason in ("refused", "protocol", "internal"):
                    return
            except (ConnectionError, EOFError, asyncio.TimeoutError):
                return

    async def _reply(
        self, loop: asyncio.AbstractEventLoop, conn: socket.socket, frame: bytes
    ) -> None:
        """A reply frame within ``send_timeout`` (a peer that stops reading is cut off)."""
        await asyncio.wait_for(loop.sock_sendall(conn, frame), self.send_timeout)

    async def _serve_store(
        self, loop: asyncio.AbstractEventLoop, conn: socket.socket, request: framing.Request
    ) -> None:
        """One operation on a live pair's store (refused for any other pair id)."""
        fields, value = await pair_store.read_op(loop, conn, request, self.group_timeout)
        store = self._stores.get(fields["pair"])
        if store is None:
            self._record_failure("refused")
            raise TransferError("refused", "no such pair")
        result, payload = await pair_store.serve_op(store, fields, value, self.group_timeout)
        message = json.dumps({"result": result})
        await self._reply(
            loop, conn, framing.encode_reply(framing.STATUS_OK, message, len(payload)) + payload
        )

    async def _connect(
        self,
        loop: asyncio.AbstractEventLoop,
        conn: socket.socket,
        request: framing.Request,
        pairs: list[str],
    ) -> Group:
        hello = json.loads(request.request_id or "{}")
        if hello.get("backend") != self.backend:
            self._record_failure("refused")
            raise TransferError("refused", f"server uses {self.backend}, client {hello}")
        if self.gpu is not None and hello.get("gpu") == self.gpu:
            self._record_failure("refused")
            raise TransferError("refused", same_gpu_refusal(self.gpu))
        pair_id = secrets.token_hex(16)
        store = pair_store.new_pair_store(self.group_timeout)
        self._stores[pair_id] = store
        pairs.append(pair_id)
        reply = json.dumps({"pair": pair_id, "backend": self.backend})
        await self._reply(loop, conn, framing.encode_reply(framing.STATUS_OK, reply))
        host = conn.getsockname()[0]
        try:
            group_args = (store, 0, self.backend, host, self.group_timeout)
            return await self.run_blocking(make_pair_group, *group_args, pool=self._collectives)
        except RuntimeError as exc:  # the client never joined
            self._record_failure("connection_lost")
            raise ConnectionResetError(f"pair group setup failed: {exc}") from exc

    async def _serve_pull(
        self,
        loop: asyncio.AbstractEventLoop,
        conn: socket.socket,
        group: Group,
        request: framing.Request,
    ) -> None:
        start = time.perf_counter()
        request, message = await ready_pull(self, request)
        args = (request.request_id, request.block_ids, request.bytes_per_block)
        with self.holding(*args):  # a copy is sent, but expiry waits for it all the same
            await self.pause_mid_transfer()
            blocks = await self.run_blocking(self.read_blocks, *args[:2])
        fault = self.draw_fault()
        if fault == "drop":  # the pair is dropped with the connection, as after any failure
            raise ConnectionResetError("injected fault: pull dropped")
        if fault == "corrupt":
            assert self.faults is not None
            blocks = self.faults.corrupted(blocks)
        num_bytes = blocks.numel() * blocks.element_size()
        await self._reply(loop, conn, framing.encode_reply(framing.STATUS_OK, message, num_bytes))
        if not num_bytes:  # a streamed part with nothing ready yet
            return
        try:
            timeout = self.group_timeout
            await self.run_blocking(_send, group, blocks, timeout, pool=self._collectives)
        except RuntimeError as exc:
            self._record_failure("connection_lost")
            raise ConnectionResetError(f"send failed: {exc}") from exc
        self.record_sent(num_bytes, time.perf_counter() - start)


@dataclass
class _Pair:
    """The client's half of one pair: control socket, store, group."""

    sock: socket.socket
    store: dist.Store
    group: Group
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def close(self) -> None:
        self.sock.close()


class TorchKVClient(KVTransferClient):
    """Pulls KV blocks through torch.distributed, one cached pair group per server."""

    transport = "torch"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """:class:`KVTransferClient`'s arguments: a pair per server, no other options."""
        super().__init__(*args, **kwargs)
        self.backend = backend_for(self.device)
        self.gpu = gpu_uuid(self.device)
        self._pairs: dict[str, _Pair] = {}
        self._connecting: dict[str, asyncio.Lock] = {}
        self._collectives = self.thread_pool(COLLECTIVE_THREADS, "collective")

    async def _pull_into(self, pull: PullRequest) -> tuple[int, str]:
        pair = await self._pair(pull.address, pull.timeout)
        async with pair.lock:
            try:
                return await self._pull_on(pair, pull)
            except TransferError as exc:
                if exc.reason not in ("unknown_request", "size_mismatch"):
                    self._drop(pull.address, pair)
                raise
            except BaseException:
                self._drop(pull.address, pair)
                raise

    async def _pull_on(self, pair: _Pair, pull: PullRequest) -> tuple[int, str]:
        loop = asyncio.get_running_loop()
        await loop.sock_sendall(pair.sock, framing.encode_pull(pull, self.token))
        status, message, payload_len = await framing.read_reply(loop, pair.sock)
        if status != framing.STATUS_OK:
            raise TransferError(framing.STATUS_REASONS.get(status, "protocol"), message)
        num = pull.announced_blocks(payload_len)
        self._mark_transferring(pull.request_id)
        if num:
            try:
                out, timeout = pull.out[:num], pull.timeout
                await self.run_blocking(_recv, pair.group, out, timeout, pool=self._collectives)
            except RuntimeError as exc:
                raise ConnectionResetError(f"recv failed: {exc}") from exc
        return num, message

    async def _pair(self, address: str, timeout: float) -> _Pair:
        lock = self._connecting.setdefault(address, asyncio.Lock())
        async with lock:
            pair = self._pairs.get(address)
            if pair is None:
                pair = await self._connect(address, timeout)
                self._pairs[address] = pair
            return pair

    async def _connect(self, address: str, timeout: float) -> _Pair:
        host, port, _ = framing.parse_address(address, "torch")
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        try:
            framing.tune_socket(sock)
            await loop.sock_connect(sock, (host, port))
            hello = json.dumps({"backend": self.backend, "gpu": self.gpu})
            request = framing.Request(framing.OP_CONNECT, self.token or "", hello, [], 0)
            await loop.sock_sendall(sock, framing.encode_request(request))
            status, message, _ = await framing.read_reply(loop, sock)
            if status != framing.STATUS_OK:
                raise TransferError(framing.STATUS_REASONS.get(status, "protocol"), message)
            pair_id = json.loads(message)["pair"]
            local = sock.getsockname()[0]
            store = pair_store.RemoteStore((host, port), self.token or "", pair_id, timeout)
            join = (store, local, timeout)
            group = await self.run_blocking(self._join, *join, pool=self._collectives)
        except BaseException:
            sock.close()
            raise
        return _Pair(sock, store, group)

    def _join(self, store: dist.Store, local: str, timeout: float) -> Group:
        try:
            return make_pair_group(store, 1, self.backend, local, timeout)
        except RuntimeError as exc:
            raise ConnectionResetError(f"pair group setup failed: {exc}") from exc

    def _drop(self, address: str, pair: _Pair) -> None:
        if self._pairs.get(address) is pair:
            del self._pairs[address]
        pair.close()

    async def close(self) -> None:
        for pair in self._pairs.values():
            pair.close()
        self._pairs.clear()
        self.shutdown_threads()
