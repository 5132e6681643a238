"""The KV transfer contract: what moves, who serves it, who pulls it, and what can go wrong.

The prefill worker P owns a :class:`BlockSource` (its pinned KV blocks) and runs one
:class:`KVTransferServer`; the decode worker D runs one :class:`KVTransferClient` and *pulls*
the blocks named in a KVHandle. A block is one contiguous row ``kv_cache[block_id]`` of shape
:attr:`KVLayout.block_shape` (all layers, K and V), so a transfer moves whole rows.

Lifecycle of one pull (:class:`TransferState`)::

    PENDING ──▶ TRANSFERRING ──▶ DONE
       │              │
       └──────────────┴────────▶ FAILED (TransferError: refused | unknown_request | timeout |
                                         size_mismatch | connection_lost | protocol | checksum)

- PENDING: ``pull`` was called; the client connects and sends (token, request id, block ids).
- TRANSFERRING: P accepted (token ok, blocks pinned, sizes agree, lease renewed) and bytes flow
  straight into a tensor preallocated by the client.
- DONE: every byte arrived; ``pull`` returns the tensor. FAILED: ``pull`` raises
  :class:`TransferError` and returns nothing: there is never partial data.

Server lifecycle: created ──start()──▶ serving ──stop()──▶ stopped. Client lifecycle: created
──pull()*──▶ close(). Each endpoint runs its blocking work (gathers, torch's collectives) in
thread pools of its own (``run_blocking``), never in asyncio's default executor, and ``stop()``
/ ``close()`` shut them down. Integrity is end to end: P computes :func:`block_checksums` when
it pins the blocks, D calls :func:`verify_checksums` after the pull (or
:meth:`KVTransferClient.pull_verified`, which does both).
"""

from __future__ import annotations

import abc
import asyncio
import enum
import functools
import hmac
import json
import math
import time
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch

from kernels.openmp import serial_thread
from kvtransfer.faults import KVFaults
from kvtransfer.metrics import TransferMetrics
from kvtransfer.progress import ProgressSignal

FAILURE_REASONS = (
    "refused",
    "unknown_request",
    "timeout",
    "size_mismatch",
    "connection_lost",
    "protocol",
    "checksum",
    "internal",
)


# The longest one send of a server waits for its reader when its source has no lease.
DEFAULT_SEND_SECONDS = 10.0
# Threads of an endpoint's own pool for its copies of blocks (gathers): a copy never waits on a
# peer, so a few keep up with every connection, and nothing else in the process (a prefill's
# checksums in asyncio's default executor, a transport's collectives) waits behind them or
# makes them wait.
COPY_THREADS = 4

T = TypeVar("T")


class TransferState(enum.Enum):
    """Where one pull is; see the module docstring for the transitions."""

    PENDING = "pending"
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"


