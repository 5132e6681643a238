"""A reference :class:`~kvtransfer.base.BlockSource`: pinned rows of one KV cache tensor.

The prefill worker pins a request's blocks when it answers Prefill and unpins them when the
decode worker releases them or when the lease runs out, whichever comes first::

    pin() ──▶ pinned ──renew_lease()──▶ pinned ──release()──▶ gone
                 └────────── lease expired (expire() or next access) ──▶ gone

Thread-safe: the transfer server reads from a worker thread while the engine pins and releases.
``on_unpin`` (if given) is called with the request id when its blocks stop being pinned, so the
owner can give them back to its block pool.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvtransfer.base import block_checksums


@dataclass
class _Pin:
    block_ids: frozenset[int]
    expires_at: float


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

    def pin(self, request_id: str, block_ids: list[int], with_checksums: bool = True) -> list[int]:
        """Pin ``block_ids`` for ``request_id``; returns their checksums (or [] if not asked)."""
        with self._lock:
            self._pins[request_id] = _Pin(frozenset(block_ids), self._clock() + self.lease_seconds)
        if not with_checksums:
            return []
        return block_checksums(self.kv_cache[torch.tensor(block_ids, dtype=torch.long)])

    def release(self, request_id: str) -> bool:
        """Unpin; False if it was not pinned (already released or expired)."""
        with self._lock:
            pin = self._pins.pop(request_id, None)
        if pin is not None and self._on_unpin is not None:
            self._on_unpin(request_id)
        return pin is not None

    def expire(self) -> list[str]:
        """Unpin every request whose lease has run out; returns their ids."""
        now = self._clock()
        with self._lock:
            expired = [rid for rid, pin in self._pins.items() if pin.expires_at <= now]
        return [rid for rid in expired if self.release(rid)]

    def pinned_request_ids(self) -> list[str]:
        with self._lock:
            return list(self._pins)

    def is_pinned(self, request_id: str) -> bool:
        with self._lock:
            pin = self._pins.get(request_id)
            return pin is not None and pin.expires_at > self._clock()

    def renew_lease(self, request_id: str) -> bool:
        with self._lock:
            pin = self._pins.get(request_id)
            if pin is None or pin.expires_at <= self._clock():
                return False
            pin.expires_at = self._clock() + self.lease_seconds
            return True

    def read_blocks(self, request_id: str, block_ids: list[int]) -> torch.Tensor:
        self._check_pinned(request_id, block_ids)
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.kv_cache.device)
        return torch.index_select(self.kv_cache, 0, ids)

    def block_rows(self, request_id: str, block_ids: list[int]) -> list[torch.Tensor]:
        """Views ``kv_cache[a:b]`` of each run of consecutive ids, in order (no copy)."""
        self._check_pinned(request_id, block_ids)
        rows: list[torch.Tensor] = []
        start = 0
        for i in range(1, len(block_ids) + 1):
            if i == len(block_ids) or block_ids[i] != block_ids[i - 1] + 1:
                rows.append(self.kv_cache[block_ids[start] : block_ids[i - 1] + 1])
                start = i
        return rows

    def _check_pinned(self, request_id: str, block_ids: list[int]) -> None:
        with self._lock:
            pin = self._pins.get(request_id)
            if pin is None or pin.expires_at <= self._clock():
                raise KeyError(request_id)
            if not pin.block_ids.issuperset(block_ids):
                raise KeyError(f"{request_id}: blocks not pinned for this request")
