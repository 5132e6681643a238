"""Routing policies: which worker of a pool gets a request.

A policy is one class: a ``name`` and ``choose(candidates, request)``. The orchestrator gives it
only routable candidates (alive, not draining, compatible, not already failed for this request)
and never an empty list. Add a policy by subclassing `RoutingPolicy` and listing it in
`POLICIES`.

Load is the router's own count of requests it has in flight on a worker (exact and immediate)
plus what the worker last published (its waiting queue and KV usage, up to a heartbeat old).
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from services.engine.hashing import hash_full_blocks
from services.registry import RegistryView, WorkerRecord

PREFIX_MEMORY_BLOCKS = 100_000  # block hashes the prefix-aware policy remembers routing
PREFIX_LOOKUP_SECONDS = 0.05


@dataclass
class RouteRequest:
    """What a policy may look at: the prompt's token ids (hashed per block size on demand),
    salted with its ``cache_salt`` as the workers hash them: a request is only routed towards,
    and only estimates as cached, blocks of its own tenant."""

    token_ids: Sequence[int]
    cache_salt: str | None = None
    _hashes: dict[int, list[int]] = field(default_factory=dict)

    def block_hashes(self, block_size: int) -> list[int]:
        if block_size not in self._hashes:
            hashes = hash_full_blocks(self.token_ids, block_size, salt=self.cache_salt)
            self._hashes[block_size] = hashes
        return self._hashes[block_size]


class PrefixIndex:
    """Where the leading blocks of a prompt are cached, per worker: the larger of what the
    worker published in the registry (up to a heartbeat old; looked up within
    PREFIX_LOOKUP_SECONDS, skipped while Redis is unreachable) and this router's memory of where
    it sent each block hash recently, which covers the heartbeat gap."""

    def __init__(self, view: RegistryView):
        self.view = view
        self._routed: OrderedDict[tuple[str, int], None] = OrderedDict()  # (worker, hash), LRU

    async def cached_blocks(
        self, candidates: Sequence[WorkerRecord], hashes: list[int]
    ) -> dict[str, int]:
        """Worker id -> leading blocks of ``hashes`` it caches."""
        published = await self._published(candidates, hashes) if hashes else {}
        return {
            w.worker_id: max(published.get(w.worker_id, 0), self._remembered(w, hashes))
            for w in candidates
        }

    def remember(self, worker: WorkerRecord, hashes: list[int]) -> None:
        """``worker`` was sent these blocks: it caches them once it computed or pulled them
        (unless it runs without a prefix cache, which keeps nothing after a request)."""
        if not worker.prefix_caching:
            return
        worker_id = worker.worker_id
        for h in hashes:
            self._routed[(worker_id, h)] = None
            self._routed.move_to_end((worker_id, h))
        while len(self._routed) > PREFIX_MEMORY_BLOCKS:
            self._routed.popitem(last=False)

    async def _published(
        self, candidates: Sequence[WorkerRecord], hashes: list[int]
    ) -> dict[str, int]:
        # Only the workers whose record says they cache blocks (the others have none of these):
        # each one looked up costs Redis a command and the router its encoding, per request.
        ids = [w.worker_id for w in candidates if w.kv_blocks_cached]
        if self.view.is_stale or not ids:
            return {}
        return await self.view.prefix_match(ids, hashes, timeout=PREFIX_LOOKUP_SECONDS)

    def _remembered(self, worker: WorkerRecord, hashes: list[int]) -> int:
        if not worker.prefix_caching:
            return 0
        count = 0
        for h in hashes:
            if (worker.worker_id, h) not in self._routed:
                break
            count += 1
        return count


@dataclass
class PolicyContext:
    """What every policy is built with."""

    view: RegistryView
    in_flight: Mapping[str, int]  # worker id -> requests this router has running there
    prefix_load_weight: float = 0.5
    prefixes: PrefixIndex | None = None  # shared by the policies and the router (None: own)

    def __post_init__(self) -> None:
        if self.prefixes is None:
            self.prefixes = PrefixIndex(self.view)


class RoutingPolicy(ABC):
    """Chooses one worker among candidates for a request."""

    name: ClassVar[str]

    def __init__(self, context: PolicyContext):
        self.context = context
        self._turn = itertools.count()

    @abstractmethod
    async def choose(
        self, candidates: Sequence[WorkerRecord], request: RouteRequest
    ) -> WorkerRecord:
        """One of ``candidates`` (never empty)."""

    def load(self, worker: WorkerRecord) -> float:
        return (
            self.context.in_flight.get(worker.worker_id, 0) + worker.num_waiting + worker.kv_usage
        )

    def rotate(self, workers: Sequence[WorkerRecord]) -> WorkerRecord:
        """Round robin among ``workers`` (spreads ties instead of always taking the first)."""
        return workers[next(self._turn) % len(workers)]

    def least_loaded(self, workers: Sequence[WorkerRecord]) -> WorkerRecord:
        lowest = min(self.load(w) for w in workers)
        return self.rotate([w for w in workers if self.load(w) == lowest])


class RoundRobinPolicy(RoutingPolicy):
    name = "round_robin"

    async def choose(
        self, candidates: Sequence[WorkerRecord], request: RouteRequest
    ) -> WorkerRecord:
        return self.rotate(candidates)


class LeastLoadedPolicy(RoutingPolicy):
    name = "least_loaded"

    async def choose(
        self, candidates: Sequence[WorkerRecord], request: RouteRequest
    ) -> WorkerRecord:
        return self.least_loaded(candidates)


class PrefixAwarePolicy(RoutingPolicy):
    """The worker caching the longest prefix of the prompt, weighed against its load.

    score = cached prompt blocks / prompt blocks - prefix_load_weight * load / highest load,
    with the cached blocks from the shared :class:`PrefixIndex` (the registry and this router's
    memory: the second request with a new system prompt follows the first).
    """

    name = "prefix_aware"

    async def choose(
        self, candidates: Sequence[WorkerRecord], request: RouteRequest
    ) -> WorkerRecord:
        prefixes = self.context.prefixes
        assert prefixes is not None
        block_size = candidates[0].fingerprint.block_size
        hashes = request.block_hashes(block_size)
        if not hashes:
            return self.least_loaded(candidates)
        if len(candidates) == 1:  # nothing to choose; remember it for when there is
            prefixes.remember(candidates[0], hashes)
            return candidates[0]
        cached = await prefixes.cached_blocks(candidates, hashes)
        highest = max(self.load(w) for w in candidates) or 1.0
        weight = self.context.prefix_load_weight

        def score(w: WorkerRecord) -> float:
            return cached[w.worker_id] / len(hashes) - weight * self.load(w) / highest

        best = max(score(w) for w in candidates)
        chosen = self.least_loaded([w for w in candidates if score(w) == best])
        prefixes.remember(chosen, hashes)
        return chosen


POLICIES: dict[str, type[RoutingPolicy]] = {
    p.name: p for p in (RoundRobinPolicy, LeastLoadedPolicy, PrefixAwarePolicy)
}


def make_policy(name: str, context: PolicyContext) -> RoutingPolicy:
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; choose from {sorted(POLICIES)}")
    return POLICIES[name](context)