class TransferError(Exception):
    """A pull failed; ``reason`` is one of :data:`FAILURE_REASONS` (also the metrics label)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"KV transfer failed ({reason}): {detail}")
        self.reason = reason
        self.detail = detail


class ChecksumError(TransferError):
    """Pulled bytes differ from what P pinned; ``block_index`` is the first bad block."""

    def __init__(self, block_index: int, detail: str):
        super().__init__("checksum", detail)
        self.block_index = block_index


@dataclass(frozen=True)
class KVLayout:
    """Shape and dtype of one KV block; both ends of a transfer must agree on it."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str = "float32"

    def __post_init__(self) -> None:
        dims = (self.num_layers, self.num_kv_heads, self.head_dim, self.block_size)
        if min(dims) <= 0:
            raise ValueError(f"KVLayout dimensions must be positive, got {self}")
        if not isinstance(getattr(torch, self.dtype, None), torch.dtype):
            raise ValueError(f"unknown dtype {self.dtype!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype = getattr(torch, self.dtype)
        assert isinstance(dtype, torch.dtype)
        return dtype

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """``(num_layers, 2, num_kv_heads, block_size, head_dim)``: one row of ``kv_cache``."""
        return (self.num_layers, 2, self.num_kv_heads, self.block_size, self.head_dim)

    @property
    def bytes_per_block(self) -> int:
        itemsize = torch.empty(0, dtype=self.torch_dtype).element_size()
        return math.prod(self.block_shape) * itemsize

    def empty_blocks(self, num_blocks: int, device: str | torch.device = "cpu") -> torch.Tensor:
        """An uninitialized ``[num_blocks, *block_shape]`` tensor to receive into."""
        return torch.empty((num_blocks, *self.block_shape), dtype=self.torch_dtype, device=device)


@runtime_checkable
class BlockSource(Protocol):
    """The prefill side's pinned blocks, as the transfer server sees them.

    Both methods may be called from a worker thread, concurrently with the engine; the blocks
    they touch are pinned, so the engine does not write them.
    """

    def read_blocks(self, request_id: str, block_ids: list[int]) -> torch.Tensor:
        """A contiguous ``[len(block_ids), *block_shape]`` copy of the blocks.

        Raises ``KeyError`` when ``request_id`` has no pinned blocks (unknown, released or
        lease expired) or a block id is not one of them: the transfer is then refused.
        """
        ...

    def renew_lease(self, request_id: str) -> bool:
        """Extend the pin's lease while a pull is in progress; False if nothing is pinned."""
        ...


@runtime_checkable
class BlockRowSource(BlockSource, Protocol):
    """A BlockSource that can also lend its pinned rows without copying (zero-copy senders)."""

    def block_rows(self, request_id: str, block_ids: list[int]) -> list[torch.Tensor]:
        """Contiguous views of the pinned rows, covering ``block_ids`` in order.

        Consecutive ids may share one view (``kv_cache[a:b]``). Read them only inside
        :meth:`reading`; raises ``KeyError`` like :meth:`BlockSource.read_blocks`.
        """
        ...

    def reading(self, request_id: str, block_ids: list[int]) -> AbstractContextManager[None]:
        """Hold the blocks while a transfer reads them: a release or a lease expiry meanwhile
        takes effect when the transfer is done (``KeyError`` if they are not pinned)."""
        ...

    def copy_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A copy of blocks the caller holds (inside :meth:`reading`), without checks."""
        ...


@dataclass
class StreamedPull:
    """The outcome of :meth:`KVTransferClient.pull_streamed`."""

    blocks: torch.Tensor
    num_blocks: int = 0
    final: dict[str, Any] | None = None  # what the prefill ended with (its first token ...)
    num_parts: int = 0
    seconds: float = 0.0  # the whole pull
    exposed_s: float = 0.0  # the last part less its wait: the pull after the prefill ended


@runtime_checkable
class StreamedSource(BlockSource, Protocol):
    """A BlockSource whose blocks may still be computed when a pull comes (streamed KV).

    ``progress`` is announced at every change that can make a pull's blocks ready (the engine's
    step done, the final answer known, a pin ended): a waiting pull looks again then."""

    progress: ProgressSignal

    def ready_count(
        self, request_id: str, block_ids: list[int]
    ) -> tuple[int, dict[str, Any] | None]:
        """Leading ``block_ids`` computed so far, and the prefill's final answer when they are
        the prompt's last blocks and it is known; KeyError when not pinned."""
        ...


@dataclass
class TransferStats:
    """Plain per-endpoint counters (the same numbers also go to Prometheus)."""

    num_ok: int = 0
    num_failed: int = 0
    num_bytes: int = 0
    seconds: float = 0.0
    failures: dict[str, int] = field(default_factory=dict)
    injected: dict[str, int] = field(default_factory=dict)  # faults injected on purpose, by kind

    def record_ok(self, num_bytes: int, seconds: float) -> None:
        self.num_ok += 1
        self.num_bytes += num_bytes
        self.seconds += seconds

    def record_failure(self, reason: str) -> None:
        self.num_failed += 1
        self.failures[reason] = self.failures.get(reason, 0) + 1

    def record_injected(self, kind: str) -> None:
        self.injected[kind] = self.injected.get(kind, 0) + 1


