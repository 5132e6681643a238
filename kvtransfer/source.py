"""The one owner of a prefill worker's pinned KV blocks: every pin state and every transition.

A pin is keyed by its *handle*: a key unique per pin (:func:`pin_key`), which the KVHandle
carries as its ``request_id``, so a late Release or renewal for an old attempt never touches a
newer pin of the same request. The pin also names the engine's request, whose blocks
``on_unpin(request_id)`` frees: it is called exactly once per pin, when the pin is dropped and
no transfer reads its blocks, from whichever thread dropped it. Nothing else frees them; the
transports and the services only ask this class::

    pin() ──▶ pinned ──renew_lease()──▶ pinned ──release() / expire() / release_all()──▶ going
                 │  ▲                                                                    │
     reading() ──┘  └── the read ends                    the last reader leaves ─────────┤
                                                                                         ▼
                                                                       dropped: on_unpin(request id)

A streamed pin (``pin(..., progress=...)``) is made when the prompt is admitted, while it is still
being computed: ``ready_count`` says how many of a pull's blocks are computed so far, and
``finish`` adds what the prefill ends with (the first token), which the pull completing the
prompt carries. Whoever advances the prompts calls ``progressed()`` after each step; with
``finish`` and every pin ended it announces ``progress``, on which waiting pulls look again.
A whole pin is made after the first token. A streamed pin dropped before its prefill finished
makes the engine abort that prefill (the owner of the engine frees the blocks of a request
still computing by aborting it), so its PrefillStream ends at once.

A transfer reads the blocks inside ``reading()``, which counts it as a reader: a release or an
expiry that comes while a transfer reads only marks the pin as going (no new transfer may start
on it) and the pin is dropped when its last reader leaves. So the blocks never return to the
block pool, to be reused by the engine, while bytes are still being copied or sent out of them;
every transport bounds its sends by the lease, so a stalled reader holds a pin one lease at most.

Thread-safe: the transfer server reads from worker threads while the engine pins and releases.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from kvtransfer.base import block_checksums
from kvtransfer.progress import ProgressSignal


def pin_key(request_id: str) -> str:
    """A handle for a new pin of ``request_id``: unique, so a handle outlives no attempt."""
    return f"{request_id}@{secrets.token_hex(6)}"


@dataclass
class _Pin:
    request_id: str  # the engine's request, whose blocks ``on_unpin`` frees
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
    """Pinned rows of ``kv_cache`` ``[num_blocks, *block_shape]``, by handle."""

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
        self.progress = ProgressSignal()  # announced when a pull's blocks may have become ready

    def pin(
        self,
        key: str,
        block_ids: list[int],
        with_checksums: bool = True,
        progress: Callable[[], int] | None = None,
        num_tokens: int = 0,
        request_id: str | None = None,
    ) -> list[int]:
        """Pin ``block_ids`` under the handle ``key`` for the engine's ``request_id`` (``key``
        itself when not given); returns their checksums (or [] if not asked).

        Streamed (``progress``: how many of the ``num_tokens`` prompt tokens are computed, read
        from any thread): the blocks fill as the prefill runs; no checksums yet."""
        expires = self._clock() + self.lease_seconds
        pin = _Pin(request_id if request_id is not None else key, frozenset(block_ids), expires)
        if progress is not None:
            pin.order, pin.progress, pin.num_tokens = list(block_ids), progress, num_tokens
        with self._lock:
            if key in self._pins:
                raise ValueError(f"handle {key!r} is pinned already")
            self._pins[key] = pin
        if not with_checksums or progress is not None:
            return []
        return block_checksums(self.kv_cache[torch.tensor(block_ids, dtype=torch.long)])

    def finish(self, key: str, final: dict[str, Any]) -> None:
        """A streamed prefill is done: ``final`` (its first token ...) goes with the last pull."""
        with self._lock:
            pin = self._pins.get(key)
            if pin is not None:
                pin.final = final
        self.progress.announce()

    def progressed(self) -> None:
        """The engine finished a step: streamed pins may have more blocks computed."""
        self.progress.announce()

    def ready_count(self, key: str, block_ids: list[int]) -> tuple[int, dict[str, Any] | None]:
        """How many leading ``block_ids`` are computed, and the prefill's final answer when
        they are the last of the prompt's blocks and it is known (KeyError: not pinned). A pin
        that is not streamed is ready at once, with no final answer. Once the whole prompt is
        computed, none are ready until the final answer is (it follows within a moment): the
        rest then goes in one reply with it, not in two, whose second would cost the puller a
        round trip on its busy event loop (~50 ms of each hand-off on 2 Zen 4 cores,
        ``benchmarks/handoff_gap.py``)."""
        with self._lock:
            pin = self._checked(key, block_ids)
            if pin.order is None or pin.progress is None:
                return len(block_ids), None
            order, computed, final = pin.order, pin.progress(), pin.final
            block_size = self.kv_cache.shape[-2]  # [.., 2, heads, block_size, head_dim]
        if computed >= pin.num_tokens and final is None:
            return 0, None
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

    # ----- the transitions to ``going`` and ``dropped`` -----------------------------------------
    def release(self, key: str) -> bool:
        """Unpin (once the transfers reading it are done); False if it was not pinned (already
        released or expired)."""
        return bool(self._end(lambda k, pin: k == key))

    def expire(self) -> list[str]:
        """Unpin every pin whose lease has run out (those being read: when their transfers
        end); returns the handles of those whose lease ran out now."""
        now = self._clock()
        return self._end(lambda key, pin: pin.expires_at <= now)

    def release_all(self) -> list[str]:
        """Abort-all (the worker drains or its engine failed): unpin every pin, each once its
        transfers are done; returns their handles."""
        return self._end(lambda key, pin: True)

    def _end(self, which: Callable[[str, _Pin], bool]) -> list[str]:
        """Unpin the pins ``which`` selects that are not going already: dropped at once when no
        transfer reads them (``on_unpin``), else marked going. Returns their handles."""
        ended, dropped = [], []
        with self._lock:
            for key, pin in list(self._pins.items()):
                if pin.going or not which(key, pin):
                    continue
                ended.append(key)
                if pin.readers:
                    pin.going = True
                else:
                    del self._pins[key]
                    dropped.append(pin.request_id)
        for request_id in dropped:
            self._unpinned(request_id)
        if ended:  # a pull waiting on one of them is refused now, not at its re-check
            self.progress.announce()
        return ended

    @contextmanager
    def reading(self, key: str, block_ids: list[int]) -> Iterator[None]:
        """Hold ``block_ids`` of a pin while a transfer reads them (KeyError if they are not
        pinned under ``key``): neither a release nor an expiry frees them meanwhile."""
        with self._lock:
            pin = self._checked(key, block_ids)
            pin.readers += 1
        try:
            yield
        finally:
            with self._lock:
                pin.readers -= 1
                last = pin.going and pin.readers == 0
                if last:
                    del self._pins[key]
            if last:
                self._unpinned(pin.request_id)

    def renew_lease(self, key: str) -> bool:
        with self._lock:
            pin = self._pins.get(key)
            if pin is None or pin.going or pin.expires_at <= self._clock():
                return False
            pin.expires_at = self._clock() + self.lease_seconds
            return True

    # ----- questions ----------------------------------------------------------------------------
    def is_pinned(self, key: str) -> bool:
        """Pinned, lease running, and not on its way out (a new transfer may read it)."""
        with self._lock:
            pin = self._pins.get(key)
            return pin is not None and not pin.going and pin.expires_at > self._clock()

    def holds(self, key: str) -> bool:
        """Whether the blocks are still held (pinned, or going but still being read)."""
        with self._lock:
            return key in self._pins

    @property
    def num_readers(self) -> int:
        """Transfers reading pinned blocks now."""
        with self._lock:
            return sum(pin.readers for pin in self._pins.values())

    @property
    def num_pins(self) -> int:
        """Pins held: pinned, or released or expired while still read."""
        with self._lock:
            return len(self._pins)

    def _unpinned(self, request_id: str) -> None:
        if self._on_unpin is not None:
            self._on_unpin(request_id)

    # ----- reading (inside ``reading``) ---------------------------------------------------------
    def read_blocks(self, key: str, block_ids: list[int]) -> torch.Tensor:
        """A copy of the blocks, taken while holding them (see ``reading``)."""
        with self.reading(key, block_ids):
            return self.copy_blocks(block_ids)

    def copy_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A copy of blocks the caller holds (inside ``reading``), without checks."""
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.kv_cache.device)
        return torch.index_select(self.kv_cache, 0, ids)

    def block_rows(self, key: str, block_ids: list[int]) -> list[torch.Tensor]:
        """Views ``kv_cache[a:b]`` of each run of consecutive ids, in order (no copy): read them
        only inside ``reading()``."""
        with self._lock:
            self._checked(key, block_ids)
        rows: list[torch.Tensor] = []
        start = 0
        for i in range(1, len(block_ids) + 1):
            if i == len(block_ids) or block_ids[i] != block_ids[i - 1] + 1:
                rows.append(self.kv_cache[block_ids[start] : block_ids[i - 1] + 1])
                start = i
        return rows

    def _checked(self, key: str, block_ids: list[int]) -> _Pin:
        """The pin ``key`` if it covers ``block_ids`` and may be read (hold the lock)."""
        pin = self._pins.get(key)
        if pin is None or pin.going or pin.expires_at <= self._clock():
            raise KeyError(key)
        if not pin.block_ids.issuperset(block_ids):
            raise KeyError(f"{key}: blocks not pinned under this handle")
        return pin
