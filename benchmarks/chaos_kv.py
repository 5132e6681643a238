"""The chaos soak's faults on the KV hand-off itself (see ``benchmarks/chaos.py``): a peer that
talks to the prefill worker as a decode worker or router would, then misbehaves.

- ``stalled_reader``: Prefill a long prompt, open its pull on the worker's KV port (tcp) with a
  tiny receive buffer and read nothing for a while (several leases), then read what comes: a
  sender that gave up at its deadline has closed the connection before the whole payload, one
  that waited for the reader sends it all. The leak check then sees whether the blocks went.
- ``lost_lease``: Prefill a prompt and drop its handle (no pull, no Release, no RenewLease, as
  when those messages are lost); start two PrefillStreams of long prompts, one whose handle is
  never pulled (the lease runs out while the prompt still computes) and one released as soon
  as its handle comes (what a decode worker does after a failed streamed pull): both streams
  must still end (their answer, or a clear error) within their deadline, and the leases must
  free every block.

The peer presents the run's cluster token, read from the environment of the worker that
``pdserve up`` started for this run.
"""

from __future__ import annotations

import asyncio
import socket
import time
import uuid
from dataclasses import dataclass, field

import grpc
import psutil

from common.wire import token_metadata
from kvtransfer import framing
from kvtransfer.base import KVLayout
from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc

CALL_SECONDS = 60.0  # a Prefill or PrefillStream that has not ended by then has hung
RECEIVE_BUFFER_BYTES = 4096


@dataclass
class Stall:
    """A pull left unread: its socket and the payload the OK reply announced."""

    sock: socket.socket
    request_id: str
    payload_len: int
    started: float