class _Endpoint:
    """What servers and clients share: a transport name, stats and metrics."""

    transport: str = "base"

    def __init__(self, metrics: TransferMetrics | None):
        self.stats = TransferStats()
        self.metrics = metrics or TransferMetrics()
        # Threads are named after their endpoint, so one that outlives it shows by name.
        self.thread_prefix = f"kv-{type(self).__name__}-{id(self):x}"
        self._pools: list[ThreadPoolExecutor] = []
        self._copies = self.thread_pool(COPY_THREADS, "copy")

    def thread_pool(self, num_threads: int, name: str) -> ThreadPoolExecutor:
        """A pool of at most ``num_threads`` (started on demand) for one kind of this
        endpoint's blocking work, shut down with the endpoint."""
        pool = ThreadPoolExecutor(
            num_threads,
            thread_name_prefix=f"{self.thread_prefix}-{name}",
            initializer=serial_thread,  # copies beside the engine's step: see kernels.openmp
        )
        self._pools.append(pool)
        return pool

    async def run_blocking(
        self, fn: Callable[..., T], *args: Any, pool: ThreadPoolExecutor | None = None
    ) -> T:
        """``fn(*args)`` in ``pool`` (the endpoint's copy threads by default), off the loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(pool or self._copies, functools.partial(fn, *args))

    def shutdown_threads(self) -> None:
        """End the endpoint's threads; stop() and close() call it. Work queued is dropped; a
        thread busy (a collective waiting on its peer) ends when its work does, by its
        timeout: the loop never waits for it."""
        for pool in self._pools:
            pool.shutdown(wait=False, cancel_futures=True)

    def _record_ok(self, num_bytes: int, seconds: float, direction: str) -> None:
        self.stats.record_ok(num_bytes, seconds)
        self.metrics.observe(self.transport, direction, num_bytes, seconds)

    def _record_failure(self, reason: str) -> None:
        self.stats.record_failure(reason)
        self.metrics.fail(self.transport, reason)


class KVTransferServer(_Endpoint, abc.ABC):
    """Serves pinned blocks of ``source`` to clients that present ``token``.

    Subclasses implement :meth:`start` / :meth:`stop`; for each request they call
    :meth:`check_token` and :meth:`read_blocks` (the validation every transport shares) and,
    after sending, :meth:`record_sent`. A failed pull is counted by whichever step failed.
    With ``faults`` (testing only, :mod:`kvtransfer.faults`) they ask :meth:`draw_fault`, once
    per pull that passed validation, whether to drop or corrupt it.
    """

    def __init__(
        self,
        source: BlockSource,
        layout: KVLayout,
        token: str | None = None,
        metrics: TransferMetrics | None = None,
        faults: KVFaults | None = None,
        send_timeout: float | None = None,
    ):
        """The arguments every transport takes. A transport's own options (tcp's
        ``chunk_bytes``, shm's ``path`` ...) are keywords of its constructor, which passes these
        on untouched: they are declared once, here.

        ``send_timeout``: the longest one send (a reply, a piece of a payload) may wait for its
        reader; past it the connection is closed, the read ends and the pin can go, so a reader
        that stops reading holds blocks no longer. By default the source's lease (the time a
        pin lasts without news from its puller), else ``DEFAULT_SEND_SECONDS``."""
        super().__init__(metrics)
        self.source = source
        self.layout = layout
        self.token = token
        self.faults = faults
        lease = getattr(source, "lease_seconds", None)
        self.send_timeout = send_timeout or lease or DEFAULT_SEND_SECONDS

    @abc.abstractmethod
    async def start(self, host: str = "127.0.0.1", advertise_host: str | None = None) -> str:
        """Listen on ``host`` (an ephemeral port) and return the address to advertise.

        The address names ``advertise_host`` when given (what peers can reach: a worker bound
        to 0.0.0.0 passes its container's address), else ``host``.
        """

    @abc.abstractmethod
    async def stop(self) -> None:
        """Stop listening, drop open connections and :meth:`shutdown_threads`; idempotent."""

    def check_token(self, token: str) -> None:
        """Refuse (TransferError "refused", counted) a client whose token differs from ours."""
        if not hmac.compare_digest(token.encode(), (self.token or "").encode()):
            self._record_failure("refused")
            raise TransferError("refused", "cluster token mismatch")

    def read_blocks(self, request_id: str, block_ids: list[int]) -> torch.Tensor:
        """A contiguous copy of the blocks; call it inside :meth:`holding` (which checked the
        block size and the lease, and holds the blocks: a source that lends rows is copied
        from without further checks, even if the lease ran out meanwhile).

        Raises TransferError (unknown_request | internal), counted. Blocking: transports call
        it through :meth:`run_blocking` for large transfers.
        """
        try:
            if isinstance(self.source, BlockRowSource):
                blocks = self.source.copy_blocks(block_ids)
            else:
                blocks = self.source.read_blocks(request_id, block_ids)
        except KeyError as exc:
            raise self.unknown(request_id) from exc
        if tuple(blocks.shape) != (len(block_ids), *self.layout.block_shape):
            self._record_failure("internal")
            raise TransferError("internal", f"source returned shape {tuple(blocks.shape)}")
        return blocks.contiguous()

    @contextmanager
    def holding(
        self, request_id: str, block_ids: list[int], bytes_per_block: int
    ) -> Iterator[None]:
        """Check the client's block size, renew the lease and hold the blocks until the
        ``with`` ends (a release or a lease expiry meanwhile waits for it; sources that cannot
        hold blocks, :class:`BlockSource` only, are read copy by copy). TransferError, counted.
        """
        self._check_size(bytes_per_block)
        with ExitStack() as held:
            try:
                if not self.source.renew_lease(request_id):
                    raise KeyError(request_id)
                if isinstance(self.source, BlockRowSource):
                    held.enter_context(self.source.reading(request_id, block_ids))
            except KeyError as exc:
                raise self.unknown(request_id) from exc
            yield

    def lent_rows(self, request_id: str, block_ids: list[int]) -> list[torch.Tensor] | None:
        """Zero-copy views of host memory, when the source lends them (:class:`BlockRowSource`);
        None when it cannot (then use :meth:`read_blocks`). Call it, and send the rows, inside
        :meth:`holding`."""
        if not isinstance(self.source, BlockRowSource):
            return None
        try:
            rows = self.source.block_rows(request_id, block_ids)
        except KeyError as exc:
            raise self.unknown(request_id) from exc
        if any(row.device.type != "cpu" or not row.is_contiguous() for row in rows):
            return None
        return rows

    def _check_size(self, bytes_per_block: int) -> None:
        if bytes_per_block != self.layout.bytes_per_block:
            self._record_failure("size_mismatch")
            raise TransferError(
                "size_mismatch",
                f"client expects {bytes_per_block} bytes per block, server has "
                f"{self.layout.bytes_per_block} ({self.layout})",
            )

    def unknown(self, request_id: str) -> TransferError:
        self._record_failure("unknown_request")
        return TransferError("unknown_request", f"no pinned blocks for {request_id!r}")

    def record_sent(self, num_bytes: int, seconds: float) -> None:
        """Transports call this once every byte of a pull has been handed to the wire."""
        self._record_ok(num_bytes, seconds, "sent")

    async def pause_mid_transfer(self) -> None:
        """Testing only (``pause=`` fault): stop here for a while, the blocks held."""
        if self.faults is not None:
            await self.faults.pause_mid_transfer()

    def draw_fault(self) -> str | None:
        """The fault to inject into this pull ("drop", "corrupt" or None: faults off), counted
        in ``stats.injected`` and the metrics when there is one."""
        kind = self.faults.draw() if self.faults is not None else None
        if kind is not None:
            self.stats.record_injected(kind)
            self.metrics.inject(self.transport, kind)
        return kind


@dataclass(frozen=True, eq=False)  # eq=False: no element-wise comparison of ``out``
class PullRequest:
    """One pull as :meth:`KVTransferClient.pull` hands it to a transport's ``_pull_into``:
    the blocks ``block_ids`` of ``request_id`` at ``address``, received into ``out`` (contiguous,
    ``[len(block_ids), *block_shape]``) within ``timeout`` seconds. ``streamed``: one part of a
    streamed pull, answered with the leading blocks computed so far (maybe none)."""

    address: str
    request_id: str
    block_ids: list[int]
    out: torch.Tensor
    timeout: float
    streamed: bool = False

    @property
    def bytes_per_block(self) -> int:
        """What the request frame announces, and the server checks against its layout."""
        return bytes_per_row(self.out)

    def announced_blocks(self, payload_len: int) -> int:
        """The number of blocks a server's OK reply announces as ``payload_len`` bytes: exactly
        ``out``'s for a plain pull, whole blocks up to that for a streamed part; TransferError
        size_mismatch otherwise (the payload would not fit ``out``, or ends mid-block)."""
        per_block, expected = self.bytes_per_block, self.out.numel() * self.out.element_size()
        whole = per_block and payload_len % per_block == 0
        if payload_len == expected or (self.streamed and whole and payload_len <= expected):
            return payload_len // per_block if per_block else 0
        raise TransferError(
            "size_mismatch", f"server announced {payload_len} bytes, expected {expected}"
        )


class KVTransferClient(_Endpoint, abc.ABC):
    """Pulls blocks from servers; one client serves all of a decode worker's pulls.

    :meth:`pull` owns the timeout, the metrics and the error mapping; a transport implements
    :meth:`_pull_into`, which fills a preallocated tensor or raises. ``states`` maps the
    request ids of pulls in flight to PENDING / TRANSFERRING; finished pulls leave it.
    """

    def __init__(
        self,
        token: str | None = None,
        device: str = "cpu",
        metrics: TransferMetrics | None = None,
    ):
        """The arguments every transport takes; as for servers, a transport's own options
        (ucx's ``ucx_options``, the pooled transports' ``max_idle_per_server``) are keywords of
        its constructor, which passes these on untouched."""
        super().__init__(metrics)
        self.token = token
        self.device = torch.device(device)
        self.states: dict[str, TransferState] = {}

    async def pull(
        self,
        address: str,
        request_id: str,
        block_ids: list[int],
        layout: KVLayout,
        timeout: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The blocks ``[len(block_ids), *layout.block_shape]``, or TransferError.

        ``out`` (optional): a contiguous tensor of that shape and dtype to receive into, e.g. a
        reused staging buffer (saves allocating and faulting in fresh pages per pull). After a
        failure its contents are undefined: they are never returned as a result.
        """
        out = self._output(layout, len(block_ids), out)
        await self._exchange(PullRequest(address, request_id, block_ids, out, timeout))
        return out

    async def pull_streamed(
        self,
        address: str,
        request_id: str,
        block_ids: list[int],
        layout: KVLayout,
        timeout: float,
        total_timeout: float | None = None,
    ) -> StreamedPull:
        """The blocks of a streaming handle, pulled as the prefill computes them: one
        ``OP_PULL_READY`` exchange after another (each within ``timeout``), each part verified
        against the checksums its reply carries, until every block and the prefill's final
        answer are in, all within ``total_timeout`` (the request's time left: each part's wait
        renews the lease, so the lease alone cannot end a pull whose prefill stopped making
        progress). TransferError as :meth:`pull` (ChecksumError included)."""
        out = self._output(layout, len(block_ids), None)
        result = StreamedPull(out)
        start = time.perf_counter()
        deadline = start + total_timeout if total_timeout is not None else None
        while result.num_blocks < len(block_ids) or result.final is None:
            got = result.num_blocks
            part_start = time.perf_counter()
            part_timeout = timeout if deadline is None else min(timeout, deadline - part_start)
            if part_timeout <= 0:
                self._record_failure("timeout")
                detail = f"{len(block_ids) - got} blocks or the final answer still missing"
                raise TransferError("timeout", f"streamed pull past its deadline: {detail}")
            part = PullRequest(
                address, request_id, block_ids[got:], out[got:], part_timeout, streamed=True
            )
            num, message = await self._exchange(part)
            reply = json.loads(message or "{}")
            try:
                verify_checksums(out[got : got + num], reply.get("checksums", []))
            except ChecksumError:
                self._record_failure("checksum")
                raise
            result.num_blocks += num
            result.final = reply.get("final")
            # What the pull cost once the prefill was done: the last part, less its wait.
            result.exposed_s = time.perf_counter() - part_start - reply.get("waited_s", 0.0)
            result.num_parts += 1
        result.seconds = time.perf_counter() - start
        return result

    async def _exchange(self, pull: PullRequest) -> tuple[int, str]:
        """One pull (or one part of a streamed one), with the timeout, states, metrics and the
        error mapping: (blocks received, the reply's message)."""
        self.states[pull.request_id] = TransferState.PENDING
        start = time.perf_counter()
        try:
            num, message = await asyncio.wait_for(self._pull_into(pull), pull.timeout)
        except TransferError as exc:
            self._record_failure(exc.reason)
            raise
        except (asyncio.TimeoutError, TimeoutError) as exc:
            self._record_failure("timeout")
            detail = f"no complete answer from {pull.address} in {pull.timeout}s"
            raise TransferError("timeout", detail) from exc
        except (ConnectionError, EOFError, OSError) as exc:
            self._record_failure("connection_lost")
            raise TransferError("connection_lost", f"{pull.address}: {exc!r}") from exc
        except Exception as exc:  # a bug or an unexpected library error: still a TransferError
            self._record_failure("internal")
            raise TransferError("internal", f"{pull.address}: {exc!r}") from exc
        finally:  # done, failed or cancelled: it is no longer in flight
            self.states.pop(pull.request_id, None)
        nbytes = num * pull.bytes_per_block
        self._record_ok(nbytes, time.perf_counter() - start, "received")
        return num, message

    async def pull_verified(
        self,
        address: str,
        request_id: str,
        block_ids: list[int],
        layout: KVLayout,
        timeout: float,
        checksums: list[int],
    ) -> torch.Tensor:
        """:meth:`pull`, then :func:`verify_checksums` (ChecksumError is a TransferError)."""
        blocks = await self.pull(address, request_id, block_ids, layout, timeout)
        try:
            verify_checksums(blocks, checksums)
        except ChecksumError:
            self._record_failure("checksum")
            raise
        return blocks

    def _output(self, layout: KVLayout, num_blocks: int, out: torch.Tensor | None) -> torch.Tensor:
        if out is None:
            return layout.empty_blocks(num_blocks, self.device)
        shape = (num_blocks, *layout.block_shape)
        if tuple(out.shape) != shape or out.dtype != layout.torch_dtype:
            raise ValueError(f"out is {tuple(out.shape)} {out.dtype}, need {shape} {layout.dtype}")
        if not out.is_contiguous():
            raise ValueError("out must be contiguous")
        return out

    def _mark_transferring(self, request_id: str) -> None:
        """Transports call this once the server has accepted the request."""
        self.states[request_id] = TransferState.TRANSFERRING

    @abc.abstractmethod
    async def _pull_into(self, pull: PullRequest) -> tuple[int, str]:
        """Fill ``pull.out`` with the blocks, or raise (TransferError or a connection error);
        return how many blocks came and the reply's message. Plain: all of them.
        ``pull.streamed``: an ``OP_PULL_READY`` request, answered with the leading ones computed
        so far (:meth:`PullRequest.announced_blocks` checks the count a reply announces).

        :meth:`pull` cancels this coroutine after ``pull.timeout``; blocking work that cannot be
        cancelled (a thread) must itself give up within it.
        """

    @abc.abstractmethod
    async def close(self) -> None:
        """Close cached connections and :meth:`shutdown_threads`; idempotent."""


def bytes_per_row(blocks: torch.Tensor) -> int:
    """Bytes of one block of ``blocks`` (also when it holds zero blocks)."""
    return math.prod(blocks.shape[1:]) * blocks.element_size()


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor (any dtype, bfloat16 included)."""
    flat = tensor.reshape(-1).view(torch.uint8)
    return flat.numpy().data.cast("B")


def block_checksums(blocks: torch.Tensor) -> list[int]:
    """One CRC-32 per block (row 0 of ``blocks``); see the benchmark for crc32 vs adler32."""
    rows = blocks.detach().cpu().contiguous()
    return [zlib.crc32(tensor_bytes(row)) for row in rows]


def verify_checksums(blocks: torch.Tensor, expected: list[int]) -> None:
    """Raise ChecksumError naming the first block whose checksum differs."""
    actual = block_checksums(blocks)
    if len(actual) != len(expected):
        raise ChecksumError(-1, f"{len(actual)} blocks but {len(expected)} checksums")
    for index, (got, want) in enumerate(zip(actual, expected)):
        if got != want:
            raise ChecksumError(index, f"block {index}: checksum {got:#010x} != {want:#010x}")


def adapt_layout(
    blocks: torch.Tensor, src: KVLayout, dst: KVLayout, num_tokens: int
) -> torch.Tensor:
    """Re-block the first ``num_tokens`` tokens of ``blocks`` from ``src`` into ``dst``.

    Block size and dtype may differ; layers, KV heads and head dim must not (ValueError).
    Returns ``ceil(num_tokens / dst.block_size)`` blocks; the tail past ``num_tokens`` is zero.
    """
    same = ("num_layers", "num_kv_heads", "head_dim")
    if any(getattr(src, name) != getattr(dst, name) for name in same):
        raise ValueError(f"cannot adapt {src} to {dst}: layers/heads/head_dim differ")
    if tuple(blocks.shape[1:]) != src.block_shape or blocks.dtype != src.torch_dtype:
        raise ValueError(f"blocks {tuple(blocks.shape)} {blocks.dtype} are not in layout {src}")
    if not 0 <= num_tokens <= blocks.shape[0] * src.block_size:
        raise ValueError(f"{num_tokens} tokens do not fit in {blocks.shape[0]} blocks")
    num_blocks = -(-num_tokens // dst.block_size)
    if src.block_size == dst.block_size:  # fast path: no re-blocking
        out = blocks[:num_blocks].to(dst.torch_dtype, copy=True)
        _zero_tail(out, num_tokens)
        return out
    # [n, L, 2, H, bs, D] -> [L, 2, H, n * bs, D]: tokens contiguous per (layer, K/V, head).
    num_layers, _, num_heads, _, head_dim = src.block_shape
    tokens = blocks.permute(1, 2, 3, 0, 4, 5).reshape(num_layers, 2, num_heads, -1, head_dim)
    padded = tokens.new_zeros(
        (num_layers, 2, num_heads, num_blocks * dst.block_size, head_dim), dtype=dst.torch_dtype
    )
    padded[:, :, :, :num_tokens] = tokens[:, :, :, :num_tokens]
    shaped = padded.view(num_layers, 2, num_heads, num_blocks, dst.block_size, head_dim)
    return shaped.permute(3, 0, 1, 2, 4, 5).contiguous()


def _zero_tail(blocks: torch.Tensor, num_tokens: int) -> None:
    """Zero the token slots past ``num_tokens`` in the last block (same-block-size path)."""
    if blocks.shape[0] == 0:
        return
    used = num_tokens - (blocks.shape[0] - 1) * blocks.shape[4]
    blocks[-1, :, :, :, used:] = 0
