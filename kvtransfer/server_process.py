"""A KV transfer server in a child process: what `pdserve plan --measure` and the transfer
benchmark time a pull against, and what the transport tests pull from.

``ServerProcess`` spawns a child that builds a deterministic random KV cache
(:func:`make_kv_cache`), pins the requested blocks in a :class:`TensorBlockSource` and serves
it with the chosen transport. The parent gets the address, can ask for the server's stats,
and can stop or SIGKILL it. One request id injects a fault on the server side:
``STALL_REQUEST`` never answers (its read waits until the server stops) and is how tests make a
server hang.
"""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing as mp
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event as EventType
from typing import Any

import torch

from kvtransfer.base import KVLayout
from kvtransfer.source import TensorBlockSource

STALL_REQUEST = "stall-forever"


@dataclass(frozen=True)
class ServerSpec:
    """What the child process serves."""

    transport: str
    layout: KVLayout
    num_blocks: int
    seed: int = 0
    token: str | None = None
    pins: dict[str, list[int]] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    num_threads: int = 1
    device: str = "cpu"  # where the served cache lives (cuda: the torch transport sends by NCCL)


def make_kv_cache(layout: KVLayout, num_blocks: int, seed: int) -> torch.Tensor:
    """The same random ``[num_blocks, *block_shape]`` cache in every process for a seed."""
    generator = torch.Generator().manual_seed(seed)
    data = torch.randn((num_blocks, *layout.block_shape), generator=generator)
    return data.to(layout.torch_dtype)


class _StallingSource(TensorBlockSource):
    """A source whose reads of ``STALL_REQUEST`` never return (a hung server: the read blocks
    the server's loop) until the parent sets ``stopping``: then the stalled read fails and the
    loop can take the stop command (it waited out ``ServerProcess.stop``'s timeouts, 20 s)."""

    def __init__(self, kv_cache: torch.Tensor, lease_seconds: float, stopping: EventType):
        super().__init__(kv_cache, lease_seconds)
        self.stopping = stopping

    def renew_lease(self, request_id: str) -> bool:
        return request_id == STALL_REQUEST or super().renew_lease(request_id)

    @contextmanager
    def reading(self, request_id: str, block_ids: list[int]) -> Iterator[None]:
        if request_id == STALL_REQUEST:
            self.stopping.wait(3600)
            raise KeyError(request_id)  # the server stops: as if its blocks were gone
        with super().reading(request_id, block_ids):
            yield


def _child_main(spec: ServerSpec, conn: Connection, stopping: EventType) -> None:
    torch.set_num_threads(spec.num_threads)
    kv_cache = make_kv_cache(spec.layout, spec.num_blocks, spec.seed).to(spec.device)
    path = None
    if spec.transport == "shm":  # the cache must live in a file the client can map
        path = f"/dev/shm/pdserve-test-{os.getpid()}"
        shared = torch.from_file(path, shared=True, size=kv_cache.numel(), dtype=kv_cache.dtype)
        kv_cache = shared.view(kv_cache.shape).copy_(kv_cache)
        spec = dataclasses.replace(spec, options={**spec.options, "path": path})
    source = _StallingSource(kv_cache, 3600.0, stopping)
    for request_id, block_ids in spec.pins.items():
        source.pin(request_id, block_ids, with_checksums=False)
    try:
        asyncio.run(_serve(spec, source, conn))
    finally:
        if path is not None:
            os.unlink(path)


async def _serve(spec: ServerSpec, source: TensorBlockSource, conn: Connection) -> None:
    from kvtransfer import make_server

    server = make_server(spec.transport, source, spec.layout, spec.token, **spec.options)
    conn.send(await server.start("127.0.0.1"))
    while True:
        command = await _next_command(conn)
        if command == "stats":
            conn.send(asdict(server.stats))
        elif command == "stop":
            await server.stop()
            conn.send("stopped")
            return


async def _next_command(conn: Connection) -> Any:
    """The parent's next command, awaited on the loop: no thread waits on the pipe (one of the
    default executor's, before, for the child's whole life)."""
    loop = asyncio.get_running_loop()
    readable = asyncio.Event()
    loop.add_reader(conn.fileno(), readable.set)
    try:
        await readable.wait()
    finally:
        loop.remove_reader(conn.fileno())
    return conn.recv()  # a small message, whole once readable (EOFError: the parent is gone)


class ServerProcess:
    """Context manager: a transfer server in a spawned child process."""

    def __init__(self, spec: ServerSpec, start_timeout: float = 60.0):
        self.spec = spec
        context = mp.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        self._stopping = context.Event()
        self.process = context.Process(
            target=_child_main, args=(spec, child_conn, self._stopping), daemon=True
        )
        self.process.start()
        child_conn.close()
        if not self._conn.poll(start_timeout):
            self.kill()
            raise TimeoutError(f"{spec.transport} server did not start in {start_timeout}s")
        self.address: str = self._conn.recv()

    def stats(self, timeout: float = 10.0) -> dict[str, Any]:
        """The server's TransferStats as a dict."""
        self._conn.send("stats")
        if not self._conn.poll(timeout):
            raise TimeoutError("server did not answer the stats command")
        stats: dict[str, Any] = self._conn.recv()
        return stats

    def stop(self, timeout: float = 10.0) -> None:
        if self.process.is_alive():
            self._stopping.set()  # a stalled read lets go of the server's loop
            try:
                self._conn.send("stop")
                if self._conn.poll(timeout):  # no answer: a hung server, killed below
                    self.process.join(timeout)
            except (BrokenPipeError, EOFError, OSError):
                pass
        self.kill()

    def kill(self) -> None:
        """SIGKILL the server (no clean shutdown) and reap it."""
        if self.process.is_alive():
            self.process.kill()
        self.process.join(10)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
