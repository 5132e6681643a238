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
    """What a policy may look at: the prompt's token ids (hashed per block size on demand)."""

    token_ids: Sequence[int]
    _hashes: dict[int, list[int]] = field(default_factory=dict)

    def block_hashes(self, block_size: int) -> list[int]:
        if block_size not in self._hashes:
            self._hashes[block_size] = hash_full_blocks(self.token_ids, block_size)
        return self._hashes[block_size]


@dataclass
class PolicyContext:
    """What every policy is built with."""

    view: RegistryView
    in_flight: Mapping[str, int]  # worker id -> requests this router has running there
    prefix_load_weight: float = 0.5


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

    score = cached prompt blocks / prompt blocks - prefix_load_weight * load / highest load.
    Cached blocks come from the Redis prefix index (what workers published, up to a heartbeat
    old) and from this router's memory of where it sent each block hash recently, which covers
    the heartbeat gap: the second request with a new system prompt follows the first.
    """

    name = "prefix_aware"

    def __init__(self, context: PolicyContext):
        super().__init__(context)
        self._routed: OrderedDict[int, str] = OrderedDict()  # block hash -> worker id (LRU)

    async def choose(
        self, candidates: Sequence[WorkerRecord], request: RouteRequest
    ) -> WorkerRecord:
        block_size = candidates[0].fingerprint.block_size
        hashes = request.block_hashes(block_size)
        if not hashes:
            return self.least_loaded(candidates)
        if len(candidates) == 1:  # nothing to choose; remember it for when there is
            self._remember(candidates[0].worker_id, hashes)
            return candidates[0]
        published = await self._published(candidates, hashes)
        highest = max(self.load(w) for w in candidates) or 1.0
        weight = self.context.prefix_load_weight

        def score(w: WorkerRecord) -> float:
            cached = max(published.get(w.worker_id, 0), self._remembered(w.worker_id, hashes))
            return cached / len(hashes) - weight * self.load(w) / highest

        best = max(score(w) for w in candidates)
        chosen = self.least_loaded([w for w in candidates if score(w) == best])
        self._remember(chosen.worker_id, hashes)
        return chosen

    async def _published(
        self, candidates: Sequence[WorkerRecord], hashes: list[int]
    ) -> dict[str, int]:
        """Cached leading blocks per worker from the Redis index; a hint, so it never waits
        long: bounded by PREFIX_LOOKUP_SECONDS, skipped while Redis is unreachable and when no
        candidate has published any cached block."""
        view = self.context.view
        if view.is_stale or not any(w.kv_blocks_cached for w in candidates):
            return {}
        ids = [w.worker_id for w in candidates]
        return await view.prefix_match(ids, hashes, timeout=PREFIX_LOOKUP_SECONDS)

    def _remembered(self, worker_id: str, hashes: list[int]) -> int:
        count = 0
        for h in hashes:
            if self._routed.get(h) != worker_id:
                break
            count += 1
        return count

    def _remember(self, worker_id: str, hashes: list[int]) -> None:
        for h in hashes:
            self._routed[h] = worker_id
            self._routed.move_to_end(h)
        while len(self._routed) > PREFIX_MEMORY_BLOCKS:
            self._routed.popitem(last=False)


POLICIES: dict[str, type[RoutingPolicy]] = {
    p.name: p for p in (RoundRobinPolicy, LeastLoadedPolicy, PrefixAwarePolicy)
}


def make_policy(name: str, context: PolicyContext) -> RoutingPolicy:
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; choose from {sorted(POLICIES)}")
    return POLICIES[name](context)
