"""The ``shm`` transport: same-host pulls straight out of the prefill worker's KV cache.

The prefill worker keeps its KV cache in a shared-memory file (``CacheConfig.shared_memory_path``,
under ``/dev/shm``). A pull is the tcp transport's request/reply on the control connection
(token check, lease renewal, pinned-block check) with an empty payload; the client then copies
the rows from its own mapping of that file into the output tensor: one memcpy, no socket bytes.
The server holds the blocks (a lease expiry or a release waits) from its reply until the client
says it is done copying (a DONE frame on the same connection, or the connection closing, or
``DONE_TIMEOUT_SECONDS``), so they cannot be reused under the copy; the decode side verifies
their checksums as for any transport.

Address: ``shm://HOST:PORT?path=/dev/shm/FILE``. Only for peers on the same host.

Injected faults (``faults=``, testing only): ``drop`` closes the control connection before the
reply. ``corrupt`` cannot be injected here: the payload never passes through the server, and
flipping a byte in the shared file would corrupt the prefill worker's own cache.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import urllib.parse
from collections import OrderedDict
from contextlib import ExitStack
from typing import Any

import torch

from kvtransfer import framing
from kvtransfer.base import PullRequest, TransferError
from kvtransfer.tcp import TcpKVClient, TcpKVServer

DONE_TIMEOUT_SECONDS = 30.0  # longest a server holds blocks for a client's copy
MAX_MAPPINGS = 16  # prefill workers' KV files a decode worker keeps mapped


class ShmKVServer(TcpKVServer):
    """Validates pulls of blocks that live in ``path``; the client reads them itself."""

    transport = "shm"

    def __init__(self, *args: Any, path: str = "", **kwargs: Any) -> None:
        """:class:`KVTransferServer`'s arguments; ``path``: the KV cache's shared-memory file,
        which clients map (required)."""
        super().__init__(*args, **kwargs)
        if not path:
            raise ValueError("the shm transport needs the KV cache's shared-memory file (path=)")
        if self.faults is not None and self.faults.corrupt:
            raise ValueError(
                "the shm transport cannot inject 'corrupt' KV faults: the decode side copies the "
                "blocks from shared memory itself (use tcp, torch or ucx)"
            )
        self.path = path

    async def start(self, host: str = "127.0.0.1", advertise_host: str | None = None) -> str:
        port = self._listener.start(host)
        address = framing.format_address("shm", advertise_host or host, port)
        return f"{address}?path={urllib.parse.quote(self.path)}"

    async def _serve_request(
        self,
        loop: asyncio.AbstractEventLoop,
        conn,
        request: framing.Request,  # type: ignore[no-untyped-def]
    ) -> bool:
        start = time.perf_counter()
        with ExitStack() as held:
            try:
                request, message = await self._admit(request, held)  # renews the lease
                if self.lent_rows(request.request_id, request.block_ids) is None:
                    raise TransferError("internal", "the shm transport needs a source of rows")
            except TransferError as exc:
                await self._send(loop, conn, framing.error_reply(exc.reason, exc.detail))
                return exc.reason not in ("refused", "protocol")
            if self.draw_fault() == "drop":  # close without a reply: the client fails at once
                return False
            await self._send(loop, conn, framing.encode_reply(framing.STATUS_OK, message, 0))
            await self.pause_mid_transfer()
            done = await framing.read_request(loop, conn, timeout=DONE_TIMEOUT_SECONDS)
            if done.op != framing.OP_DONE:
                raise framing.ProtocolError(f"expected DONE after a pull, got op {done.op}")
        num_bytes = len(request.block_ids) * self.layout.bytes_per_block
        self.record_sent(num_bytes, time.perf_counter() - start)
        return True


class ShmKVClient(TcpKVClient):
    """Copies pinned blocks out of the prefill worker's mapped KV cache file."""

    transport = "shm"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """:class:`TcpKVClient`'s arguments (its control connections are pooled alike)."""
        super().__init__(*args, **kwargs)
        # path -> (file identity, mapping); bounded, least recently used first out
        self._mappings: OrderedDict[str, tuple[tuple[int, int], torch.Tensor]] = OrderedDict()

    async def _pull_into(self, pull: PullRequest) -> tuple[int, str]:
        host, port, params = framing.parse_address(pull.address, "shm")
        path = urllib.parse.unquote(params.get("path", ""))
        frame = framing.encode_pull(pull, self.token)
        sock, payload_len, message = await self._request((host, port), frame, pull.timeout)
        block_ids, out = pull.block_ids, pull.out
        try:
            if payload_len != 0:
                raise TransferError("protocol", f"shm server announced {payload_len} payload bytes")
            num = int(json.loads(message)["blocks"]) if pull.streamed else len(block_ids)
            if not 0 <= num <= len(block_ids):
                raise TransferError("protocol", f"shm server announced {num} blocks")
            self._mark_transferring(pull.request_id)
            source = self._map(path, out)
            ids = torch.tensor(block_ids[:num], dtype=torch.long)
            if max(block_ids[:num], default=0) >= source.shape[0]:
                raise TransferError("size_mismatch", f"block id beyond the end of {path}")
            if out.device.type == "cpu":
                torch.index_select(source, 0, ids, out=out[:num])
            else:
                out[:num].copy_(source.index_select(0, ids))
            done = framing.Request(framing.OP_DONE, "", pull.request_id, [], 0)
            await asyncio.get_running_loop().sock_sendall(sock, framing.encode_request(done))
        except BaseException:
            sock.close()  # the server lets the blocks go when it sees the connection close
            raise
        self.connections.release((host, port), sock)
        return num, message

    def _map(self, path: str, out: torch.Tensor) -> torch.Tensor:
        """The mapping of ``path`` (kept for the last few peers). Mappings whose file is gone
        or was replaced (a prefill worker that stopped, or restarted at the same path) are
        dropped first: each holds a whole KV cache in RAM until unmapped."""
        self._drop_stale_mappings()
        entry = self._mappings.get(path)
        if entry is None:
            try:
                identity, size = _file_identity(path), os.path.getsize(path)
            except OSError:
                identity, size = None, 0
            layout_shape = tuple(out.shape[1:])
            itemsize = out.element_size()
            per_block = int(torch.Size(layout_shape).numel()) * itemsize
            if identity is None:  # the peer stopped, or runs on another host
                raise TransferError("connection_lost", f"{path} is not reachable from this host")
            if not size or size % per_block:
                raise TransferError("size_mismatch", f"{path} does not hold whole KV blocks")
            flat = torch.from_file(path, shared=True, size=size // itemsize, dtype=out.dtype)
            entry = (identity, flat.view(-1, *layout_shape))
            self._mappings[path] = entry
            while len(self._mappings) > MAX_MAPPINGS:
                self._mappings.popitem(last=False)
        self._mappings.move_to_end(path)
        return entry[1]

    def _drop_stale_mappings(self) -> None:
        for path, (identity, _) in list(self._mappings.items()):
            try:
                current = _file_identity(path)
            except OSError:
                current = None
            if current != identity:
                del self._mappings[path]


def _file_identity(path: str) -> tuple[int, int]:
    """(device, inode): a file replaced at the same path is another file."""
    stat = os.stat(path)
    return stat.st_dev, stat.st_ino