@dataclass
class PrefillPeer:
    """A misbehaving peer of one prefill worker; ``sockets``: the stalled pulls, open."""

    grpc_address: str
    token: str | None
    stalls: list[Stall] = field(default_factory=list)

    @classmethod
    def of(cls, pid: int, grpc_address: str) -> PrefillPeer:
        token = psutil.Process(pid).environ().get("PDSERVE_CLUSTER_TOKEN")
        return cls(grpc_address, token)

    def _request(self, what: str, token_ids: list[int]) -> pb.PrefillRequest:
        sampling = pb.SamplingParams(temperature=0.0, max_tokens=4)
        return pb.PrefillRequest(
            request_id=f"chaos-{what}-{uuid.uuid4().hex[:8]}",
            token_ids=token_ids,
            sampling=sampling,
        )

    async def prefill(self, what: str, token_ids: list[int]) -> pb.KVHandle:
        """A unary Prefill: its handle (pinned blocks under a lease)."""
        async with grpc.aio.insecure_channel(self.grpc_address) as channel:
            answer = await pb_grpc.PrefillServiceStub(channel).Prefill(
                self._request(what, token_ids),
                timeout=CALL_SECONDS,
                metadata=token_metadata(self.token),
            )
        return answer.kv

    async def stall_a_pull(self, token_ids: list[int], tries: int = 3) -> Stall:
        """Prefill, then ask for every block and read nothing past the reply; a pull that the
        worker's --kv-faults drop (closed with no payload) is tried again."""
        for _ in range(tries - 1):
            stall = await self._stall_once(token_ids)
            try:
                stall.sock.settimeout(5.0)
                if stall.sock.recv(1, socket.MSG_PEEK):  # payload coming: not dropped
                    return stall
            except OSError:  # closed or silent: the pull was dropped, try another
                pass
            self.stalls.remove(stall)
            stall.sock.close()
        return await self._stall_once(token_ids)

    async def _stall_once(self, token_ids: list[int]) -> Stall:
        handle = await self.prefill("stall", token_ids)
        host, port, _ = framing.parse_address(handle.address, "tcp")
        layout = KVLayout(
            num_layers=handle.layout.num_layers,
            num_kv_heads=handle.layout.num_kv_heads,
            head_dim=handle.layout.head_dim,
            block_size=handle.layout.block_size,
            dtype=handle.layout.dtype,
        )
        frame = framing.encode_request(
            framing.Request(
                framing.OP_PULL,
                self.token or "",
                handle.request_id,
                list(handle.block_ids),
                layout.bytes_per_block,
            )
        )
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER_BYTES)
        sock.settimeout(10.0)
        sock.connect((host, port))
        sock.sendall(frame)
        started = time.monotonic()
        status, message, payload_len = framing.parse_reply(_reply(sock))
        if status != framing.STATUS_OK:
            sock.close()
            raise RuntimeError(f"the pull was refused: {message}")
        stall = Stall(sock, handle.request_id, payload_len, started)
        self.stalls.append(stall)
        return stall

    @staticmethod
    def resume(stall: Stall, timeout: float) -> tuple[bool | None, str]:
        """Read the stalled pull to its end: (cut off, what happened). Not cut off: the whole
        payload came, so the sender waited for the reader without a deadline; None: no
        payload at all (an injected drop: it says nothing about the deadline)."""
        received, deadline = 0, time.monotonic() + timeout
        held = time.monotonic() - stall.started
        try:
            while received < stall.payload_len and time.monotonic() < deadline:
                stall.sock.settimeout(max(0.1, deadline - time.monotonic()))
                chunk = stall.sock.recv(1 << 20)
                if not chunk:
                    break
                received += len(chunk)
        except OSError as exc:  # reset, or no more bytes before the deadline
            if isinstance(exc, TimeoutError):
                return False, f"after {held:.0f} s unread: no end in {timeout:g} s more"
        finally:
            stall.sock.close()
        if received >= stall.payload_len:
            return False, (
                f"after {held:.0f} s unread the whole payload ({stall.payload_len} bytes) still "
                "came: the sender waited for the stalled reader"
            )
        if received == 0:  # closed before any payload: --kv-faults dropped this pull
            return None, "dropped at once by an injected kv fault (no payload at all)"
        return True, f"cut off after {received} of {stall.payload_len} bytes ({held:.0f} s)"

    async def lose_leases(
        self, short_ids: list[int], long_ids: list[int], other_ids: list[int]
    ) -> tuple[str, str]:
        """Drop a Prefill's handle; start two PrefillStreams at once, one whose handle is
        never pulled (its lease runs out while the prompt computes) and one released as soon
        as its handle comes (as a decode worker does after a failed streamed pull). (outcome,
        detail): "ended" when both streams ended (their done event or a clear gRPC status),
        else "hung"."""
        await self.prefill("lost", short_ids)  # the handle is dropped here
        ends = await asyncio.gather(
            self._stream("unpulled", long_ids, release=False),
            self._stream("released", other_ids, release=True),
        )
        hung = any(outcome == "hung" for outcome, _ in ends)
        return ("hung" if hung else "ended"), "; ".join(detail for _, detail in ends)

    async def _stream(self, what: str, token_ids: list[int], release: bool) -> tuple[str, str]:
        """One PrefillStream whose handle is never pulled, released at once if ``release``."""
        start, events = time.monotonic(), []
        try:
            async with grpc.aio.insecure_channel(self.grpc_address) as channel:
                stub = pb_grpc.PrefillServiceStub(channel)
                metadata = token_metadata(self.token)
                request = self._request(f"lost-{what}", token_ids)
                stream = stub.PrefillStream(request, timeout=CALL_SECONDS, metadata=metadata)
                async for event in stream:
                    events.append(event.WhichOneof("event"))
                    if release and event.HasField("kv"):
                        release_request = pb.ReleaseRequest(request_id=event.kv.request_id)
                        await stub.Release(release_request, timeout=5.0, metadata=metadata)
        except grpc.aio.AioRpcError as exc:
            seconds = time.monotonic() - start
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return "hung", f"{what} PrefillStream: {events}, then no end in {seconds:.0f} s"
            return "ended", f"{what} PrefillStream: {events}, {exc.code().name} in {seconds:.1f} s"
        return "ended", f"{what} PrefillStream: {events} in {time.monotonic() - start:.1f} s"

    def close(self) -> None:
        for stall in self.stalls:
            stall.sock.close()
        self.stalls.clear()


def _reply(sock: socket.socket) -> bytes:
    """One whole reply frame (header and message), blocking."""
    header = _exactly(sock, framing.REPLY_HEADER.size)
    return header + _exactly(sock, framing.REPLY_HEADER.unpack(header)[3])


def _exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the KV server closed the connection")
        data += chunk
    return data
