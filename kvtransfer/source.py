"""A reference :class:`~kvtransfer.base.BlockSource`: pinned rows of one KV cache tensor.

The prefill worker pins a request's blocks when it answers Prefill and unpins them when the
decode worker releases them or when the lease runs out, whichever comes first::

    pin() ──▶ pinned ──renew_lease()──▶ pinned ──release()──▶ gone
                 └────────── lease expired (expire() or next access) ──▶ gone

A streamed pin (``pin(..., progress=...)``) is made while the prompt is still being computed:
``ready_count`` says how many of a pull's blocks are computed so far, and ``finish`` adds what
the prefill ends with (the first token), which the pull completing the prompt carries.

A transfer reads the blocks inside ``reading()``, which counts it as a reader: a release or an
expiry that comes while a transfer reads only marks the pin as going (no new transfer may start
on it) and the pin is dropped when its last reader leaves. So the blocks never return to the
block pool, to be reused by the engine, while bytes are still being copied or sent out of them.

Thread-safe: the transfer server reads from worker threads while the engine pins and releases.
``on_unpin`` (if given) is called with the request id when its blocks stop being pinned, from
whichever thread dropped the pin, so the owner can give them back to its block pool.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from kvtransfer.base import block_checksums


@dataclass
class _Pin:
    block_ids: frozenset[int]
    expires_at: float
    readers: int = 0  # transfers reading the blocks now
    going: bool = False  # released or expired while read: dropped when the last reader leaves
    # Streamed: the blocks in prompt order, the prompt's tokens computed so far, its length,
    # and what the prefill ended with (set by ``finish``).
    order: list[int] | None = None
    progress: Callable[[], int] | None = None
    num_tokens: int = 0
    final: dict[str, Any] | None = None


class TensorBlockSource:
    """Serves pinned rows of ``kv_cache`` ``[num_blocks, *block_shape]``."""

    def __init__(
        self,
        kv_cache: torch.Tensor,
        lease_seconds: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        on_unpin: Callable[[str], None] | None = None,
    ):
        self.kv_cache = kv_cache
        self.lease_seconds = lease_seconds
        self._clock = clock
        self._on_unpin = on_unpin
        self._pins: dict[str, _Pin] = {}
        self._lock = threading.Lock()

    def pin(
        self,
        request_id: str,
        block_ids: list[int],
        with_checksums: bool = True,
        progress: Callable[[], int] | None = None,
        num_tokens: int = 0,
    ) -> list[int]:
        """Pin ``block_ids`` for ``request_id``; returns their checksums (or [] if not asked).

        Streamed (``progress``: how many of the ``num_tokens`` prompt tokens are computed, read
        from any thread): the blocks fill as the prefill runs; no checksums yet."""
        pin = _Pin(frozenset(block_ids), self._clock() + self.lease_seconds)
        if progress is not None:
            pin.order, pin.progress, pin.num_tokens = list(block_ids), progress, num_tokens
        with self._lock:
            self._pins[request_id] = pin
        if not with_checksums or progress is not None:
            return []
        return block_checksums(self.kv_cache[torch.tensor(block_ids, dtype=torch.long)])

    def finish(self, request_id: str, final: dict[str, Any]) -> None:
        """A streamed prefill is done: ``final`` (its first token ...) goes with the last pull."""
        with self._lock:
            pin = self._pins.get(request_id)
            if pin is not None:
                pin.final = final

    def ready_count(
        self, request_id: str, block_ids: list[int]
    ) -> tuple[int, dict[str, Any] | None]:
        """How many leading ``block_ids`` are computed, and the prefill's final answer when
        they are the last of the prompt's blocks and it is known (KeyError: not pinned). A pin
        that is not streamed is ready at once, with no final answer."""
        with self._lock:
            pin = self._checked(request_id, block_ids)
            if pin.order is None or pin.progress is None:
                return len(block_ids), None
            order, computed, final = pin.order, pin.progress(), pin.final
            block_size = self.kv_cache.shape[-2]  # [.., 2, heads, block_size, head_dim]
        position = {block: i for i, block in enumerate(order)}
        ready = 0
        for block in block_ids:
            done = computed >= pin.num_tokens or (position[block] + 1) * block_size <= computed
            if not done:
                break
            ready += 1
        last = not block_ids or position[block_ids[-1]] == len(order) - 1
        if ready == len(block_ids) and last:  # the prompt's last block goes with the final answer
            return (ready, final) if final is not None else (max(0, ready - 1), None)
        return ready, None

    def release(self, request_id: str) -> bool:
        """Unpin (once the transfers reading it are done); False if it was not pinned (already
        released or expired)."""
        with self._lock:
            pin = self._pins.get(request_id)
            if pin is None or pin.going:
                return False
            dropped = self._drop_locked(request_id, pin)
        if dropped:
            self._unpinned(request_id)
        return True

    def expire(self) -> list[str]:
        """Unpin every request whose lease has run out (those being read: when their transfers
        end); returns the ids of those whose lease ran out now."""
        now = self._clock()
        expired, dropped = [], []
        with self._lock:
            for rid, pin in list(self._pins.items()):
                if pin.expires_at <= now and not pin.going:
                    expired.append(rid)
                    if self._drop_locked(rid, pin):
                        dropped.append(rid)
        for rid in dropped:
            self._unpinned(rid)
        return expired

    @contextmanager
    def reading(self, request_id: str, block_ids: list[int]) -> Iterator[None]:
        """Hold ``block_ids`` of a pinned request while a transfer reads them (KeyError if they
        are not pinned for it): neither a release nor an expiry frees them meanwhile."""
        with self._lock:
            pin = self._checked(request_id, block_ids)
            pin.readers += 1
        try:
            yield
        finally:
            with self._lock:
                pin.readers -= 1
                last = pin.going and pin.readers == 0
                if last:
                    del self._pins[request_id]
            if last:
                self._unpinned(request_id)

    def pinned_request_ids(self) -> list[str]:
        with self._lock:
            return [rid for rid, pin in self._pins.items() if not pin.going]

    def is_pinned(self, request_id: str) -> bool:
        """Pinned, lease running, and not on its way out (a new transfer may read it)."""
        with self._lock:
            pin = self._pins.get(request_id)
            return pin is not None and not pin.going and pin.expires_at > self._clock()

    def holds(self, request_id: str) -> bool:
        """Whether the blocks are still held (pinned, or going but still being read)."""
        with self._lock:
            return request_id in self._pins

    def renew_lease(self, request_id: str) -> bool:
        with self._lock:
            pin = self._pins.get(request_id)
            if pin is None or pin.going or pin.expires_at <= self._clock():
                return False
            pin.expires_at = self._clock() + self.lease_seconds
            return True

    def _drop_locked(self, request_id: str, pin: _Pin) -> bool:
        """Drop the pin now (True) or, while it is read, when its last reader leaves."""
        if pin.readers:
            pin.going = True
            return False
        del self._pins[request_id]
        return True

    def _unpinned(self, request_id: str) -> None:
        if self._on_unpin is not None:
            self._on_unpin(request_id)

    def read_blocks(self, request_id: str, block_ids: list[int]) -> torch.Tensor:
        """A copy of the blocks, taken while holding them (see ``reading``)."""
        with self.reading(request_id, block_ids):
            return self.copy_blocks(block_ids)

    def copy_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A copy of blocks the caller holds (inside ``reading``), without checks."""
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.kv_cache.device)
        return torch.index_select(self.kv_cache, 0, ids)

    def block_rows(self, request_id: str, block_ids: list[int]) -> list[torch.Tensor]:
        """Views ``kv_cache[a:b]`` of each run of consecutive ids, in order (no copy): read them
        only inside ``reading()``."""
        with self._lock:
            self._checked(request_id, block_ids)
        rows: list[torch.Tensor] = []
        start = 0
        for i in range(1, len(block_ids) + 1):
            if i == len(block_ids) or block_ids[i] != block_ids[i - 1] + 1:
                rows.append(self.kv_cache[block_ids[start] : block_ids[i - 1] + 1])
                start = i
        return rows

    def _checked(self, request_id: str, block_ids: list[int]) -> _Pin:
        """The pin of ``request_id`` if it covers ``block_ids`` and may be read (hold the lock)."""
        pin = self._pins.get(request_id)
        if pin is None or pin.going or pin.expires_at <= self._clock():
            raise KeyError(request_id)
        if not pin.block_ids.issuperset(block_ids):
            raise KeyError(f"{request_id}: blocks not pinned for this request")
        return pin
